"""Expert-parallel collectives as differentiable graph ops (GShard's dispatch and combine).

Each op takes an `EPComm`, a small module every expert-parallel program holds as `self.ep_comm`;
the runtime binds it to this rank's expert-parallel process group (ep consecutive data-parallel
ranks). Nothing here is global.

    dispatch_to_experts   [E, N, ...] this rank's tokens for every expert
                          -> [E/ep, ep*N, ...] every rank's tokens for this rank's experts
                          (forward all-to-all; backward the inverse all-to-all)
    combine_from_experts  the inverse: [E/ep, ep*N, ...] -> [E, N, ...]

Token block r*N .. r*N+N-1 of the local-expert tensor holds rank r's tokens, in rank r's order,
so any op that treats each (expert, token) row on its own (batched matmuls with the expert's
weights, activations) gives the same rows as on one process.

Dropless layers that sort their (token, choice) rows by expert and run grouped matmuls with
cumulative row offsets per expert (Hugging Face's grouped_mm experts: Mixtral, Qwen2-MoE, OLMoE)
send a data-dependent number of rows to each rank:

    sorted_layout(offsets)          rows every rank sends this rank, per local expert [ep, E/ep]
                                    (one all-to-all of counts; no gradient)
    local_offsets(layout)           cumulative rows per local expert, for the grouped matmuls
    dispatch_rows(x, offsets, layout)   [S, ...] rows sorted by expert -> [R, ...] this rank's
                                    experts' rows from every rank, sorted by local expert
    combine_rows(y, offsets, layout)    the inverse, [R, ...] -> [S, ...]; rows past offsets[-1]
                                    (assigned to no expert) come back as zeros
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.ops.comm import GroupComm
from autopart.ops.registry import register


class EPComm(GroupComm):
    """This program's expert-parallel group: size, this rank's index in it, the process group."""

    axis = "expert-parallel"
    unbound_ok_when_alone = True   # one expert group: nothing to exchange


def _all_to_all(x: torch.Tensor, comm: EPComm) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i."""
    comm._check()
    x = x.contiguous()
    out = torch.empty_like(x)
    if comm.moves_data:
        dist.all_to_all_single(out, x, group=comm.group)
    return out


def _dispatch(x: torch.Tensor, comm: EPComm) -> torch.Tensor:
    ep = comm.size
    if ep == 1:
        return x
    E, N, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    got = _all_to_all(x, comm)                                   # [ep(source), E/ep, N, ...]
    got = got.view(ep, E // ep, N, *rest).transpose(0, 1)        # [E/ep, ep, N, ...]
    return got.reshape(E // ep, ep * N, *rest)


def _combine(y: torch.Tensor, comm: EPComm) -> torch.Tensor:
    ep = comm.size
    if ep == 1:
        return y
    local, N, rest = y.shape[0], y.shape[1] // ep, tuple(y.shape[2:])
    send = y.view(local, ep, N, *rest).transpose(0, 1)           # [ep(token owner), E/ep, N, ...]
    got = _all_to_all(send, comm)                                # [ep(expert owner), E/ep, N, ...]
    return got.view(ep * local, N, *rest)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _dispatch(x, comm)

    @staticmethod
    def backward(ctx, g):
        return _combine(g, ctx.comm), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, comm):
        ctx.comm = comm
        return _combine(y, comm)

    @staticmethod
    def backward(ctx, g):
        return _dispatch(g, ctx.comm), None


def dispatch_to_experts(x: torch.Tensor, comm: EPComm) -> torch.Tensor:
    """[E, N, ...] (this rank's tokens, every expert) -> [E/ep, ep*N, ...] (all ranks' tokens,
    this rank's experts). E must divide by ep and N must be the same on every rank."""
    if x.shape[0] % comm.size:
        raise RuntimeError(f"dispatch_to_experts: {x.shape[0]} experts do not divide over "
                           f"ep={comm.size} ranks")
    return _Dispatch.apply(x, comm)


def combine_from_experts(y: torch.Tensor, comm: EPComm) -> torch.Tensor:
    """[E/ep, ep*N, ...] -> [E, N, ...]: each rank's tokens back from every expert."""
    return _Combine.apply(y, comm)


# -- sorted rows with per-expert offsets (dropless, data-dependent sizes) -----------------------


def _counts(offsets: torch.Tensor) -> torch.Tensor:
    """Rows per expert from cumulative offsets [E]."""
    offsets = offsets.to(torch.int64)
    return torch.diff(offsets, prepend=offsets.new_zeros(1))


@torch.no_grad()
def sorted_layout(offsets: torch.Tensor, comm: EPComm) -> torch.Tensor:
    """int64 [ep, E/ep]: rows source rank r sends this rank for its local expert e."""
    ep = comm.size
    counts = _counts(offsets).view(ep, -1)               # [dest rank, its experts]
    if ep == 1:
        return counts
    comm._check()
    out = torch.empty_like(counts)
    if comm.moves_data:
        dist.all_to_all_single(out, counts.contiguous(), group=comm.group)
    return out


@torch.no_grad()
def local_offsets(layout: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Cumulative rows per local expert (the dtype of the original offsets)."""
    return torch.cumsum(layout.sum(dim=0), dim=0).to(like.dtype)


def _row_plan(offsets: torch.Tensor, layout: torch.Tensor, ep: int):
    """(rows sent to each rank, rows received from each rank, permutation of the received rows
    into local-expert order). One host sync: all_to_all_single takes its split sizes as Python
    ints; the backward reuses the forward's plan."""
    sizes = torch.cat([_counts(offsets).view(ep, -1).sum(dim=1), layout.sum(dim=1)]).tolist()
    send, recv = sizes[:ep], sizes[ep:]
    flat = layout.reshape(-1)                              # blocks in arrival order (r, e)
    starts = torch.cumsum(flat, 0) - flat                  # where block (r, e) starts
    by_expert = layout.t().reshape(-1)                     # blocks wanted in (e, r) order
    block_start = starts.view(layout.shape).t().reshape(-1)
    within = torch.arange(sum(recv), device=flat.device) - torch.repeat_interleave(
        torch.cumsum(by_expert, 0) - by_expert, by_expert, output_size=sum(recv))
    perm = torch.repeat_interleave(block_start, by_expert, output_size=sum(recv)) + within
    return send, recv, perm


def _rows_a2a(x: torch.Tensor, out_rows: int, in_splits, out_splits, comm) -> torch.Tensor:
    comm._check()
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=comm.group)
    return out


def _rows_forward(x, plan, comm):
    send, recv, perm = plan
    got = _rows_a2a(x[:sum(send)], sum(recv), send, recv, comm)
    return got[perm]


def _rows_backward(y, plan, comm, rows: int):
    send, recv, perm = plan
    back = torch.empty_like(y)
    back[perm] = y
    out = _rows_a2a(back, sum(send), recv, send, comm)
    if out.shape[0] < rows:                  # rows assigned to no expert: zeros
        out = torch.cat([out, out.new_zeros((rows - out.shape[0], *out.shape[1:]))])
    return out


def _plan_for(offsets: torch.Tensor, layout: torch.Tensor, comm: EPComm):
    """_row_plan, made once per dispatch: the combine of the same rows (the same offsets and
    layout tensors) reuses the dispatch's plan, so a layer syncs the host once per forward."""
    memo = getattr(comm, "_plan_memo", None)
    if memo is not None and memo[0] is offsets and memo[1] is layout:
        return memo[2]
    plan = _row_plan(offsets, layout, comm.size)
    comm._plan_memo = (offsets, layout, plan)
    return plan


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, layout, comm):
        ctx.plan = _plan_for(offsets, layout, comm)     # kept for the backward: no new sync
        ctx.comm, ctx.rows = comm, x.shape[0]
        return _rows_forward(x, ctx.plan, comm)

    @staticmethod
    def backward(ctx, g):
        return _rows_backward(g, ctx.plan, ctx.comm, ctx.rows), None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, offsets, layout, rows, comm):
        ctx.plan = _plan_for(offsets, layout, comm)
        ctx.comm = comm
        return _rows_backward(y, ctx.plan, comm, rows)

    @staticmethod
    def backward(ctx, g):
        return _rows_forward(g, ctx.plan, ctx.comm), None, None, None, None


def dispatch_rows(x: torch.Tensor, offsets: torch.Tensor, layout: torch.Tensor,
                  comm: EPComm) -> torch.Tensor:
    """Rows sorted by expert [S, ...] -> this rank's experts' rows from every rank [R, ...]."""
    if comm.size == 1:
        return x
    return _DispatchRows.apply(x, offsets, layout, comm)


def combine_rows(y: torch.Tensor, offsets: torch.Tensor, layout: torch.Tensor, like: torch.Tensor,
                 comm: EPComm) -> torch.Tensor:
    """The inverse of dispatch_rows: [R, ...] -> [S, ...] with S = like.shape[0] (the rows
    dispatched); rows past offsets[-1] are zeros."""
    if comm.size == 1:
        return y
    return _CombineRows.apply(y, offsets, layout, like.shape[0], comm)


register(dispatch_to_experts, combine_from_experts, sorted_layout, dispatch_rows, combine_rows,
         kind="collective", axis="ep", namespace="autopart.ep_ops")
register(local_offsets, kind="local", axis="ep", namespace="autopart.ep_ops")
