"""Expert parallelism's all-to-alls behind the other microbatch of a pair (issue 52;
passes/overlap_experts.py, runtime/executor.py paired_computes; under pp a forward beside another
microbatch's backward: combined_computes) on real ranks: equal to the plain
model (every step's loss, step-1 gradients, the clipped norm, parameters after 3 SGD steps), and
the computes really ran as paired programs (a run with the overlap off, or pairing broken, runs
none and fails the count). Under Gloo and under NCCL's contract (tests/nccl_contract.py: an async
all-to-all's output is poisoned until its wait, so a read before the wait gives NaN).

Fast tier: python -m pytest -m "not full" tests/test_ep_overlap.py
"""
from __future__ import annotations

import pytest

from dataclasses import replace

from tests.workers.ep_overlap import OCase, run_cases
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group

SWITCH_2 = OCase("ov-switch-dp2-ep2-m2", model="switch", dp=2, ep=2, microbatches=2)
MIXTRAL_2 = OCase("ov-mixtral-dp2-ep2-m2", model="mixtral", dp=2, ep=2, microbatches=2, batch=4)
MIXTRAL_PP = OCase("ov-mixtral-pp2xdp2-ep2-m4", model="mixtral", pp=2, dp=2, ep=2,
                   microbatches=4, batch=8)


def _both(case: OCase) -> list[OCase]:
    """The case under Gloo, then under NCCL's contract (installed from then on)."""
    return [case, replace(case, name=case.name + "-contract", contract=True)]


SWITCH_PP = OCase("ov-switch-pp2xdp2-ep2-m4-contract", model="switch", pp=2, dp=2, ep=2,
                  microbatches=4, batch=8, contract=True)


GROUPS = {("fast", 2): _both(SWITCH_2),            # ~40 s: the dense dispatch (GShard)
          ("fast", 4): [SWITCH_PP],                # combined 1F1B under NCCL's contract
          ("full", 2): _both(MIXTRAL_2),           # rows sorted by expert (dropless, HF)
          ("full", 4): _both(MIXTRAL_PP)}
CASES = [pytest.param(key, c, id=c.name, marks=[pytest.mark.full] if key[0] == "full" else [])
         for key, cases in GROUPS.items() for c in cases]


def _assert_combined(case: OCase, ranks: list) -> None:
    """Under pp, each rank of pipeline stage s ran m - (pp - s) forwards combined with a backward
    (schedule_lowering.combine_forward_backward: pp - s warmup forwards) in each of the 3 steps,
    the others alone, and nothing paired: counted per stage, since the ranks of a stage are
    known only by count (dp * ep... ranks each)."""
    m, pp = case.microbatches, case.pp
    per_stage = len(ranks) // pp
    want = sorted(3 * (m - (pp - s)) for s in range(pp) for _ in range(per_stage))
    got = sorted(r["paths"].get(("combined F"), 0) for r in ranks)
    assert got == want, [(r["rank"], r["paths"]) for r in ranks]
    for r in ranks:
        assert r["paths"].get("combined B") == r["paths"]["combined F"], r["paths"]
        assert r["paths"].get("autograd F", 0) + r["paths"]["combined F"] == 3 * m, r["paths"]
        assert not any(k.startswith("paired") for k in r["paths"]), r["paths"]


@pytest.mark.parametrize("key,case", CASES)
def test_overlapped_experts_equal_the_plain_model(key, case, spawn_cache):
    ranks = run_group(spawn_cache, ("ep-overlap",) + key, GROUPS[key],
                      rank_fn=run_cases)[case.name]
    assert_all_ranks_equal_plain(case, ranks)
    if case.pp > 1:     # 1F1B's steady state combined: _assert_combined
        _assert_combined(case, ranks)
    for r in ranks:
        if case.pp == 1:    # every compute of every rank ran paired: 3 steps x microbatches
            want = {"paired F": 3 * case.microbatches, "paired B": 3 * case.microbatches}
            assert r["paths"] == want, (r["rank"], r["paths"])
        if case.contract:     # the all-to-alls went through the contract's streams
            assert r["contract"]["collectives"] > 0 and not r["contract"]["errors"], r["contract"]
