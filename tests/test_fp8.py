"""parallelize(..., precision="fp8"): the linears as FP8 GEMMs (tensorwise or rowwise dynamic
scaling), the rest bf16, fp32 master weights; against the plain model trained under the same
recipe, written out in tests/workers/fp8.py with plain torch._scaled_mm calls.

Fast tier: python -m pytest -m "not full" tests/test_fp8.py   (one process, tensorwise, with and
           without recompute="full"; one linear over 2 ranks)
Full tier: python -m pytest tests/test_fp8.py                  (rowwise, and one 2-rank spawn)
"""
from __future__ import annotations

import pytest

from tests.workers.equivalence import run_group
from tests.workers.fp8 import FCase, fp8_equivalence, run_fp8_cases

# the example GPT: 4 layers, n_embd 32, vocab 128, seq 16, global batch 8, 3 SGD steps
CASES = [
    FCase("gpt4-tp2", model="gpt4", tp=2, microbatches=2, noise="tp"),
    FCase("gpt4-tp2-rowwise", model="gpt4", tp=2, microbatches=2, noise="tp",
          scaling="rowwise"),
    FCase("gpt4-tp2-all", model="gpt4", tp=2, microbatches=2, noise="tp", layers="all"),
    FCase("gpt4-pp2", model="gpt4", pp=2, microbatches=2),
    FCase("gpt4-pp2-zb-v", model="gpt4", pp=2, schedule="zb-v", virtual_stages=2,
          microbatches=4),
    FCase("gpt4-pp2-dualpipe-v", model="gpt4", pp=2, schedule="dualpipe-v", virtual_stages=2,
          microbatches=4),
    FCase("gpt4-dp2-zero1", model="gpt4", dp=2, microbatches=2, zero=1),
    FCase("gpt4-dp2-zero2", model="gpt4", dp=2, microbatches=2, zero=2),
    FCase("gpt4-tp2-sp", model="gpt4", tp=2, microbatches=2, noise="tp", sequence_parallel=True),
    FCase("gpt4-tp2-recompute-full", model="gpt4", tp=2, microbatches=2, noise="tp",
          recompute="full"),
    FCase("gpt4-pp2-recompute-selective", model="gpt4", pp=2, microbatches=2,
          recompute="selective"),
]
BY_NAME = {c.name: c for c in CASES}


def _problems(r) -> str:
    return f"{r['case']} rank {r['rank']}:\n" + "\n".join(r["problems"])


@pytest.mark.parametrize("scaling, recompute", [
    ("tensorwise", "none"), pytest.param("rowwise", "none", marks=pytest.mark.full),
    ("tensorwise", "full"), pytest.param("rowwise", "full", marks=pytest.mark.full)])
def test_fp8_matches_the_recipe_single_process(scaling, recompute, single_process_group):
    """One process: the very roundings of the recipe (measured: every error 0.0), and 4e-2
    (tensorwise) / 3e-2 (rowwise) from the bf16 recipe's step-1 gradients; recompute="full"
    replays every FP8 linear of each layer in backward, to the same bits."""
    r = fp8_equivalence(FCase("gpt4-pp1", model="gpt4", microbatches=2, scaling=scaling,
                              recompute=recompute), 0)
    assert not r["problems"], _problems(r)
    assert r["errors"]["grad"] <= 1e-5 and r["apart"]["grad"] > 1e-2, r["errors"]
    assert len(r["converted"]) == 15 and len(r["fp8"]["fp8"]) == 15, r["fp8"]


@pytest.mark.full
@pytest.mark.parametrize("name", list(BY_NAME))
def test_fp8_matches_the_recipe_on_the_plain_model(name, spawn_cache):
    results = run_group(spawn_cache, "fp8-world2", CASES, rank_fn=run_fp8_cases, timeout=1500)
    ranks = results[name]
    assert len(ranks) == 2, ranks
    for r in ranks:
        assert not r["problems"], _problems(r)


def _tp_linear(rank: int, world: int) -> list[str]:
    from tests.workers.fp8 import tp_linear_problems
    return tp_linear_problems(rank, world, "tensorwise") + \
        tp_linear_problems(rank, world, "rowwise")


def test_tp_shards_scale_with_the_global_amax():
    """Two ranks, one linear column- then row-parallel, each half of every tensor 50x the other
    (a rank's own amax is never the global one): every output and gradient bitwise its share of
    the recipe's GEMMs on the whole tensors (tests/workers/fp8.tp_linear_problems)."""
    from autopart.runtime.launch import spawn
    for rank, problems in enumerate(spawn(_tp_linear, 2, timeout=300)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
