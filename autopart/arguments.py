"""Checks of what a user hands `compile` and `parallelize`, before anything is traced.

Each mistake gets its own message and remedy here, instead of a failure deep inside torch.export
whose text points somewhere else (a missing target used to surface as a complaint about control
flow).
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn as nn

from autopart.errors import AutopartError
from autopart.mesh import Mesh


def check_arguments(model, mesh, example_inputs, loss_fn: Callable | None, target) -> tuple:
    """Raise on a wrong type, a missing target, an input count forward() cannot take, or tensors
    on devices that do not match; return the example inputs as a tuple."""
    if not isinstance(model, nn.Module):
        raise AutopartError(f"model is a {type(model).__name__}, not a torch.nn.Module: pass the "
                            "model itself (a lambda or function is not captured)")
    if isinstance(mesh, str):
        raise AutopartError(f"mesh is the string {mesh!r}: pass autopart.Mesh.parse({mesh!r}) "
                            "or autopart.Mesh(pp=..., dp=..., tp=...)")
    if not isinstance(mesh, Mesh):
        raise AutopartError(f"mesh is a {type(mesh).__name__}, not an autopart.Mesh: build one "
                            "with autopart.Mesh(pp=..., dp=..., tp=...) or Mesh.from_device_mesh")
    inputs = _as_tuple(example_inputs)
    if target is not None and not isinstance(target, torch.Tensor):
        raise AutopartError(f"target is a {type(target).__name__}, not a tensor")
    _check_loss_target(loss_fn, target)
    _check_forward_arity(model, len(inputs))
    _check_batch_and_devices(model, inputs, target)
    return inputs


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, dict):
        raise AutopartError("example_inputs is a dict: pass a tuple of tensors in the order "
                            f"forward() takes them, e.g. ({', '.join(example_inputs)},)")
    if not isinstance(example_inputs, (tuple, list)):
        raise AutopartError(f"example_inputs is a {type(example_inputs).__name__}: pass a tuple "
                            "of tensors whose dim 0 is the global batch")
    for i, a in enumerate(example_inputs):
        if not isinstance(a, torch.Tensor):
            raise AutopartError(f"example_inputs must hold at least one tensor whose dim 0 is the "
                                f"batch, and only tensors: example input {i} is a "
                                f"{type(a).__name__} (fix other arguments inside the model, e.g. "
                                "with functools.partial or a wrapper module)")
    return tuple(example_inputs)


def _required_positional(fn) -> list[str] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty]


def _check_loss_target(loss_fn, target) -> None:
    if loss_fn is None or target is not None:
        return
    needed = _required_positional(loss_fn)
    if needed is not None and len(needed) >= 2:
        raise AutopartError(
            f"loss_fn takes ({', '.join(needed)}) but no target was given.\n  remedy: pass "
            "target=... (a tensor whose dim 0 is the global batch, e.g. the next-token ids), or "
            "a loss_fn of the output alone")


def _check_forward_arity(model: nn.Module, n_inputs: int) -> None:
    needed = _required_positional(model.forward)
    if needed is not None and len(needed) > n_inputs:
        missing = needed[n_inputs:]
        raise AutopartError(
            f"{type(model).__name__}.forward takes ({', '.join(needed)}) but example_inputs "
            f"holds {n_inputs} tensor(s): {', '.join(missing)} would be missing.\n  remedy: "
            f"pass all {len(needed)} in forward()'s order, or give {', '.join(missing)} a default")


def _check_batch_and_devices(model: nn.Module, inputs: tuple, target) -> None:
    tensors = list(inputs) + ([target] if target is not None else [])
    if not inputs or inputs[0].dim() == 0:
        raise AutopartError("example_inputs must hold at least one tensor whose dim 0 is the batch")
    batch = inputs[0].shape[0]
    for i, t in enumerate(tensors):
        what = "target" if target is not None and i == len(tensors) - 1 else f"example input {i}"
        if t.dim() == 0:
            raise AutopartError(f"{what} is a scalar; inputs need a batch dimension (dim 0)")
        if t.shape[0] != batch:
            raise AutopartError(f"{what} has batch {t.shape[0]} (shape {tuple(t.shape)}) but "
                                f"example input 0 has {batch}: every input and the target share "
                                "dim 0, the global batch")
    p = next(iter(model.parameters()), None)
    if p is None:
        return
    for i, t in enumerate(tensors):
        if t.device.type != p.device.type and "meta" in (t.device.type, p.device.type):
            raise AutopartError(f"the model is on {p.device} but input {i} is on {t.device}: "
                                "build the inputs on the model's device (both on meta to inspect "
                                "a model that is not allocated)")
