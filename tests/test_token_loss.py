"""Real batches: padded sequences and ignored labels give the plain model's loss and gradients
on every mesh (passes/weigh_loss_by_tokens.py). Each case trains 3 steps against the unmodified
single-process model on the same global batch (tests/workers/equivalence.equivalence: every loss,
the first gradients, the clipped norm and every parameter), with labels set to -100 unevenly over
the rows ("uneven": half the rows lose their second half; "empty": also one microbatch wholly
ignored), for cross_entropy(ignore_index), a Hugging Face model's own `labels` loss and a
masked-sum loss. Before the pass, the first case's loss was off by 8e-3 and its gradients by
up to 147%.

Fast tier: python -m pytest -m "not full" tests/test_token_loss.py
"""
from __future__ import annotations

import pytest

from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.workers.token_loss import run_token_cases

FAST_2 = [
    Case("gpt-pp2-1f1b-uneven", model="gpt4", pp=2, microbatches=4, ignored="uneven"),
    Case("gpt-pp2-zbv-empty", model="gpt4", pp=2, schedule="zb-v", virtual_stages=2,
         microbatches=4, ignored="empty"),
    Case("gpt-dp2-adamw-uneven", model="gpt4", dp=2, microbatches=2, optim="adamw",
         ignored="uneven"),
    Case("hf-labels-pp2-adamw-empty", model="hf-labels", pp=2, microbatches=4, optim="adamw",
         ignored="empty"),
    Case("masked-sum-dp2-uneven", model="masked-sum", dp=2, microbatches=2, ignored="uneven"),
]
FULL_4 = [
    Case("gpt-tp2xpp2-adamw-empty", model="gpt4", tp=2, pp=2, microbatches=4, optim="adamw",
         ignored="empty"),
    Case("hf-labels-tp2xdp2-uneven", model="hf-labels", tp=2, dp=2, microbatches=2,
         ignored="uneven"),
    Case("masked-sum-pp2xdp2-empty", model="masked-sum", pp=2, dp=2, microbatches=2,
         ignored="empty"),
]
FULL_2 = [Case("mixtral-dp2-ep2-uneven", model="mixtral", dp=2, ep=2, microbatches=2,
               ignored="uneven")]
FULL_8 = [Case("gpt-pp2xdp2xtp2-adamw-uneven", model="gpt4", pp=2, dp=2, tp=2,
               microbatches=2, optim="adamw", ignored="uneven")]
GROUPS = {("tokens", 2): FAST_2, ("tokens-full", 2): FULL_2, ("tokens-full", 4): FULL_4,
          ("tokens-full", 8): FULL_8}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
CASES = [pytest.param(c, id=c.name) for c in FAST_2] + [
    pytest.param(c, id=c.name, marks=pytest.mark.full) for c in FULL_2 + FULL_4 + FULL_8]


@pytest.mark.parametrize("case", CASES)
def test_ignored_labels_match_the_plain_model(case: Case, spawn_cache):
    key = _GROUP_OF[case.name]
    results = run_group(spawn_cache, key, GROUPS[key], rank_fn=run_token_cases)
    assert_all_ranks_equal_plain(case, results[case.name])
