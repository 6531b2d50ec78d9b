"""ZeRO-3's parameter collectives as graph ops (passes/gather_parameters.py inserts them).

Under zero=3 a rank keeps only its 1/dp slice of each parameter (runtime/sharding.py); between
uses a parameter keeps its shape but no storage. The rank programs say where each layer's
parameters are all-gathered and freed:

    gather_params(self.param_shards, g)       all-gather group g's parameters (no-op when held)
    release_params(self.param_shards, g)      free their storage (the slice stays)
    release_params(self.param_shards, g, after="backward")
                                              keep them: the backward frees them once their
                                              gradients are in (no re-gather in between)
    release_params(self.param_shards, g, after="step")
                                              keep them across the step's microbatches: freed
                                              when the step ends (one gather per step)
    regather_on_backward(x, self.param_shards, g)
                                              forward identity; backward gathers group g again
                                              before the backward of the op that made x runs
                                              (it reads g's parameters, saved by reference)

`ParamShards` is a small module each zero=3 program holds as `self.param_shards`: the groups
(parameter attribute names, in the order the forward first uses them) and, once the runtime binds
it, the object that moves the data (runtime/param_shards.py). Unbound (the compile-time program
checker's fake tensors, a program run by hand) the ops move nothing.
"""
from __future__ import annotations

import torch
import torch.fx.node
import torch.nn as nn

from autopart.ops.registry import register


# when a group's gathered parameters are freed (passes/gather_parameters.py decides per group)
RELEASES = ("forward", "backward", "step")


class ParamShards(nn.Module):
    """A zero=3 program's parameter groups: `groups[g]` the attribute names of group g,
    `labels[g]` what the program says it is (the layer whose nodes first read it); `reduced`
    the names read only by ops that autocast runs in bf16 (passes/gather_parameters.py)."""

    def __init__(self, groups: list[tuple[str, ...]], labels: list[str],
                 reduced: list[str] = (), after: list[str] | None = None):
        super().__init__()
        self.groups, self.labels = [tuple(g) for g in groups], list(labels)
        # per group, when it is freed: "forward" (after its last reader there, gathered again
        # for the backward), "backward" (once its gradients are in), "step" (at the step's end)
        self.after = list(after) if after is not None else ["forward"] * len(self.groups)
        # read only by ops autocast runs in bf16: under precision="bf16" gathered in bf16
        self.reduced = tuple(reduced)
        self.owner = None          # the runtime's ShardedParameters, once bound
        self.params: list[list[torch.Tensor]] = []     # group -> this rank's Parameters

    def bind(self, owner, params: list[list[torch.Tensor]]) -> "ParamShards":
        self.owner, self.params = owner, params
        return self

    def extra_repr(self) -> str:
        kept = {k: self.after.count(k) for k in RELEASES if k != "forward" and k in self.after}
        return (f"groups={len(self.groups)}, kept past the forward: {kept or 'none'}, gathered "
                f"in the reduced precision under bf16: {len(self.reduced)}, "
                f"bound={self.owner is not None}")


def gather_params(shards: ParamShards, group: int) -> None:
    if shards.owner is not None:
        shards.owner.gather(shards.params[group], next_group=_next(shards, group, +1))


def release_params(shards: ParamShards, group: int, after: str = "forward") -> None:
    """Free group's storage now (after="forward"); a kept group (after="backward" or "step")
    stays gathered: the runtime frees it later (ShardedParameters.watch, .end_step)."""
    if shards.owner is not None and after == "forward":
        shards.owner.release(shards.params[group])


def _next(shards: ParamShards, group: int, step: int):
    """The group the program uses after `group` in this direction (the one to prefetch)."""
    at = group + step
    return shards.params[at] if 0 <= at < len(shards.params) else None


class _Regather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shards, group):
        ctx.shards, ctx.group = shards, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shards = ctx.shards
        if shards.owner is not None:   # the backward runs the groups in reverse: prefetch g - 1
            shards.owner.gather(shards.params[ctx.group], next_group=_next(shards, ctx.group, -1))
        return grad, None, None


def regather_on_backward(x: torch.Tensor, shards: ParamShards, group: int) -> torch.Tensor:
    if not (isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()):
        return x
    return _Regather.apply(x, shards, group)


register(gather_params, release_params, regather_on_backward, kind="collective", axis="dp",
         namespace="autopart.zero_ops")
# fx's dead-code elimination must keep them: they return nothing anyone reads
torch.fx.node._side_effectful_functions.update({gather_params, release_params})

__all__ = ["RELEASES", "ParamShards", "gather_params", "release_params", "regather_on_backward"]
