"""Packed documents with expert parallelism: an unmodified Hugging Face Mixtral (4 experts,
top-2, random weights) on rows packed with documents (tests/workers/packed_experts.py: a
per-token document id and per-document positions as inputs, attention causal within each
document, the last row's padded tail a document of its own with labels -100, the per-token mean
loss) trains as the plain model does on the same global batch: every step's loss, the first
step's gradients, the clipped norm and the parameters after 3 optimizer steps, fp32, project
tolerances (tests/workers/equivalence.py), with each rank holding 1/ep of every expert weight.

Meshes: ep=2 over dp=2; cp=2 alone (all-gather); dp=4 with ep=2; cp=2 x dp=2 x ep=2 with ring
and with all-gather (ignored labels, Adam). Under cp the document mask is applied per block
from each rank's chunks of `doc` and the experts' sort/gather/scatter are proved per-token
(tests/test_context_parallel.py has the same model family without documents).

Full tier only (each spawn compiles Mixtral on every rank): python -m pytest -m full
tests/test_packed_experts.py
"""
from __future__ import annotations

import pytest

from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.workers.packed_experts import run_packed_expert_cases

SEQ = dict(model="packed-mixtral", batch=4, seq=32)

TWO = [
    Case("packed-mixtral-ep2xdp2", dp=2, ep=2, optim="adamw", **SEQ),
    Case("packed-mixtral-cp2-allgather", cp=2, cp_attention="allgather", **SEQ),
]
FOUR = [
    Case("packed-mixtral-cp2xdp2xep2-ring", cp=2, dp=2, ep=2, **SEQ),
    Case("packed-mixtral-cp2xdp2xep2-allgather-ignored", cp=2, dp=2, ep=2,
         cp_attention="allgather", ignored="uneven", optim="adam", **SEQ),
    Case("packed-mixtral-dp4xep2", dp=4, ep=2, **SEQ),
]
GROUPS = {("packed-experts", 2): TWO, ("packed-experts", 4): FOUR}
_GROUP_OF = {c.name: k for k, cases in GROUPS.items() for c in cases}


def _expert_numel() -> dict:
    """name -> numel of each plain expert weight (the model built here, not by autopart)."""
    from tests.workers.common import build
    model = build(TWO[0])[0]
    return {n: p.numel() for n, p in model.named_parameters() if ".experts." in n}


@pytest.mark.full
@pytest.mark.parametrize("case", [c for cases in GROUPS.values() for c in cases],
                         ids=lambda c: c.name)
def test_packed_documents_through_experts_match_plain_model(case: Case, spawn_cache):
    results = run_group(spawn_cache, _GROUP_OF[case.name], GROUPS[_GROUP_OF[case.name]],
                        rank_fn=run_packed_expert_cases)[case.name]
    assert_all_ranks_equal_plain(case, results)
    if case.ep > 1:          # each rank holds its experts only: 1/ep of every expert weight
        experts = _expert_numel()
        for r in results:
            assert sorted(r["ep_sharded"]) == sorted(experts), (r["ep_sharded"], experts)
            for name, n in experts.items():
                assert r["held"][name] * case.ep == n, (r["rank"], name, r["held"][name], n)
