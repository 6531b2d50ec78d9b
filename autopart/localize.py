"""Per-tensor-parallel-rank parameters: cut a full weight into a rank's shard and back.

A ParamShard splits `dim` into sections (fused q|k|v weights have three) and gives each tp rank
the same 1/tp slice of every section, so each rank gets its own heads of q, of k and of v.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from autopart.tp_ops import TPComm


def shard_tensor(full: torch.Tensor, dim: int, sections: tuple, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full` (a view when there is one section)."""
    pieces = full.split(list(sections), dim) if len(sections) > 1 else (full,)
    local = [piece.chunk(tp, dim)[rank] for piece in pieces]
    return local[0] if len(local) == 1 else torch.cat(local, dim)


def unshard_tensor(shards: list[torch.Tensor], dim: int, sections: tuple) -> torch.Tensor:
    """Inverse of shard_tensor over all tp ranks' shards, in rank order."""
    tp = len(shards)
    local_sections = [s // tp for s in sections]
    split = [s.split(local_sections, dim) for s in shards]
    return torch.cat([torch.cat([split[r][i] for r in range(tp)], dim)
                      for i in range(len(sections))], dim)


def localize_module(gm: fx.GraphModule, shards: dict, tp: int, rank: int,
                    copy: bool) -> fx.GraphModule:
    """A GraphModule running the same graph with tp rank `rank`'s shards of the sharded weights.

    With copy=True each shard is a fresh Parameter (a real rank keeps only its share); with
    copy=False it is a view of the full tensor (inspection, e.g. on the meta device)."""
    attrs: dict = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = attribute(gm, node.target)
        if isinstance(value, TPComm):
            attrs[node.target] = TPComm(tp, rank)
        elif node.target in shards:
            sh = shards[node.target]
            local = shard_tensor(value.detach(), sh.dim, sh.sections, tp, rank)
            local = local.clone() if copy else local
            attrs[node.target] = nn.Parameter(local, requires_grad=value.requires_grad)
        else:
            attrs[node.target] = value
    out = fx.GraphModule(attrs, gm.graph, class_name=type(gm).__name__)
    return out


def attribute(gm: torch.nn.Module, target: str):
    """The object at a dotted attribute path of a module (a get_attr node's target)."""
    return operator.attrgetter(target)(gm)
