"""What the runtime allocates follows the tensors it serves (issue 33, rows 4 and 5), checked on a
CPU machine: each allocation must take its device from those tensors, which the test sees by
recording the `device` argument of the allocating calls (on the CPU, a tensor made without one
lands on the right device by chance; on a GPU rank it would be on the CPU)."""
from __future__ import annotations

import types
from datetime import timedelta

import torch

import autopart
from autopart.ops import ep
from tests.workers.common import Case, build


def _recording(names: tuple, calls: list):
    """A stand-in for the `torch` module that records (name, size, device) of `names` calls."""
    def wrap(name):
        real = getattr(torch, name)

        def call(*args, **kwargs):
            calls.append((name, args[0] if args else None, kwargs.get("device")))
            return real(*args, **kwargs)
        return call
    proxy = types.ModuleType("torch_recording")
    proxy.__getattr__ = lambda attr: getattr(torch, attr)     # everything else: torch itself
    for name in names:
        setattr(proxy, name, wrap(name))
    return proxy


def test_zero_optimizer_state_loads_on_the_parameters_device(tmp_path, single_process_group,
                                                             monkeypatch):
    """Row 4: loading a zero=1 checkpoint built the Adam moments with torch.zeros on the CPU and
    installed them for the parameters, wherever those are (CUDA: the next step fails)."""
    case = Case("zero-load", model="gpt4")
    model, loss_fn, inputs, target = build(case)
    pm = autopart.parallelize(model, autopart.Mesh(), inputs, loss_fn=loss_fn, target=target,
                              zero=1, timeout=timedelta(seconds=60))
    opt = pm.optimizer(torch.optim.Adam, lr=1e-3)
    pm.train_step(*inputs, target=target)
    opt.step(), opt.zero_grad()
    pm.save(tmp_path / "ck", optimizer=opt)
    calls: list = []
    from autopart.runtime.checkpoint import loading, zero_state
    for module in (loading, zero_state):        # where the optimizer's state is built on load
        monkeypatch.setattr(module, "torch", _recording(("zeros",), calls))
    pm.load(tmp_path / "ck", optimizer=opt)
    device = next(pm.parameters()).device
    moments = [c for c in calls if c[1] == opt.layouts[0].shard]
    assert len(moments) == 2, calls                      # exp_avg, exp_avg_sq
    assert all(c[2] == device for c in moments), moments
    steps = [c for c in calls if c[1] == ()]
    assert steps and all(torch.device(c[2]) == torch.device("cpu") for c in steps), steps
    state = [v for s in opt.inner.state.values() for k, v in s.items() if k != "step"]
    assert state and all(v.device == device for v in state)
    pm.train_step(*inputs, target=target)
    opt.step()


def test_expert_row_plan_is_made_on_the_layouts_device(monkeypatch):
    """Row 5: dropless dispatch's permutation subtracted a CUDA tensor from torch.arange(total)
    made on the CPU. The plan must be the same, with every arange on the layout's device."""
    offsets = torch.tensor([3, 4, 6, 9])                # 4 experts, cumulative rows
    layout = torch.tensor([[2, 1], [3, 0]])             # rows from rank r for local expert e
    expected = ep._row_plan(offsets, layout, 2)
    calls: list = []
    monkeypatch.setattr(ep, "torch", _recording(("arange",), calls))
    got = ep._row_plan(offsets, layout, 2)
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert calls and all(c[2] == layout.device for c in calls), calls
