"""What a rank holds and contributes to a checkpoint: model state, optimizer state by name, RNG."""
from __future__ import annotations

import hashlib
import json
import torch
from autopart.errors import AutopartError
from typing import Any

from .geometry import _split_dim, sliced

# -- what a rank holds -----------------------------------------------------------------------------

def _infos(pm) -> dict:
    """canonical name -> TensorInfo of every parameter and persistent buffer of the model."""
    program = pm.compiled.program
    out = {n: i for n, i in program.params.items()}
    out.update({n: i for n, i in program.buffers.items() if i.persistent})
    return out


def _held_state(pm) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers (local shards) by canonical name."""
    infos, held = _infos(pm), {}
    for c in pm.program.chunks:
        for n, t in c.gm.state_dict(keep_vars=True).items():
            if n in infos:
                held.setdefault(n, t)
    for n, p in pm.named_parameters():
        held.setdefault(n, p)
    return held


def _unheld_state(pm) -> dict[str, torch.Tensor]:
    """State no chunk holds (a parameter forward never reads), by canonical name: it never
    changes in training and every rank has it whole."""
    infos = _infos(pm)
    canon = {a: n for n, i in infos.items() for a in (n, *i.aliases)}
    out = {}
    for key, t in pm._state.extra_state.items():     # recorded by parallelize
        out.setdefault(canon.get(key, key), t)
    return out


def _model_entries(pm) -> dict[str, Any]:
    infos = _infos(pm)
    out = {}
    for n, t in _held_state(pm).items():
        out[f"model/{n}"] = sliced(pm, n, t, infos[n].shape)
    for n, t in _unheld_state(pm).items():
        out.setdefault(f"model/{n}", t.detach())
    return out


def _describe_model(pm) -> dict[str, Any]:
    """The model as the marker records it: names, global shapes, dtypes, aliases, key order."""
    infos = _infos(pm)
    tensors = {n: {"shape": list(i.shape), "dtype": str(i.dtype).replace("torch.", ""),
                   "aliases": list(i.aliases)} for n, i in sorted(infos.items())}
    for n, t in sorted(_unheld_state(pm).items()):
        tensors.setdefault(n, {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                               "aliases": []})
    order = pm._state.key_order     # the plain model's state_dict order, recorded by parallelize
    return {"tensors": tensors, "state_dict_keys": list(order), "digest": _digest(tensors)}


def _digest(tensors: dict) -> str:
    text = json.dumps({n: [v["shape"], v["dtype"]] for n, v in sorted(tensors.items())})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _param_names(pm, optimizer) -> list[tuple[str, torch.Tensor, dict]]:
    """(plain name, parameter, its param group) for every parameter the optimizer holds."""
    names = {id(p): n for n, p in pm.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise AutopartError(
                    f"checkpoint: the optimizer holds a tensor of shape {tuple(p.shape)} that is "
                    "not one of pm.parameters(); build it over pm.parameters()")
            out.append((names[id(p)], p, group))
    return out


def _is_zero(optimizer) -> bool:
    from autopart.runtime.optimizer import ZeroOptimizer
    return isinstance(optimizer, ZeroOptimizer)


def _optimizer_name(optimizer) -> str:
    """The torch optimizer's class name; for zero=1 the class ZeroOptimizer runs (the state is
    stored in its per-parameter form, so either kind loads it)."""
    return type(optimizer.inner if _is_zero(optimizer) else optimizer).__name__


def _state_by_name(pm, optimizer) -> list[tuple[str, torch.Tensor, dict]]:
    """(plain name, this rank's parameter, its optimizer state as a torch optimizer over
    pm.parameters() holds it). A ZeroOptimizer's flat slices are gathered per parameter onto the
    first rank of each replica group (collective); its other ranks have the scalar state only,
    and DCP keeps one writer of each replicated chunk anyway."""
    if _is_zero(optimizer):
        local = dict(pm.named_parameters())
        return [(n, local[n], state) for n, state in optimizer.gather_state_by_parameter().items()]
    return [(name, p, optimizer.state.get(p, {})) for name, p, _ in _param_names(pm, optimizer)]


def _optimizer_entries(pm, optimizer) -> dict[str, Any]:
    infos, out = _infos(pm), {}
    for name, p, state in _state_by_name(pm, optimizer):
        for key, v in state.items():
            fqn = f"optim/state/{name}/{key}"
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape:
                out[fqn] = sliced(pm, name, v, infos[name].shape)
            elif torch.is_tensor(v) and (v.dim() == 0 or _split_dim(name, pm.compiled.plan,
                                                                    pm.mesh) is None):
                out[fqn] = v.detach()
            elif torch.is_tensor(v):
                raise AutopartError(
                    f"checkpoint: optimizer state {key!r} of {name} has shape {tuple(v.shape)}, "
                    f"neither the parameter's {tuple(p.shape)} nor a scalar, and the parameter is "
                    "sharded: cannot place it in the global tensor")
            elif v is not None:
                out[fqn] = v       # a Python value: pickled, stored once
    return out


def _hyperparameters(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _rng_entries(rank: int) -> dict[str, torch.Tensor]:
    out = {f"rng/{rank}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    return out


def _set_hyperparameters(optimizer, groups: list[dict] | None) -> None:
    if groups is None:
        return
    if len(groups) != len(optimizer.param_groups):
        raise AutopartError(f"checkpoint has {len(groups)} optimizer param groups, the "
                            f"optimizer {len(optimizer.param_groups)}")
    for group, hyper in zip(optimizer.param_groups, groups):
        group.update(hyper)
