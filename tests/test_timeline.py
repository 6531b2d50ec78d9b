"""autopart.cli.timeline: simulated and measured timelines drawn as PNG files."""

from __future__ import annotations

import json

import pytest

from autopart.schedule import make_schedule, simulate
from autopart.cli.timeline import Slice, draw_simulated, draw_trace, load_trace, simulated_slices, trace_slices

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipe-v", 2)])
def test_draw_simulated(tmp_path, name, v):
    s = make_schedule(name, pp=2, microbatches=4, virtual_stages=v)
    path = draw_simulated(s, simulate(s), tmp_path / "t.png")
    assert path.read_bytes()[:8] == PNG


def test_simulated_slices_cover_every_compute_once():
    s = make_schedule("zb-v", pp=2, microbatches=3, virtual_stages=2)
    r = simulate(s, latency=0.5)
    slices = simulated_slices(s, r)
    computes = [x for x in slices if x.kind in "FBIW"]
    assert len(computes) == sum(a.kind.is_compute for rank in s.ranks for a in rank) == 2 * 2 * 3 * 3
    assert {x.shade for x in computes if x.rank == 0 and x.chunk == 3} == {1}  # rank 0's later chunk is lighter
    assert {x.shade for x in computes if x.rank == 0 and x.chunk == 0} == {0}
    assert all(x.end - x.start == 0.5 for x in slices if x.kind not in "FBIW")  # transfers take the latency


def test_draw_needs_a_timeline(tmp_path):
    from autopart.schedule import SimResult

    s = make_schedule("1f1b", pp=2, microbatches=2)
    with pytest.raises(ValueError, match="no timeline"):
        draw_simulated(s, SimResult(1.0, 1.0, 0.0, (), (), ()), tmp_path / "t.png")


def trace_event(name, ts, dur, pid, chunk, mb, kind):
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": 0,
            "args": {"chunk": chunk, "microbatch": mb, "kind": kind}}


def test_trace_slices_in_milliseconds_from_the_first_event():
    trace = {"traceEvents": [trace_event("0F0", 5000, 2000, 0, 0, 0, "F"),
                             trace_event("3B0", 9000, 1000, 1, 3, 0, "B"),
                             trace_event("1F0", 7000, 1000, 1, 1, 0, "F"),
                             {"ph": "M", "name": "process_name", "pid": 0}]}
    assert trace_slices(trace) == [Slice(0, 0.0, 2.0, "F", 0, 0, 0), Slice(1, 4.0, 5.0, "B", 3, 0, 1),
                                   Slice(1, 2.0, 3.0, "F", 1, 0, 0)]


def test_load_and_draw_trace(tmp_path):
    events = [trace_event(f"{r}{k}{i}", 1000 * (3 * i + r + j), 900, r, r, i, k)
              for r in range(2) for i in range(3) for j, k in enumerate("FIW")]
    events.append(trace_event("0SEND_F0", 900, 50, 0, 0, 0, "SEND_F"))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = load_trace(path)
    out = draw_trace(trace, tmp_path / "trace.png")
    assert out.read_bytes()[:8] == PNG


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json", "is not JSON"),
        ('{"traceEvents": {}}', 'a "traceEvents" list'),
        ('{"traceEvents": [{"ph": "M"}]}', "no complete events"),
        ('{"traceEvents": [{"ph": "X", "name": "0F0", "ts": 0, "dur": 1, "pid": 0}]}',
         r"trace event #0 \(0F0\) needs pid, ts, dur and args.kind"),
        ('{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1, "pid": 0, "args": {"chunk": 0, "microbatch": 0, "kind": "Q"}}]}',
         "has kind 'Q'"),
        ('{"traceEvents": [{"ph": "X", "ts": 0, "dur": -1, "pid": 0, "args": {"chunk": 0, "microbatch": 0, "kind": "F"}}]}',
         "need pid >= 0 and finite dur >= 0"),
    ],
)  # fmt: skip
def test_load_trace_errors(tmp_path, content, match):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_drawing_leaves_the_pyplot_backend_alone(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    s = make_schedule("zb-h1", pp=2, microbatches=2)
    draw_simulated(s, simulate(s), tmp_path / "t.png")
    assert matplotlib.get_backend() == before


def test_os_process_ids_become_ranks_in_their_order():
    """A trace whose pid is an OS process id draws one row per process, not 31,339 rows."""
    trace = {"traceEvents": [trace_event("0F0", 0, 10, 31338, 0, 0, "F"),
                             trace_event("1F0", 10, 10, 40112, 1, 0, "F")]}
    assert [s.rank for s in trace_slices(trace)] == [0, 1]


def test_process_name_metadata_says_which_rank_a_pid_is():
    trace = {"traceEvents": [trace_event("1F0", 0, 10, 31338, 1, 0, "F"),
                             trace_event("0F0", 10, 10, 40112, 0, 0, "F"),
                             {"ph": "M", "name": "process_name", "pid": 31338, "args": {"name": "rank 1"}},
                             {"ph": "M", "name": "process_name", "pid": 40112, "args": {"name": "rank 0"}}]}
    assert [s.rank for s in trace_slices(trace)] == [1, 0]


def test_trace_cli_on_os_pids_answers_at_once(tmp_path):
    from autopart.cli import main

    events = [trace_event(f"{k}{i}", 1000 * i, 900, pid, 0, i, k) for pid in (31338, 31339) for i in range(2)
              for k in "FB"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert main(["trace", str(path), "--png", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG


def test_gradient_reductions_are_read_but_not_drawn(tmp_path):
    """autopart's traces hold each gradient bucket's all-reduce (args.kind REDUCE, tid 1, no
    chunk or microbatch) beside the actions: loading and drawing skip them."""
    reduce = {"name": "REDUCE0", "ph": "X", "ts": 500, "dur": 900, "pid": 0, "tid": 1,
              "args": {"kind": "REDUCE", "bucket": 0, "elements": 10, "step": 0}}
    events = [trace_event("0F0", 0, 400, 0, 0, 0, "F"), trace_event("0B0", 400, 800, 0, 0, 0, "B"),
              reduce]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = load_trace(path)
    assert [s.kind for s in trace_slices(trace)] == ["F", "B"]
    assert draw_trace(trace, tmp_path / "t.png").read_bytes()[:8] == PNG
