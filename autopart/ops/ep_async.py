"""The expert-parallel all-to-alls split into a start and a wait (passes/overlap_experts.py).

`ops/ep.py`'s dispatch and combine post their all-to-all and wait for it in one op. Here each is
two graph nodes, so a program can run other work between them (another microbatch's attention,
routing or experts: Megatron-Core's combined 1F1B, DeepSeek's two-microbatch overlap):

    h = dispatch_start(x, comm)          posts the all-to-all (async_op=True), returns a Pending
    y = ep_wait(h)                       waits for it; y is what dispatch_to_experts(x) returns

and likewise combine_start, dispatch_rows_start, combine_rows_start. The backward mirrors it:
ep_wait's backward posts the inverse all-to-all of the gradient and returns at once; the start's
backward waits for it. Autograd runs ready nodes latest-created first, so what the forward ran
between start and wait (the other microbatch's ops, created between them) runs between the
backward's post and its wait too.

Same values as ops/ep.py (the same all-to-alls of the same tensors, the same row plans); the
buffers are read only after their work was waited on, so NCCL's contract (a buffer holds the data
only after wait) is kept: tests/test_nccl_contract.py runs it under tests/nccl_contract.py.
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from autopart.ops.ep import EPComm, _row_plan
from autopart.ops.registry import register


class Pending:
    """One posted all-to-all of a dispatch or combine: the forward's work and receive buffer,
    the backward's, and how to turn the buffers into the op's result (`post`) and back."""

    __slots__ = ("comm", "form", "work", "buf", "bwork", "bbuf", "after_post")

    def __init__(self, comm: EPComm, form: "_Form"):
        self.comm, self.form = comm, form
        self.work = self.buf = self.bwork = self.bbuf = None
        # set by the runtime for a combined forward-backward (runtime/compute.py
        # forward_backward): run after the backward posted this gradient's all-to-all, before
        # it is waited on (the other microbatch's forward, up to its next post)
        self.after_post = None


class _Form:
    """What surrounds one all-to-all: `pre` (the input as sent), its split sizes, `post` (the
    received buffer as the op's result) and the inverses the backward runs."""

    def __init__(self, pre, post, post_back, pre_back, splits=(None, None)):
        self.pre, self.post, self.post_back, self.pre_back = pre, post, post_back, pre_back
        self.out_splits, self.in_splits = splits


def _post(x: torch.Tensor, out: torch.Tensor, out_splits, in_splits, comm: EPComm):
    comm._check()
    if not comm.moves_data:
        return None
    return dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                                  input_split_sizes=in_splits, group=comm.group, async_op=True)


def _wait(work) -> None:
    if work is not None:
        work.wait()


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p: Pending, out_rows):
        ctx.p = p
        send = p.form.pre(x)
        p.buf = send.new_empty((out_rows, *send.shape[1:]) if out_rows is not None else send.shape)
        p.work = _post(send, p.buf, p.form.out_splits, p.form.in_splits, p.comm)
        return p.buf

    @staticmethod
    def backward(ctx, _):
        p = ctx.p
        _wait(p.bwork)          # posted by ep_wait's backward, with other work run since
        return p.form.pre_back(p.bbuf), None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf, p: Pending):
        ctx.p = p
        _wait(p.work)
        p.work = None
        return p.form.post(buf)

    @staticmethod
    def backward(ctx, g):
        p = ctx.p
        send = p.form.post_back(g).contiguous()     # shaped as the forward's receive buffer
        p.bbuf = send.new_empty((sum(p.form.in_splits), *send.shape[1:])
                                if p.form.in_splits is not None else send.shape)
        p.bwork = _post(send, p.bbuf, p.form.in_splits, p.form.out_splits, p.comm)
        if p.after_post is not None:
            p.after_post()
        return send, None       # its value is not read: the start's backward reads p.bbuf


def _start(x: torch.Tensor, comm: EPComm, form: _Form, out_rows=None) -> Pending:
    p = Pending(comm, form)
    p.buf = _Start.apply(x, p, out_rows)
    return p


def ep_wait(p: Pending) -> torch.Tensor:
    """The result of the all-to-all `p` (dispatch_start ...), once it arrived."""
    return _Wait.apply(p.buf, p)


def dispatch_start(x: torch.Tensor, comm: EPComm) -> Pending:
    """dispatch_to_experts(x) posted: [E, N, ...] -> (at ep_wait) [E/ep, ep*N, ...]."""
    ep, E, N, rest = comm.size, x.shape[0], x.shape[1], tuple(x.shape[2:])
    return _start(x, comm, _Form(
        pre=lambda t: t.contiguous(),
        post=lambda t: t.view(ep, E // ep, N, *rest).transpose(0, 1).reshape(E // ep, ep * N,
                                                                               *rest),
        post_back=lambda g: g.view(E // ep, ep, N, *rest).transpose(0, 1).reshape(E, N, *rest),
        pre_back=lambda t: t))


def combine_start(y: torch.Tensor, comm: EPComm) -> Pending:
    """combine_from_experts(y) posted: [E/ep, ep*N, ...] -> (at ep_wait) [E, N, ...]."""
    ep, local, rest = comm.size, y.shape[0], tuple(y.shape[2:])
    N = y.shape[1] // ep
    return _start(y, comm, _Form(
        pre=lambda t: t.view(local, ep, N, *rest).transpose(0, 1).contiguous(),
        post=lambda t: t.view(ep * local, N, *rest),
        post_back=lambda g: g.view(ep, local, N, *rest),
        pre_back=lambda t: t.transpose(0, 1).reshape(local, ep * N, *rest)))


def _plan(offsets: torch.Tensor, layout: torch.Tensor, comm: EPComm):
    """ops/ep.py's row plan, once per (offsets, layout): the combine of the same rows reuses
    the dispatch's, also with another microbatch's dispatch between them (two kept per
    microbatch in flight; ops/ep.py keeps one)."""
    memo = comm.__dict__.setdefault("_async_plans", collections.deque(maxlen=8))
    for o, lay, plan in memo:
        if o is offsets and lay is layout:
            return plan
    plan = _row_plan(offsets, layout, comm.size)
    memo.append((offsets, layout, plan))
    return plan


def dispatch_rows_start(x: torch.Tensor, offsets: torch.Tensor, layout: torch.Tensor,
                        comm: EPComm) -> Pending:
    """dispatch_rows(x, offsets, layout) posted: rows sorted by expert -> this rank's experts'."""
    send, recv, perm = _plan(offsets, layout, comm)
    rows = x.shape[0]
    return _start(x, comm, _Form(pre=lambda t: t[:sum(send)], post=lambda t: t[perm],
                                 post_back=lambda g: _unpermuted(g, perm),
                                 pre_back=lambda t: _padded(t, rows), splits=(recv, send)),
                  sum(recv))


def combine_rows_start(y: torch.Tensor, offsets: torch.Tensor, layout: torch.Tensor,
                       like: torch.Tensor, comm: EPComm) -> Pending:
    """combine_rows(y, offsets, layout, like) posted: the inverse of dispatch_rows_start."""
    send, recv, perm = _plan(offsets, layout, comm)
    rows = like.shape[0]
    return _start(y, comm, _Form(pre=lambda t: _unpermuted(t, perm),
                                 post=lambda t: _padded(t, rows),
                                 post_back=lambda g: g[:sum(send)], pre_back=lambda t: t[perm],
                                 splits=(send, recv)), sum(send))


def _unpermuted(t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The rows of `t` back in arrival order (the inverse of t[perm])."""
    out = torch.empty_like(t)
    out[perm] = t
    return out


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows up to `rows` (the rows assigned to no expert)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


STARTS = (dispatch_start, combine_start, dispatch_rows_start, combine_rows_start)

register(*STARTS, ep_wait, kind="collective", axis="ep", namespace="autopart.ep_ops")
