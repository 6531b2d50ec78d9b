"""save: a temporary directory, DCP's write, the completion marker, then the swap into place."""
from __future__ import annotations

import io
import json
import os
import shutil
import time
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import uuid

from autopart._version import __version__
from autopart.errors import AutopartError
from pathlib import Path

from .checks import _file_record, _read_marker, model_group
from .geometry import FORMAT, MARKER, _OLD, _TMP
from .held import (_describe_model, _hyperparameters, _model_entries, _optimizer_entries,
                   _optimizer_name, _rng_entries)
from .peers import peers_named
from .planners import _SavePlanner

# -- save ------------------------------------------------------------------------------------------

def save(pm, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None, *, model: torch.nn.Module | None = None,
         loader=None) -> dict:
    """Save `pm`'s shards (and `optimizer`'s state, RNG states and `extra`) to directory `path`.

    Collective: every rank calls it with the same `path`. Returns the completion marker (a dict).
    `extra` (rank 0's) comes back from `load`. `model`, when given, is the plain model the
    ParallelModel was made from: its class, and for a Hugging Face model its config, are
    recorded so `autopart export` can write a model directory. `loader` (anything with
    `state_dict()`, the same on every rank, as autopart.data.TokenLoader's is) has its state
    saved once, checked equal on every rank, for `load(..., loader=)`.

        save(pm, "ckpt/step7", optimizer=opt, extra={"step": 7})
    """
    start = time.perf_counter()
    path = Path(path).absolute()
    _enter(pm, "save")
    with peers_named(pm, "save", path):        # a rank lost meanwhile is named
        return _save(pm, path, optimizer, extra, model, start, loader)


def _save(pm, path: Path, optimizer, extra, model, start: float, loader=None) -> dict:
    rank, group = dist.get_rank(), model_group(pm)
    # the temporary directory's name, the same on every rank; and rank 0's checks of `path` and
    # of `extra` (rank 0's is the one saved), in the first collective, so every rank raises alike
    # before anything is written
    token = ([uuid.uuid4().hex[:12], _check_target(path) or _check_extra(extra)] if rank == 0
             else [None, None])
    dist.broadcast_object_list(token, src=0, group=group)
    if token[1]:
        raise AutopartError(token[1])
    if loader is not None:     # one state for every rank: refused alike before any write
        extra = {**(extra or {}), _LOADER: _same_loader_state(loader, group)}
    tmp = path.parent / f".{path.name}{_TMP}{token[0]}"
    try:
        return _save_into(pm, path, tmp, token[0], optimizer, extra, model, rank, start, group)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)      # a failed save leaves nothing behind
        raise


def _save_into(pm, path: Path, tmp: Path, token: str, optimizer, extra, model, rank: int,
               start: float, group) -> dict:
    state = _model_entries(pm)
    if optimizer is not None:
        state.update(_optimizer_entries(pm, optimizer))
        if rank == 0:
            state["optim/param_groups"] = _hyperparameters(optimizer)
    state.update(_rng_entries(rank))
    if rank == 0:
        state["extra"] = dict(extra or {})
    writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
    metadata = dcp.save(state, storage_writer=writer, planner=_SavePlanner(), process_group=group)

    # every rank's files are written (dcp.save ends with a collective); each checksums its own
    mine = {f.name: _file_record(f) for f in sorted(tmp.glob(f"__{rank}_*"))}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine, group=group)
    status: list = [None]
    marker: dict = {}
    if rank == 0:
        try:
            files = {k: v for part in gathered for k, v in part.items()}
            files[".metadata"] = _file_record(tmp / ".metadata")
            marker = _marker(pm, optimizer, model, sorted(metadata.state_dict_metadata), files)
            marker["seconds_to_write"] = round(time.perf_counter() - start, 3)
            _write_json(tmp / MARKER, marker)
            _swap_into_place(tmp, path, token)
        except Exception as e:  # noqa: BLE001  (every rank raises it, below)
            status[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(status, src=0, group=group)
    if status[0] is not None:
        raise AutopartError(f"checkpoint save to {path} failed on rank 0: {status[0]}")
    if rank != 0:
        marker = _read_marker(path)
    return marker


_LOADER = "autopart/loader"     # the loader's state, in `extra`, which load takes it out of


def _same_loader_state(loader, group) -> dict:
    """The loader's state, the same on every rank; else an error (on every rank) naming them."""
    state = loader.state_dict()
    states: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    differ = [r for r, s in enumerate(states) if s != states[0]]
    if differ:
        raise AutopartError(
            f"save(loader=...): the loader's state on rank(s) {differ} differs from rank 0's "
            f"({states[differ[0]]} against {states[0]}); a checkpoint keeps one loader state, "
            "for every rank and any mesh.\n  remedy: advance every rank's loader alike (one "
            "batch per train_step, on every rank), with a loader whose state is the position "
            "in the global stream (autopart.data.TokenLoader)")
    return state


def _enter(pm, what: str) -> None:
    groups = getattr(pm, "_groups", None)
    if groups is not None and getattr(groups, "timeout", None) is not None:
        from autopart.runtime.groups import enter_together
        enter_together(groups, what)


def _check_extra(extra) -> str | None:
    """Why `extra` cannot be saved (None: it can): not a dict, or a value torch.save cannot
    pickle (a lambda, an open file), found before any file is written."""
    if extra is None:
        return None
    if not isinstance(extra, dict):
        return (f"save(extra=...) is a {type(extra).__name__}, not a dict.\n  remedy: pass a "
                "dict of picklable values, e.g. extra={'step': 7}")
    for key, value in extra.items():
        try:
            torch.save(value, io.BytesIO())
        except Exception as e:  # noqa: BLE001  (pickling fails in many ways; name the entry)
            return (f"save(extra=...): extra[{key!r}] (a {type(value).__name__}) cannot be "
                    f"pickled: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}."
                    "\n  remedy: keep only picklable values in extra (numbers, strings, lists, "
                    "dicts, tensors, module-level functions and classes); rebuild the rest after "
                    "load")
    return None


def _check_target(path: Path) -> str | None:
    """Why `path` cannot be replaced by a checkpoint (None: it can)."""
    if path.exists() and not path.is_dir():
        return f"checkpoint path {path} exists and is not a directory"
    if path.is_dir() and any(path.iterdir()) and not (path / MARKER).exists():
        return (f"checkpoint path {path} is a non-empty directory without {MARKER}: not an "
                "autopart checkpoint, so it is left alone; choose another path or remove it")
    return None


def _marker(pm, optimizer, model, keys: list[str], files: dict) -> dict:
    plan = pm.compiled.plan
    mesh = pm.mesh
    out = {
        "format": FORMAT, "autopart_version": __version__,
        "torch_version": torch.__version__,
        "mesh": {"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp, "ep": mesh.ep, "cp": mesh.cp},
        "world_size": mesh.world_size, "schedule": plan.config.schedule,
        "virtual_stages": plan.config.virtual_stages, "microbatches": plan.config.microbatches,
        "optimizer": _optimizer_name(optimizer) if optimizer is not None else None,
        "model": _describe_model(pm), "keys": keys, "files": files,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if model is not None:
        out["model_class"] = f"{type(model).__module__}.{type(model).__qualname__}"
        config = getattr(model, "config", None)
        if config is not None and callable(getattr(config, "to_dict", None)):
            out["hf"] = {"class": type(model).__name__,
                         "config": json.loads(json.dumps(config.to_dict(), default=str))}
    return out


def _write_json(f: Path, data: dict) -> None:
    part = f.with_name(f.name + ".part")
    with open(part, "w") as stream:
        json.dump(data, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(part, f)


def _swap_into_place(tmp: Path, path: Path, token: str) -> None:
    """Move the finished `tmp` to `path`; a previous checkpoint there is removed only after."""
    old = path.parent / f".{path.name}{_OLD}{token}"
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    for stale in path.parent.glob(f".{path.name}.autopart-*"):   # this one's and interrupted saves'
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
