"""One tensor as this rank's pieces of the global tensor: the slice geometry of a checkpoint."""
from __future__ import annotations

import torch
from autopart.errors import AutopartError
from autopart.localize import section_range
from dataclasses import dataclass
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata


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
    """(start, size) of part `index` of `length` elements cut in `parts`, by the one slice
    arithmetic (autopart.localize.section_range, what shard_tensor cuts by)."""
    start, stop = section_range(length, parts, index)
    return start, stop - start


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
