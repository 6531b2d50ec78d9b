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


def test_a_local_batch_case_fed_anything_but_its_share_fails():
    """A "local" case's rank must have had every train_step given its share (4 of 8 rows at
    dp=2; 8 of 16 positions at cp=2): a global batch or no call fails; None where the rank
    reads nothing passes."""
    case = next(c for c in CASES.values() if c.feed == "local" and c.dp == 2 and not c.refused)
    share = (4, 16 // case.cp)
    assert cm.share_problems(case, [[share, None], [None, share], [None, None]]) == []
    for fed in ([], [[(8, 16), None]], [[share, (8, 16)]], [[share, None], [(8, 16), None]]):
        assert cm.share_problems(case, fed), fed
    assert cm.share_problems(CASES[next(r.name for r in ROWS if r.batch == "global")], []) == []


def test_the_constraints_refuse_what_cannot_run():
    assert not cm.allowed({"model": "gpt", "ep": 2, "dp": 2})        # no experts to shard
    assert not cm.allowed({"model": "hf-mixtral", "ep": 2, "dp": 1})  # ep is carved out of dp
    assert not cm.allowed({"zero": 1, "dp": 1})                       # nothing to shard over
    assert not cm.allowed({"zero": 2, "dp": 1})
    assert not cm.allowed({"zero": 3, "dp": 1})
    assert not cm.allowed({"tp": "2", "dp": 2, "compile": True})      # 8 ranks of Inductor
    assert cm.allowed({"tp": "2+sp", "dp": 2, "ep": 2, "model": "hf-mixtral"})


# -- the bf16 and compiled cases' checks can fail (no processes) ----------------------------------

def _recipe_grads(microbatch: int | None) -> dict:
    """Step-1 gradients of the tied GPT under the bf16 recipe, `microbatch` rows at a time
    (None: the plain fp32 model) on one thread (a tiny model's bf16 kernels on two threads of
    a loaded machine take 50x as long)."""
    import torch
    from tests.workers.common import build
    from tests.workers.precision import reference_step
    model, loss_fn, inputs, target = build(cm.CCase("x", model="c-gpt-tied", batch=8, seq=16))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if microbatch is None:
            loss_fn(model(*inputs), target).backward()
        else:
            reference_step(model, inputs, target, loss_fn, microbatch, "cpu")
    finally:
        torch.set_num_threads(threads)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _found(ours: dict, ref: dict, fp32: dict, by_param: dict | None = None) -> dict:
    """What tests/workers/precision._measure finds for step-1 gradients `ours` (and, as SGD
    without clipping moves each parameter by lr x its gradient, for step 1's change)."""
    from tests.workers.precision import _rel, per_parameter
    order = list(ref)

    def rel(a, b):
        return _rel([a[n] for n in order], [b[n] for n in order])
    found = {"errors": rel(ours, ref), "gap": rel(fp32, ref), "apart": rel(ours, fp32),
             "by_param": by_param or per_parameter(ours, ref)}
    return {k: {"grad": v, "step1": v} for k, v in found.items()}


def test_one_small_gradient_zeroed_or_doubled_fails_the_bf16_check():
    """The loose classes' bounds are per parameter: on the tied GPT each LayerNorm gradient
    holds under 1% of the gradient norm, so zeroing or doubling one moves the whole model's
    relative error by less than the class's bound (checked here), but its own by 100%: every
    such change fails, under each loose class and the routed bounds. Another valid bf16 recipe
    (other microbatches: other GEMM shapes) passes."""
    import torch
    from tests.workers.precision import BOUNDS, PER_PARAMETER, _rel, bound_problems
    ref, other, fp32 = _recipe_grads(2), _recipe_grads(4), _recipe_grads(None)
    assert any(not torch.equal(other[n], ref[n]) for n in ref), "the recipes must differ"
    base = _found(other, ref, fp32)["by_param"]["grad"]
    norms = {n: float(g.norm()) for n, g in ref.items()}
    total = sum(v * v for v in norms.values()) ** 0.5
    small = [n for n, v in norms.items() if v < 0.01 * total]
    assert len(small) >= 18, small       # every LayerNorm weight and bias among them
    classes = [(c, False) for c in PER_PARAMETER] + [("moe", True)]
    changed = [(name, {**other, name: other[name] * factor}) for name in small
               for factor in (0.0, 2.0)]
    for name, ours in [("", other)] + changed:
        by_param = {**base, name: _rel([ours[name]], [ref[name]])} if name else base
        found = _found(ours, ref, fp32, by_param)
        for noise, routed in classes:
            assert found["errors"]["grad"] <= BOUNDS[noise], (noise, name)  # the global check
            problems = bound_problems(noise, found, routed)
            if not name:
                assert problems == [], f"another valid recipe must pass: {problems}"
            else:
                assert any(f"grad of {name}:" in p for p in problems), (noise, name)


def test_an_fp32_run_fails_the_bf16_check():
    """Gradients computed in fp32 are as far from the bf16 recipe as another bf16 recipe's, so
    no bound on that distance tells them apart; the guard on the distance from the fp32 plain
    model does, in every class."""
    from tests.workers.precision import BOUNDS, bound_problems
    ref, fp32 = _recipe_grads(2), _recipe_grads(None)
    for noise in BOUNDS:
        problems = bound_problems(noise, _found(fp32, ref, fp32))
        assert any("did not compute in bf16" in p for p in problems), (noise, problems)


def _ranks(case, wire: dict, inductor=None) -> list[dict]:
    return [{"case": case.name, "rank": r, "problems": [], "wire": wire, "inductor": inductor}
            for r in range(case.world)]


def test_the_wire_and_inductor_reports_are_read():
    """A rank result whose wire shows fp32 pipeline transfers for a bf16 case, bf16 in an fp32
    case, gradients reduced in bf16, or compile=True without Inductor's artifacts fails, though
    its own problems list is empty."""
    # picked by what they are (the greedy's picks, so the names, change with the axes)
    trained = [c for c in CASES.values() if not c.refused]
    bf16 = next(c for c in trained if c.precision == "bf16" and c.compile and c.tp == 2
                and c.dp * c.cp == 1)
    fp32 = next(c for c in trained if c.precision == "fp32" and c.dp == 2 and c.zero
                and not c.compile)
    tp_kind = "reduce_scatter" if bf16.sequence_parallel else "all_reduce"   # its tp reduction
    ran = {"artifacts": 3, "segments": 6, "fallbacks": {}}
    good_bf16 = {"isend": {"bfloat16": {1: 2}}, "irecv": {"bfloat16": {1: 2}},
                 tp_kind: {"bfloat16": {1: 2}, "float32": {1: 1}},
                 "all_gather": {"float32": {1: 2}}}
    good_fp32 = {"isend": {"float32": {1: 2}}, "irecv": {"float32": {1: 2}},
                 "grad_reduce_scatter": {"float32": {8: 1}}}
    assert_all_ranks_equal_plain(bf16, _ranks(bf16, good_bf16, ran))
    assert_all_ranks_equal_plain(fp32, _ranks(fp32, good_fp32))
    bad = [(bf16, {**good_bf16, "isend": {"float32": {1: 2}}}, ran),
           (bf16, {**good_bf16, "all_reduce": {"float32": {1: 2}},
                   "reduce_scatter": {"float32": {1: 2}}}, ran),
           (bf16, None, ran),
           (bf16, good_bf16, None),
           (bf16, good_bf16, {**ran, "fallbacks": {"layer 0": "no"}}),
           (fp32, {**good_fp32, "irecv": {"bfloat16": {1: 2}}}, None),
           (fp32, {**good_fp32, "grad_reduce_scatter": {}}, None)]
    for case, wire, inductor in bad:
        with pytest.raises(AssertionError):
            assert_all_ranks_equal_plain(case, _ranks(case, wire, inductor))


@pytest.mark.parametrize("zero", [1, 2])
def test_step1_gradients_are_compared_at_every_zero_level(monkeypatch, zero):
    """held_grads (both harnesses' step-1 gradient check) at zero >= 1: replica 1 of 2 holds
    elements [6, 12) of a 12-element gradient and [3, 5) of a 5-element one, reduced (zero=1:
    in the full-shaped .grad, zero=2: in the layout's slice); a wrong held element is found, an
    element another replica holds is not this rank's to compare. (The layout's own group is
    faked as 2 ranks; the chunks are cut by the test's rule.)"""
    import types
    import torch
    import torch.distributed as dist
    from autopart.runtime.sharding import ShardLayout
    from tests.workers.common import ATOL, RTOL, _compare
    from tests.workers.equivalence import held_grads
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group: 1)
    g = torch.Generator().manual_seed(0)
    plain = {n: torch.nn.Parameter(torch.randn(shape, generator=g))
             for n, shape in (("a", (4, 3)), ("b", (5,)))}
    for p in plain.values():
        p.grad = torch.randn(p.shape, generator=g)
    ours = {n: torch.nn.Parameter(p.detach().clone()) for n, p in plain.items()}
    lay = ShardLayout(ours, list(ours), group=object())
    pm = types.SimpleNamespace(zero=zero, _grads=types.SimpleNamespace(zero_layouts=[lay]),
                               named_parameters=lambda: list(ours.items()))

    def problems(corrupt_at: int) -> list[str]:
        grads = [plain[n].grad.clone() for n in ours]
        grads[0].view(-1)[corrupt_at] += 1.0
        if zero == 1:
            for p, grad in zip(ours.values(), grads):
                p.grad = grad
        else:
            lay.grad = lay.slice_of(grads)
        got, want = held_grads(pm, lambda name, t: t, plain, lambda name: (2, 1))
        assert {n: t.numel() for n, t in want.items()} == {"a": 6, "b": 2}
        found: list[str] = []
        for name in want:
            _compare(f"step 1 grad of {name}", got[name], want[name], RTOL, ATOL, found)
        return found
    assert problems(corrupt_at=2) == []          # replica 0's element: not held here
    assert any("grad of a" in p for p in problems(corrupt_at=8))


def test_the_wire_names_each_collective_by_its_kind(single_process_group):
    """Wire records torch.distributed's calls under the kinds wire_problems reads (a kind recorded
    under another name reads as "carried nothing")."""
    import torch
    import torch.distributed as dist
    from tests.workers.precision import WIRE_KINDS, Wire
    x = torch.ones(4, dtype=torch.bfloat16)
    with Wire() as wire:
        dist.all_reduce(x.float())
        dist.all_to_all_single(torch.empty_like(x), x)
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4))
    assert wire.report() == {**{k: {} for k in WIRE_KINDS}, "all_reduce": {"float32": {4: 1}},
                             "all_to_all": {"bfloat16": {4: 1}},
                             "grad_reduce_scatter": {"float32": {4: 1}}}


def test_tp_reductions_must_carry_bf16_under_bf16():
    """wire_problems: a bf16 tp case whose partial sums went out in fp32 fails, whether they
    were reduce-scattered (sp) or all-reduced (sp on a model that flattens batch and sequence,
    HF GPT-2's Conv1D); either reduction in bf16 passes. Gathers of a norm's fp32 output pass."""
    from types import SimpleNamespace
    from tests.workers.equivalence import wire_problems
    case = SimpleNamespace(precision="bf16", pp=1, cp=1, tp=2, dp=1, sequence_parallel=True)
    fp32 = {"all_gather": {"float32": {512: 9}}, "reduce_scatter": {"float32": {1024: 1}},
            "all_reduce": {"float32": {2: 1}}}
    assert any("tp's reductions carried no bfloat16" in p for p in wire_problems(case, fp32))
    flattened = {**fp32, "all_reduce": {"bfloat16": {1024: 8}, "float32": {2: 1}}}
    assert wire_problems(case, flattened) == []
    scattered = {**fp32, "reduce_scatter": {"bfloat16": {1024: 8}}}
    assert wire_problems(case, scattered) == []
