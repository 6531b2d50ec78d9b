"""bench/run_all.py (`python -m bench`) without running a benchmark: the benchmark processes are
replaced by fake JSON outputs. Median of per-round ratios, the 3% noisy rule, the RESULTS.md row."""
from __future__ import annotations

import datetime
import json

import pytest

from bench import run_all


def _pipeline_json(autopart: list[float], torch: list[float]) -> str:
    return json.dumps({"bench": "pipeline_vs_torch", "results": [
        {"schedule": "1f1b", "autopart_ms_all": autopart, "torch_ms_all": torch},
        {"schedule": "interleaved-1f1b", "autopart_ms_all": torch, "torch_ms_all": autopart}]})


@pytest.fixture
def fake(monkeypatch):
    """Queue of (exit status, stdout) the next benchmark processes 'print'; the argv each got."""
    outputs, calls = [], []

    def invoke(argv, timeout):
        calls.append(argv)
        code, out = outputs.pop(0)
        return code, "table on stderr\n" + out + "\n", "the last stderr line"
    monkeypatch.setattr(run_all, "invoke", invoke)
    return outputs, calls


def test_a_run_is_the_median_of_per_round_ratios_not_a_ratio_of_medians(fake):
    outputs, calls = fake
    # per-round ratios 2, 1, 0.5, 1.1, 1.2 -> median 1.1; medians 100 / 100 would say 1.0
    outputs.append((0, _pipeline_json([200, 100, 50, 110, 120], [100, 100, 100, 100, 100])))
    got, _, error = run_all.run_once(run_all.BENCHMARKS[0], 5)
    assert error == ""
    assert got["pp 1f1b"] == pytest.approx(1.1)
    assert got["pp interleaved-1f1b"] == pytest.approx(1 / 1.1)
    assert calls[0][1].endswith("pipeline_vs_torch.py")
    assert calls[0][-3:] == ["--steps", "5", "--json"]


def test_unpaired_rounds_are_refused():
    with pytest.raises(ValueError, match="not paired"):
        run_all._per_round([1.0, 2.0], [1.0])


@pytest.mark.parametrize("first, second, expected", [
    (1.00, 1.03, "result"),       # 3.0% apart: within the rule
    (1.00, 1.0301, "noisy"),
    (1.0301, 1.00, "noisy"),      # either order
    (0.50, 0.51, "result"),
    (1.00, None, "failed"),
])
def test_two_runs_more_than_3_percent_apart_are_noisy(first, second, expected):
    assert run_all.verdict(first, second) == expected


def test_measure_runs_twice_and_rows_carry_both_runs(fake):
    outputs, calls = fake
    outputs += [(0, _pipeline_json([100] * 3, [100] * 3)),
                (0, _pipeline_json([110] * 3, [100] * 3))]
    rows = run_all.measure(run_all.BENCHMARKS[0], 3, runs=2, log=open("/dev/null", "w"))
    assert len(calls) == 2
    one = next(r for r in rows if r["benchmark"] == "pp 1f1b")
    assert one["runs"] == [pytest.approx(1.0), pytest.approx(1.1)]
    assert one["verdict"] == "noisy" and one["rounds"] == 3 and one["unit"] == "ratio"


def test_a_failed_run_is_reported_and_the_rest_goes_on(fake):
    outputs, _ = fake
    outputs += [(1, ""), (0, json.dumps({"runs": [{"process_wall": 7.0}, {"process_wall": 9.0},
                                                   {"process_wall": 8.0}]}))]
    compile_1t = next(b for b in run_all.BENCHMARKS if b.name == "compile-1t")
    rows = run_all.measure(compile_1t, 30, runs=2, log=open("/dev/null", "w"))
    assert rows[0]["verdict"] == "failed" and rows[0]["runs"] == [None, 8.0]
    assert "exit status 1" in rows[0]["errors"][0]
    assert rows[0]["rounds"] == 3                     # a process per 10 rounds


def test_results_md_section_and_row_format():
    rows = [{"benchmark": "pp 1f1b", "what": "autopart / torch", "unit": "ratio",
             "runs": [1.0312, 1.0401], "verdict": "result", "rounds": 30, "seconds": 81.4,
             "errors": []},
            {"benchmark": "compile 1T s", "what": "seconds", "unit": "s", "runs": [7.5, 8.1],
             "verdict": "noisy", "rounds": 3, "seconds": 50.2, "errors": []}]
    text = run_all.section(rows, when=datetime.datetime(2026, 11, 25, 12, 40), commit="abc1234",
                           dirty=True, load_before=(1.0, 1.5, 2.0), load_after=(1.25, 1.5, 2.0),
                           command="python -m bench", rounds=30)
    lines = text.splitlines()
    assert lines[0] == "## 2026-11-25 12:40: `python -m bench`"
    assert "Commit abc1234 (working tree dirty)" in text
    assert "1.00, 1.50, 2.00 before, 1.25, 1.50, 2.00 after" in text
    assert "| pp 1f1b | autopart / torch | 1.031 | 1.040 | 0.9% | result | 30 | 81 |" in lines
    assert "| compile 1T s | seconds | 7.50 s | 8.10 s | 8.0% | noisy | 3 | 50 |" in lines


def test_main_records_one_section_and_quick_never_records(fake, monkeypatch, tmp_path, capsys):
    outputs, calls = fake
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark runs\n")
    monkeypatch.setattr(run_all, "RESULTS", results)
    monkeypatch.setattr(run_all, "git_state", lambda: ("abc1234", False))
    tp = json.dumps({"step_seconds": {"autopart": [1.0] * 30, "dtensor": [2.0] * 30}})
    outputs += [(0, tp), (0, tp)]
    assert run_all.main(["--only", "tp"]) == 0
    assert [c[-3:] for c in calls] == [["--steps", "30", "--json"]] * 2
    text = results.read_text()
    assert text.count("\n## ") == 1 and "| tp=2 |" in text and "| 0.500 | 0.500 | 0.0% | result | 30 |" in text
    assert "tp=2" in capsys.readouterr().out

    outputs.append((0, tp))
    assert run_all.main(["--only", "tp", "--quick"]) == 0
    assert calls[-1][-3:] == ["--steps", "3", "--json"] and len(calls) == 3   # once, 3 rounds
    assert results.read_text() == text                                          # not recorded
    outputs += [(0, tp), (0, tp)]
    assert run_all.main(["--only", "tp", "--rounds", "10"]) == 0                # a trial
    assert results.read_text() == text


def test_zero_rows_pair_each_level_with_fsdp2_round_by_round(fake):
    outputs, calls = fake
    fsdp = [1.0, 2.0, 1.0]
    outputs.append((0, json.dumps({"step_seconds": {
        "autopart_zero2": [0.5, 2.0, 0.9], "autopart_zero1": [1.0, 1.0, 1.0],
        "autopart_zero0": [2.0, 2.0, 2.0], "fsdp2": fsdp}})))
    zero = next(b for b in run_all.BENCHMARKS if b.name == "zero")
    got, _, error = run_all.run_once(zero, 3)
    assert error == ""
    assert calls[0][1].endswith("zero_vs_fsdp.py") and calls[0][-3:] == ["--steps", "3", "--json"]
    assert got == {"zero2 / fsdp2": pytest.approx(0.9), "zero1 / fsdp2": pytest.approx(1.0),
                   "zero0 / fsdp2": pytest.approx(2.0)}
    outputs.append((0, json.dumps({"step_seconds": {       # with zero=3 and its own peer
        "autopart_zero3": [3.0, 1.0, 2.0], "fsdp2_reshard": [1.0, 2.0, 4.0],
        "autopart_zero2": [0.5, 2.0, 0.9], "autopart_zero1": [1.0, 1.0, 1.0],
        "autopart_zero0": [2.0, 2.0, 2.0], "fsdp2": fsdp}})))
    got, _, error = run_all.run_once(zero, 3)
    assert error == "" and got["zero3 / fsdp2 reshard"] == pytest.approx(0.5)
    assert got["zero2 / fsdp2"] == pytest.approx(0.9)


def test_tp_rows_pair_overlap_with_its_absence_round_by_round():
    """bench/tp_vs_dtensor.py's third side (overlap=False) gives two rows, each the per-round
    ratio; a run without it (before 2026-12-02) gives the tp=2 row alone."""
    tp = next(b for b in run_all.BENCHMARKS if b.name == "tp")
    rows = tp.values({"step_seconds": {"autopart": [1.0, 2.0], "dtensor": [2.0, 2.0],
                                       "autopart_no_overlap": [2.0, 4.0]}})
    assert rows == {"tp=2": [0.5, 1.0], "tp=2 overlap=False": [1.0, 2.0],
                    "tp=2 overlap / overlap=False": [0.5, 0.5]}
    assert set(tp.values({"step_seconds": {"autopart": [1.0], "dtensor": [2.0]}})) == {"tp=2"}
    assert set(rows) - {"tp=2"} <= set(tp.optional)


def test_tp_own_floor_rows_are_per_round_and_their_distance():
    """The fourth side (2026-12-03: the same programs with every tp collective skipped) gives the
    floor's ratio to DTensor and autopart's distance above it, round by round."""
    tp = next(b for b in run_all.BENCHMARKS if b.name == "tp")
    rows = tp.values({"step_seconds": {"autopart": [1.0, 3.0], "dtensor": [2.0, 4.0],
                                       "autopart_no_overlap": [1.0, 3.0],
                                       "autopart_floor": [0.5, 2.0]}})
    assert rows["tp=2 own floor"] == [0.25, 0.5]
    assert rows["tp=2 above own floor"] == pytest.approx([0.25, 0.25])
    assert set(rows) - {"tp=2"} <= set(tp.optional)


def test_traced_rows_pair_autopart_and_its_own_floor_with_torchs_traced_stages(fake):
    """pipeline_vs_torch.py --traced (issue 52's setup): autopart / torch traced, own floor /
    torch traced, and their per-round difference (the distance from autopart's own floor)."""
    outputs, calls = fake
    one = {"autopart_ms_all": [6.0, 8.0, 7.0], "own_floor_ms_all": [3.0, 2.0, 4.0],
           "torch_traced_ms_all": [10.0, 10.0, 10.0], "torch_ms_all": [1.0] * 3}
    outputs.append((0, json.dumps({"results": [{"schedule": "1f1b", **one},
                                               {"schedule": "interleaved-1f1b", **one}]})))
    traced = next(b for b in run_all.BENCHMARKS if b.name == "pipeline-traced")
    got, _, error = run_all.run_once(traced, 3)
    assert error == ""
    argv = calls[0]
    assert argv[1].endswith("pipeline_vs_torch.py") and "--traced" in argv
    assert argv[argv.index("--microbatches") + 1] == "8"
    assert argv[argv.index("--microbatch-size") + 1] == "2"
    assert argv[argv.index("--config") + 1] == "tiny,n_layer=8,n_embd=128,block_size=16"
    for s in ("1f1b", "interleaved-1f1b"):
        assert got[f"pp {s} / torch traced"] == pytest.approx(0.7)           # 0.6, 0.8, 0.7
        assert got[f"pp {s} own floor / torch traced"] == pytest.approx(0.3)  # 0.3, 0.2, 0.4
        assert got[f"pp {s} / torch traced above own floor"] == pytest.approx(0.3)  # .3 .6 .3
    assert set(got) == set(traced.rows)      # only its own rows: no name shared with `pipeline`
    assert not set(traced.rows) & {r for b in run_all.BENCHMARKS if b is not traced
                                   for r in {**b.rows, **b.optional}}


def test_zero3_prefetch_rows_pair_it_with_its_absence_round_by_round():
    zero = next(b for b in run_all.BENCHMARKS if b.name == "zero")
    t = {"autopart_zero3": [1.0, 3.0, 2.0], "autopart_zero3_noprefetch": [2.0, 2.0, 4.0],
         "fsdp2_reshard": [2.0, 4.0, 4.0], "autopart_zero2": [1.0] * 3,
         "autopart_zero1": [1.0] * 3, "autopart_zero0": [1.0] * 3, "fsdp2": [1.0] * 3}
    rows = zero.values({"step_seconds": t})
    assert rows["zero3 / fsdp2 reshard"] == [0.5, 0.75, 0.5]
    assert rows["zero3 no prefetch / fsdp2 reshard"] == [1.0, 0.5, 1.0]
    assert rows["zero3 prefetch / no prefetch"] == [0.5, 1.5, 0.5]
    assert {"zero3 no prefetch / fsdp2 reshard", "zero3 prefetch / no prefetch"} <= set(zero.optional)


def test_moe_overlap_rows_pair_the_overlap_with_its_absence_round_by_round():
    """bench/moe_overlap.py: one row, the per-round ratio of its two sides."""
    bench = next(b for b in run_all.BENCHMARKS if b.name == "moe-overlap")
    rows = bench.values({"step_seconds": {"overlap": [1.0, 3.0], "no_overlap": [2.0, 4.0]}})
    assert rows == {"ep overlap / no overlap": [0.5, 0.75]}
    assert set(rows) == set(bench.rows)
    rows = bench.values({"step_seconds": {"overlap": [1.0, 3.0], "no_overlap": [2.0, 4.0],
                                          "serial": [1.0, 6.0]}})
    assert rows["ep overlap / serial pairs"] == [1.0, 0.5]
    assert set(rows) - set(bench.rows) <= set(bench.optional)
