"""The distributed optimizer (ZeRO-1, Megatron-LM's distributed optimizer layout).

    pm = autopart.parallelize(model, mesh, ..., zero=1)
    opt = pm.optimizer(torch.optim.AdamW, lr=3e-4)      # any element-wise torch optimizer
    pm.train_step(x, target=y); opt.step(); opt.zero_grad()

The parameters a rank shares with its data-parallel replicas are laid end to end in one flat
buffer (sorted by name, padded to a multiple of the replica count d); replica i owns elements
[i*n/d, (i+1)*n/d) of it. Expert parameters form a second flat buffer over their own replica
group (the ranks holding the same experts). After backward the gradient reducer
reduce-scatters each flat gradient instead of all-reducing it, so each replica receives the
summed gradient of its own 1/d slice; `.grad` of every parameter is then full-shaped with the
reduced gradient in the elements of this rank's slice and zeros elsewhere (clipping and
accumulation act on it as usual). `step` runs the user's optimizer class on one fp32 tensor
per flat buffer holding this rank's slice (its state, Adam's two moments, is 1/d of the plain
optimizer's), then all-gathers the updated slices into the parameters: a reduce-scatter plus an
all-gather move the same bytes as the all-reduce they replace. Checkpoints store the state per
parameter, as the plain optimizer holds it (gather_state_by_parameter, load_slices; the mapping
is in runtime/checkpoint.py), so they load at any zero level.

Why not torch.distributed.optim.ZeroRedundancyOptimizer: it assigns whole parameters to ranks
(a sorted-greedy partition), so a rank's share is uneven (one 50k x 1k embedding outweighs a
layer); it reduces no gradient itself, expecting DDP's full all-reduce before it; it broadcasts
each owner's updated parameters; and it knows one process group, while autopart's dense and
expert parameters replicate over different groups.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.errors import AutopartError


class FlatLayout:
    """Parameters `names` of one replica group laid end to end; this rank's slice of them."""

    def __init__(self, params: dict[str, torch.nn.Parameter], names: list[str], group):
        self.names, self.group = sorted(names), group
        self.params = [params[n] for n in self.names]
        self.size = dist.get_world_size(group) if group is not None else 1
        self.index = dist.get_rank(group) if group is not None else 0
        numel = sum(p.numel() for p in self.params)
        self.padded = -(-numel // self.size) * self.size
        self.shard = self.padded // self.size
        self.lo, self.hi = self.index * self.shard, (self.index + 1) * self.shard

    def flat(self, tensors) -> torch.Tensor:
        parts = [t.reshape(-1) for t in tensors]
        pad = self.padded - sum(p.numel() for p in parts)
        if pad:
            parts.append(parts[0].new_zeros(pad) if parts else torch.zeros(pad))
        return torch.cat(parts)

    def scatter_back(self, flat: torch.Tensor, targets) -> None:
        offset = 0
        for t in targets:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def reduce_scatter_grads(self) -> None:
        """Sum the gradients over the group, keeping this rank's slice (zeros elsewhere)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = self.flat([p.grad for p in self.params])
        mine = torch.empty(self.shard, dtype=flat.dtype, device=flat.device)
        if self.group is not None:
            dist.reduce_scatter_tensor(mine, flat, group=self.group)
        else:
            mine.copy_(flat)
        flat.zero_()
        flat[self.lo:self.hi] = mine
        self.scatter_back(flat, [p.grad for p in self.params])

    def spans(self):
        """(name, parameter, first, last, at) for each parameter with elements in this rank's
        slice: elements [first, last) of its flattened tensor are slice[at:at + last - first]."""
        offset = 0
        for name, p in zip(self.names, self.params):
            a, b = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if a < b:
                yield name, p, a - offset, b - offset, a - self.lo
            offset += p.numel()

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

    def slice_of(self, tensors) -> torch.Tensor:
        return self.flat(tensors)[self.lo:self.hi].clone()

    def all_gather_params(self, mine: torch.Tensor) -> None:
        full = torch.empty(self.padded, dtype=mine.dtype, device=mine.device)
        if self.group is not None:
            dist.all_gather_into_tensor(full, mine.contiguous(), group=self.group)
        else:
            full.copy_(mine)
        with torch.no_grad():
            self.scatter_back(full, self.params)


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


class ZeroOptimizer:
    """`cls` over this rank's slices of each flat layout; steps then all-gathers."""

    def __init__(self, layouts: list[FlatLayout], cls, **kwargs):
        self.layouts = layouts
        self.shards = [torch.nn.Parameter(lay.slice_of([p.detach() for p in lay.params]).float())
                       for lay in layouts]
        self.inner = cls([s for s in self.shards], **kwargs)
        setattr(self.inner, _MARK, True)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        for lay, shard in zip(self.layouts, self.shards):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in lay.params]
            shard.grad = lay.slice_of(grads).float()
        self.inner.step()
        for lay, shard in zip(self.layouts, self.shards):
            lay.all_gather_params(shard.detach().to(lay.params[0].dtype if lay.params
                                                    else shard.dtype))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)
        for lay in self.layouts:
            for p in lay.params:
                p.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    # -- per-parameter state, the plain optimizer's form (checkpoints: runtime/checkpoint.py) --
    def gather_state_by_parameter(self) -> dict[str, dict]:
        """{parameter name: its state as `cls` over pm.parameters() would hold it}. Collective
        over each replica group: a tensor state the size of the slice (momentum, Adam's moments)
        is gathered onto the group's first rank only, whose entries are then views of one
        full-length buffer per key (the plain optimizer's footprint, for this rank's parameters
        only); the other ranks get only the scalar state (Adam's `step`), which every replica
        has whole."""
        out: dict[str, dict] = {}
        for lay, shard in zip(self.layouts, self.shards):
            state = self.inner.state.get(shard, {})
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
        for lay, shard, state in zip(self.layouts, self.shards, states):
            self.inner.state.pop(shard, None)
            if state:
                self.inner.state[shard] = dict(state)
            with torch.no_grad():
                shard.copy_(lay.slice_of([p.detach() for p in lay.params]))

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


__all__ = ["FlatLayout", "ZeroOptimizer", "manage"]
