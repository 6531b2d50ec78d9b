"""The gradient reducer: after a step's backward, each rank's gradients become those of the plain
model's loss over the global batch; and the global gradient norm over every shard.

Reductions, in order:
  sequence-parallel  replicated weights that saw only a sequence shard (norms, biases): sum over tp
  tied               a parameter used by chunks on several pipeline ranks: sum over those ranks
  data-parallel      dense gradients: sum over the dp replicas (the loss was scaled by
                     1/(microbatches * dp), so the sum is the mean)
  expert             an expert's gradient already holds every token of its ep group: sum over
                     the dp/ep ranks holding the same experts only

Overlap with the backward (zero=0): a gradient whose only reduction is the data-parallel or the
expert sum goes into a bucket of about `bucket_bytes` (25 MiB, DDP's bucket_cap_mb), filled in
the order the backward finishes the gradients, and each bucket's all-reduce is posted
(async_op) as soon as all its gradients are final for the step: after the last backward action
(B, or W for split schedules) of the last microbatch of every chunk on this rank that reads
them. Where autograd accumulates (a fused B), a post-accumulate-grad hook marks each gradient as
it lands, so buckets go out while that backward still runs (a pp=1 model overlaps too); where
the executor accumulates (split programs, W by autograd.grad) the bucket is marked after the
action. Buckets are posted in one fixed order, the same on every replica. The executor waits on
every bucket at the end of its action list (StepBuckets.finish); `reduce` then does the rest as
before: the sequence-parallel and tied sums, and the data-parallel sum of those gradients (a
sum over tp or pp first, so that they add up in the same order as without overlap). zero=1
reduce-scatters everything after the backward: its buckets are ranges of every replica's slice
of the flat order, which the backward does not finish in any order (runtime/optimizer.py).

`all_reduce` is injectable so the reducer is tested without processes.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from autopart.errors import AutopartError
from autopart.ir import Plan

BUCKET_BYTES = 25 * 2 ** 20     # gradient bytes per overlapped all-reduce (DDP's bucket_cap_mb)


def all_reduce_flat(grads: list[torch.Tensor], group, all_reduce: Callable = dist.all_reduce) -> None:
    """Sum `grads` over `group` in one all-reduce (nothing to do without a group)."""
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, group=group)
    _copy_back(flat, grads)


def _copy_back(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class GradientReducer:
    """Reduces and measures the gradients of one rank's parameters (`params`: plain name ->
    Parameter) over the process groups in `groups` (a RankGroups)."""

    def __init__(self, plan: Plan, params: dict[str, torch.nn.Parameter], groups, coords: dict,
                 device: torch.device, all_reduce: Callable = dist.all_reduce,
                 bucket_bytes: int | None = None):
        self.plan, self.params, self.groups, self.coords = plan, params, groups, coords
        self.device, self.all_reduce = device, all_reduce
        # read when the buckets are first laid out; the module's BUCKET_BYTES when not given
        # (tests set it to cut a small model into several buckets)
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        # zero=1: (dense, experts) FlatLayouts (runtime/optimizer.py); their gradients are
        # reduce-scattered over the replicas instead of all-reduced
        self.zero_layouts: tuple = ()
        self._layout: _Layout | None = None     # the buckets, laid out on the first step
        self._running: StepBuckets | None = None    # the step whose buckets the hooks fill
        self._overlapped: frozenset = frozenset()   # names this step's buckets already summed

    def overlap(self, actions, chunks: dict, trace=None) -> "StepBuckets | None":
        """This step's buckets, to be driven by the executor over `actions` (this rank's list)
        and `chunks` (chunk index -> ChunkProgram); None when no gradient can go early."""
        if self.zero_layouts:
            return None
        if self._layout is None:
            self._layout = self._lay_out(actions, chunks)
            for p in {id(p): p for b in self._layout.buckets for p in b.params}.values():
                p.register_post_accumulate_grad_hook(self._landed)
        if not self._layout.buckets:
            return None
        self._running = StepBuckets(self, self._layout, trace)
        return self._running

    def _landed(self, p: torch.Tensor) -> None:
        if self._running is not None:
            self._running.landed(p)

    def _done(self, names: frozenset) -> None:
        """The executor waited on every bucket: `reduce` leaves `names` alone this step."""
        self._running, self._overlapped = None, names

    def _lay_out(self, actions, chunks: dict) -> "_Layout":
        """The buckets of the gradients whose only reduction is their replicas' sum, in the
        order they become final (by action, then the reverse of their chunk's parameter order:
        a backward finishes the last-read weights first), one bucket per group and dtype open
        at a time."""
        last = {a.chunk: i for i, a in enumerate(actions) if a.kind in ("B", "W")}
        final: dict[str, tuple[int, int]] = {}     # name -> (action index, rank in the chunk)
        for c, chunk in chunks.items():
            for k, name in enumerate(reversed(chunk.params)):
                if c in last and self._sum_group(name) is not None:
                    final[name] = max(final.get(name, (-1, 0)), (last[c], k))
        layout, open_buckets = _Layout(), {}
        for name in sorted(final, key=final.__getitem__):
            p, group = self.params[name], self._sum_group(name)
            key = (id(group), p.dtype, p.device)
            bucket = open_buckets.get(key)
            if bucket is None or bucket.nbytes + p.nbytes > self.bucket_bytes:
                bucket = open_buckets[key] = _Bucket(group, len(layout.buckets))
                layout.buckets.append(bucket)
            bucket.add(name, p)
            layout.bucket_of[id(p)] = bucket.index
            layout.final_after.setdefault(final[name][0], []).append(p)
        return layout

    def _sum_group(self, name: str):
        """The group of the one sum `name`'s gradient needs when that is all it needs (the
        data-parallel or the expert sum), else None (also for a frozen or foreign name)."""
        p, groups = self.params.get(name), self.groups
        if p is None or not p.requires_grad or name in groups.shared or \
                (name in self.plan.sp_grad_reduce and groups.tp is not None):
            return None
        return groups.ep_replica if name in self.plan.ep_shards else groups.dp

    def reduce(self) -> None:
        """Turn this step's local gradients into the plain model's (see the module docstring);
        what the step's buckets summed already (StepBuckets) is left as it is."""
        plan, groups = self.plan, self.groups
        done, self._overlapped = self._overlapped, frozenset()
        all_reduce_flat([self.params[n].grad for n in sorted(plan.sp_grad_reduce)
                         if n in self.params and self.params[n].grad is not None],
                        groups.tp, self.all_reduce)
        for name, group in groups.shared.items():
            p = self.params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.all_reduce(p.grad, group=group)
        if self.zero_layouts:
            for layout in self.zero_layouts:
                layout.reduce_scatter_grads()
            return
        left = [(n, p.grad) for n, p in self.params.items() if p.grad is not None and n not in done]
        all_reduce_flat([g for n, g in left if n not in plan.ep_shards], groups.dp, self.all_reduce)
        all_reduce_flat([g for n, g in left if n in plan.ep_shards], groups.ep_replica,
                        self.all_reduce)

    def global_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient: every shard counted once (a tied parameter
        on its first chunk's rank, a replicated weight on tp rank 0, experts over ep). One
        _foreach_norm per kind, the per-tensor norms combined in float64; no host sync."""
        plan, pp, tp = self.plan, self.coords["pp"], self.coords["tp"]
        dense, experts = [], []
        for name, p in self.params.items():
            owner = plan.chunk_ranks[plan.shared_params[name][0]] if name in plan.shared_params \
                else pp
            counted = name in plan.tp_shards or tp == 0
            if p.grad is not None and owner == pp and counted:
                (experts if name in plan.ep_shards else dense).append(p.grad)
        sq, sq_experts = self._sum_of_squares(dense), self._sum_of_squares(experts)
        if self.zero_layouts:   # zero=1: each replica holds the gradient of its slice only
            if self.groups.dp is not None:
                self.all_reduce(sq, group=self.groups.dp)
            if self.groups.ep_replica is not None:
                self.all_reduce(sq_experts, group=self.groups.ep_replica)
        if self.groups.ep is not None:      # each ep rank holds 1/ep of the experts
            self.all_reduce(sq_experts, group=self.groups.ep)
        sq += sq_experts
        if self.groups.model is not None:
            self.all_reduce(sq, group=self.groups.model)
        return sq.sqrt().float()

    def _sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the squared elements of `grads`, float64, on this rank's device."""
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch._foreach_norm(grads)
        return torch.stack([n.to(torch.float64) for n in norms]).square().sum()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so the global norm is at most `max_norm`; return the norm. The
        factor min(1, max_norm / (norm + 1e-6)) stays on the device, as in
        torch.nn.utils.clip_grad_norm_: no host sync."""
        max_norm = check_max_norm(max_norm)     # on every rank, before the norm's collectives
        norm = self.global_norm()
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if grads:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef)
        return norm


@dataclass
class _Bucket:
    """Parameters whose gradients are all-reduced together over `group`."""
    group: object
    index: int
    names: list = field(default_factory=list)
    params: list = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, p: torch.Tensor) -> None:
        self.names.append(name)
        self.params.append(p)
        self.nbytes += p.nbytes


@dataclass
class _Layout:
    buckets: list = field(default_factory=list)
    bucket_of: dict = field(default_factory=dict)      # id(parameter) -> its bucket's index
    final_after: dict = field(default_factory=dict)    # action index -> parameters final then


class StepBuckets:
    """One step's buckets. The executor calls `before(i)` and `after(i)` around action i of
    its list and `finish` at its end; the reducer's hooks call `landed(p)` when autograd
    accumulated p's gradient. A bucket is posted when all its gradients are final and every
    bucket before it was posted."""

    def __init__(self, reducer: GradientReducer, layout: _Layout, trace=None):
        self.reducer, self.layout, self.trace = reducer, layout, trace
        self.missing = [len(b.params) for b in layout.buckets]
        self.armed: dict[int, torch.Tensor] = {}    # id -> parameter final in this action
        self.next = 0                               # the next bucket to post
        self.posted: list = []      # (bucket, work, flat, grads, posted at)

    def before(self, i: int) -> None:
        self.armed = {id(p): p for p in self.layout.final_after.get(i, ())}

    def landed(self, p: torch.Tensor) -> None:
        if self.armed.pop(id(p), None) is not None:
            self._final(p)

    def after(self, i: int) -> None:
        """The action ran: its gradients autograd did not hand to `landed` (accumulated by the
        executor, or none this step) are final too."""
        armed, self.armed = self.armed, {}
        for p in armed.values():
            self._final(p)

    def _final(self, p: torch.Tensor) -> None:
        self.missing[self.layout.bucket_of[id(p)]] -= 1
        while self.next < len(self.missing) and self.missing[self.next] == 0:
            self._post(self.layout.buckets[self.next])
            self.next += 1

    def _post(self, bucket: _Bucket) -> None:
        # a gradient the step did not produce stays None, as without overlap
        grads = [p.grad for p in bucket.params if p.grad is not None]
        if not grads:
            return
        flat = grads[0] if len(grads) == 1 and grads[0].is_contiguous() else \
            torch.cat([g.reshape(-1) for g in grads])
        work = self.reducer.all_reduce(flat, group=bucket.group, async_op=True)
        self.posted.append((bucket, work, flat, grads, time.perf_counter()))

    def finish(self, wait: Callable, now: Callable = time.perf_counter) -> None:
        """Wait on every bucket's work (`wait(work, what)`), each once, and put the sums into
        the gradients; `now()` times the waits for the trace."""
        for bucket in self.layout.buckets[self.next:]:     # none left once every action ran
            self._post(bucket)
        self.next = len(self.layout.buckets)
        for bucket, work, flat, grads, posted in self.posted:
            start = now()
            wait(work, f"was waiting for the gradient all-reduce of bucket {bucket.index} "
                       f"({', '.join(bucket.names[:2])}{', ...' if len(bucket.names) > 2 else ''})")
            if flat is not grads[0]:
                _copy_back(flat, grads)
            if self.trace is not None:
                self.trace.record_reduction(bucket.index, flat.numel(), posted, start, now())
        self.posted = []
        self.reducer._done(frozenset(n for b in self.layout.buckets for n in b.names))


def check_max_norm(max_norm) -> float:
    """`max_norm` as a float; an AutopartError unless it is a positive finite number (a negative
    one would flip every gradient's sign, nan or inf would clip nothing or zero everything)."""
    value = None
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1 and \
            not max_norm.dtype.is_complex and max_norm.dtype != torch.bool:
        value = float(max_norm)
    elif isinstance(max_norm, numbers.Real) and not isinstance(max_norm, bool):
        value = float(max_norm)
    if value is None or not math.isfinite(value) or value <= 0:
        raise AutopartError(
            f"clip_grad_norm_(max_norm={max_norm!r}): max_norm must be a positive finite number"
            f"{'' if value is None else f', got {value}'} (the largest global gradient norm to "
            "keep).\n  remedy: pass e.g. pm.clip_grad_norm_(1.0); leave the call out to not clip")
    return value
