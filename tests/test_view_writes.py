"""Writes into views of tensors made in forward (slice assignment, `index_put_`, `masked_fill_`,
`copy_`) are kept on every mesh: 3 SGD steps of tests/workers/view_writes.py's model against the
unmodified single-process model, every loss, gradient and parameter (tests/workers/equivalence.py).

Before the fix, a write into a tensor computed from the inputs alone (the per-document positions
of packed sequences) was dropped from every rank program, even in one process: the loss was off
by 3e-3 and the parameters by 1e-4.
"""
from __future__ import annotations

import pytest
import torch

from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain
from tests.workers.view_writes import PackedDocs, build, doc_positions, run_view_write_group

M = "packed-docs"
ONE = [Case("view-writes-1", model=M)]
TWO = [Case("view-writes-tp2", model=M, tp=2), Case("view-writes-pp2", model=M, pp=2, microbatches=2),
       Case("view-writes-dp2", model=M, dp=2)]
FOUR = [Case("view-writes-tp2xpp2", model=M, tp=2, pp=2, microbatches=2)]
GROUPS = {("view-writes", 1): ONE, ("view-writes", 2): TWO, ("view-writes-full", 4): FOUR}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
CASES = [pytest.param(c, id=c.name) for c in ONE + TWO] + \
        [pytest.param(c, id=c.name, marks=pytest.mark.full) for c in FOUR]


def test_the_positions_restart_per_document():
    """The model's own premise, in plain torch: without the slice write every position would count
    from the row's start."""
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    assert doc_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]


def test_the_writes_change_the_loss():
    """Each write matters: dropping them changes the plain model's loss (so the equivalence below
    can fail when one is lost)."""
    model, loss_fn, (x, doc), y = build(ONE[0])
    with torch.no_grad():
        base = loss_fn(model(x, doc), y)
        no_docs = loss_fn(model(x, torch.zeros_like(doc)), y)   # no document starts after 0
    assert abs(float(base) - float(no_docs)) > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_matches_plain_model(case: Case, spawn_cache):
    key = _GROUP_OF[case.name]
    assert_all_ranks_equal_plain(case, run_view_write_group(spawn_cache, key, GROUPS[key])[case.name])
