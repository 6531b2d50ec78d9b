"""Tensor-parallel collectives as differentiable graph ops (Megatron-LM's f, g and friends).

Each op takes a `TPComm`, a small module every tensor-parallel program holds as `self.tp_comm`;
the runtime binds it to this rank's tensor-parallel process group. Nothing here is global.

    copy_to_tp          forward identity,   backward all-reduce   (Megatron's f)
    reduce_from_tp      forward all-reduce, backward identity     (Megatron's g)
    gather_from_tp      forward all-gather, backward split
    scatter_to_tp       forward split (per section, optionally), backward all-gather
    reduce_scatter_tp   forward reduce-scatter, backward all-gather (sequence parallelism)
    gather_linear_sp    all-gather along the sequence then linear; backward re-gathers the input
                        instead of keeping the gathered copy (sequence parallelism's memory saving),
                        each backward collective running behind a matmul
    copy_linears_tp     copy_to_tp then the linears that read it (passes/overlap_collectives.py):
                        backward all-reduces the input gradient while the weight gradients compute
    vocab_parallel_embedding / vocab_parallel_cross_entropy: the vocabulary split over tp ranks
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopart.ops.comm import GroupComm
from autopart.ops.registry import register


class TPComm(GroupComm):
    """This program's tensor-parallel group: size, this rank's index in it, the process group."""

    axis = "tensor-parallel"


# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases have the old names.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _finish(*_start_all_reduce(x, comm))


def _all_gather(x: torch.Tensor, dim: int, comm: TPComm) -> torch.Tensor:
    return _finish(*_start_all_gather(x, dim, comm))


def _reduce_scatter(x: torch.Tensor, dim: int, comm: TPComm) -> torch.Tensor:
    return _finish(*_start_reduce_scatter(x, dim, comm))


# The started forms return (work or None, out, dim): the caller computes, then _finish waits.
# Under NCCL wait() orders the compute stream after the collective without blocking the host;
# under Gloo it blocks until the collective, which ran meanwhile, is done.
def _start_all_gather(x: torch.Tensor, dim: int, comm: TPComm):
    comm._check()
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((comm.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather_into(out, x, group=comm.group, async_op=True) if comm.moves_data else None
    return work, out, dim


def _start_reduce_scatter(x: torch.Tensor, dim: int, comm: TPComm):
    comm._check()
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // comm.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _reduce_scatter_into(out, x, group=comm.group, async_op=True) if comm.moves_data \
        else None
    return work, out, dim


def _start_all_reduce(x: torch.Tensor, comm: TPComm):
    comm._check()
    x = x.contiguous().clone()
    work = dist.all_reduce(x, group=comm.group, async_op=True) if comm.moves_data else None
    return work, x, None


def _finish(work, out: torch.Tensor, dim) -> torch.Tensor:
    if work is not None:
        work.wait()
    return out if dim is None else out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, comm: TPComm, sections=None) -> torch.Tensor:
    if sections:        # this rank's 1/tp of each section, side by side (a fused projection's)
        return torch.cat([part.chunk(comm.size, dim=dim)[comm.rank]
                          for part in x.split(list(sections), dim=dim)], dim=dim)
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


def _gather_sections(g: torch.Tensor, dim: int, comm: TPComm, sections) -> torch.Tensor:
    """The inverse of _split with sections: every rank's parts of each section, in order."""
    full = _all_gather(g, dim, comm).chunk(comm.size, dim=dim)      # per rank: its parts
    local = [v // comm.size for v in sections]
    per_rank = [r.split(local, dim=dim) for r in full]
    return torch.cat([r[i] for i in range(len(local)) for r in per_rank], dim=dim)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.comm), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _all_gather(x, dim, comm)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.dim, ctx.comm), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, sections):
        ctx.dim, ctx.comm, ctx.sections = dim, comm, sections
        return _split(x, dim, comm, sections)

    @staticmethod
    def backward(ctx, g):
        if ctx.sections:
            return _gather_sections(g, ctx.dim, ctx.comm, ctx.sections), None, None, None
        return _all_gather(g, ctx.dim, ctx.comm), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _reduce_scatter(x, dim, comm)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.comm), None, None


class _GatherLinear(torch.autograd.Function):
    """y = linear(all_gather(x, dim), w, b), saving only the local shard of x."""

    @staticmethod
    def forward(ctx, x, w, b, dim, comm):
        ctx.dim, ctx.comm, ctx.has_bias = dim, comm, b is not None
        ctx.save_for_backward(x, w)
        return F.linear(_all_gather(x, dim, comm), w, b)

    @staticmethod
    def backward(ctx, g):
        # Megatron-LM's order: the input's re-gather runs behind the input-gradient matmul,
        # the input gradient's reduce-scatter behind the weight-gradient matmul
        x, w = ctx.saved_tensors
        gathering = _start_all_gather(x, ctx.dim, ctx.comm)   # re-gathered, not kept
        grad_full = g @ w
        full = _finish(*gathering)
        scattering = _start_reduce_scatter(grad_full, ctx.dim, ctx.comm)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return _finish(*scattering), grad_w, grad_b, None, None


class _CopyLinears(torch.autograd.Function):
    """linear(copy_to_tp(x), w_i, b_i) for each (w_i, b_i): Megatron's f and the column-parallel
    linears that read it, with its overlapped backward (LinearWithGradAccumulationAndAsync-
    Communication): the input gradient, summed over the linears, is all-reduced while their
    weight gradients are computed. The same matmuls, in autograd's order, as the unfused ops."""

    @staticmethod
    def forward(ctx, x, comm, *weights_and_biases):
        ws, bs = weights_and_biases[0::2], weights_and_biases[1::2]
        ctx.comm, ctx.has_bias = comm, tuple(b is not None for b in bs)
        ctx.save_for_backward(x, *ws)
        return tuple(F.linear(x, w, b) for w, b in zip(ws, bs))

    @staticmethod
    def backward(ctx, *gs):
        x, *ws = ctx.saved_tensors
        grad_x = None
        for g, w in reversed(list(zip(gs, ws))):   # autograd sums the last linear's first
            grad_x = g @ w if grad_x is None else grad_x + g @ w
        reducing = _start_all_reduce(grad_x, ctx.comm)
        flat = x.reshape(-1, x.shape[-1])
        grads = []
        for g, has_bias in zip(gs, ctx.has_bias):
            g2 = g.reshape(-1, g.shape[-1])
            grads += [g2.t() @ flat, g2.sum(0) if has_bias else None]
        return (_finish(*reducing), None, *grads)


def copy_to_tp(x, comm):
    return _Copy.apply(x, comm)


def reduce_from_tp(x, comm):
    return _Reduce.apply(x, comm)


def gather_from_tp(x, dim, comm):
    return _Gather.apply(x, dim, comm)


def scatter_to_tp(x, dim, comm, sections=None):
    """This rank's 1/tp of x along dim; with sections, its 1/tp of each section side by side
    (what meets a rank's shard of a projection cut in sections)."""
    return _Scatter.apply(x, dim, comm, tuple(sections) if sections else None)


def reduce_scatter_tp(x, dim, comm):
    return _ReduceScatter.apply(x, dim, comm)


def gather_linear_sp(x, w, b, dim, comm):
    return _GatherLinear.apply(x, w, b, dim, comm)


def copy_linears_tp(x, comm, *weights_and_biases):
    """(linear(x, w_0, b_0), ...) after copy_to_tp(x): arguments w_0, b_0, w_1, b_1, ... (a bias
    may be None); backward all-reduces x's gradient behind the weight gradients."""
    return _CopyLinears.apply(x, comm, *weights_and_biases)


def vocab_parallel_embedding(weight: torch.Tensor, idx: torch.Tensor, comm,
                             padding_idx: int | None = None) -> torch.Tensor:
    """This rank's rows of the table: ids outside them look up zeros (summed over tp after).
    The row of `padding_idx` (global id) gets no gradient, as in nn.Embedding."""
    start = comm.rank * weight.shape[0]
    local = idx - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    if padding_idx is not None:
        out = torch.where((idx == padding_idx).unsqueeze(-1), out.detach(), out)
    return out


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, never gathering them (Megatron)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, comm, reduction="mean"):
        comm._check()
        logits = logits.float()
        vocab = logits.shape[-1]
        start = comm.rank * vocab
        peak = logits.max(dim=-1).values
        if comm.moves_data:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=comm.group)
        shifted = logits - peak.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= vocab)
        local = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        both = torch.stack([exp.sum(-1), picked])
        if comm.moves_data:
            dist.all_reduce(both, group=comm.group)
        sum_exp, picked = both[0], both[1]
        keep = target != ignore_index
        # "sum" (weigh_loss_by_tokens): the runtime divides by the global count
        count = keep.sum().clamp(min=1) if reduction == "mean" else torch.ones((), device=keep.device)
        loss = ((sum_exp.log() - picked) * keep).sum() / count
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, outside, keep)
        ctx.count = count
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local, outside, keep = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        grad = grad * (keep.unsqueeze(-1) * (g / ctx.count))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, comm, ignore_index: int = -100,
                                 reduction: str = "mean"):
    """Cross-entropy of logits[..., V/tp] (this rank's vocabulary slice) against target: the
    mean over the targets that are not ignore_index, or (reduction="sum") their sum."""
    return _VocabParallelCE.apply(logits, target, ignore_index, comm, reduction)


register(reduce_from_tp, gather_from_tp, scatter_to_tp, reduce_scatter_tp,
         vocab_parallel_embedding, vocab_parallel_cross_entropy,
         kind="collective", axis="tp", namespace="autopart.tp_ops")
register(copy_to_tp, gather_linear_sp, copy_linears_tp, kind="collective", axis="tp",
         namespace="autopart.tp_ops", before_linear=True)
