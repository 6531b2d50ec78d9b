"""nonfinite.local_problems finds every non-finite gradient element, one block at a time."""
from __future__ import annotations

import pytest
import torch

from autopart.runtime import nonfinite


@pytest.mark.parametrize("where", [0, 999, 1000, 1001, 4999])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_no_element_is_missed(where, bad):
    t = torch.ones(50, 100)
    assert nonfinite._nonfinite_grads({"w": t}) == []
    t.view(-1)[where] = bad
    assert nonfinite._nonfinite_grads({"w": t}) == ["w"]


def test_local_problems_names_the_gradient():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    p.grad = torch.zeros(3, 4)
    p.grad[2, 3] = float("nan")
    q = torch.nn.Parameter(torch.zeros(5))
    q.grad = torch.ones(5)
    out = nonfinite.local_problems([torch.tensor(1.0)], {"w": p.grad, "b": q.grad}, pp_rank=1)
    assert out == ["the gradient of w has 1 non-finite value(s) (pipeline stage 1)"]


def test_a_non_contiguous_gradient():
    g = torch.ones(40, 30).t()                               # a transposed view
    assert nonfinite._nonfinite_grads({"g": g}) == []
    g[29, 39] = float("inf")
    assert nonfinite._nonfinite_grads({"g": g}) == ["g"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_bad_gradients_are_named(bad):
    """The names found are exactly the bad ones, whatever the dtype, size or layout."""
    params = {}
    for i, (shape, dtype) in enumerate([((3, 4), torch.float32), ((5,), torch.bfloat16),
                                        ((40, 30), torch.float32), ((7,), torch.float32)]):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.full(shape, 1e30 if dtype == torch.float32 else 1.0, dtype=dtype)
        params[f"p{i}"] = p
    grads = {name: p.grad for name, p in params.items()}
    grads["none"] = None                                       # no gradient: skipped
    assert nonfinite._nonfinite_grads(grads) == []             # 1e30: large, finite
    params["p1"].grad[4] = bad
    params["p2"].grad.t()[29, 39] = bad
    params["p3"].grad[0] = bad
    assert sorted(nonfinite._nonfinite_grads(grads)) == ["p1", "p2", "p3"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["small", "large", "bf16"])
def test_local_flag_sees_every_non_finite_gradient_without_a_host_sync(bad, where, monkeypatch):
    params = {}
    for name, shape, dtype in [("small", (3, 4), torch.float32), ("large", (300, 500), torch.float32),
                               ("bf16", (5,), torch.bfloat16)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.full(shape, 3e38 if dtype == torch.float32 else 1.0, dtype=dtype)
        params[name] = p
    flags = []
    for make_bad in (False, True):
        if make_bad:
            params[where].grad.view(-1)[-1] = bad
        reduced = torch.tensor([2.5, 0.0])       # the step's [loss, flags] buffer: a slot of it
        for method in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, method, lambda *a, m=method: pytest.fail(f"host sync: {m}"))
        nonfinite.local_flag([p.grad for p in params.values()], reduced[1:])
        monkeypatch.undo()
        flags.append(reduced.tolist())
    assert flags == [[2.5, 0.0], [2.5, 1.0]]          # the loss slot untouched


@pytest.mark.parametrize("loss, flags, expected", [
    (2.5, 0.0, False), (0.0, 0.0, False), (1e38, 0.0, False),      # finite: nothing flagged
    (2.5, 1.0, True), (2.5, 3.0, True),                             # ranks flagged gradients
    (float("nan"), 0.0, True), (float("inf"), 0.0, True), (-float("inf"), 0.0, True)])
def test_a_non_finite_microbatch_loss_flags_the_step_through_the_reduced_loss(loss, flags, expected):
    """The losses are not checked rank by rank: a NaN or inf microbatch loss makes the summed
    global loss non-finite on every rank, and `flagged` reads it with the ranks' flags."""
    assert nonfinite.flagged(torch.tensor([loss, flags])) is expected


def test_the_check_leaves_every_gradient_as_it_was():
    """local_flag's kernel writes each element back times 1.0: bit for bit the same values,
    signed zeros, subnormals, the largest floats and NaN payloads included, in every dtype."""
    special = [0.0, -0.0, 1e-45, -1e-40, 3.4e38, -3.4e38, 1.5, float("nan"), float("inf")]
    grads = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        grads[str(dtype)] = torch.tensor(special, dtype=torch.float64).to(dtype)
    grads["transposed"] = torch.randn(7, 5).t()
    before = {n: g.clone() for n, g in grads.items()}
    found = torch.zeros(1)
    nonfinite.local_flag(list(grads.values()), found)
    assert found.item() == 1.0
    for n, g in grads.items():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
        assert torch.equal(g.contiguous().view(bits), before[n].contiguous().view(bits)), n
