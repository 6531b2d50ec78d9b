"""nonfinite.local_problems finds every non-finite gradient element, one block at a time."""
from __future__ import annotations

import pytest
import torch

from autopart.runtime import nonfinite


@pytest.mark.parametrize("where", [0, 999, 1000, 1001, 4999])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_blocks_miss_no_element(where, bad):
    t = torch.ones(50, 100)
    assert nonfinite._all_finite(t, block=1000)
    t.view(-1)[where] = bad
    assert not nonfinite._all_finite(t, block=1000)
    assert not nonfinite._all_finite(t)                      # the default block: one block


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
    g[29, 39] = float("inf")
    assert not nonfinite._all_finite(g, block=7)
    assert nonfinite._all_finite(torch.ones(40, 30).t(), block=7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_small_gradients_are_checked_together_and_named(bad):
    """Gradients of at most `block` elements go through one multi-tensor max-norm; the names
    found are exactly the bad ones, whatever the dtype, above or below the block size."""
    params = {}
    for i, (shape, dtype) in enumerate([((3, 4), torch.float32), ((5,), torch.bfloat16),
                                        ((40, 30), torch.float32), ((7,), torch.float32)]):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.full(shape, 1e30 if dtype == torch.float32 else 1.0, dtype=dtype)
        params[f"p{i}"] = p
    grads = {name: p.grad for name, p in params.items()}
    grads["none"] = None                                       # no gradient: skipped
    assert nonfinite._nonfinite_grads(grads, block=100) == []
    params["p1"].grad[4] = bad
    params["p2"].grad.t()[29, 39] = bad                        # above the block: blockwise
    params["p3"].grad[0] = bad
    assert sorted(nonfinite._nonfinite_grads(grads, block=100)) == ["p1", "p2", "p3"]
    assert sorted(nonfinite._nonfinite_grads(grads)) == ["p1", "p2", "p3"]   # all small


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["loss", "small", "large", "bf16"])
def test_local_flag_sees_every_non_finite_value_without_a_host_sync(bad, where, monkeypatch):
    params = {}
    for name, shape, dtype in [("small", (3, 4), torch.float32), ("large", (300, 500), torch.float32),
                               ("bf16", (5,), torch.bfloat16)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.full(shape, 3e38 if dtype == torch.float32 else 1.0, dtype=dtype)
        params[name] = p
    grads = {name: p.grad for name, p in params.items()}
    grads["none"] = None                                              # no gradient: skipped
    losses = [torch.tensor(2.0), torch.tensor(1.0)]
    flags = []
    for make_bad in (False, True):
        if make_bad and where == "loss":
            losses[1] = torch.tensor(bad)
        elif make_bad:
            params[where].grad.view(-1)[-1] = bad
        for method in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, method, lambda *a, m=method: pytest.fail(f"host sync: {m}"))
        flags.append(nonfinite.local_flag(losses, grads, torch.device("cpu")))
        monkeypatch.undo()
    assert [f.item() for f in flags] == [0.0, 1.0]
