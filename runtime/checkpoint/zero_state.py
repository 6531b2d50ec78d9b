"""zero=1: this rank's flat slice of the per-parameter optimizer state."""
from __future__ import annotations

import math
import torch
from autopart.errors import AutopartError
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from .geometry import Slices, _split_dim, layout
from .held import _infos, _set_hyperparameters

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
