"""Expert parallelism's all-to-alls behind the other microbatch of a pair (issue 52;
passes/overlap_experts.py, runtime/executor.py paired_computes) on real ranks: equal to the plain
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


GROUPS = {("fast", 2): _both(SWITCH_2),            # ~40 s: the dense dispatch (GShard)
          ("full", 2): _both(MIXTRAL_2),           # rows sorted by expert (dropless, HF)
          ("full", 4): _both(MIXTRAL_PP)}
CASES = [pytest.param(key, c, id=c.name, marks=[pytest.mark.full] if key[0] == "full" else [])
         for key, cases in GROUPS.items() for c in cases]


@pytest.mark.parametrize("key,case", CASES)
def test_overlapped_experts_equal_the_plain_model(key, case, spawn_cache):
    ranks = run_group(spawn_cache, ("ep-overlap",) + key, GROUPS[key],
                      rank_fn=run_cases)[case.name]
    assert_all_ranks_equal_plain(case, ranks)
    # every compute of every rank ran paired: 3 steps x microbatches x this rank's one chunk
    for r in ranks:
        want = {"paired F": 3 * case.microbatches, "paired B": 3 * case.microbatches}
        assert r["paths"] == want, (r["rank"], r["paths"])
        if case.contract:     # the all-to-alls went through the contract's streams
            assert r["contract"]["collectives"] > 0 and not r["contract"]["errors"], r["contract"]
