"""The one localizer: a rank's copy of a chunk program, cut from the full program by its shards.

A parameter may be sharded over tensor parallelism (`Plan.tp_shards`), over expert parallelism
(`Plan.ep_shards`: dim 0, E/ep whole experts) or both; each `ParamShard` splits `dim` into
sections (fused q|k|v weights have three) and gives each rank the same 1/size slice of every
section, so each tp rank gets its own heads of q, of k and of v. The program's comm modules
(`TPComm`, `EPComm`) get this rank's index; the runtime binds their process groups.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn as nn

from autopart.ir import ChunkProgram, ParamShard, Plan
from autopart.ops.comm import GroupComm
from autopart.ops.ep import EPComm
from autopart.ops.tp import TPComm


def shard_tensor(full: torch.Tensor, dim: int, sections: tuple, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full` (a view when there is one section)."""
    pieces = full.split(list(sections), dim) if len(sections) > 1 else (full,)
    local = [piece.chunk(size, dim)[rank] for piece in pieces]
    return local[0] if len(local) == 1 else torch.cat(local, dim)


def section_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `length` elements cut in `parts`: torch.chunk's split
    (parts of ceil(length / parts), the last ones shorter or empty), which shard_tensor cuts by.
    The one slice arithmetic: rank_ranges (loading pretrained weights) and the checkpoint's
    layout (runtime/checkpoint/geometry.py) read it."""
    step = -(-length // parts)
    return min(step * index, length), min(step * (index + 1), length)


def rank_ranges(shape: tuple, cuts) -> list[list[tuple[int, int]]]:
    """Per dim, the (start, stop) ranges of the full tensor that make this rank's slice, in
    order: `cuts` as rank_cuts gives them, each section cut by section_range."""
    ranges = [[(0, n)] for n in shape]
    for sh, size, rank in cuts:
        segments, out, offset = ranges[sh.dim], [], 0
        for section in sh.sections:
            lo, hi = section_range(section, size, rank)
            out += _logical(segments, offset + lo, offset + hi)
            offset += section
        ranges[sh.dim] = out
    return ranges


def _logical(segments, lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) of the concatenation of `segments`, as ranges of the full tensor."""
    out, base = [], 0
    for a, b in segments:
        s, e = max(lo, base), min(hi, base + b - a)
        if s < e:
            out.append((a + s - base, a + e - base))
        base += b - a
    return out


def unshard_tensor(shards: list[torch.Tensor], dim: int, sections: tuple) -> torch.Tensor:
    """Inverse of shard_tensor over all ranks' shards, in rank order."""
    size = len(shards)
    local_sections = [s // size for s in sections]
    split = [s.split(local_sections, dim) for s in shards]
    return torch.cat([torch.cat([split[r][i] for r in range(size)], dim)
                      for i in range(len(sections))], dim)


def rank_cuts(plan: Plan, name: str, tp_rank: int, ep_rank: int) -> list:
    """(ParamShard, axis size, rank index) for each cut of parameter `name` on this rank, in the
    order localize_module applies them (experts first, then tensor parallelism)."""
    mesh = plan.mesh
    return [(shards[name], size, rank)
            for shards, size, rank in ((plan.ep_shards, mesh.ep, ep_rank),
                                       (plan.tp_shards, mesh.tp, tp_rank))
            if size > 1 and name in shards]


def rank_slice(plan: Plan, name: str, full: torch.Tensor, tp_rank: int, ep_rank: int) -> torch.Tensor:
    """This rank's slice of the full tensor `name`, cut exactly as localize_module cuts it."""
    for sh, size, rank in rank_cuts(plan, name, tp_rank, ep_rank):
        full = shard_tensor(full, sh.dim, sh.sections, size, rank)
    return full


def localize_chunk(chunk: ChunkProgram, plan: Plan, tp_rank: int, ep_rank: int, *,
                   copy: bool, made: dict | None = None) -> ChunkProgram:
    """`chunk` as the rank with these tp and ep indices runs it (see localize_module). Chunks
    of one rank localized with one `made` share the slices of the tensors they share."""
    mesh = plan.mesh
    gm = localize_module(chunk.gm, tp_shards=plan.tp_shards if mesh.tp > 1 else {},
                         tp=(mesh.tp, tp_rank), ep_shards=plan.ep_shards if mesh.ep > 1 else {},
                         ep=(mesh.ep, ep_rank), copy=copy, made=made)
    return chunk if gm is chunk.gm else dataclasses.replace(chunk, gm=gm)


def localize_module(gm: fx.GraphModule, *, tp_shards: dict[str, ParamShard] = {},
                    tp: tuple[int, int] = (1, 0), ep_shards: dict[str, ParamShard] = {},
                    ep: tuple[int, int] = (1, 0), copy: bool,
                    made: dict | None = None) -> fx.GraphModule:
    """The same graph with one rank's slices of its sharded parameters and comm modules of its
    own: `tp` and `ep` are (axis size, this rank's index on the axis).

    With copy=True each slice is a fresh Parameter (a real rank keeps only its share); with
    copy=False it is a view of the full tensor (inspection, e.g. on the meta device). A module
    with nothing to cut is returned as it is.

    `made` (full tensor's id -> its slice) is shared by the chunks one rank runs: a tensor two of
    them read (a tied embedding and head when a V schedule puts the first and the last chunk on
    one rank) must stay one Parameter there, so both chunks' gradients accumulate into one .grad
    as in the plain model; two slices would each get half, and nothing would sum them."""
    made = {} if made is None else made
    cuts: dict[str, list] = {}
    for shards, (size, rank) in ((ep_shards, ep), (tp_shards, tp)):
        for name, sh in shards.items():
            cuts.setdefault(name, []).append((sh, size, rank))
    comms = {TPComm: tp, EPComm: ep}
    attrs: dict = {}
    changed = False
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in attrs:
            continue
        value = attribute(gm, node.target)
        if isinstance(value, GroupComm):
            # its own comm (binding sets the group and index); cp's index is bound at run time
            attrs[node.target] = type(value)(*comms.get(type(value), (value.size, 0)))
            changed = True
        elif node.target in cuts:
            if id(value) not in made:
                local = value.detach()
                for sh, size, rank in cuts[node.target]:
                    local = shard_tensor(local, sh.dim, sh.sections, size, rank)
                made[id(value)] = (value, nn.Parameter(local.clone() if copy else local,
                                                       requires_grad=value.requires_grad))
            attrs[node.target] = made[id(value)][1]   # the full tensor kept: its id stays its own
            changed = True
        else:
            attrs[node.target] = value
    if not changed:
        return gm
    return fx.GraphModule(attrs, gm.graph, class_name=type(gm).__name__)


def attribute(gm: torch.nn.Module, target: str):
    """The object at a dotted attribute path of a module (a get_attr node's target)."""
    return operator.attrgetter(target)(gm)
