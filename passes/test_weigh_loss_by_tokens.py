"""weigh_loss_by_tokens on captured programs, in one process: which losses it finds by ops
and dataflow, what it rewrites, what its count program counts; tests/test_token_loss.py runs
the results on ranks against the plain model."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from autopart.capture import capture
from autopart.passes.weigh_loss_by_tokens import weigh_loss_by_tokens
from examples.gpt import GPT, config, lm_loss
from tests.workers.common import ignore_labels
from tests.workers.token_loss import MaskedSumLM, ce_plus_aux

aten = torch.ops.aten


def _gpt(loss_fn=lm_loss):
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    y = ignore_labels(torch.randint(0, 256, (4, 16)), "empty")
    return capture(GPT(config("tiny,n_layer=2")), (x,), loss_fn=loss_fn, target=y), x, y


def _count(program, *inputs):
    counter = program.loss_count
    by_name = dict(zip(program.inputs, inputs))
    return int(counter.gm(*(by_name[n] for n in counter.inputs)))


def test_cross_entropy_with_ignored_labels_is_summed_and_counted():
    program, x, y = _gpt()
    out, report = weigh_loss_by_tokens(program, splits=4)
    ce = [n for n in out.gm.graph.nodes if n.target is aten.cross_entropy_loss.default]
    assert len(ce) == 1 and ce[0].args[3] == 2                  # reduction=sum
    assert out.loss_count.inputs == ("target",)
    assert _count(out, x, y) == int((y != -100).sum()) == 8 + 16 + 16   # row 0 ignored, 1 half
    assert _count(out, x, y[:1]) == 0                            # the all-ignored row
    assert "token-weighted" in report["loss"] and "targets != -100" in report["loss"]


def test_one_microbatch_and_one_replica_keep_the_loss_as_it_is():
    program, _, _ = _gpt()
    out, report = weigh_loss_by_tokens(program, splits=1)
    assert out.gm is program.gm and out.loss_count is None
    assert report["loss"].startswith("whole batch")


def test_masked_sum_over_the_mask_count():
    model = MaskedSumLM()
    x = torch.randint(0, 128, (4, 8))
    y = torch.randint(0, 128, (4, 8))
    mask = torch.rand(4, 8) > 0.3
    program = capture(model, (x, y, mask))
    out, report = weigh_loss_by_tokens(program, splits=2)
    assert _count(out, x, y, mask) == int(mask.sum())
    assert out.loss_count.inputs == ("mask",)
    assert not any(n.target is aten.div.Tensor for n in out.gm.graph.nodes
                   if n in list(out.gm.graph.nodes)[-3:])
    # the rewritten program returns the masked sum, the plain one the mean
    with torch.no_grad():
        plain = model(x, y, mask)
        summed = out.gm(*[dict(zip(program.inputs, (x, y, mask)))[n] for n in program.inputs])
    summed = summed[0] if isinstance(summed, (tuple, list)) else summed
    torch.testing.assert_close(summed / mask.sum(), plain, rtol=1e-6, atol=1e-6)


def test_a_loss_with_more_than_the_token_mean_keeps_the_microbatch_rule_and_warns():
    program, _, _ = _gpt(ce_plus_aux)
    with pytest.warns(UserWarning, match="loss follows the microbatch mean") as caught:
        out, report = weigh_loss_by_tokens(program, splits=4)
    assert out.gm is program.gm and out.loss_count is None
    assert "cross_entropy_loss" in str(caught[0].message) and "auxiliary" in report["loss"]


def test_a_mean_without_excluded_elements_keeps_the_rule_without_a_warning():
    class MSE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, y):
            return F.mse_loss(self.lin(x), y)

    program = capture(MSE(), (torch.randn(4, 8), torch.randn(4, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, report = weigh_loss_by_tokens(program, splits=4)
    assert out.loss_count is None and report["loss"].startswith("microbatch mean")


def test_a_count_that_depends_on_parameters_is_not_taken():
    class LearnedMask(torch.nn.Module):     # the 'count' reads a weight: not inputs alone
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            m = (self.lin(x) > 0).float()
            return (x * m).sum() / m.sum()

    program = capture(LearnedMask(), (torch.randn(4, 8),))
    out, _ = weigh_loss_by_tokens(program, splits=2)
    assert out.loss_count is None and out.gm is program.gm
