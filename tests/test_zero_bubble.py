"""Zero-bubble schedules on real processes: equivalence with the plain model, the backward path each
mesh takes, the measured trace, and receive hoisting.

Each schedule (zb-h1, its interleaved form, zb-v, dualpipe-v) trains the example GPT or Hugging
Face GPT-2 for 3 steps on spawned Gloo ranks and must match a deep copy of the plain model
(losses, first-step gradients, clipped norm, parameters: tests/workers/equivalence.equivalence).
pp/dp chunks run the compile-time I/W programs; tensor-parallel chunks split by autograd (each
checked: runtime.executor.PATHS counts which way every compute action ran). The I/W
programs' bitwise equality with the fused backward is passes/test_split_backward.py's.

Fast tier: python -m pytest -m "not full" tests/test_zero_bubble.py
Full:      python -m pytest tests/test_zero_bubble.py
"""
from __future__ import annotations

import json
from collections import Counter

import pytest

from autopart import schedule as sched
from autopart.schedule_lowering import hoist_receives
from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group

FAST_2 = [   # the first one also writes the trace the trace test reads
    Case("gpt4-pp2-zb-v", model="gpt4", pp=2, schedule="zb-v", virtual_stages=2, microbatches=4),
]
FULL_2 = [
    Case("gpt4-pp2-zb-h1", model="gpt4", pp=2, schedule="zb-h1", microbatches=4),
    Case("gpt-pp2-dualpipe-v", pp=2, schedule="dualpipe-v", virtual_stages=2, microbatches=4),
    Case("gpt-pp2-zb-h1-interleaved", pp=2, schedule="zb-h1", virtual_stages=2, microbatches=4),
    Case("hf-pp2-zb-h1", model="hf", pp=2, schedule="zb-h1", batch=4, seq=32, microbatches=2),
    Case("hf-pp2-zb-v", model="hf", pp=2, schedule="zb-v", virtual_stages=2, batch=4, seq=32,
         microbatches=4),
]
FULL_4 = [
    Case("gpt-pp4-zb-h1", pp=4, schedule="zb-h1", microbatches=4),
    Case("gpt-pp4-zb-v", pp=4, schedule="zb-v", virtual_stages=2, microbatches=8, batch=8),
    Case("gpt-pp4-dualpipe-v", pp=4, schedule="dualpipe-v", virtual_stages=2, microbatches=8,
         batch=8),
    Case("gpt-pp2xdp2-zb-h1", pp=2, dp=2, schedule="zb-h1", microbatches=2),
    Case("gpt-pp2xdp2-zb-v", pp=2, dp=2, schedule="zb-v", virtual_stages=2, microbatches=2),
    Case("gpt-pp2xtp2-zb-h1", pp=2, tp=2, schedule="zb-h1", microbatches=4),   # autograd split
    # the HF model has 4 layers: pp=4 with zb-v would need 8 chunks (zb-v on HF runs at pp=2)
    Case("hf-pp4-zb-h1", model="hf", pp=4, schedule="zb-h1", batch=8, seq=32, microbatches=8),
]


@pytest.fixture(scope="module")
def fast_run(spawn_cache, tmp_path_factory):
    from autopart.runtime.launch import spawn
    key = ("zero-bubble", "fast")
    if key not in spawn_cache:
        path = str(tmp_path_factory.mktemp("trace") / "zb-v.json")
        from tests.workers.zb import zb_cases
        per_rank = spawn(zb_cases, 2, FAST_2, path, timeout=420, pg_timeout=120)
        spawn_cache[key] = (_by_case(per_rank), path)
    return spawn_cache[key]


def _by_case(per_rank: list[list[dict]]) -> dict:
    out: dict = {}
    for rank_results in per_rank:
        for r in rank_results:
            out.setdefault(r["case"], []).append(r)
    return out


def _assert_paths(case: Case, results: list[dict]) -> None:
    """Every compute action of every step ran the way the case expects: the compile-time I/W
    programs (split_backward) for pp/dp chunks, autograd for tensor-parallel ones (collectives in
    the chunk: the fallback), never a mix; counted by runtime.executor.PATHS, against the
    schedule's own action list (each F, I, W, B once per train_step, steps x accumulate calls)."""
    expected_path = "autograd" if case.tp > 1 else "split"
    schedule = sched.make_schedule(case.schedule, case.pp, case.microbatches, case.virtual_stages)
    calls = case.steps * case.accumulate
    for r in results:
        assert "paths" in r, f"{case.name} rank {r['rank']}: {r['problems']}"
        p = r["rank"] // (case.dp * case.tp)
        want = Counter()
        for a in schedule.ranks[p]:
            if a.kind.is_compute:
                want[f"{expected_path} {a.kind}"] += calls
        assert Counter(r["paths"]) == want, (
            f"{case.name} rank {r['rank']}: compute actions ran {r['paths']}, expected {dict(want)}")


@pytest.mark.parametrize("case", FAST_2, ids=[c.name for c in FAST_2])
def test_matches_plain_model(case, fast_run):
    assert_all_ranks_equal_plain(case, fast_run[0][case.name])
    _assert_paths(case, fast_run[0][case.name])


def test_trace_holds_every_action_once_per_step(fast_run):
    assert_all_ranks_equal_plain(FAST_2[0], fast_run[0][FAST_2[0].name])
    case, trace = FAST_2[0], json.loads(open(fast_run[1]).read())
    schedule = sched.make_schedule(case.schedule, case.pp, case.microbatches, case.virtual_stages)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in events} == set(range(case.steps))
    for step in range(case.steps):
        for rank in range(case.world):       # pp only: global rank = pipeline rank
            ran = Counter(e["name"] for e in events
                          if e["pid"] == rank and e["args"]["step"] == step)
            expected = Counter(map(str, schedule.ranks[rank]))
            assert ran == expected, f"rank {rank} step {step}: {ran - expected} extra, " \
                                    f"{expected - ran} missing"
    for e in events:
        assert e["dur"] >= 0 and e["args"]["kind"] in ("F", "I", "W", "B", "SEND_F", "RECV_F",
                                                       "SEND_B", "RECV_B")
    # the colleague's drawing reads it as is
    from autopart.cli.timeline import trace_slices
    assert len(trace_slices(trace)) == len(events)


@pytest.mark.full
@pytest.mark.parametrize("case", FULL_2, ids=[c.name for c in FULL_2])
def test_matches_plain_model_full_2(case, spawn_cache):
    from tests.workers.zb import zb_cases
    results = _group(spawn_cache, ("zb", 2), FULL_2, zb_cases)[case.name]
    assert_all_ranks_equal_plain(case, results)
    _assert_paths(case, results)


@pytest.mark.full
@pytest.mark.parametrize("case", FULL_4, ids=[c.name for c in FULL_4])
def test_matches_plain_model_full_4(case, spawn_cache):
    from tests.workers.zb import zb_cases
    results = _group(spawn_cache, ("zb", 4), FULL_4, zb_cases)[case.name]
    assert_all_ranks_equal_plain(case, results)
    _assert_paths(case, results)


def _group(cache, key, cases, fn):
    from autopart.runtime.launch import spawn
    if key not in cache:
        try:
            cache[key] = _by_case(spawn(fn, cases[0].world, cases, timeout=900, pg_timeout=120))
        except Exception as e:  # noqa: BLE001  (every test of the group reports it)
            cache[key] = e
    if isinstance(cache[key], Exception):
        raise cache[key]
    return cache[key]


# -- receive hoisting, in this process ----------------------------------------------------------

HOISTED = [("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 4, 8, 1),
           ("zb-v", 2, 4, 2), ("dualpipe-v", 4, 8, 2), ("gpipe", 2, 4, 1)]


@pytest.mark.parametrize("name,pp,m,v", HOISTED)
def test_hoisting_keeps_transfer_order_and_validates(name, pp, m, v):
    s = sched.make_schedule(name, pp, m, v)
    h = hoist_receives(s)
    sched.validate(h)
    comm = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
    for before, after in zip(s.ranks, h.ranks):
        assert sorted(map(str, before)) == sorted(map(str, after))
        # transfers in the same order (a pair's messages match in posting order) ...
        assert [a for a in before if a.kind in comm] == [a for a in after if a.kind in comm]
        # ... and computes too: only receives move, and only earlier
        assert [a for a in before if a.kind.is_compute] == [a for a in after if a.kind.is_compute]
        for a in after:
            if a.kind in ("RECV_F", "RECV_B"):
                assert after.index(a) <= before.index(a)


@pytest.mark.parametrize("name,pp,m,v", HOISTED + [("interleaved-1f1b", 4, 8, 2)])
def test_gloo_lowering_posts_receives_early_keeping_every_order(name, pp, m, v):
    """independent_posts (Gloo): computes, sends and receives each keep their order (a pair's
    messages match in posting order: swapped receives gave wrong losses on Gloo, silently),
    receives only move up, never ahead of the compute consuming the receive two before."""
    s = sched.make_schedule(name, pp, m, v)
    h = hoist_receives(s, independent_posts=True)
    recv = (sched.Kind.RECV_F, sched.Kind.RECV_B)
    moved = 0
    for before, after in zip(s.ranks, h.ranks):
        assert [a for a in before if a.kind in recv] == [a for a in after if a.kind in recv]
        assert [a for a in before if a.kind not in recv] == [a for a in after if a.kind not in recv]
        assert all(after.index(a) <= before.index(a) for a in after if a.kind in recv)
        moved += sum(before.index(a) - after.index(a) for a in after if a.kind in recv)
        assert _most_waiting(after) <= max(2, _most_waiting(before)), (name, after)
    assert moved > 0


def _most_waiting(actions) -> int:
    """The most receives posted whose data no compute has read yet, along one rank's list."""
    waiting, most = set(), 0
    for a in actions:
        if a.kind in (sched.Kind.RECV_F, sched.Kind.RECV_B):
            waiting.add((a.chunk, a.microbatch, a.kind is sched.Kind.RECV_F))
        elif a.kind.is_compute:
            waiting.discard((a.chunk, a.microbatch, a.kind is sched.Kind.F))
        most = max(most, len(waiting))
    return most


def test_hoisting_moves_receives_before_computes():
    s = sched.make_schedule("1f1b", 4, 8)
    h = hoist_receives(s)
    moved = sum(b.index(a) - h_r.index(a) for b, h_r in zip(s.ranks, h.ranks) for a in b
                if a.kind in (sched.Kind.RECV_F, sched.Kind.RECV_B))
    assert moved > 0
