"""`pm.load_pretrained(source)`: each rank reads its own slices of a checkpoint of the plain model.

    pm = autopart.parallelize(meta_model, mesh, (tokens,), ...)   # built on torch.device("meta")
    pm.load_pretrained("llama-dir/")     # HF directory: *.safetensors + model.safetensors.index.json

`source` is a state dict, a `torch.save` file (opened with mmap, so only the pages of the slices
read are touched), a `.safetensors` file, a Hugging Face model directory (one
`model.safetensors` or shards listed by `model.safetensors.index.json`) or a
torch.distributed.checkpoint directory of the plain model's state dict (torchtitan's format:
DCP reads only the saved chunks overlapping each slice). Safetensors are read with
`safe_open(...).get_slice(key)[ranges]`: a tensor-parallel slice of a fused q|k|v weight is three
ranges of rows, an expert slice a range of dim 0; no rank reads a tensor it does not hold.

Keys are the plain model's state dict keys. A tied parameter may be stored under any one of its
names (safetensors' save_model keeps the alphabetically first, HF's save_pretrained the input
embedding). Persistent buffers load like parameters; non-persistent ones (RoPE's inv_freq) are
not in checkpoints and keep the values the rank computed when it was built (autopart/
materialize.py rebuilds them from the module's constructor). Every rank checks every key's name,
shape and dtype from the checkpoint's metadata before reading anything, so a bad checkpoint fails
on all ranks alike, with the key and the file.
"""
from __future__ import annotations

import json
from itertools import chain
from pathlib import Path

import torch

from autopart.errors import AutopartError
from autopart.localize import rank_cuts, rank_ranges

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# -- checkpoint readers: keys, metadata, and a slice read ----------------------------------------

class DictCheckpoint:
    """A state dict in memory, or a torch.save file memory-mapped."""

    def __init__(self, tensors: dict, where: str):
        self.tensors, self.where = tensors, where
        _check_only_tensors(tensors, where)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, key: str) -> tuple[tuple, torch.dtype, str]:
        t = self.tensors[key]
        return tuple(t.shape), t.dtype, self.where

    def read(self, key: str, index: tuple) -> torch.Tensor:
        return self.tensors[key][index]


def _check_only_tensors(tensors: dict, where: str) -> None:
    """Refuse a state dict with entries that are not tensors ({"epoch": 3} beside the weights, a
    training checkpoint's {"model": ..., "optimizer": ...}): naming them beats skipping them."""
    bad = [(k, v) for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if not bad:
        return
    listed = ", ".join(f"{k!r} (a {type(v).__name__})" for k, v in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    nested = [k for k, v in bad if isinstance(v, dict)]
    hint = (f"ckpt[{nested[0]!r}] if the weights sit under that key, or " if nested else "")
    raise AutopartError(
        f"load_pretrained: {where} holds {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} that "
        f"{'is' if len(bad) == 1 else 'are'} not a tensor: {listed}{more}; a checkpoint of the "
        "plain model maps each of its state dict keys to a tensor.\n  remedy: pass only the "
        f"model's weights: {hint}{{k: v for k, v in ckpt.items() if torch.is_tensor(v)}}, "
        "keeping the other entries (the epoch, say) for yourself")


class SafetensorsCheckpoint:
    """One or more .safetensors files; each opened once, lazily, read by slices."""

    def __init__(self, files: dict[str, str], where: str):
        self.files, self.where = files, where       # key -> file
        self._open: dict[str, object] = {}

    def _handle(self, key: str):
        from safetensors import safe_open
        path = self.files[key]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt", device="cpu")
        return self._open[path]

    def keys(self) -> list[str]:
        return list(self.files)

    def info(self, key: str) -> tuple[tuple, torch.dtype, str]:
        sl = self._handle(key).get_slice(key)
        code = sl.get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise AutopartError(f"{self.files[key]}: key {key!r} has dtype {code}, which autopart "
                                f"cannot read (known: {', '.join(_SAFETENSORS_DTYPES)})")
        return tuple(sl.get_shape()), _SAFETENSORS_DTYPES[code], self.files[key]

    def read(self, key: str, index: tuple) -> torch.Tensor:
        if not index:                              # a 0-dim tensor
            return self._handle(key).get_tensor(key)
        return self._handle(key).get_slice(key)[index]


class DcpCheckpoint:
    """A torch.distributed.checkpoint directory of the plain model's state dict (torchtitan's
    `dcp.save(model.state_dict(), ...)`): each read asks DCP for one box of one tensor, and DCP
    reads only the saved chunks overlapping it. Entries that are not tensors (a training loop's
    step counter saved beside the weights) are not keys."""

    def __init__(self, path: Path):
        import torch.distributed.checkpoint as dcp
        self.where = str(path)
        self.reader = dcp.FileSystemReader(str(path))
        try:
            meta = self.reader.read_metadata()
        except Exception as e:  # noqa: BLE001  (an unreadable .metadata: say which and why)
            raise AutopartError(f"load_pretrained: {path}/.metadata cannot be read as a "
                                f"torch.distributed.checkpoint ({type(e).__name__}: {e})") from e
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        self.tensors = {k: m for k, m in meta.state_dict_metadata.items()
                        if isinstance(m, TensorStorageMetadata)}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, key: str) -> tuple[tuple, torch.dtype, str]:
        m = self.tensors[key]
        return tuple(m.size), m.properties.dtype, self.where

    def read(self, key: str, index: tuple) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp
        from autopart.runtime.checkpoint import Slices, _LoadPlanner
        shape = tuple(self.tensors[key].size)
        box = [(s.start, s.stop) for s in index] + [(0, n) for n in shape[len(index):]]
        out = torch.empty([b - a for a, b in box], dtype=self.tensors[key].properties.dtype)
        if out.numel():
            piece = Slices(torch.Size(shape), [(torch.Size([a for a, _ in box]), out)])
            dcp.load({key: piece}, storage_reader=self.reader, planner=_LoadPlanner(),
                     no_dist=True)
        return out


def open_checkpoint(source):
    """A reader for `source` (see the module docstring)."""
    if isinstance(source, dict):
        return DictCheckpoint(source, "the given state dict")
    path = Path(source)
    if path.is_dir() and (path / ".metadata").exists():
        return DcpCheckpoint(path)
    if path.is_dir():
        return _hf_directory(path)
    if not path.exists():
        raise AutopartError(f"load_pretrained: {path} does not exist.\n  remedy: pass a state "
                            "dict, a torch.save file, a .safetensors file or a model directory")
    if path.suffix == ".safetensors":
        return _safetensors_files([path], str(path))
    try:   # mmap: a rank touches only the pages of the slices it copies
        tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001  (any unreadable file: say which and why)
        raise AutopartError(f"load_pretrained: cannot read {path} with torch.load(mmap=True, "
                            f"weights_only=True): {type(e).__name__}: {e}") from e
    if not isinstance(tensors, dict):
        raise AutopartError(f"load_pretrained: {path} holds a {type(tensors).__name__}, not a "
                            "state dict (name -> tensor)")
    return DictCheckpoint(tensors, str(path))


def _hf_directory(path: Path):
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return SafetensorsCheckpoint({k: str(path / f) for k, f in weight_map.items()}, str(index))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise AutopartError(f"load_pretrained: {path} holds no *.safetensors files (and no "
                            "model.safetensors.index.json).\n  remedy: save with "
                            "save_pretrained(..., safe_serialization=True)")
    return _safetensors_files(files, str(path))


def _safetensors_files(files, where: str) -> SafetensorsCheckpoint:
    from safetensors import safe_open
    owner = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for k in h.keys():
                owner[k] = str(f)
    return SafetensorsCheckpoint(owner, where)


# -- which slice a rank holds --------------------------------------------------------------------

def read_ranges(ckpt, key: str, ranges) -> torch.Tensor:
    """The tensor made of `ranges` of checkpoint tensor `key` (one read per block)."""
    for d, rs in enumerate(ranges):
        if len(rs) > 1:
            return torch.cat([read_ranges(ckpt, key, ranges[:d] + [[r]] + ranges[d + 1:])
                              for r in rs], d)
    return ckpt.read(key, tuple(slice(a, b) for (a, b), in ranges))


# -- load -----------------------------------------------------------------------------------------

def load_pretrained(pm, source) -> set[str]:
    """Overwrite `pm`'s shards (and the state no chunk holds) with their slices of `source`;
    returns the canonical names of the model's tensors it filled (on every rank alike)."""
    ckpt = open_checkpoint(source)
    groups, skip = _expected(pm)
    stored = check_checkpoint(ckpt, groups, skip)
    plan, tp_rank, ep_rank = pm.compiled.plan, pm.coords["tp"], pm.ep_rank
    for name, tensor in held_tensors(pm).items():
        if name not in stored:
            continue                                  # a non-persistent buffer
        key = stored[name]
        shape = groups[name][1]
        block = read_ranges(ckpt, key, rank_ranges(shape, rank_cuts(plan, name, tp_rank, ep_rank)))
        if block.shape != tensor.shape:
            raise AutopartError(f"internal: the slice of {key!r} read for rank {pm.rank} has shape "
                                f"{tuple(block.shape)}, its shard {tuple(tensor.shape)}")
        with torch.no_grad():
            tensor.copy_(block)
    extra = pm._state.extra_state
    for name in list(extra):
        if name in stored:
            extra[name] = read_ranges(ckpt, stored[name], [[(0, n)] for n in extra[name].shape]
                                      ).to(extra[name].dtype).clone()
    return set(stored)


def _expected(pm) -> tuple[dict, set]:
    """canonical name -> (its names, full shape, dtype) for every persistent tensor of the
    model; and the names of non-persistent buffers (accepted in a checkpoint, ignored)."""
    program = pm.compiled.program
    groups, skip = {}, set()
    for info in chain(program.params.values(), program.buffers.values()):
        names = (info.name, *info.aliases)
        if not info.persistent:
            skip.update(names)
            continue
        groups[info.name] = (names, tuple(int(d) for d in info.shape), info.dtype)
    known = {n for names, _, _ in groups.values() for n in names}
    for name, t in pm._state.extra_state.items():
        if name not in known:
            groups[name] = ((name,), tuple(t.shape), t.dtype)
    return groups, skip


def check_checkpoint(ckpt, groups: dict, skip: set) -> dict[str, str]:
    """canonical name -> the checkpoint key holding it; raise on a missing or extra key, a shape
    that differs, or a dtype that cannot be cast to the model's."""
    keys = set(ckpt.keys())
    stored = {}
    for name, (names, shape, dtype) in groups.items():
        present = [n for n in names if n in keys]
        if not present:
            also = f" (or its tied names {list(names[1:])})" if len(names) > 1 else ""
            raise AutopartError(
                f"load_pretrained: {ckpt.where} has no key {names[0]!r}{also}, which the model "
                f"needs (shape {list(shape)}, {dtype}).\n  remedy: load a checkpoint of this "
                "model (keys are model.state_dict()'s), or rename the key")
        key = present[0]
        got_shape, got_dtype, where = ckpt.info(key)
        if tuple(got_shape) != tuple(shape):
            raise AutopartError(
                f"load_pretrained: key {key!r} in {where} has shape {list(got_shape)} but the "
                f"model's is {list(shape)}.\n  remedy: build the model with the checkpoint's "
                "config")
        if not torch.can_cast(got_dtype, dtype):
            raise AutopartError(
                f"load_pretrained: key {key!r} in {where} is {got_dtype}, which cannot be cast to "
                f"the model's {dtype} without losing its kind (torch.can_cast).\n  remedy: "
                "convert the checkpoint, or build the model in a matching dtype")
        stored[name] = key
    known = {n for names, _, _ in groups.values() for n in names} | skip
    extra = sorted(keys - known)
    if extra:
        where = ckpt.info(extra[0])[2]
        raise AutopartError(
            f"load_pretrained: key {extra[0]!r} in {where} is not in the model"
            + (f" (and {len(extra) - 1} more: {extra[1:4]})" if len(extra) > 1 else "")
            + ".\n  remedy: load a checkpoint of this model, or drop the key from the state dict")
    return stored


def held_tensors(pm) -> dict[str, torch.Tensor]:
    """This rank's tensors by canonical name, each once, for a load or an init to fill: under
    zero=3 a sharded parameter is its SliceWriter (runtime/param_shards.py), which keeps only
    this rank's slice of what is copied into it."""
    sharded = getattr(pm, "_sharded", None)
    writers = sharded.writers() if sharded is not None else {}
    out = {}
    for c in pm.program.chunks:
        for n, t in chain(c.gm.named_parameters(remove_duplicate=False),
                          c.gm.named_buffers(remove_duplicate=False)):
            out.setdefault(n, writers.get(id(t), t))
    return out


__all__ = ["held_tensors", "load_pretrained", "open_checkpoint", "rank_ranges", "read_ranges"]
