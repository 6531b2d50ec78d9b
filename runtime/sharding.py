"""How ZeRO shards one replica group's parameters: each parameter cut into d chunks (FSDP2's
layout), the rank's slice the concatenation of its chunk of every parameter.

Parameter i, of n_i elements, is flattened and padded to d * c_i elements (c_i = ceil(n_i / d));
replica k owns elements [k * c_i, (k + 1) * c_i) of it. A rank's slice is its chunk of every
parameter laid end to end, in the layout's order: the order the backward finishes the gradients
(runtime/gradients.py `GradientReducer.shard`), cut into segments (a chunk's parameters, then those
that need a sum over tp or pp first), so that a bucket, a range [s, e) of the slice, holds
parameters that are final together. A bucket's collective takes row k = elements [s, e) of
replica k's slice: a reduce-scatter's input and an all-gather's output are one bucket
(d * (e - s) elements), whatever the parameters' sizes.

Why per parameter and not one flat order cut into d ranges (Megatron's distributed optimizer,
autopart's first ZeRO-1): with ranges of one flat order, a bucket holds a piece of every
replica's range, so no bucket is final before the backward is (no overlap), while here every
replica owns a piece of every parameter and a bucket is final when its few parameters are. The
ownership depends on d only, never on the bucket size, so checkpoints (which store the state
per parameter, runtime/checkpoint/zero_state.py) do not depend on either.
"""
from __future__ import annotations

import bisect
import itertools

import torch
import torch.distributed as dist

DEFAULT_BUCKET_SIZE = 40_000_000     # elements per collective (Megatron-LM's default bucket_size)


class ShardLayout:
    """Parameters `names` (in this order) of one replica group; `segments` (lengths in
    parameters, summing to len(names)) are never mixed in one bucket; the first `early`
    parameters (all by default) are those whose gradients may be reduced during the backward;
    `groups` (lengths, each within a segment; default `segments`) are never mixed in one
    reduce-scatter: a layer's gradients go out as soon as that layer's backward is done, while
    the optimizer's buckets (`ranges`) stay as few as the segments and the bucket size allow."""

    def __init__(self, params: dict[str, torch.nn.Parameter], names: list[str], group,
                 bucket_size: int = DEFAULT_BUCKET_SIZE, segments: list[int] | None = None,
                 early: int | None = None, groups: list[int] | None = None):
        self.names, self.group = list(names), group
        self.params = [params[n] for n in self.names]
        self.size = dist.get_world_size(group) if group is not None else 1
        self.index = dist.get_rank(group) if group is not None else 0
        self.numels = [p.numel() for p in self.params]
        self.shapes = [p.shape for p in self.params]    # (zero=3 slices them between uses)
        self.chunks = [-(-n // self.size) for n in self.numels]
        self.offsets = [0, *itertools.accumulate(self.chunks)]     # of each chunk in a slice
        self.shard = self.offsets[-1]
        self.numel = sum(self.numels)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")
        step = max(1, bucket_size // self.size)
        self.ranges = _ranges(self.offsets, segments or [len(self.names)], step)
        # the gradient reduce-scatters' ranges (runtime/gradients.py): the buckets cut further
        self.reduce_ranges = _ranges(self.offsets, groups or segments or [len(self.names)], step)
        self.early = self.offsets[len(self.names) if early is None else early]   # slice offset
        # zero=2: the reduced gradient of this rank's slice (None until a step made one)
        self.grad: torch.Tensor | None = None
        # zero=3 (runtime/param_shards.py): this rank's slice of the parameters, which hold
        # their full values only while a layer uses them, and the ShardedParameters doing it
        self.store: torch.Tensor | None = None
        self.sharded = None

    # -- geometry -------------------------------------------------------------------------
    def pieces(self, a: int, b: int):
        """(i, first, last, at) for each parameter i with slice elements in [a, b): elements
        [first, last) of its chunk are [a + at, a + at + last - first) of the slice."""
        # from the parameter holding slice element a (a bisect, not a scan: read and write call
        # this once per replica for every bucket, each microbatch under zero=2)
        i = max(0, bisect.bisect_right(self.offsets, a) - 1)
        while i < len(self.params) and self.offsets[i] < b:
            lo, hi = max(a, self.offsets[i]), min(b, self.offsets[i + 1])
            if lo < hi:
                yield i, lo - self.offsets[i], hi - self.offsets[i], lo - a
            i += 1

    def read(self, tensors, k: int, a: int, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` with elements [a, a + len(out)) of replica k's slice of `tensors` (one per
        parameter; None and the padding read as zeros); returns `out`."""
        for i, first, last, at in self.pieces(a, a + out.numel()):
            lo, hi = k * self.chunks[i] + first, min(k * self.chunks[i] + last, self.numels[i])
            n, t = max(0, hi - lo), tensors[i]
            if t is None:
                n = 0
            else:
                out[at:at + n].copy_(t.detach().reshape(-1)[lo:lo + n])
            out[at + n:at + last - first].zero_()
        return out

    def write(self, src: torch.Tensor, k: int, a: int, tensors) -> None:
        """Elements [a, a + len(src)) of replica k's slice of `tensors` = `src` (padding
        dropped)."""
        for i, first, last, at in self.pieces(a, a + src.numel()):
            lo, hi = k * self.chunks[i] + first, min(k * self.chunks[i] + last, self.numels[i])
            if lo < hi:
                _write_flat(tensors[i].detach(), lo, hi, src[at:at + hi - lo])

    def own(self, i: int) -> tuple[int, int]:
        """Elements [lo, hi) of parameter i's flattened tensor that this rank owns."""
        lo = min(self.index * self.chunks[i], self.numels[i])
        return lo, min(lo + self.chunks[i], self.numels[i])

    def spans(self):
        """(name, parameter, first, last, at) for each parameter with elements in this rank's
        slice: elements [first, last) of its flattened tensor are slice[at:at + last - first]."""
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            lo, hi = self.own(i)
            if lo < hi:
                yield name, p, lo, hi, self.offsets[i]

    def by_name(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every replica's slice concatenated (`gather`'s result) as one tensor per parameter."""
        rows = full.view(self.size, self.shard)
        return {name: rows[:, self.offsets[i]:self.offsets[i + 1]].reshape(-1)[:self.numels[i]]
                .view(self.shapes[i]) for i, name in enumerate(self.names)}

    def slice_of(self, tensors, dtype=None) -> torch.Tensor:
        """This rank's slice of `tensors` (one per parameter, None: zeros) laid end to end."""
        dtype = dtype or next((t.dtype for t in tensors if t is not None), self.dtype)
        out = torch.empty(self.shard, dtype=dtype, device=self.device)
        return self.read(tensors, self.index, 0, out)

    def own_values(self, dtype=None) -> torch.Tensor:
        """This rank's slice of the parameters' values: zero=3's store, else read from them."""
        if self.store is not None:
            return self.store.to(dtype or self.store.dtype)
        return self.slice_of(self.params, dtype)

    def grad_views(self) -> dict[str, torch.Tensor]:
        """zero=2: {name: this rank's part of its reduced gradient} (views of the slice)."""
        if self.grad is None:
            return {}
        return {name: self.grad[at:at + hi - lo] for name, _, lo, hi, at in self.spans()}

    def grad_range(self, s: int, e: int) -> torch.Tensor:
        """The fp32 gradient of slice elements [s, e): the zero=2 slice, or (zero=1) read from
        the parameters' full-shaped `.grad`."""
        if self.grad is not None:
            return self.grad[s:e].float()
        out = torch.empty(e - s, dtype=torch.float32, device=self.device)
        return self.read([p.grad for p in self.params], self.index, s, out)

    # -- collectives ----------------------------------------------------------------------
    def post_reduce_scatter(self, s: int, e: int, async_op: bool = True):
        """Post the sum over the group of slice range [s, e) of the gradients: (work or None,
        this rank's row, the whole input); the row holds the sum once the work completes."""
        n, grads = e - s, [p.grad for p in self.params]
        dtype = next((g.dtype for g in grads if g is not None), self.dtype)
        bucket = torch.empty(self.size * n, dtype=dtype, device=self.device)
        whole = self._whole(s, e)
        if whole is not None and all(g is not None and g.dtype == dtype for g in grads[whole]):
            # whole parameters (a layer group): one op lays out every replica's row, each
            # gradient cut in `size` chunks, zero-padded (FSDP2's copy-in), not a copy per
            # parameter and replica
            torch._chunk_cat([g.detach().reshape(-1) for g in grads[whole]], 0, self.size,
                             out=bucket.view(self.size, n))
        else:
            for k in range(self.size):
                self.read(grads, k, s, bucket[k * n:(k + 1) * n])
        mine = bucket[self.index * n:(self.index + 1) * n]
        work = None
        if self.group is not None:   # in place: this rank's row receives the sum (NCCL's form)
            work = dist.reduce_scatter_tensor(mine, bucket, group=self.group, async_op=async_op)
        return work, mine, bucket

    def _whole(self, s: int, e: int) -> slice | None:
        """The parameters whose chunks are exactly slice range [s, e) (several), else None."""
        i, j = bisect.bisect_left(self.offsets, s), bisect.bisect_left(self.offsets, e)
        if j < len(self.offsets) and self.offsets[i] == s and self.offsets[j] == e and i < j:
            return slice(i, j)
        return None

    def take_reduced(self, s: int, mine: torch.Tensor, keep_full: bool) -> None:
        """A waited reduce-scatter's row: into the parameters' `.grad` (zero=1: full-shaped,
        this rank's chunks hold the sum) or added to the slice gradient (zero=2)."""
        if keep_full:
            self.write(mine, self.index, s, [p.grad for p in self.params])
            return
        if self.grad is None:
            self.grad = torch.zeros(self.shard, dtype=mine.dtype, device=self.device)
        self.grad[s:s + mine.numel()] += mine

    def keep_own(self) -> None:
        """zero=1: zero every element of `.grad` this rank does not own."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                lo, hi = self.own(i)
                flat = p.grad.view(-1)
                flat[:lo].zero_()
                flat[hi:].zero_()

    def all_gather_params(self, mine: torch.Tensor) -> None:
        """Every replica's updated slice into the parameters, one bucket at a time."""
        for s, e in self.ranges:
            n = e - s
            piece = mine[s:e].to(self.dtype).contiguous()
            full = piece
            if self.group is not None:
                full = torch.empty(self.size * n, dtype=piece.dtype, device=piece.device)
                dist.all_gather_into_tensor(full, piece, group=self.group)
            for k in range(self.size):
                self.write(full[k * n:(k + 1) * n], k, s, self.params)
            del piece, full     # before the next bucket's: one bucket alive at a time

    def gather(self, mine: torch.Tensor) -> torch.Tensor | None:
        """Every replica's slice, concatenated, on the group's first rank; None on the others."""
        if self.group is None:
            return mine.clone()
        first = dist.get_global_rank(self.group, 0)
        parts = [torch.empty_like(mine) for _ in range(self.size)] if self.index == 0 else None
        dist.gather(mine.contiguous(), parts, dst=first, group=self.group)
        return torch.cat(parts) if parts is not None else None


def _ranges(offsets: list[int], segments: list[int], step: int) -> list[tuple[int, int]]:
    """Buckets [s, e) of at most `step` slice elements, none crossing a segment's end; one
    (empty) bucket when the slice is empty."""
    out, first = [], 0
    for count in segments:
        lo, hi = offsets[first], offsets[first + count]
        out += [(s, min(s + step, hi)) for s in range(lo, hi, step)]
        first += count
    return out or [(0, 0)]


def _write_flat(t: torch.Tensor, first: int, last: int, src: torch.Tensor) -> None:
    """Elements [first, last) of `t` flattened (row-major) = `src`."""
    if t.is_contiguous():
        t.view(-1)[first:last].copy_(src)
    else:   # e.g. a strided shard: through a copy
        flat = t.reshape(-1)
        flat[first:last].copy_(src)
        t.copy_(flat.view_as(t))


__all__ = ["DEFAULT_BUCKET_SIZE", "ShardLayout"]
