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


# -- option values: one check per option, used by compile, parallelize and the command lines ----

BOOL_OPTIONS = ("sequence_parallel",)

_REMEDIES = {
    "schedule": "a schedule named in autopart.schedule.SCHEDULES (--schedule on the command line)",
    "recompute": "none, selective (attention's inner ops), full (whole layers) or auto (the "
                 "cheapest that fits memory_budget)",
    "optimizer": "the optimizer the memory lines count: 'adam' (Adam and AdamW), 'sgd-momentum' "
                 "or 'sgd'",
    "precision": "precision=\"bf16\" (bf16 compute and transfers, fp32 master weights and "
                 "gradients) or \"fp32\"; fp16 would need loss scaling, which autopart does not do",
    "zero": "zero=0, 1, 2 or 3 (ZeRO stage 1: optimizer state and fp32 master slice sharded "
            "over data-parallel replicas; stage 2: the gradients too; stage 3: the parameters "
            "too, gathered a layer at a time)",
    "nonfinite": "raise (stop with the step, stage and microbatch), skip (drop the step's "
                 "gradients) or ignore",
    "compile": "False, True (Inductor) or 'cudagraphs'",
    "cp_attention": "'ring' (K/V passed peer to peer around the context-parallel ranks, "
                    "overlapped with compute) or 'allgather' (K/V all-gathered at once)",
}


def _choices() -> dict[str, tuple]:
    from autopart.compiler import CP_ATTENTIONS, PRECISIONS
    from autopart.memory import OPTIMIZER_STATES, ZERO_LEVELS
    from autopart.passes.recompute_activations import MODES as RECOMPUTE
    from autopart.runtime.nonfinite import MODES as NONFINITE
    from autopart.schedule import SCHEDULES
    return {"schedule": SCHEDULES, "recompute": RECOMPUTE, "optimizer": tuple(OPTIMIZER_STATES),
            "precision": PRECISIONS, "zero": ZERO_LEVELS, "nonfinite": NONFINITE,
            "compile": (False, True, "cudagraphs"), "cp_attention": CP_ATTENTIONS}


def check_choice(name: str, value):
    """Raise unless `value` is one of option `name`'s values, of the same type (zero=True,
    compile=1 or a misspelt string name the option, the value and the allowed ones)."""
    allowed = _choices()[name]
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise AutopartError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}."
                            f"\n  remedy: {_REMEDIES[name]}")
    return value


def check_bool(name: str, value) -> bool:
    """Raise unless `value` is a bool: sequence_parallel="no" would be true."""
    if not isinstance(value, bool):
        raise AutopartError(
            f"{name}={value!r} is a {type(value).__name__}, not a bool (any non-empty string or "
            f"non-zero number would switch it on).\n  remedy: pass {name}=True or {name}=False "
            f"(on the command line: the flag --{name.replace('_', '-')}, or leave it out)")
    return value


def check_options(**options) -> None:
    """Check the keyword options of compile / parallelize by name, before anything is traced:
    booleans are bools, choices one of their values, memory_budget a positive size."""
    for name, value in options.items():
        if name in BOOL_OPTIONS:
            check_bool(name, value)
        elif name == "memory_budget":
            if value is not None:
                from autopart.memory import parse_bytes
                parse_bytes(value)
        else:
            check_choice(name, value)
