"""bench/cp_attention.py end to end on a short sequence: its JSON has what `python -m bench` and
bench/RESULTS.md read, and a rank at cp=2 keeps fewer activation bytes than one rank at cp=1."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import run_all

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.full
def test_cp_attention_json_and_activation_bytes():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "cp_attention.py"), "--rounds", "1",
                        "--warmup", "0", "--seq", "256", "--sides", "ring,allgather,cp1",
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("step_seconds", "median_step_seconds", "ratios", "activation_bytes",
                "saved_total_bytes", "activation_ratio_to_cp1", "maxrss_bytes",
                "torch_context_parallel", "equal_work", "load_before", "load_after"):
        assert key in out, sorted(out)
    assert out["torch_context_parallel"] == "not asked (--sides)"
    times = out["step_seconds"]
    assert len(times["ring"]) == len(times["allgather"]) == len(times["cp1"]) == 1
    assert set(out["ratios"]) == {"ring / allgather"}
    acts = out["activation_bytes"]
    assert len(acts["cp1"]) == 1 and len(acts["ring"]) == len(acts["allgather"]) == 2
    for side in ("ring", "allgather"):
        assert all(0 < b < acts["cp1"][0] for b in acts[side]), acts
        assert all(r < 1 for r in out["activation_ratio_to_cp1"][side])
    assert all(b > 0 for ranks in out["maxrss_bytes"].values() for b in ranks)
    # what `python -m bench` makes of it
    cp = next(b for b in run_all.BENCHMARKS if b.name == "cp")
    assert set(cp.values(out)) == {"cp ring / allgather"}


def test_cp_rows_in_python_m_bench_torch_row_only_when_torch_ran(monkeypatch):
    """Fake outputs: ring / allgather per round; the torch row appears only when a run has it."""
    cp = next(b for b in run_all.BENCHMARKS if b.name == "cp")
    without = {"step_seconds": {"ring": [1.0, 2.0, 3.0], "allgather": [2.0, 2.0, 2.0],
                                "cp1": [0.5]}}
    with_torch = {"step_seconds": {**without["step_seconds"], "torch": [4.0, 4.0, 1.0]}}
    outputs = [without, without, with_torch, with_torch]
    monkeypatch.setattr(run_all, "invoke",
                        lambda argv, timeout: (0, json.dumps(outputs.pop(0)) + "\n", ""))
    rows = run_all.measure(cp, 3, runs=2, log=open("/dev/null", "w"))
    assert [r["benchmark"] for r in rows] == ["cp ring / allgather"]
    assert rows[0]["runs"] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert rows[0]["verdict"] == "result"
    rows = run_all.measure(cp, 3, runs=2, log=open("/dev/null", "w"))
    assert [r["benchmark"] for r in rows] == ["cp ring / allgather",
                                              "cp ring / torch context_parallel"]
    assert rows[1]["runs"] == [pytest.approx(0.5), pytest.approx(0.5)]
