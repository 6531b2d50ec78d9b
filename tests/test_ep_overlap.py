"""Expert parallelism's all-to-alls behind the other microbatch of a pair (issue 52;
passes/overlap_experts.py, runtime/executor.py paired_computes; under the interleaved 1F1B a
forward beside another microbatch's backward: combined_computes) on real ranks: equal to the plain
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


MIXTRAL_VPP = OCase("ov-mixtral-pp2xdp2-ep2-v2-m4-contract", model="mixtral4", pp=2, dp=2,
                    ep=2, microbatches=4, batch=8, schedule="interleaved-1f1b",
                    virtual_stages=2, contract=True)


GROUPS = {("fast", 2): _both(SWITCH_2),            # ~40 s: the dense dispatch (GShard)
          ("fast", 4): [MIXTRAL_VPP],              # combined F&B under NCCL's contract
          ("full", 2): _both(MIXTRAL_2),           # rows sorted by expert (dropless, HF)
          ("full", 4): _both(MIXTRAL_PP) + [replace(MIXTRAL_VPP, name="ov-mixtral-pp2xdp2-ep2-v2-m4",
                                                    contract=False)]}
CASES = [pytest.param(key, c, id=c.name, marks=[pytest.mark.full] if key[0] == "full" else [])
         for key, cases in GROUPS.items() for c in cases]


def _assert_combined(case: OCase, ranks: list) -> None:
    """pp=2, v=2, m=4 (every chunk holds all-to-alls): the interleaved 1F1B runs, on rank 0 of
    the pipeline, 0F2 next to 2B0, 0F3 / 2B1, 2F2 / 0B0 and 2F3 / 0B1, and on rank 1 1F2 / 1B0
    and 1F3 / 1B1, with no send between (read off make_schedule("interleaved-1f1b", 2, 4, 2));
    each such pair ran combined in each of the 3 steps, every other compute alone, nothing
    paired. The ranks of a stage are known only by count, so the counts are compared sorted."""
    assert (case.pp, case.virtual_stages, case.microbatches) == (2, 2, 4)
    per_stage = len(ranks) // case.pp
    want = sorted([3 * 4] * per_stage + [3 * 2] * per_stage)
    got = sorted(r["paths"].get("combined F", 0) for r in ranks)
    assert got == want, [(r["rank"], r["paths"]) for r in ranks]
    for r in ranks:
        p = r["paths"]
        assert p.get("combined B") == p["combined F"], p
        assert p.get("autograd F", 0) + p["combined F"] == 3 * 4 * 2, p   # 4 mb x 2 chunks
        assert not any(k.startswith("paired") for k in p), p


@pytest.mark.parametrize("key,case", CASES)
def test_overlapped_experts_equal_the_plain_model(key, case, spawn_cache):
    ranks = run_group(spawn_cache, ("ep-overlap",) + key, GROUPS[key],
                      rank_fn=run_cases)[case.name]
    assert_all_ranks_equal_plain(case, ranks)
    if case.schedule == "interleaved-1f1b":
        _assert_combined(case, ranks)
    for r in ranks:
        if case.schedule == "1f1b":     # every compute ran paired: 3 steps x microbatches
            want = {"paired F": 3 * case.microbatches, "paired B": 3 * case.microbatches}
            assert r["paths"] == want, (r["rank"], r["paths"])
        if case.contract:     # the all-to-alls went through the contract's streams
            assert r["contract"]["collectives"] > 0 and not r["contract"]["errors"], r["contract"]
