"""Gradient buckets reduced while the backward runs: which parameters go together, when a bucket
is final, and one step's driving of them (runtime/gradients.py lays them out, the executor tells
StepBuckets before and after each compute action).

Two kinds of bucket: an all-reduce of whole gradients (zero=0, about 25 MiB each, in the order
the backward finishes them; the gradients are views of the bucket's buffer, summed in place), and a reduce-scatter of a range of the ZeRO slices
(runtime/sharding.py: zero=1 and zero=2). Two timings: once per step, after the last backward
action of the last microbatch of every chunk that reads a bucket's parameters (zero=0, zero=1:
the gradients are accumulated over the microbatches first, as Megatron-LM does); or after every
backward action of the bucket's chunk (zero=2: each microbatch's gradient is reduce-scattered
into the slice as the backward produces it and the full-shaped gradient freed, as FSDP and
DeepSpeed's ZeRO-2 do: more traffic, but the rank never holds a whole gradient between
microbatches). Buckets go out in one fixed order, the same on every replica.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

# ZeRO buckets posted and not yet waited on, at most: each one's input is a copy of its range of
# every replica's slice, so without a bound zero=1's last backward would hold a second copy of
# the whole gradient (zero=0's all-reduce sums the gradients themselves where a bucket is one)
IN_FLIGHT = 2


@dataclass
class Bucket:
    """Gradients reduced together over `group`: all-reduced whole, or (`shards` = (layout, s,
    e)) slice range [s, e) of a ShardLayout reduce-scattered."""
    group: object
    index: int
    names: list = field(default_factory=list)
    params: list = field(default_factory=list)
    nbytes: int = 0
    shards: tuple | None = None
    # zero=0: the buffer its all-reduce sums in place, kept across steps; the gradients are
    # made views of it (bucket_views), as DDP's gradient_as_bucket_view
    flat: torch.Tensor | None = None

    def add(self, name: str, p: torch.Tensor) -> None:
        self.names.append(name)
        self.params.append(p)
        self.nbytes += p.nbytes


@dataclass
class BucketLayout:
    buckets: list = field(default_factory=list)
    buckets_of: dict = field(default_factory=dict)     # id(parameter) -> its buckets' indices
    final_after: dict = field(default_factory=dict)    # action index -> parameters final then
    # every-backward timing (zero=2): action index -> the buckets that action finishes; the
    # full-shaped gradients are freed once posted
    window_after: dict = field(default_factory=dict)

    def place(self, bucket: Bucket) -> None:
        self.buckets.append(bucket)
        for p in bucket.params:
            self.buckets_of.setdefault(id(p), []).append(bucket.index)


class StepBuckets:
    """One step's buckets. The executor calls `bind(wait, now)` first, `before(i)` and
    `after(i)` around action i of its list and `finish` at its end; autograd hooks call
    `landed(p)` when p's gradient was accumulated. A bucket is posted when all its gradients
    are final and every bucket before it (in its window) was posted."""

    def __init__(self, layout: BucketLayout, all_reduce: Callable, trace=None):
        self.layout, self.all_reduce, self.trace = layout, all_reduce, trace
        self.every_backward = bool(layout.window_after)
        self.wait: Callable = lambda work, what: work.wait()
        self.now: Callable = time.perf_counter
        self._open(list(range(len(layout.buckets))))
        self.armed: dict[int, torch.Tensor] = {}    # id -> parameter final in this action
        self.posted: list = []      # (bucket, work, result, what to copy back, posted at)

    def bind(self, wait: Callable, now: Callable) -> None:
        """How a work is waited on (failures named as the executor names them) and timed."""
        self.wait, self.now = wait, now

    def _open(self, window: list[int]) -> None:
        buckets = self.layout.buckets
        self.window, self.next = window, 0
        self.missing = {b: len(buckets[b].params) for b in window}
        self.unposted: dict[int, int] = {}     # id(p) -> its buckets in the window not posted
        for b in window:
            for p in buckets[b].params:
                self.unposted[id(p)] = self.unposted.get(id(p), 0) + 1

    def before(self, i: int) -> None:
        window = self.layout.window_after.get(i)
        if window is not None:      # zero=2: the previous backward's reductions land first
            self.settle()
            self._open(window)
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
        for b in self.layout.buckets_of[id(p)]:
            if b in self.missing:
                self.missing[b] -= 1
        while self.next < len(self.window) and self.missing[self.window[self.next]] == 0:
            self._post(self.layout.buckets[self.window[self.next]])
            self.next += 1

    def _post(self, bucket: Bucket) -> None:
        # a gradient the step did not produce stays None, as without overlap
        grads = [p.grad for p in bucket.params if p.grad is not None]
        if grads and bucket.shards is not None:
            if len(self.posted) >= IN_FLIGHT:     # its input is a copy: bound the copies
                self.settle(keep=IN_FLIGHT - 1)     # the oldest: the newer ones still run
            lay, s, e = bucket.shards
            work, mine, _ = lay.post_reduce_scatter(s, e)
            self.posted.append((bucket, work, mine, None, time.perf_counter()))
        elif grads:
            flat = grads[0] if len(bucket.params) == 1 and grads[0].is_contiguous() else \
                bucket_views(bucket)
            work = self.all_reduce(flat, group=bucket.group, async_op=True)
            self.posted.append((bucket, work, flat, None, time.perf_counter()))
        if self.every_backward:     # zero=2: the slice rows were copied out; free the rest
            for p in bucket.params:
                self.unposted[id(p)] -= 1
                if self.unposted[id(p)] == 0:
                    p.grad = None

    def settle(self, keep: int = 0) -> None:
        """Wait on every posted bucket's work but the `keep` newest, each once, in posting
        order, and put the sums where they belong."""
        done = self.posted[:len(self.posted) - keep]
        self.posted = self.posted[len(done):]
        for bucket, work, result, grads, posted in done:
            start = self.now()
            if work is not None:        # the text is formatted only if the wait fails
                self.wait(work, _Waiting(bucket))
            if bucket.shards is not None:
                lay, s, _ = bucket.shards
                lay.take_reduced(s, result, keep_full=not self.every_backward)
            if self.trace is not None:
                self.trace.record_reduction(bucket.index, result.numel(), posted, start,
                                            self.now())

    def finish(self, wait: Callable | None = None, now: Callable | None = None) -> None:
        """Post what is left, then wait on every bucket (see `settle`)."""
        if wait is not None:
            self.bind(wait, now or self.now)
        for b in self.window[self.next:]:     # none left once every action ran
            self._post(self.layout.buckets[b])
        self.next = len(self.window)
        self.settle()


class _Waiting:
    """What a rank was doing when a bucket's wait failed: formatted only then (a step waits on
    every bucket; formatting each would cost every step)."""

    def __init__(self, bucket: Bucket):
        self.bucket = bucket

    def __str__(self) -> str:
        names = self.bucket.names
        return (f"was waiting for the gradient reduction of bucket {self.bucket.index} "
                f"({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})")


def bucket_views(bucket: Bucket) -> torch.Tensor:
    """`bucket.flat` holding its parameters' gradients, each `.grad` made a view of its range:
    the all-reduce then sums the gradients themselves, with no concatenation before it and no
    copy back after (DDP's gradient_as_bucket_view). A gradient autograd made anew this step
    (optimizers set .grad to None) is copied in once; one already a view is left as it is. A
    parameter with no gradient this step keeps None, its range zeroed, so every replica sums
    the same layout."""
    if bucket.flat is None:
        first = bucket.params[0]
        bucket.flat = torch.empty(sum(p.numel() for p in bucket.params), dtype=first.dtype,
                                  device=first.device)
    offset = 0
    for p in bucket.params:
        view = bucket.flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is None:
            view.zero_()
        elif not _same_memory(p.grad, view):
            view.copy_(p.grad)
            p.grad = view
    return bucket.flat


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def in_a_bucket(grad: torch.Tensor, layout: BucketLayout | None) -> bool:
    """Whether `grad` is a view of one of `layout`'s bucket buffers (the next step's reduction
    overwrites those)."""
    storage = grad.untyped_storage().data_ptr()
    return layout is not None and any(b.flat is not None and
                                      b.flat.untyped_storage().data_ptr() == storage
                                      for b in layout.buckets)


def copy_back(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


__all__ = ["Bucket", "BucketLayout", "StepBuckets", "bucket_views", "copy_back", "in_a_bucket"]
