"""`python -m autopart.smoke --dry-run --json`: the GPU smoke's plumbing on the CPU.

The dry run trains, saves, resumes, compiles (compile=True and "cudagraphs", Inductor's CPU
code) and runs the pipeline and tensor-parallel comparisons over Gloo, and runs the CUDA-only
tests (which skip here). Measured on 2 cores: 49 s with Inductor's cache warm, 87-127 s cold
(the two compile rows are most of it), so it stays in the fast tier; the timeout leaves room for
a loaded machine.

    python -m pytest -q tests/test_smoke.py
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROWS = ["cuda tests", "train bf16 zero=1", "save / resume", "compile=True", "compile=cudagraphs",
        "meta model", "pp=2 1f1b", "tp=2"]


@pytest.mark.timeout(660)
def test_dry_run_passes_every_row():
    done = subprocess.run([sys.executable, "-m", "autopart.smoke", "--dry-run", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert set(report) == {"dry_run", "ok", "seconds", "counts", "rows"}
    assert report["dry_run"] is True and report["ok"] is True
    assert [r["name"] for r in report["rows"]] == ROWS
    for row in report["rows"]:
        assert set(row) == {"name", "status", "seconds", "figure", "note"}
        assert row["status"] in ("pass", "skip"), row
        assert row["note"], row                       # what a dry run could not do, or why skipped
        if row["status"] == "pass":
            assert row["figure"], row
    assert report["counts"] == {"pass": 8, "fail": 0, "skip": 0}
    selected, passed, failed, skipped = map(int, re.fullmatch(
        r"(\d+) selected: (\d+) passed, (\d+) failed, (\d+) skipped",
        report["rows"][0]["figure"]).groups())
    assert selected >= 5 and failed == 0 and passed + skipped == selected


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
