"""The distributed optimizer of ZeRO-1 and ZeRO-2.

    pm = autopart.parallelize(model, mesh, ..., zero=1)     # or zero=2
    opt = pm.optimizer(torch.optim.AdamW, lr=3e-4)      # any element-wise torch optimizer
    pm.train_step(x, target=y); opt.step(); opt.zero_grad()

Each replica group's parameters are sharded as runtime/sharding.py lays them out (every
parameter cut into d chunks, a rank's slice its chunk of each); expert parameters form a second
layout over their own replica group (the ranks holding the same experts). The gradient reducer
(runtime/gradients.py) reduce-scatters the gradients in buckets, overlapped with the backward,
instead of all-reducing them, so each replica receives the summed gradient of its own slice:
zero=1 writes it into full-shaped `.grad` (zeros in the elements other replicas own; clipping
and accumulation act on it as usual); zero=2 keeps only the slice (`ShardLayout.grad`; `.grad`
is None), reducing each microbatch's gradient as the backward produces it. `step` runs the
user's optimizer class on this rank's fp32 slice, one tensor per bucket (its state, Adam's two
moments, is 1/d of the plain optimizer's), then all-gathers the updated slices into the
parameters: a reduce-scatter plus an all-gather move the same bytes as the all-reduce they
replace. Checkpoints store the state per parameter, as the plain optimizer holds it
(gather_state_by_parameter, load_slices; the mapping is in runtime/checkpoint/), so they load at
any zero level.

Buckets (`parallelize(..., zero_bucket_size=)`, elements, default 40M as Megatron-LM's
bucket_size): a bucket is the same range [s, e) of every replica's slice, so a reduce-scatter's
input, an all-gather's output and the optimizer's tensors are one bucket each, and a rank's
transient memory is one bucket, not its whole parameter set three times over.

Why not torch.distributed.optim.ZeroRedundancyOptimizer: it assigns whole parameters to ranks
(a sorted-greedy partition), so a rank's share is uneven (one 50k x 1k embedding outweighs a
layer); it reduces no gradient itself, expecting DDP's full all-reduce before it; it broadcasts
each owner's updated parameters; and it knows one process group, while autopart's dense and
expert parameters replicate over different groups.
"""
from __future__ import annotations

import torch

from autopart.errors import AutopartError
from autopart.runtime.sharding import DEFAULT_BUCKET_SIZE, ShardLayout


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
                    "zero=1 or zero=2, which keeps only this rank's 1/dp slice of each gradient "
                    "(zero=1 in .grad, zeros elsewhere; zero=2 in the slice, .grad None): it "
                    "would update every other element with zero gradient, or nothing.\n  "
                    "remedy: build the optimizer with pm.optimizer(torch.optim.AdamW, lr=...), "
                    "or pass zero=0")


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

    def __init__(self, layouts: list[ShardLayout], cls, **kwargs):
        check_elementwise(cls, kwargs, layouts[0].device if layouts else torch.device("cpu"))
        self.layouts = layouts
        # (zero=3 with fp32 parameters: the store itself, stepped in place)
        self.shards = [torch.nn.Parameter(lay.own_values(torch.float32)) for lay in layouts]
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
            for b, (s, e) in zip(buckets, lay.ranges):
                b.grad = lay.grad_range(s, e)
                self.inner.step()
                b.grad = None
            if lay.sharded is not None:     # zero=3: the slice is all a rank keeps
                if lay.store.data_ptr() != shard.data_ptr():
                    lay.store.copy_(shard.detach())
                lay.sharded.updated()
            else:
                lay.all_gather_params(shard.detach())

    @torch.no_grad()
    def reload_master(self) -> None:
        """Take this rank's fp32 slices again from the parameters (after they were loaded
        without this optimizer): as a plain optimizer, which holds no copy, would step them."""
        for lay, shard in zip(self.layouts, self.shards):
            shard.copy_(lay.own_values(torch.float32))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)
        for lay in self.layouts:
            lay.grad = None         # zero=2's slice gradient
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
                        for name, view in lay.by_name(full).items():
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
                shard.copy_(lay.own_values(torch.float32))

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def _bucket_of(v, s: int, e: int, shard: int, buckets: int):
    """Bucket [s, e)'s part of a loaded slice state `v`: a view of a slice-long tensor, its own
    copy of a scalar tensor (each bucket's `step` counts in place), a Python value as is."""
    if torch.is_tensor(v) and v.dim() == 1 and v.numel() == shard:
        return v[s:e]
    return v.clone() if torch.is_tensor(v) and buckets > 1 else v


__all__ = ["DEFAULT_BUCKET_SIZE", "ShardLayout", "ZeroOptimizer", "manage"]
