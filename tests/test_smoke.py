"""`python -m autopart.smoke --dry-run --json`: the GPU smoke's plumbing on the CPU.

The dry run trains (ZeRO-1 on 2 ranks), saves, resumes, compiles (compile=True, Inductor's CPU
code) and runs the meta-model, pipeline and tensor-parallel comparisons over Gloo; the CUDA-only
tests (which all skip here) and compile="cudagraphs" (no CUDA graph on the CPU) are skipped
rows. It stays in the fast tier (one compile row; 49 s on 2 cores with Inductor's cache warm
before the rework, which removed a compile row); the timeout leaves room for a loaded machine.
The other tests check, with stand-ins for pytest, spawn and CUDA, what the dry run cannot:
which rows skip, on how many ranks each runs, and that a row that tested nothing or a NaN
never passes (the NaN cases: tests/test_compare.py).

    python -m pytest -q tests/test_smoke.py
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROWS = ["cuda tests", "train bf16 zero=1", "save / resume", "compile=True", "compile=cudagraphs",
        "fp8", "meta model", "pp=2 1f1b", "tp=2"]
SKIPPED_ON_CPU = {"cuda tests", "compile=cudagraphs"}


@pytest.mark.full      # about a minute on 2 cores; the rows' verdicts are tested one by one below
@pytest.mark.timeout(660)
def test_dry_run_passes_or_skips_every_row():
    """Every row that can run on the CPU passes; the CUDA tests (all skip here) and
    compile="cudagraphs" (no CUDA graph on the CPU) are skipped, not passed; the ZeRO-1 row ran
    on 2 ranks, each holding its share of AdamW's moments, counted from the model's shapes."""
    done = subprocess.run([sys.executable, "-m", "autopart.smoke", "--dry-run", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert set(report) == {"dry_run", "ok", "seconds", "counts", "rows"}
    assert report["dry_run"] is True and report["ok"] is True
    assert [r["name"] for r in report["rows"]] == ROWS
    rows = {r["name"]: r for r in report["rows"]}
    for row in report["rows"]:
        assert set(row) == {"name", "status", "seconds", "figure", "note"}
        assert row["status"] == ("skip" if row["name"] in SKIPPED_ON_CPU else "pass"), row
        assert row["note"], row                       # what a dry run could not do, or why skipped
        if row["status"] == "pass":
            assert row["figure"], row
    assert report["counts"] == {"pass": 7, "fail": 0, "skip": 2}
    assert "CUDA" in rows["compile=cudagraphs"]["note"]
    selected, passed, failed, skipped = map(int, re.fullmatch(
        r"(\d+) selected: (\d+) passed, (\d+) failed, (\d+) skipped",
        rows["cuda tests"]["figure"]).groups())
    assert selected >= 5 and passed == failed == 0 and skipped == selected
    held = re.search(r"AdamW moments per rank (\d+)/(\d+) of (\d+)",
                     rows["train bf16 zero=1"]["figure"])
    assert held, rows["train bf16 zero=1"]
    sizes = [p.numel() for p in _model().parameters()]
    assert int(held[3]) == sum(sizes)
    for n in map(int, held.groups()[:2]):             # 2 ranks, each its chunk of every parameter
        assert n == sum(math.ceil(s / 2) for s in sizes) < sum(sizes)


def _model():
    from autopart.smoke import TinyGPT
    return TinyGPT()


def test_the_plugin_keeps_only_tests_that_need_cuda(monkeypatch):
    """-p autopart.smoke with AUTOPART_SMOKE_CUDA_TESTS=1: the tests behind a skipif whose
    reason names CUDA, and no other."""
    import pytest as pt
    from autopart import smoke

    class Item:
        def __init__(self, reason):
            self.reason = reason

        def iter_markers(self, name):
            assert name == "skipif"
            return [pt.mark.skipif(True, reason=self.reason).mark] if self.reason else []

    class Config:
        class hook:
            deselected = []

            @classmethod
            def pytest_deselected(cls, items):
                cls.deselected += items

    items = [Item("needs a CUDA device"), Item(None), Item("needs 2 CUDA GPUs (runs on NCCL)"),
             Item("needs transformers")]
    kept = list(items)
    smoke.pytest_collection_modifyitems(Config, kept)        # off without the variable
    assert kept == items
    monkeypatch.setenv("AUTOPART_SMOKE_CUDA_TESTS", "1")
    smoke.pytest_collection_modifyitems(Config, kept)
    assert kept == [items[0], items[2]] and Config.hook.deselected == [items[1], items[3]]


def test_a_failed_row_fails_the_run(monkeypatch, capsys):
    """Exit status 1 when a row that ran failed (skips do not count); ranks that died fail every
    row of their spawn, with the error's last line."""
    from autopart import smoke

    def dead(fn, world, *args, **kwargs):
        raise RuntimeError("1 of 2 ranks failed:\n--- rank 1: ValueError: boom")

    rows = smoke._spawned(dead, smoke.two_gpus, 2, ["pp=2 1f1b", "tp=2"], True, device="cpu",
                          timeout=1)
    assert [(r["name"], r["status"]) for r in rows] == [("pp=2 1f1b", "fail"), ("tp=2", "fail")]
    assert "boom" in rows[0]["figure"]
    monkeypatch.setattr(smoke, "run", lambda dry: [smoke._row("a", "skip", note="why"), *rows])
    assert smoke.main(["--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "0 passed, 2 failed, 1 skipped" in out and "boom" in out
    monkeypatch.setattr(smoke, "run", lambda dry: [smoke._row("a", "skip", note="why")])
    assert smoke.main(["--json"]) == 0


def _pytest_writing(tests: int, skipped: int, failures: int, returncode: int):
    """A stand-in for subprocess.run of pytest: writes the junit report its command asks for."""
    def run(cmd, **kwargs):
        path = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        Path(path).write_text(f'<testsuites><testsuite tests="{tests}" skipped="{skipped}" '
                              f'failures="{failures}" errors="0"/></testsuites>')
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr="")
    return run


@pytest.mark.parametrize("tests, skipped, failures, returncode, status", [
    (5, 5, 0, 0, "skip"),        # every selected test skipped: nothing was tested
    (0, 0, 0, 5, "skip"),        # none selected (pytest's exit 5)
    (5, 1, 0, 0, "pass"),
    (5, 0, 1, 1, "fail"),
    (5, 5, 0, 1, "fail"),        # pytest failed although nothing failed in the report
])
def test_the_cuda_tests_row_passes_only_when_a_test_passed(monkeypatch, tests, skipped,
                                                             failures, returncode, status):
    from autopart import smoke
    monkeypatch.setattr(smoke.subprocess, "run",
                        _pytest_writing(tests, skipped, failures, returncode))
    row = smoke.cuda_tests(dry=False, timeout=1)
    assert row["status"] == status, row
    assert row["note"] or status == "fail", row


def _runs_with_spawns(monkeypatch, gpus: int, dry: bool) -> tuple[list, dict]:
    """smoke.run with CUDA faked to `gpus` devices and every spawn failing with its world size
    as the error: each spawned row's figure says on how many ranks it would have run."""
    from autopart import smoke
    from autopart.runtime import launch
    import torch
    spawns = []

    def spawn(fn, world, *args, **kwargs):
        spawns.append((fn.__name__, world, kwargs["device"]))
        raise RuntimeError(f"world {world}")
    monkeypatch.setattr(launch, "spawn", spawn)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(smoke, "cuda_tests", lambda dry, timeout: smoke._row("cuda tests", "skip"))
    rows = smoke.run(dry)
    assert [r["name"] for r in rows] == ROWS
    return spawns, {r["name"]: r for r in rows}


def test_zero_runs_on_two_ranks_and_cudagraphs_never_on_the_cpu(monkeypatch):
    """The dry run: ZeRO-1 is spawned on 2 ranks (on 1 it shards nothing), and
    compile="cudagraphs" is skipped with its reason, not run on the CPU (where it would pass
    with no CUDA graph)."""
    spawns, rows = _runs_with_spawns(monkeypatch, gpus=0, dry=True)
    assert rows["train bf16 zero=1"]["figure"] == "world 2", rows["train bf16 zero=1"]
    assert rows["compile=cudagraphs"]["status"] == "skip"
    assert "CUDA" in rows["compile=cudagraphs"]["note"]
    assert {r["figure"] for n, r in rows.items() if n not in SKIPPED_ON_CPU} == {"world 1",
                                                                                "world 2"}
    assert all(device == "cpu" for _, _, device in spawns)


def test_one_gpu_skips_zero_and_runs_cudagraphs(monkeypatch):
    """One GPU: NCCL runs one rank per GPU, so the 2-rank rows, ZeRO-1's too, are skipped with
    the reason; compile="cudagraphs" runs there (world 1, on CUDA)."""
    spawns, rows = _runs_with_spawns(monkeypatch, gpus=1, dry=False)
    for name in ("train bf16 zero=1", "pp=2 1f1b", "tp=2"):
        assert rows[name]["status"] == "skip" and "needs 2 GPUs" in rows[name]["note"], rows[name]
    assert rows["compile=cudagraphs"]["figure"] == "world 1"
    assert spawns == [("single_gpu", 1, "cuda")]


def test_a_rank_that_failed_fails_the_row():
    """Every rank checks its rows: rank 1's failure fails the row rank 0 passed."""
    from autopart import smoke
    ok = [smoke._row("tp=2", "pass", figure="fine"), smoke._row("pp=2 1f1b", "pass")]
    bad = [smoke._row("tp=2", "fail", figure="loss |diff| nan"), smoke._row("pp=2 1f1b", "pass")]
    merged = smoke.merge_ranks([ok, bad])
    assert [(r["name"], r["status"]) for r in merged] == [("tp=2", "fail"), ("pp=2 1f1b", "pass")]
    assert merged[0]["figure"] == "rank 1: loss |diff| nan"
    assert smoke.merge_ranks([ok, ok]) == ok


def test_the_zero_row_fails_on_one_rank(single_process_group):
    """World 1: ZeRO-1 shards nothing, the rank holds all of AdamW's moments: the row fails
    although the losses match the plain model's."""
    import torch
    from autopart import smoke
    ok, figure = smoke._zero(torch.device("cpu"), 1)
    total = sum(p.numel() for p in _model().parameters())
    assert ok is False and f"moments per rank {total} of {total}" in figure, figure


def test_the_cudagraphs_row_needs_replayed_graphs(single_process_group, monkeypatch):
    """compile="cudagraphs" matching the plain model is not enough: with Inductor replaced by
    the segment graphs themselves, no CUDA graph is captured or replayed and the row fails;
    the same run whose segments capture once and replay (torch.cuda.CUDAGraph's methods faked)
    passes."""
    import torch
    from autopart import smoke
    from autopart.runtime import compiled

    graph_calls = []

    def eager(gm, args, options, report, static=()):
        report.graphs += 1

        def run(*a):
            for name in graph_calls:        # looked up now: the class's methods as counted
                getattr(torch.cuda.CUDAGraph, name)(None)
            return gm(*a)
        return run

    monkeypatch.setattr(compiled, "_inductor", eager)
    ok, figure = smoke._compiled(torch.device("cpu"), "cudagraphs")
    assert ok is False and "0 captured, 0 replayed" in figure, figure
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", lambda g: None)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: None)
    graph_calls[:] = ["capture_end", "replay"]
    ok, figure = smoke._compiled(torch.device("cpu"), "cudagraphs")
    assert ok is True and "0 replayed" not in figure, figure


@pytest.mark.full      # two 4-step trainings, about 50 s here; the row itself runs in the dry run
def test_the_fp8_row_needs_fp8_gemms(single_process_group):
    """The fp8 row passes on FP8 GEMMs within FP8's band of the plain bf16 model, and fails on
    the same run in bf16, whose losses are as close but which runs no FP8 GEMM."""
    import torch
    from autopart import smoke
    ok, figure = smoke._fp8(torch.device("cpu"))
    assert ok is True and "0 FP8 GEMMs" not in figure, figure
    ok, figure = smoke._fp8(torch.device("cpu"), precision="bf16")
    assert ok is False and figure.startswith("0 FP8 GEMMs"), figure
