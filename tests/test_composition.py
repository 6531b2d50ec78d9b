"""The composition matrix (tests/composition.py): every pair of feature values, each case trained
3 steps against the plain model, or refused by parallelize naming both features.

The fast tier runs a slice (every schedule, every axis value at least once); the full tier runs
the rest.
"""
from __future__ import annotations

import pytest

from tests import composition as cm
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group

ROWS = cm.combos()
FAST = set(cm.fast_slice(ROWS))
CASES = {row.name: row.case() for row in ROWS}
TIMEOUT = 1000.0     # one case, up to 8 ranks of compile and 3 steps on a loaded 2-core machine


def _param(row: cm.Combo):
    marks = () if row in FAST else (pytest.mark.full,)
    return pytest.param(row.name, id=row.name, marks=marks + (pytest.mark.timeout(1100),))


def _group(spawn_cache, name: str) -> list[dict]:
    """This case's per-rank results. The fast slice shares one spawn per world size (rank
    start-up is most of a small case's time); a full-tier case has a spawn of its own, so one
    that fails or hangs takes no other case with it and each test's time is its own case's."""
    case = CASES[name]
    if any(r.name == name for r in FAST):
        same = [CASES[r.name] for r in ROWS if r in FAST and CASES[r.name].world == case.world]
        key = ("composition-fast", case.world)
    else:
        same, key = [case], ("composition", name)
    return run_group(spawn_cache, key, same, TIMEOUT, rank_fn=cm.run_composition)[name]


@pytest.mark.parametrize("name", [_param(r) for r in ROWS if not CASES[r.name].refused])
def test_case_trains_like_the_plain_model(spawn_cache, name):
    assert_all_ranks_equal_plain(CASES[name], _group(spawn_cache, name))


@pytest.mark.parametrize("name", [_param(r) for r in ROWS if CASES[r.name].refused])
def test_case_is_refused_naming_both_features(spawn_cache, name):
    assert_all_ranks_equal_plain(CASES[name], _group(spawn_cache, name))


def test_every_allowed_pair_is_covered():
    assert cm.uncovered_pairs(ROWS) == []
    assert all(cm.allowed({a: getattr(r, a) for a in cm.AXES}) for r in ROWS)
    assert len({r.name for r in ROWS}) == len(ROWS), "case names must be unique"


def test_the_fast_slice_has_every_schedule_and_every_axis_value():
    for axis, values in cm.AXES.items():
        assert {getattr(r, axis) for r in FAST} == set(values), axis


def test_the_constraints_refuse_what_cannot_run():
    assert not cm.allowed({"model": "gpt", "ep": 2, "dp": 2})        # no experts to shard
    assert not cm.allowed({"model": "hf-mixtral", "ep": 2, "dp": 1})  # ep is carved out of dp
    assert not cm.allowed({"zero": 1, "dp": 1})                       # nothing to shard over
    assert not cm.allowed({"zero": 2, "dp": 1})
    assert not cm.allowed({"zero": 3, "dp": 1})
    assert not cm.allowed({"tp": "2", "dp": 2, "compile": True})      # 8 ranks of Inductor
    assert cm.allowed({"tp": "2+sp", "dp": 2, "ep": 2, "model": "hf-mixtral"})
