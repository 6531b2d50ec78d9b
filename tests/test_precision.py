"""parallelize(..., precision="bf16"): bf16 compute, fp32 master weights, gradients and loss, bf16 on
the wire; against the plain model trained under the same recipe (tests/workers/precision.py writes
it out, with the bounds and why).

Fast tier: python -m pytest -m "not full" tests/test_precision.py   (bad input, explain; no processes)
Full tier: python -m pytest tests/test_precision.py                  (one 2-rank spawn, ~3 min)
"""
from __future__ import annotations

import json
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import autopart
from autopart.errors import AutopartError
from tests.workers.common import build
from tests.workers.equivalence import claim_problems, run_group
from tests.workers.precision import BCase, run_bf16_cases

# 4 layers, n_embd 32, vocab 128, seq 16, global batch 8 (tests/workers/common.py gpt_config)
CASES = [
    BCase("gpt4-pp2", model="gpt4", pp=2, microbatches=2),
    BCase("gpt4-pp2-zb-v", model="gpt4", pp=2, schedule="zb-v", virtual_stages=2, microbatches=4),
    BCase("gpt4-dp2", model="gpt4", dp=2, microbatches=2),
    BCase("gpt4-dp2-zero1", model="gpt4", dp=2, microbatches=2, zero=1),
    BCase("switch-dp2-ep2", model="switch", dp=2, ep=2, microbatches=2, noise="kernels"),
    BCase("gpt4-tp2", model="gpt4", tp=2, microbatches=2, noise="tp"),
    BCase("gpt4-tp2-sp", model="gpt4", tp=2, microbatches=2, sequence_parallel=True, noise="tp"),
    # compile=True: Inductor's bf16 kernels round elsewhere than eager's (workers/precision.py)
    BCase("gpt4-pp2-compiled", model="gpt4", pp=2, microbatches=2, compile=True,
          noise="compiled"),
]
ROOT = Path(__file__).resolve().parent.parent
BY_NAME = {c.name: c for c in CASES}
ACTIVATION = 4 * 16 * 32          # one microbatch's hidden state: microbatch 4 x seq 16 x n_embd 32
MICROBATCHES_RUN = 3 * 2          # 3 steps x 2 microbatches per rank


def _results(name: str, cache) -> list[dict]:
    results = run_group(cache, "bf16-world2", CASES, rank_fn=run_bf16_cases, timeout=900)
    if isinstance(results, Exception):
        raise results
    ranks = results[name]
    assert len(ranks) == 2, ranks
    return ranks


@pytest.mark.full
@pytest.mark.parametrize("name", list(BY_NAME))
def test_bf16_matches_the_recipe_on_the_plain_model(name, spawn_cache):
    """Within the bounds, and the wire and Inductor's report as the case claims
    (tests/workers/equivalence.claim_problems)."""
    for r in _results(name, spawn_cache):
        problems = r["problems"] + claim_problems(BY_NAME[name], r)
        assert not problems, f"{name} rank {r['rank']}:\n" + "\n".join(problems)


@pytest.mark.full
def test_compiled_bf16_runs_inductor_artifacts(spawn_cache):
    """The compiled case above really ran compiled code: artifacts on every rank, no layer
    left eager."""
    for r in _results("gpt4-pp2-compiled", spawn_cache):
        assert r["inductor"]["artifacts"] >= 1 and not r["inductor"]["fallbacks"], r["inductor"]


@pytest.mark.full
@pytest.mark.parametrize("name", ["gpt4-pp2", "gpt4-pp2-zb-v", "gpt4-pp2-compiled"])
def test_pipeline_transfers_carry_bf16(name, spawn_cache):
    for r in _results(name, spawn_cache):
        for kind in ("isend", "irecv"):
            # every transfer is a hidden state or its gradient: bf16, one microbatch's size
            # (global batch 8 over the case's microbatches, x seq 16 x n_embd 32)
            size = 8 // BY_NAME[name].microbatches * 16 * 32
            assert set(r["wire"][kind]) == {"bfloat16"}, (name, kind, r["wire"][kind])
            assert set(r["wire"][kind]["bfloat16"]) == {size}, r["wire"][kind]


@pytest.mark.full
def test_gradients_reduce_in_fp32(spawn_cache):
    for name, collective in (("gpt4-dp2", "grad_all_reduce"),
                             ("gpt4-dp2-zero1", "grad_reduce_scatter")):
        for r in _results(name, spawn_cache):
            # (float64 too where a norm is reduced: no bf16)
            assert "float32" in r["wire"][collective], (name, r["wire"][collective])
            assert "bfloat16" not in r["wire"][collective], (name, r["wire"][collective])


@pytest.mark.full
def test_tensor_parallel_collectives_carry_bf16(spawn_cache):
    """Per microbatch, 4 layers: the 8 row-parallel all-reduces (attention and MLP outputs) and
    the 9 copy_to_tp backward all-reduces (c_attn, c_fc and the lm head's inputs) carry bf16;
    the vocabulary-parallel embedding's all-reduce is on the fp32 residual stream and stays fp32."""
    for r in _results("gpt4-tp2", spawn_cache):
        reduces = r["wire"]["all_reduce"]
        assert reduces["bfloat16"] == {ACTIVATION: 17 * MICROBATCHES_RUN}, reduces
        assert reduces["float32"].get(ACTIVATION) == MICROBATCHES_RUN, reduces
    for r in _results("gpt4-tp2-sp", spawn_cache):
        # sequence parallel: the gathers before each column linear and the reduce-scatters after
        # each row linear move half a microbatch's hidden state each (1024 of 2048 per rank)
        assert ACTIVATION // 2 in r["wire"]["all_gather"]["bfloat16"], r["wire"]
        assert ACTIVATION in r["wire"]["reduce_scatter"]["bfloat16"], r["wire"]


@pytest.mark.full
def test_expert_all_to_all_carries_bf16(spawn_cache):
    for r in _results("switch-dp2-ep2", spawn_cache):
        assert set(r["wire"]["all_to_all"]) == {"bfloat16"}, r["wire"]["all_to_all"]


# -- no processes: the compiled plan, explain, the CLI, bad input ---------------------------------

def test_unknown_precision_is_rejected():
    model, loss_fn, inputs, target = build(BCase("x", model="gpt4"))
    with pytest.raises(AutopartError, match=r"precision='fp16'.*\n  remedy: precision=\"bf16\""):
        autopart.compile(model, autopart.Mesh(pp=2), inputs, loss_fn=loss_fn, target=target,
                         microbatches=2, precision="fp16")


def test_explain_counts_bf16_bytes_on_the_wire():
    """tp=2 at bf16: a row-parallel all-reduce moves 2(t-1)/t x the hidden state at 2 bytes an
    element; the vocabulary-parallel embedding's all-reduce stays at 4. The plan's digest
    changes with the precision, so ranks that disagree on it fail at parallelize."""
    model, loss_fn, inputs, target = build(BCase("x", model="gpt4"))
    kwargs = dict(loss_fn=loss_fn, target=target, microbatches=2)
    c = autopart.compile(model, autopart.Mesh(tp=2), inputs, precision="bf16", **kwargs)
    assert c.plan.config.precision == "bf16"
    rows = c.to_json()["tensor_parallel"]
    by_split = {}
    for r in rows:
        by_split.setdefault(r["split"], set()).add(r["bytes_per_microbatch"])
    ring = 2 * (2 - 1) / 2
    assert by_split["row"] == {ring * ACTIVATION * 2}, rows
    assert by_split["column"] == {ring * ACTIVATION * 2}, rows
    assert by_split["vocab"] == {ring * ACTIVATION * 4}, rows
    assert "precision=bf16" in c.explain()
    fp32_plan = dataclasses.replace(c.plan, config=c.plan.config.replace(precision="fp32"))
    assert dataclasses.replace(c, plan=fp32_plan).digest() != c.digest()


@pytest.mark.full
def test_cli_precision_halves_pipeline_transfers():
    """`autopart compile --precision bf16`: each pipeline transfer of the tiny GPT (n_embd 64,
    block_size 64 tokens) at microbatch 1 is 64 x 64 x 2 bytes, half the fp32 figure."""
    out = subprocess.run([sys.executable, "-m", "autopart", "compile", "examples/gpt.py:GPT",
                          "--config", "tiny,n_layer=2", "--mesh", "pp=2", "--batch", "2",
                          "--microbatches", "2", "--precision", "bf16", "--json"],
                         capture_output=True, text=True, timeout=300,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["precision"] == "bf16"
    assert data["chunks"][0]["send_bytes_per_microbatch"] == 64 * 64 * 2
    assert data["chunks"][1]["recv_bytes_per_microbatch"] == 64 * 64 * 2


@pytest.mark.full
def test_bf16_matches_the_recipe_single_process(single_process_group):
    """pp=1 in this process: the recipe's autocast step, fp32 gradients and parameters."""
    from tests.workers.precision import bf16_equivalence
    r = bf16_equivalence(BCase("gpt4-pp1", model="gpt4", microbatches=2), rank=0)
    assert not r["problems"], "\n".join(r["problems"])
    assert r["errors"]["grad"] <= 1e-6 and r["gap"]["grad"] > 1e-3, r


@pytest.mark.full
def test_demo_bf16_tracks_the_fp32_curve():
    """examples/train_gpt.py --precision bf16: 50 steps within 2% of the fp32 plain model."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--precision",
                          "bf16", "--steps", "50"], capture_output=True, text=True, timeout=900,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "relative loss difference, bf16 vs the fp32 plain model" in out.stdout
