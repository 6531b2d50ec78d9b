"""The comparator every equivalence, checkpoint and meta test goes through
(tests/workers/common._compare) rejects a non-finite value: `err > atol + rtol * |expected|` is
False for a NaN error, so a NaN parameter would otherwise pass every comparison."""
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
