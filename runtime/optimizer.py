"""The distributed optimizer (ZeRO-1, Megatron-LM's distributed optimizer layout).

    pm = autopart.parallelize(model, mesh, ..., zero=1)
    opt = pm.optimizer(torch.optim.AdamW, lr=3e-4)      # any element-wise torch optimizer
    pm.train_step(x, target=y); opt.step(); opt.zero_grad()

The parameters a rank shares with its data-parallel replicas are laid end to end in one flat
order (sorted by name, padded to a multiple of the replica count d); replica i owns elements
[i*n/d, (i+1)*n/d) of it. Expert parameters form a second flat order over their own replica
group (the ranks holding the same experts). After backward the gradient reducer
reduce-scatters the gradients instead of all-reducing them, so each replica receives the
summed gradient of its own 1/d slice; `.grad` of every parameter is then full-shaped with the
reduced gradient in the elements of this rank's slice and zeros elsewhere (clipping and
accumulation act on it as usual). `step` runs the user's optimizer class on this rank's fp32
slice (its state, Adam's two moments, is 1/d of the plain optimizer's), then all-gathers the
updated slices into the parameters: a reduce-scatter plus an all-gather move the same bytes as
the all-reduce they replace. Checkpoints store the state per parameter, as the plain optimizer
holds it (gather_state_by_parameter, load_slices; the mapping is in runtime/checkpoint/), so
they load at any zero level.

Buckets (`parallelize(..., zero_bucket_size=)`, elements, default 40M as Megatron-LM's
bucket_size): the flat order is never built whole. A bucket is the same range [s, e) of every
replica's slice, so each collective takes the d pieces [k*n/d + s, k*n/d + e) copied from (or
into) the parameters' own tensors: a reduce-scatter's input, an all-gather's output, and the
optimizer's tensors (one per bucket, views of the slice, stepped one bucket at a time) are one
bucket each, and a rank's transient memory is one bucket, not its whole parameter set three
times over. Taking the same range of every slice (rather than Megatron's cut of each
bucket into d parts) keeps the ownership above, so checkpoints do not depend on the bucket size.

Why not torch.distributed.optim.ZeroRedundancyOptimizer: it assigns whole parameters to ranks
(a sorted-greedy partition), so a rank's share is uneven (one 50k x 1k embedding outweighs a
layer); it reduces no gradient itself, expecting DDP's full all-reduce before it; it broadcasts
each owner's updated parameters; and it knows one process group, while autopart's dense and
expert parameters replicate over different groups.
"""
from __future__ import annotations

import bisect
import itertools

import torch
import torch.distributed as dist

from autopart.errors import AutopartError

DEFAULT_BUCKET_SIZE = 40_000_000     # elements per collective (Megatron-LM's default bucket_size)


def check_bucket_size(bucket_size, zero: int) -> int:
    """`zero_bucket_size` as given to parallelize, or the default; a clear error otherwise."""
    if bucket_size is None:
        return DEFAULT_BUCKET_SIZE
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise AutopartError(f"zero_bucket_size={bucket_size!r}: expected a positive number of "
                            "gradient elements per reduce-scatter / all-gather.\n  remedy: an "
                            f"int such as {DEFAULT_BUCKET_SIZE} (the default), or leave it out")
    if not zero:
        raise AutopartError(f"zero_bucket_size={bucket_size} sizes the buckets of zero=1's "
                            "reduce-scatter and all-gather, but zero=0 has none.\n  remedy: "
                            "pass zero=1, or leave zero_bucket_size out")
    return bucket_size


class FlatLayout:
    """Parameters `names` of one replica group laid end to end; this rank's slice of them, cut
    into buckets of `bucket_size` elements over the group (bucket_size // d of each slice)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], names: list[str], group,
                 bucket_size: int = DEFAULT_BUCKET_SIZE):
        self.names, self.group = sorted(names), group
        self.params = [params[n] for n in self.names]
        self.size = dist.get_world_size(group) if group is not None else 1
        self.index = dist.get_rank(group) if group is not None else 0
        self.offsets = [0, *itertools.accumulate(p.numel() for p in self.params)]
        self.numel = self.offsets[-1]
        self.padded = -(-self.numel // self.size) * self.size
        self.shard = self.padded // self.size
        self.lo, self.hi = self.index * self.shard, (self.index + 1) * self.shard
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")
        step = max(1, bucket_size // self.size)
        # [s, e) of every replica's slice; one (empty) bucket when the slice is empty
        self.ranges = [(s, min(s + step, self.shard)) for s in range(0, self.shard, step)] \
            or [(0, 0)]

    def pieces(self, a: int, b: int):
        """(i, first, last, at) for each parameter i with elements in [a, b) of the flat order:
        elements [first, last) of its flattened tensor are [a + at, a + at + last - first)."""
        i = max(0, bisect.bisect_right(self.offsets, a) - 1)
        while i < len(self.params) and self.offsets[i] < b:
            o = self.offsets[i]
            first, last = max(a, o) - o, min(b, self.offsets[i + 1]) - o
            if first < last:
                yield i, first, last, o + first - a
            i += 1

    def read(self, tensors, a: int, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` with elements [a, a + len(out)) of `tensors` laid end to end (a None
        tensor and the padding read as zeros); returns `out`."""
        end = a + out.numel()
        for i, first, last, at in self.pieces(a, end):
            t = tensors[i]
            if t is None:
                out[at:at + last - first].zero_()
            else:
                out[at:at + last - first].copy_(t.detach().reshape(-1)[first:last])
        out[max(0, min(end, self.numel) - a):].zero_()
        return out

    def write(self, src: torch.Tensor, a: int, tensors) -> None:
        """Copy `src` into elements [a, a + len(src)) of `tensors` laid end to end."""
        for i, first, last, at in self.pieces(a, a + src.numel()):
            _write_flat(tensors[i].detach(), first, last, src[at:at + last - first])

    def reduce_scatter_grads(self) -> None:
        """Sum the gradients over the group, keeping this rank's slice (zeros elsewhere), one
        bucket at a time: each bucket's input holds its d pieces copied from the gradients."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
        grads = [p.grad for p in self.params]
        if self.group is None:
            return
        for s, e in self.ranges:
            n = e - s
            bucket = torch.empty(self.size * n, dtype=grads[0].dtype, device=grads[0].device)
            for k in range(self.size):
                self.read(grads, k * self.shard + s, bucket[k * n:(k + 1) * n])
            # in place: this rank's piece of the input receives the sum (NCCL's in-place form)
            mine = bucket[self.index * n:(self.index + 1) * n]
            dist.reduce_scatter_tensor(mine, bucket, group=self.group)
            self.write(mine, self.lo + s, grads)
            del bucket, mine    # before the next bucket's: one bucket alive at a time
        for o, end, g in zip(self.offsets, self.offsets[1:], grads):
            first, last = min(max(self.lo - o, 0), end - o), min(max(self.hi - o, 0), end - o)
            flat = g.view(-1)
            flat[:first].zero_()
            flat[last:].zero_()

    def spans(self):
        """(name, parameter, first, last, at) for each parameter with elements in this rank's
        slice: elements [first, last) of its flattened tensor are slice[at:at + last - first]."""
        for i, first, last, at in self.pieces(self.lo, self.hi):
            yield self.names[i], self.params[i], first, last, at

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole flat buffer `flat` (padded length) as one view per parameter, by name."""
        out, offset = {}, 0
        for name, p in zip(self.names, self.params):
            out[name] = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        return out

    def gather(self, mine: torch.Tensor) -> torch.Tensor | None:
        """Every replica's slice, concatenated, on the group's first rank; None on the others."""
        if self.group is None:
            return mine.clone()
        first = dist.get_global_rank(self.group, 0)
        parts = [torch.empty_like(mine) for _ in range(self.size)] if self.index == 0 else None
        dist.gather(mine.contiguous(), parts, dst=first, group=self.group)
        return torch.cat(parts) if parts is not None else None

    def slice_of(self, tensors, dtype=None) -> torch.Tensor:
        """This rank's slice of `tensors` (one per parameter, None: zeros) laid end to end."""
        dtype = dtype or next((t.dtype for t in tensors if t is not None), self.dtype)
        return self.read(tensors, self.lo, torch.empty(self.shard, dtype=dtype, device=self.device))

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
                self.write(full[k * n:(k + 1) * n], k * self.shard + s, self.params)
            del piece, full     # before the next bucket's: one bucket alive at a time


def _write_flat(t: torch.Tensor, first: int, last: int, src: torch.Tensor) -> None:
    """Elements [first, last) of `t` flattened (row-major) = `src`."""
    if t.is_contiguous():
        t.view(-1)[first:last].copy_(src)
    else:   # e.g. a strided shard: through a copy
        flat = t.reshape(-1)
        flat[first:last].copy_(src)
        t.copy_(flat.view_as(t))


# A parameter whose .grad holds a slice only carries this attribute: a torch optimizer stepping
# it directly would be wrong. (An attribute, not a WeakSet: tensors compare element-wise.)
_MARK = "_autopart_zero_slice"
_HOOK = None


def _check_step(optimizer, args, kwargs):
    if getattr(optimizer, _MARK, False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, _MARK, False):
                raise AutopartError(
                    f"{type(optimizer).__name__} steps parameters of a ParallelModel built with "
                    "zero=1, whose .grad holds only this rank's 1/dp slice of the gradient: it "
                    "would update every other element with zero gradient.\n  remedy: build the "
                    "optimizer with pm.optimizer(torch.optim.AdamW, lr=...), or drop zero=1")


def manage(params) -> None:
    """Mark `params` as sharded by a distributed optimizer (see _check_step)."""
    global _HOOK
    for p in params:
        setattr(p, _MARK, True)
    if _HOOK is None:   # one process-wide hook: any torch optimizer's step is checked
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _HOOK = register_optimizer_step_pre_hook(_check_step)


def check_elementwise(cls, kwargs: dict, device: torch.device = torch.device("cpu")) -> None:
    """Refuse an optimizer class that is not element-wise: zero=1 steps it over flat 1-D slices
    (in buckets), which is only the plain optimizer when each element's update depends on that
    element's own value, gradient and state. Decided by what `cls` does, not by its name: two
    steps of `cls(**kwargs)` on a 3x5 parameter and on the same values flattened (same
    gradients) must give the same updates (Adafactor's factored second moments, or any step that
    reads the parameter's shape, do not; an optimizer whose step fails on a 1-D tensor, or needs
    a closure as LBFGS does, is refused too). Local and deterministic: every rank decides alike."""
    name = getattr(cls, "__name__", repr(cls))
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 5, generator=gen)
    grads = [torch.randn(3, 5, generator=gen) * torch.arange(1.0, 4.0).unsqueeze(1)
             for _ in range(2)]
    p2 = torch.nn.Parameter(values.clone().to(device))
    p1 = torch.nn.Parameter(values.clone().flatten().to(device))
    try:
        opts = [cls([p2], **kwargs), cls([p1], **kwargs)]
    except Exception:  # noqa: BLE001 - bad kwargs: the real construction raises its own error
        return
    problem = None
    try:
        with torch.random.fork_rng(devices=[]):     # a step that draws leaves the user's RNG be
            for g in grads:
                for opt, p in zip(opts, (p2, p1)):
                    p.grad = g.to(device).reshape(p.shape)
                    opt.step()
    except Exception as e:  # noqa: BLE001
        problem = (f"its step on a flat 1-D tensor (what zero=1 gives it) raised "
                   f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    else:
        start = values.flatten().to(device)
        d2, d1 = p2.detach().flatten() - start, p1.detach() - start
        diff = float((d2 - d1).abs().max())
        if not torch.allclose(d1, d2, rtol=1e-4, atol=1e-6 * float(d2.abs().max()) + 1e-12):
            problem = (f"two steps on a 3x5 parameter and on the same values flattened to 1-D "
                       f"(same gradients) give updates that differ by up to {diff:.3g}: its step "
                       "reads the parameter's shape (factored second moments over rows and "
                       "columns, say)")
    if problem is not None:
        raise AutopartError(
            f"zero=1 steps {name} over flat 1-D slices of the parameters, which is only the plain "
            f"optimizer for an element-wise one, and {name} is not: {problem}.\n  remedy: "
            f"parallelize(..., zero=0) to keep {name}, or with zero=1 an element-wise optimizer "
            "such as torch.optim.AdamW, Adam or SGD")


class ZeroOptimizer:
    """`cls` over this rank's fp32 slice of each flat layout, one tensor per bucket (views of
    the slice, so the optimizer's temporaries are one bucket's); steps then all-gathers."""

    def __init__(self, layouts: list[FlatLayout], cls, **kwargs):
        check_elementwise(cls, kwargs, layouts[0].device if layouts else torch.device("cpu"))
        self.layouts = layouts
        self.shards = [torch.nn.Parameter(lay.slice_of(lay.params, torch.float32))
                       for lay in layouts]
        # a slice of one bucket is stepped whole (the shard is the optimizer's tensor)
        self.buckets = [[shard] if len(lay.ranges) == 1 else
                        [torch.nn.Parameter(shard.detach()[s:e]) for s, e in lay.ranges]
                        for lay, shard in zip(layouts, self.shards)]
        self.inner = cls([b for bs in self.buckets for b in bs], **kwargs)
        setattr(self.inner, _MARK, True)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        """`cls`'s step once per bucket, the others without .grad (a torch optimizer skips a
        tensor without one), so only one bucket's fp32 gradient exists at a time; then the
        all-gather, a bucket at a time."""
        for lay, shard, buckets in zip(self.layouts, self.shards, self.buckets):
            grads = [p.grad for p in lay.params]
            for b, (s, e) in zip(buckets, lay.ranges):
                b.grad = lay.read(grads, lay.lo + s,
                                  torch.empty(e - s, dtype=torch.float32, device=lay.device))
                self.inner.step()
                b.grad = None
            lay.all_gather_params(shard.detach())

    @torch.no_grad()
    def reload_master(self) -> None:
        """Take this rank's fp32 slices again from the parameters (after they were loaded
        without this optimizer): as a plain optimizer, which holds no copy, would step them."""
        for lay, shard in zip(self.layouts, self.shards):
            shard.copy_(lay.slice_of(lay.params, torch.float32))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)
        for lay in self.layouts:
            for p in lay.params:
                p.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    # -- per-parameter state, the plain optimizer's form (checkpoints: runtime/checkpoint/) --
    def slice_state(self, index: int) -> dict:
        """Layout `index`'s optimizer state as one slice-long tensor per key (the buckets'
        joined; a view when there is one bucket), or a scalar state (Adam's `step`) as is."""
        buckets = self.buckets[index]
        states = [self.inner.state.get(b, {}) for b in buckets]
        out = {}
        for key, v in states[0].items():
            if torch.is_tensor(v) and v.dim() == 1 and v.shape == buckets[0].shape:
                out[key] = v if len(buckets) == 1 else torch.cat([st[key] for st in states])
            else:
                out[key] = v
        return out

    def gather_state_by_parameter(self) -> dict[str, dict]:
        """{parameter name: its state as `cls` over pm.parameters() would hold it}. Collective
        over each replica group: a tensor state the size of the slice (momentum, Adam's moments)
        is gathered onto the group's first rank only, whose entries are then views of one
        full-length buffer per key (the plain optimizer's footprint, for this rank's parameters
        only); the other ranks get only the scalar state (Adam's `step`), which every replica
        has whole."""
        out: dict[str, dict] = {}
        for index, lay in enumerate(self.layouts):
            state = self.slice_state(index)
            per_name: dict[str, dict] = {n: {} for n in lay.names}
            for key in sorted(state):     # the same order on every replica: gathers pair up
                v = state[key]
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == lay.shard:
                    full = lay.gather(v.detach())
                    if full is not None:
                        for name, view in lay.views(full).items():
                            per_name[name][key] = view
                else:
                    for name in lay.names:
                        per_name[name][key] = v
            out.update(per_name)
        return out

    def load_slices(self, states: list[dict]) -> None:
        """Replace the state: per flat layout, {key: this rank's slice of it, or a scalar}; and
        take the slices of the parameters as they are now (after a checkpoint loaded them)."""
        if len(states) != len(self.shards):
            raise AutopartError(f"ZeroOptimizer.load_slices: {len(states)} states for "
                                f"{len(self.shards)} flat layouts")
        for lay, shard, buckets, state in zip(self.layouts, self.shards, self.buckets, states):
            for b, (s, e) in zip(buckets, lay.ranges):
                self.inner.state.pop(b, None)
                if state:
                    self.inner.state[b] = {k: _bucket_of(v, s, e, lay.shard, len(buckets))
                                           for k, v in state.items()}
            with torch.no_grad():
                lay.read(lay.params, lay.lo, shard)

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def _bucket_of(v, s: int, e: int, shard: int, buckets: int):
    """Bucket [s, e)'s part of a loaded slice state `v`: a view of a slice-long tensor, its own
    copy of a scalar tensor (each bucket's `step` counts in place), a Python value as is."""
    if torch.is_tensor(v) and v.dim() == 1 and v.numel() == shard:
        return v[s:e]
    return v.clone() if torch.is_tensor(v) and buckets > 1 else v


__all__ = ["DEFAULT_BUCKET_SIZE", "FlatLayout", "ZeroOptimizer", "check_bucket_size", "manage"]
