"""Sharded checkpoints of a ParallelModel on torch.distributed.checkpoint (DCP).

    autopart.runtime.checkpoint.save(pm, "ckpt/step100", optimizer=opt, extra={"step": 100})
    extra = autopart.runtime.checkpoint.load(pm, "ckpt/step100", optimizer=opt)  # any mesh
    # one process, no process group: the plain model's state dict as safetensors
    autopart.runtime.checkpoint.export("ckpt/step100", "out/")

Every tensor is stored under the plain model's canonical name with its global shape; each rank
writes only its own pieces of it, as chunks with global offsets (DCP's chunk metadata). A
tensor-parallel shard of a fused weight (q|k|v) is one chunk per section, since it is several
separate slices of the full tensor; an expert shard is rows of dim 0. Replicas (data-parallel
copies, both holders of a tied weight) offer the same chunk and DCP's save planner keeps one
writer per chunk. On load each rank asks for its own chunks and DCP reads whatever saved chunks
overlap them, so a checkpoint saved on one mesh loads on any other.

Keys: `model/<name>`, `optim/state/<name>/<key>` (sharded like the parameter when it has the
parameter's shape: momentum, Adam moments; else stored whole: `step`), `optim/param_groups`
(hyperparameters), `rng/<rank>/cpu` (and `/cuda`), `extra`. A zero=1 ZeroOptimizer's flat slices
are saved in this same per-parameter form (gathered per replica group) and loaded by cutting each
rank's slice out of it, so a checkpoint loads across a change of zero level too.

A save writes into a temporary directory beside `path`; after every rank finished (DCP's final
collective, then a gather of each rank's file checksums) rank 0 writes the completion marker
`.autopart_complete` (JSON: mesh, world size, keys, the model's names and global shapes and a
digest of them, each file's size and CRC-32) and only then moves the directory to `path`. A save
that dies on any rank leaves `path` as it was.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import (_create_read_items, _create_write_items,
                                                          create_read_items_for_chunk_list)

from autopart.errors import AutopartError

MARKER = ".autopart_complete"
FORMAT = 1
_TMP, _OLD = ".autopart-tmp-", ".autopart-old-"


# -- one tensor as this rank's pieces of the global tensor ---------------------------------------

@dataclass
class Slices:
    """This rank's pieces of one global tensor: (global offsets, view of the local tensor)."""
    shape: torch.Size
    pieces: list[tuple[torch.Size, torch.Tensor]]

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.pieces]

    def piece(self, offsets) -> torch.Tensor:
        for o, t in self.pieces:
            if o == offsets:
                return t
        raise KeyError(offsets)


def _ranges(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of torch.chunk(parts)[index] of `length` elements (the runtime's split)."""
    step = -(-length // parts)
    start = min(step * index, length)
    return start, max(0, min(step, length - start))


def layout(name: str, shape: tuple, plan, coords: dict, mesh, ep_rank: int | None = None
           ) -> list[tuple[tuple, tuple, int]]:
    """Where this rank's tensor `name` lies in the global tensor: [(global offsets, sizes, local
    offset along the split dim)], in the order the pieces are concatenated in the local tensor.
    One piece covering everything for a replicated tensor."""
    offsets, sizes = [0] * len(shape), list(shape)
    split_dim, pieces = None, [(offsets, sizes)]
    experts = plan.ep_shards.get(name) if mesh.ep > 1 else None
    tp_spec = plan.tp_shards.get(name) if mesh.tp > 1 else None
    if experts is not None:         # dim 0 over the ep ranks (the Mesh says which is ours)
        start, size = _ranges(shape[0], mesh.ep,
                              mesh.ep_rank(mesh.rank(**coords)) if ep_rank is None else ep_rank)
        offsets, sizes = [start] + offsets[1:], [size] + sizes[1:]
        pieces, split_dim = [(offsets, sizes)], 0
    if tp_spec is not None:         # the same 1/tp slice of every section of `dim`
        d = tp_spec.dim
        if experts is not None and d == 0:
            raise AutopartError(f"checkpoint: {name} is sharded over both ep and tp on dim 0; "
                                "not supported")
        pieces, begin = [], 0
        for section in tp_spec.sections:
            start, size = _ranges(section, mesh.tp, coords["tp"])
            o, s = list(offsets), list(sizes)
            o[d], s[d] = begin + start, size
            pieces.append((o, s))
            begin += section
        if begin != shape[d]:
            raise AutopartError(f"checkpoint: {name}'s tensor-parallel sections {tp_spec.sections} "
                                f"do not add up to its dim {d} of size {shape[d]}")
        split_dim = d
    out, local = [], 0
    for o, s in pieces:
        out.append((tuple(o), tuple(s), local))
        if split_dim is not None:
            local += s[split_dim]
    return out if split_dim is not None else [(tuple(offsets), tuple(sizes), 0)]


def _split_dim(name: str, plan, mesh) -> int | None:
    if mesh.tp > 1 and name in plan.tp_shards:
        return plan.tp_shards[name].dim
    if mesh.ep > 1 and name in plan.ep_shards:
        return 0
    return None


def sliced(pm, name: str, local: torch.Tensor, shape: tuple) -> torch.Tensor | Slices:
    """`local` (this rank's tensor `name`, or state shaped like it) as pieces of the global one."""
    plan, mesh = pm.compiled.plan, pm.mesh
    boxes = layout(name, shape, plan, pm.coords, mesh, getattr(pm, "ep_rank", None))
    dim = _split_dim(name, plan, mesh)
    if dim is None:
        if tuple(local.shape) != tuple(shape):
            raise AutopartError(f"checkpoint: {name} has shape {tuple(local.shape)} on rank "
                                f"{pm.rank} but the model's is {tuple(shape)}")
        return local.detach()
    expect = list(boxes[0][1])
    expect[dim] = sum(b[1][dim] for b in boxes)
    if list(local.shape) != expect:
        raise AutopartError(f"checkpoint: {name} has shape {tuple(local.shape)} on rank {pm.rank}; "
                            f"its shard of the global {tuple(shape)} should be {tuple(expect)}")
    t = local.detach()
    return Slices(torch.Size(shape), [(torch.Size(o), t.narrow(dim, at, s[dim]))
                                      for o, s, at in boxes])


# -- DCP planners that understand Slices ----------------------------------------------------------

class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner (duplicate chunks kept once, on the least loaded rank), with each
    Slices entry written as one chunk per piece at its global offsets."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, Slices):
                for offsets, t in obj.pieces:
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                            properties=TensorProperties.create_from_tensor(t), size=obj.shape)))
            else:
                items += _create_write_items(fqn, obj)
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Slices):
            return obj.piece(index.offset)
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """Each rank reads, for every Slices piece, the parts of the saved chunks that overlap it."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # not the default's: its _init_state_dict turns values it does not know (Slices) to None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(obj, Slices):
                requests += create_read_items_for_chunk_list(fqn, md, obj.chunks())
            else:
                requests += _create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Slices):
            return obj.piece(index.offset)
        return super().lookup_tensor(index)


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
    for key, t in _private(pm, "extra_state", {}).items():
        out.setdefault(canon.get(key, key), t)
    return out


def _private(pm, what: str, default):
    """The plain model's key order / unheld state that parallelize recorded (kept by the
    ParallelModel's state gatherer; directly on the ParallelModel before the restructure)."""
    gatherer = getattr(pm, "_state", None)
    if gatherer is not None and hasattr(gatherer, what):
        return getattr(gatherer, what)
    return getattr(pm, "_" + what, default)


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
    order = _private(pm, "key_order", None)
    if order is None:
        order = [k for n in tensors for k in (n, *tensors[n]["aliases"])]
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


# -- save ------------------------------------------------------------------------------------------

def save(pm, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None, *, model: torch.nn.Module | None = None) -> dict:
    """Save `pm`'s shards (and `optimizer`'s state, RNG states and `extra`) to directory `path`.

    Collective: every rank calls it with the same `path`. Returns the completion marker (a dict).
    `extra` (rank 0's) comes back from `load`. `model`, when given, is the plain model the
    ParallelModel was made from: its class, and for a Hugging Face model its config, are
    recorded so `autopart export` can write a model directory.

        save(pm, "ckpt/step7", optimizer=opt, extra={"step": 7})
    """
    start = time.perf_counter()
    path = Path(path).absolute()
    rank = dist.get_rank()
    _enter(pm, "save")
    # the temporary directory's name, the same on every rank; and rank 0's checks of `path` and
    # of `extra` (rank 0's is the one saved), in the first collective, so every rank raises alike
    # before anything is written
    token = ([uuid.uuid4().hex[:12], _check_target(path) or _check_extra(extra)] if rank == 0
             else [None, None])
    dist.broadcast_object_list(token, src=0)
    if token[1]:
        raise AutopartError(token[1])
    tmp = path.parent / f".{path.name}{_TMP}{token[0]}"
    try:
        return _save_into(pm, path, tmp, token[0], optimizer, extra, model, rank, start)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)      # a failed save leaves nothing behind
        raise


def _save_into(pm, path: Path, tmp: Path, token: str, optimizer, extra, model, rank: int,
               start: float) -> dict:
    state = _model_entries(pm)
    if optimizer is not None:
        state.update(_optimizer_entries(pm, optimizer))
        if rank == 0:
            state["optim/param_groups"] = _hyperparameters(optimizer)
    state.update(_rng_entries(rank))
    if rank == 0:
        state["extra"] = dict(extra or {})
    writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
    metadata = dcp.save(state, storage_writer=writer, planner=_SavePlanner())

    # every rank's files are written (dcp.save ends with a collective); each checksums its own
    mine = {f.name: _file_record(f) for f in sorted(tmp.glob(f"__{rank}_*"))}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
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
    dist.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise AutopartError(f"checkpoint save to {path} failed on rank 0: {status[0]}")
    if rank != 0:
        marker = _read_marker(path)
    return marker


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


def _file_record(f: Path) -> dict:
    crc = 0
    with open(f, "rb") as stream:
        while block := stream.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return {"bytes": f.stat().st_size, "crc32": crc}


def _marker(pm, optimizer, model, keys: list[str], files: dict) -> dict:
    import autopart
    plan = pm.compiled.plan
    mesh = pm.mesh
    out = {
        "format": FORMAT, "autopart_version": autopart.__version__,
        "torch_version": torch.__version__,
        "mesh": {"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp, "ep": mesh.ep},
        "world_size": mesh.world_size, "schedule": plan.schedule,
        "virtual_stages": plan.virtual_stages, "microbatches": plan.microbatches,
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


# -- checks on load --------------------------------------------------------------------------------

def _resolve(path: Path) -> Path:
    """`path`, or the previous checkpoint a save moved aside just before it died (rank 0 killed
    between its two renames)."""
    if path.exists():
        return path
    aside = sorted(path.parent.glob(f".{path.name}{_OLD}*"), key=lambda p: p.stat().st_mtime)
    for old in reversed(aside):
        if (old / MARKER).exists():
            warnings.warn(f"no checkpoint at {path}; loading the previous one, moved aside to "
                          f"{old} by a save that did not finish", stacklevel=3)
            return old
    return path


def _read_marker(path: Path) -> dict:
    if not path.is_dir():
        tmp = sorted(path.parent.glob(f".{path.name}{_TMP}*"))
        hint = f" (an unfinished save left {tmp[-1]})" if tmp else ""
        raise AutopartError(f"no checkpoint at {path}: not a directory{hint}")
    f = path / MARKER
    if not f.exists():
        raise AutopartError(f"checkpoint {path} is incomplete: its completion marker {MARKER} is "
                            "missing (a save that did not finish, or not an autopart checkpoint)")
    try:
        marker = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise AutopartError(f"checkpoint {path}: the completion marker {MARKER} is corrupt "
                            f"({type(e).__name__}: {e})") from e
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise AutopartError(f"checkpoint {path}: {MARKER} is not a format-{FORMAT} autopart marker")
    return marker


def check_files(path: Path, marker: dict, which: list[str] | None = None) -> list[str]:
    """Problems with the checkpoint's files: missing, wrong size, CRC mismatch (for `which`)."""
    problems = []
    for name, rec in sorted(marker["files"].items()):
        f = path / name
        if not f.exists():
            problems.append(f"file {name} is missing")
        elif f.stat().st_size != rec["bytes"]:
            problems.append(f"file {name} has {f.stat().st_size} bytes, {rec['bytes']} were "
                            "written (truncated or overwritten)")
        elif which is not None and name in which and _file_record(f)["crc32"] != rec["crc32"]:
            problems.append(f"file {name} is corrupt (CRC-32 differs from the one saved)")
    return problems


def _verify(path: Path, marker: dict, rank: int, world: int, distributed: bool) -> None:
    """Every rank checks every file's size and the checksums of its share of the files."""
    names = sorted(marker["files"])
    mine = [n for i, n in enumerate(names) if i % world == rank]
    problems = check_files(path, marker, mine)
    if distributed:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = sorted({p for part in gathered for p in part})
    if problems:
        raise AutopartError(f"checkpoint {path} is corrupt or incomplete:\n  "
                            + "\n  ".join(problems))


def _check_same_model(pm, marker: dict, path: Path) -> None:
    saved = marker["model"]["tensors"]
    mine = _describe_model(pm)["tensors"]
    if marker["model"]["digest"] == _digest(mine):
        return
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    differ = [f"{n}: saved {tuple(saved[n]['shape'])} {saved[n]['dtype']}, model "
              f"{tuple(mine[n]['shape'])} {mine[n]['dtype']}"
              for n in sorted(set(saved) & set(mine))
              if (saved[n]["shape"], saved[n]["dtype"]) != (mine[n]["shape"], mine[n]["dtype"])]
    lines = []
    for title, items in (("missing from the checkpoint", missing),
                         ("in the checkpoint but not in the model", unexpected),
                         ("with different shapes or dtypes", differ)):
        if items:
            shown = items[:8] + ([f"... and {len(items) - 8} more"] if len(items) > 8 else [])
            lines.append(f"{len(items)} tensors {title}: " + "; ".join(shown))
    raise AutopartError(f"checkpoint {path} is of a different model "
                        f"({marker.get('model_class', 'class not recorded')}):\n  "
                        + "\n  ".join(lines))


# -- load ------------------------------------------------------------------------------------------

def load(pm, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None, *,
         verify: bool = True) -> dict:
    """Load a checkpoint made by `save` (on any mesh) into `pm` in place; returns its `extra`.

    Collective. Parameters are copied into the existing tensors, so an optimizer over
    `pm.parameters()` keeps them; its state is filled, entries a fresh optimizer has not made
    yet included. `verify` checks every file's size and CRC-32 (each rank a share of the files).

        opt = torch.optim.AdamW(pm.parameters(), lr=3e-4)
        extra = load(pm, "ckpt/step7", optimizer=opt)      # {"step": 7}
    """
    path = _resolve(Path(path).absolute())
    rank, world = dist.get_rank(), dist.get_world_size()
    _enter(pm, "load")
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
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise AutopartError(next(p for p in problems if p))
    _verify(path, marker, rank, world, distributed=True) if verify else None

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
        dcp.load(state, storage_reader=reader, planner=_LoadPlanner())
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


def _set_hyperparameters(optimizer, groups: list[dict] | None) -> None:
    if groups is None:
        return
    if len(groups) != len(optimizer.param_groups):
        raise AutopartError(f"checkpoint has {len(groups)} optimizer param groups, the "
                            f"optimizer {len(optimizer.param_groups)}")
    for group, hyper in zip(optimizer.param_groups, groups):
        group.update(hyper)


# -- zero=1: this rank's flat slice of the per-parameter state ---------------------------------

def _prepare_zero_optimizer(pm, optimizer, saved: dict, state: dict):
    """A ZeroOptimizer's entries: for each flat layout, the part of each parameter's saved state
    that lies in this rank's slice (read straight into a slice-sized buffer per key, so a rank
    reads and holds only its 1/dp share), and the scalar state (`step`) of every parameter."""
    infos = _infos(pm)
    per_layout = []
    inner = optimizer.inner.param_groups[0] if optimizer.inner.param_groups else {}
    scalars_on_device = inner.get("capturable") or inner.get("fused")   # torch's own policy
    for lay in optimizer.layouts:
        flat_keys, scalar_keys = _state_kinds(lay, saved, infos)
        # the moments live where the parameters do (a CUDA rank's Adam state on its GPU)
        flats = {key: torch.zeros(lay.shard, dtype=dtype, device=lay.device)
                 for key, dtype in flat_keys.items()}
        for name, p, first, last, at in lay.spans():
            for key, flat in flats.items():
                fqn = f"optim/state/{name}/{key}"
                if fqn in saved:     # a parameter the plain optimizer never stepped has none
                    state[fqn] = _flat_slices(pm, name, tuple(infos[name].shape), p.shape,
                                              flat[at:at + last - first], first)
        scalars = {}
        for name in lay.names:
            for key in scalar_keys:
                fqn = f"optim/state/{name}/{key}"
                md = saved.get(fqn)
                if isinstance(md, BytesStorageMetadata):
                    state[fqn], scalars[fqn] = None, (name, key)
                elif md is not None:
                    state[fqn] = torch.zeros(tuple(md.size), dtype=md.properties.dtype,
                                             device=lay.device if scalars_on_device else "cpu")
                    scalars[fqn] = (name, key)
        per_layout.append((flats, scalars))

    def fill(loaded: dict) -> None:
        states = []
        for lay, (flats, scalars) in zip(optimizer.layouts, per_layout):
            merged: dict = dict(flats)
            seen: dict = {}
            for fqn, (name, key) in scalars.items():
                value = loaded[fqn]
                if key in seen and not _same_value(merged[key], value):
                    raise AutopartError(
                        f"checkpoint: optimizer state {key!r} is {merged[key]} for {seen[key]} "
                        f"but {value} for {name}; zero=1 steps the parameters of one flat buffer "
                        "together, so they must agree.\n  remedy: load this checkpoint with "
                        "zero=0 (an optimizer over pm.parameters())")
                merged[key], seen[key] = value, name
            states.append(merged)
        optimizer.load_slices(states)
        _set_hyperparameters(optimizer, loaded.get("optim/param_groups"))
    return fill


def _state_kinds(lay, saved: dict, infos: dict) -> tuple[dict, list[str]]:
    """The saved state keys of a layout's parameters: ({key: dtype} of those shaped like the
    parameter, which the flat buffers hold; [keys of scalar or Python state])."""
    flat, scalar = {}, set()
    for name in lay.names:
        shape, prefix = tuple(infos[name].shape), f"optim/state/{name}/"
        for fqn in (k for k in saved if k.startswith(prefix)):
            key, md = fqn[len(prefix):], saved[fqn]
            if isinstance(md, BytesStorageMetadata) or len(md.size) == 0:
                scalar.add(key)
            elif tuple(md.size) == shape:
                flat[key] = md.properties.dtype
            else:
                raise AutopartError(
                    f"checkpoint: optimizer state {key!r} of {name} has shape {tuple(md.size)}, "
                    f"neither the parameter's {shape} nor a scalar: zero=1 cannot slice it.\n  "
                    "remedy: load it with zero=0")
    # a 0-dim parameter's moment is 0-dim too: it is flat state if any other parameter says so
    return flat, sorted(scalar - set(flat))


def _same_value(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and torch.equal(a, b)
    return a == b


def _flat_slices(pm, name: str, shape: tuple, local_shape, segment: torch.Tensor,
                 first: int) -> Slices | torch.Tensor:
    """`segment` (elements [first, first + len) of this rank's flattened tensor `name`, or state
    shaped like it) as pieces of the global tensor: row-major boxes of the local tensor, each cut
    at the tensor-parallel / expert pieces that `layout` places in the global tensor."""
    if len(shape) == 0:
        return segment.view(())
    plan, mesh = pm.compiled.plan, pm.mesh
    dim = _split_dim(name, plan, mesh)
    placed = layout(name, shape, plan, pm.coords, mesh, getattr(pm, "ep_rank", None))
    out, at = [], 0
    for offsets, sizes in _boxes(tuple(local_shape), first, first + segment.numel()):
        n = math.prod(sizes)
        box, at = segment[at:at + n].view(sizes), at + n
        for go, gs, lo in placed:
            g, part = [o + x for o, x in zip(go, offsets)], box
            if dim is not None:     # the local tensor's [lo, lo + gs[dim]) along dim is this piece
                a, b = max(offsets[dim], lo), min(offsets[dim] + sizes[dim], lo + gs[dim])
                if a >= b:
                    continue
                g[dim] = go[dim] + a - lo
                part = box.narrow(dim, a - offsets[dim], b - a)
            out.append((torch.Size(g), part))
    return Slices(torch.Size(shape), out)


def _boxes(shape: tuple, first: int, last: int) -> list[tuple[tuple, tuple]]:
    """Elements [first, last) of a row-major tensor of `shape` as boxes (offsets, sizes), in
    order, each contiguous in memory: a partial first row, whole rows, a partial last row (the
    partial rows split the same way one dimension down)."""
    if first >= last:
        return []
    if len(shape) == 1:
        return [((first,), (last - first,))]
    inner, out = math.prod(shape[1:]), []

    def part_of_row(row: int, a: int, b: int) -> list:
        return [((row, *o), (1, *s)) for o, s in _boxes(shape[1:], a - row * inner,
                                                        b - row * inner)]
    if first % inner:
        row = first // inner
        end = min(last, (row + 1) * inner)
        out += part_of_row(row, first, end)
        first = end
    if first < last and last // inner > first // inner:    # first is at a row start here
        rows = last // inner - first // inner
        out.append(((first // inner, *[0] * (len(shape) - 1)), (rows, *shape[1:])))
        first = (last // inner) * inner
    if first < last:
        out += part_of_row(first // inner, first, last)
    return out


# -- export ----------------------------------------------------------------------------------------

def read_full_state_dict(path: str | os.PathLike, *, verify: bool = True
                         ) -> tuple[dict[str, torch.Tensor], dict]:
    """The plain model's full state dict from a checkpoint, in one process (no process group):
    (state dict under every key the plain model's state_dict has, aliases included; marker)."""
    path = _resolve(Path(path).absolute())
    marker = _read_marker(path)
    problems = check_files(path, marker, list(marker["files"]) if verify else [])
    if problems:
        raise AutopartError(f"checkpoint {path} is corrupt or incomplete:\n  "
                            + "\n  ".join(problems))
    reader = dcp.FileSystemReader(str(path))
    saved = _read_metadata(reader, path).state_dict_metadata
    tensors = marker["model"]["tensors"]
    full = {}
    for name in tensors:
        md = saved.get(f"model/{name}")
        if not isinstance(md, TensorStorageMetadata):
            raise AutopartError(f"checkpoint {path} is corrupt: no tensor model/{name}")
        full[f"model/{name}"] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # "torch.distributed is disabled...": intended
        try:
            dcp.load(full, storage_reader=reader, planner=_LoadPlanner(), no_dist=True)
        except Exception as e:
            raise AutopartError(f"checkpoint {path} could not be read ({type(e).__name__}: "
                                f"{str(e)[:400]})") from e
    canon = {a: n for n, v in tensors.items() for a in (n, *v["aliases"])}
    out = {}
    for key in marker["model"]["state_dict_keys"]:
        name = canon.get(key, key)
        t = full[f"model/{name}"]
        out[key] = t if key == name or name not in tensors else t.clone()
    return out, marker


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, verify: bool = True
           ) -> list[Path]:
    """Write the plain model's state dict as safetensors: `out` itself when it ends in
    .safetensors, else `out/model.safetensors` (with `out/config.json` for a Hugging Face model,
    a directory `from_pretrained` loads). Returns the files written."""
    from safetensors.torch import save_file

    out = Path(out)
    target = out if out.suffix == ".safetensors" else out / "model.safetensors"
    _check_writable(target)                      # before the (possibly long) read
    state, marker = read_full_state_dict(checkpoint, verify=verify)
    files = {target: None}
    hf = marker.get("hf")
    if hf is not None and target.parent == out:
        config = dict(hf["config"])
        config["architectures"] = config.get("architectures") or [hf["class"]]
        files[out / "config.json"] = json.dumps(config, indent=2, sort_keys=True)
    meta = {"format": "pt", "autopart_checkpoint": str(Path(checkpoint).absolute()),
            "mesh": json.dumps(marker["mesh"])}
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    temps = {}
    try:   # each file under a temporary name, renamed only when all are written: a failure writes nothing
        for path, text in files.items():
            temps[path] = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            if text is None:
                save_file({k: v.contiguous() for k, v in state.items()}, str(temps[path]), metadata=meta)
            else:
                temps[path].write_text(text)
        for path, temp in temps.items():
            os.replace(temp, path)
    except BaseException:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
        for d in made:                           # innermost first
            shutil.rmtree(d, ignore_errors=True)
        raise
    return list(files)


def _check_writable(target: Path) -> None:
    """Refuse an OUT that cannot receive `target`, naming why, before anything is read."""
    if target.is_dir():
        raise AutopartError(f"export: {target} is a directory; give a path ending in .safetensors that is "
                            "not one, or a directory to hold model.safetensors")
    parent = next(p for p in (target.parent, *target.parent.parents) if p.exists())
    if not parent.is_dir():
        raise AutopartError(f"export: {parent} is a file, so {target} cannot be written under it; give a "
                            "directory or a path ending in .safetensors")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AutopartError(f"export: cannot write under {parent} (permission denied); choose another OUT")


def read_marker(path: str | os.PathLike) -> dict:
    """The completion marker of the checkpoint at `path` (AutopartError if there is none)."""
    return _read_marker(_resolve(Path(path).absolute()))


def summary(marker: dict) -> str:
    """One line about a checkpoint: mesh, tensors, bytes."""
    total = sum(f["bytes"] for f in marker["files"].values())
    mesh = ",".join(f"{k}={v}" for k, v in marker["mesh"].items() if v > 1) or "pp=1"
    return (f"{len(marker['model']['tensors'])} tensors, {total / 2**20:.1f} MiB in "
            f"{len(marker['files'])} files, saved on {mesh}"
            + (f" with {marker['optimizer']} state" if marker.get("optimizer") else ""))


__all__ = ["save", "load", "export", "read_full_state_dict", "read_marker", "check_files",
           "layout", "Slices", "MARKER", "summary"]
