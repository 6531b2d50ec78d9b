"""load: each rank reads its own chunks (any saved mesh), the optimizer's state mapped back."""
from __future__ import annotations

import os
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from autopart.errors import AutopartError
from pathlib import Path
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from .checks import _check_same_model, _read_marker, _resolve, _verify, model_group
from .geometry import _split_dim, sliced
from .held import (_infos, _is_zero, _model_entries, _optimizer_name, _param_names,
                   _set_hyperparameters)
from .peers import peers_named
from .planners import _LoadPlanner
from .saving import _LOADER, _enter
from .zero_state import _prepare_zero_optimizer

# -- load ------------------------------------------------------------------------------------------

def load(pm, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None, *,
         verify: bool = True, loader=None) -> dict:
    """Load a checkpoint made by `save` (on any mesh) into `pm` in place; returns its `extra`.

    Collective. Parameters are copied into the existing tensors, so an optimizer over
    `pm.parameters()` keeps them; its state is filled, entries a fresh optimizer has not made
    yet included. `verify` checks every file's size and CRC-32 (each rank a share of the files).
    `loader` gets the state `save(..., loader=)` kept (`loader.load_state_dict`).

        opt = torch.optim.AdamW(pm.parameters(), lr=3e-4)
        extra = load(pm, "ckpt/step7", optimizer=opt)      # {"step": 7}
    """
    path = _resolve(Path(path).absolute())
    _enter(pm, "load")
    with peers_named(pm, "load", path):        # a rank lost meanwhile is named
        extra = _load(pm, path, optimizer, verify)
    state = extra.pop(_LOADER, None)
    if loader is not None:
        if state is None:
            raise AutopartError(f"load(loader=...): checkpoint {path} holds no loader state "
                                "(saved without loader=).\n  remedy: load it without loader= "
                                "and position the loader yourself, or save with loader=")
        loader.load_state_dict(state)
    return extra


def _load(pm, path: Path, optimizer, verify: bool) -> dict:
    rank, world, group = dist.get_rank(), dist.get_world_size(), model_group(pm)
    # every rank reads the marker; a problem on one rank is raised on all of them
    marker, problem = None, None
    try:
        marker = _read_marker(path)
        _check_same_model(pm, marker, path)
        if optimizer is not None and marker.get("optimizer") is None:
            raise AutopartError(f"checkpoint {path} holds no optimizer state (saved without "
                                "optimizer=); load it without optimizer=")
        if optimizer is not None and marker["optimizer"] != _optimizer_name(optimizer):
            raise AutopartError(f"checkpoint {path} holds {marker['optimizer']} state; the "
                                f"optimizer given is {_optimizer_name(optimizer)}")
    except AutopartError as e:
        problem = str(e)
    problems: list = [None] * world
    dist.all_gather_object(problems, problem, group=group)
    if any(problems):
        raise AutopartError(next(p for p in problems if p))
    _verify(path, marker, rank, world, distributed=True, group=group) if verify else None

    reader = dcp.FileSystemReader(str(path))
    metadata = _read_metadata(reader, path)
    saved = metadata.state_dict_metadata
    missing = [k for k in marker["keys"] if k not in saved and not k.startswith("rng/")]
    if missing:
        raise AutopartError(f"checkpoint {path} is corrupt: its .metadata lacks "
                            f"{len(missing)} keys the marker lists, e.g. {missing[:5]}")
    state = _model_entries(pm)
    state = {k: v for k, v in state.items() if k in saved}   # checked equal to the model above
    fill = _prepare_optimizer(pm, optimizer, saved, state) if optimizer is not None else None
    rng = {k: torch.empty(saved[k].size, dtype=saved[k].properties.dtype)
           for k in (f"rng/{rank}/cpu", f"rng/{rank}/cuda") if k in saved}
    state.update(rng)
    for k in ("extra", "optim/param_groups"):
        if k in saved and (k == "extra" or optimizer is not None):
            state[k] = None
    try:
        dcp.load(state, storage_reader=reader, planner=_LoadPlanner(), process_group=group)
    except Exception as e:
        raise AutopartError(f"checkpoint {path} could not be read ({type(e).__name__}: "
                            f"{str(e)[:400]})") from e
    if fill is not None:
        fill(state)
    if f"rng/{rank}/cpu" in rng:
        torch.set_rng_state(rng[f"rng/{rank}/cpu"])
    if f"rng/{rank}/cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng[f"rng/{rank}/cuda"])
    return dict(state.get("extra") or {})


def _read_metadata(reader, path: Path):
    try:
        return reader.read_metadata()
    except Exception as e:
        raise AutopartError(f"checkpoint {path}: its DCP .metadata cannot be read "
                            f"({type(e).__name__}: {e})") from e


def _prepare_optimizer(pm, optimizer, saved: dict, state: dict):
    """Add the optimizer's entries to `state` (creating the tensors a fresh optimizer has not
    made); return a function that finishes the job once DCP has filled them."""
    if _is_zero(optimizer):
        return _prepare_zero_optimizer(pm, optimizer, saved, state)
    infos = _infos(pm)
    new_state: dict = {}
    plain: dict = {}
    for name, p, group in _param_names(pm, optimizer):
        prefix = f"optim/state/{name}/"
        entries = {}
        for fqn in (k for k in saved if k.startswith(prefix)):
            key = fqn[len(prefix):]
            md = saved[fqn]
            current = optimizer.state.get(p, {}).get(key)
            if isinstance(md, BytesStorageMetadata):
                state[fqn] = None
                plain[fqn] = (p, key)
                continue
            size, dtype = tuple(md.size), md.properties.dtype
            if size == tuple(infos[name].shape) and len(size) > 0:
                t = current if torch.is_tensor(current) and current.shape == p.shape \
                    and current.dtype == dtype else torch.zeros_like(p, dtype=dtype)
                state[fqn] = sliced(pm, name, t, size)
            else:
                on_device = group.get("capturable") or group.get("fused")
                device = p.device if on_device or len(size) > 0 else torch.device("cpu")
                t = current if torch.is_tensor(current) and tuple(current.shape) == size \
                    and current.dtype == dtype else torch.zeros(size, dtype=dtype, device=device)
                if len(size) > 0 and _split_dim(name, pm.compiled.plan, pm.mesh) is not None:
                    raise AutopartError(f"checkpoint: optimizer state {key!r} of {name} has "
                                        f"shape {size}, not the parameter's; cannot shard it")
                state[fqn] = t
            entries[key] = t
        new_state[p] = (entries, prefix)

    def fill(loaded: dict) -> None:
        for p, (entries, prefix) in new_state.items():
            optimizer.state[p] = dict(entries)    # exactly the checkpoint's state, nothing older
        for fqn, (p, key) in plain.items():
            optimizer.state[p][key] = loaded[fqn]
        _set_hyperparameters(optimizer, loaded.get("optim/param_groups"))
    return fill


