"""The comparator every equivalence, checkpoint and meta test goes through
(tests/workers/common._compare) rejects a non-finite value: `err > atol + rtol * |expected|` is
False for a NaN error, so a NaN parameter would otherwise pass every comparison. The GPU
smoke's own comparisons (autopart/smoke.py: `worst`, `_steps_against_plain`) fail on a NaN too."""
from __future__ import annotations

import math

import pytest
import torch

from tests.workers.common import _compare


def _problems(actual, expected) -> tuple[list[str], float]:
    problems: list[str] = []
    err = _compare("p", torch.tensor(actual, dtype=torch.float64),
                   torch.tensor(expected, dtype=torch.float64), 1e-5, 1e-6, problems)
    return problems, err


def test_close_values_pass_and_far_values_fail():
    problems, err = _problems([1.0, 2.0], [1.0, 2.0 + 1e-6])
    assert problems == [] and err == pytest.approx(1e-6)
    problems, _ = _problems([1.0, 2.1], [1.0, 2.0])
    assert len(problems) == 1 and "1 of 2 elements differ" in problems[0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_actual_fails(bad):
    problems, err = _problems([1.0, bad, 3.0], [1.0, 2.0, 3.0])
    assert err == math.inf
    assert len(problems) == 1
    assert "actual value are not finite" in problems[0] and "flat index 1" in problems[0]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_expected_fails_and_says_which(bad):
    problems, err = _problems([1.0, 2.0], [bad, 2.0])
    assert err == math.inf and len(problems) == 1
    assert "expected value are not finite" in problems[0] and "actual" not in problems[0]


def test_nan_on_both_sides_fails_twice():
    problems, _ = _problems([math.nan], [math.nan])
    assert len(problems) == 2
    assert "actual" in problems[0] and "expected" in problems[1]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_precision_relative_error_is_inf_on_non_finite(bad):
    """tests/workers/precision._rel feeds `max(previous, err)`, which drops a NaN: it must
    say inf."""
    from tests.workers.precision import _rel
    one = torch.ones(3)
    with_bad = torch.tensor([1.0, bad, 1.0])
    assert _rel([with_bad], [one]) == math.inf
    assert _rel([one], [with_bad]) == math.inf
    assert max(0.0, _rel([with_bad], [one])) == math.inf
    assert _rel([one], [one]) == 0.0


# -- the GPU smoke's comparisons (autopart/smoke.py) ---------------------------------------------

def test_smoke_worst_error_is_nan_when_any_is():
    """Python's max(1e-6, nan) is 1e-6: the smoke's largest error must be NaN instead, which
    fails every `err <= bound`."""
    from autopart import smoke
    assert math.isnan(smoke._max_diff([4.1, 4.2, 4.3], [4.1, math.nan, 4.3]))
    assert math.isnan(smoke.worst([1e-6, math.nan, 0.0]))
    assert smoke._max_diff([4.1, 4.2], [4.1, 4.25]) == pytest.approx(0.05)
    assert smoke.worst([]) == 0.0 and smoke.worst([math.inf, 1.0]) == math.inf


class _Twin:
    """A stand-in for a ParallelModel: the plain model's own copy, trained alike, with a NaN
    put into one loss or one parameter (not the first: Python's max drops a NaN that comes
    after a number)."""

    def __init__(self, plain, nan_in: str):
        import copy
        self.model, self.nan_in, self.steps = copy.deepcopy(plain), nan_in, 0

    def parameters(self):
        return self.model.parameters()

    def train_step(self, x, target):
        from autopart.smoke import lm_loss
        loss = lm_loss(self.model(x), target)
        loss.backward()
        self.steps += 1
        return loss.detach() * (math.nan if self.nan_in == "loss" and self.steps == 2 else 1)

    def full_state_dict(self):
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.nan_in == "parameter":
            state[list(state)[-1]].view(-1)[0] = math.nan
        return state


@pytest.mark.parametrize("nan_in", ["loss", "parameter"])
def test_smoke_steps_against_plain_fail_on_a_nan(nan_in):
    from autopart import smoke
    plain = smoke._gpt("cpu")
    ok, figure = smoke._steps_against_plain(_Twin(plain, nan_in), plain, torch.device("cpu"), 2)
    assert ok is False and "nan" in figure, figure
    ok, figure = smoke._steps_against_plain(_Twin(plain, "nowhere"), plain, torch.device("cpu"), 2)
    assert ok is True, figure          # the same twin without the NaN passes
