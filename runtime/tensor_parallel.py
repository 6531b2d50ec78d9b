"""The runtime's tensor-parallel duties: this rank's weight shards, its bound TPComm, and the
gradient all-reduce of replicated weights that saw only sequence shards."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.localize import localize_module
from autopart.passes.emit_rank_programs import ChunkProgram
from autopart.tp_ops import TPComm


def localize_chunks(chunks, tp_plan, tp_rank: int, tp_group) -> list[ChunkProgram]:
    """Each chunk with this tp rank's own copy of its weight shards, its TPComm bound."""
    if tp_plan is None or tp_plan.tp == 1:
        return list(chunks)
    out = []
    for chunk in chunks:
        gm = localize_module(chunk.gm, tp_plan.params, tp_plan.tp, tp_rank, copy=True)
        for module in gm.modules():
            if isinstance(module, TPComm):
                module.bind(tp_group, tp_rank)
        out.append(_with_gm(chunk, gm))
    return out


def _with_gm(chunk: ChunkProgram, gm) -> ChunkProgram:
    import dataclasses
    return dataclasses.replace(chunk, gm=gm)


def reduce_sequence_parallel_grads(params: dict, tp_plan, tp_group) -> None:
    """Sum over tp the gradients of replicated weights used on sequence shards (norms, biases)."""
    if tp_plan is None or not tp_plan.sp_grad_reduce:
        return
    all_reduce_flat([params[n].grad for n in sorted(tp_plan.sp_grad_reduce)
                     if n in params and params[n].grad is not None], tp_group)


def all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    """Sum `grads` over `group` in one all-reduce (nothing to do without a group)."""
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
