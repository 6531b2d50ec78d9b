"""The gradient reducer: after a step's backward, each rank's gradients become those of the plain
model's loss over the global batch; and the global gradient norm over every shard.

Reductions, in order:
  sequence-parallel  replicated weights that saw only a sequence shard (norms, biases): sum over tp
  tied               a parameter used by chunks on several pipeline ranks: sum over those ranks
  data-parallel      dense gradients: sum over the dp replicas (the loss was scaled by
                     1/(microbatches * dp), so the sum is the mean)
  expert             an expert's gradient already holds every token of its ep group: sum over
                     the dp/ep ranks holding the same experts only

`all_reduce` is injectable so the reducer is tested without processes.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable

import torch
import torch.distributed as dist

from autopart.errors import AutopartError
from autopart.ir import Plan


def all_reduce_flat(grads: list[torch.Tensor], group, all_reduce: Callable = dist.all_reduce) -> None:
    """Sum `grads` over `group` in one all-reduce (nothing to do without a group)."""
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class GradientReducer:
    """Reduces and measures the gradients of one rank's parameters (`params`: plain name ->
    Parameter) over the process groups in `groups` (a RankGroups)."""

    def __init__(self, plan: Plan, params: dict[str, torch.nn.Parameter], groups, coords: dict,
                 device: torch.device, all_reduce: Callable = dist.all_reduce):
        self.plan, self.params, self.groups, self.coords = plan, params, groups, coords
        self.device, self.all_reduce = device, all_reduce
        # zero=1: (dense, experts) FlatLayouts (runtime/optimizer.py); their gradients are
        # reduce-scattered over the replicas instead of all-reduced
        self.zero_layouts: tuple = ()

    def reduce(self) -> None:
        """Turn this step's local gradients into the plain model's (see the module docstring)."""
        plan, groups = self.plan, self.groups
        all_reduce_flat([self.params[n].grad for n in sorted(plan.sp_grad_reduce)
                         if n in self.params and self.params[n].grad is not None],
                        groups.tp, self.all_reduce)
        for name, group in groups.shared.items():
            p = self.params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.all_reduce(p.grad, group=group)
        dense = [p.grad for n, p in self.params.items()
                 if p.grad is not None and n not in plan.ep_shards]
        experts = [p.grad for n, p in self.params.items()
                   if p.grad is not None and n in plan.ep_shards]
        if self.zero_layouts:
            for layout in self.zero_layouts:
                layout.reduce_scatter_grads()
            return
        all_reduce_flat(dense, groups.dp, self.all_reduce)
        all_reduce_flat(experts, groups.ep_replica, self.all_reduce)

    def global_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient: every shard counted once (a tied parameter
        on its first chunk's rank, a replicated weight on tp rank 0, experts over ep)."""
        plan, pp, tp = self.plan, self.coords["pp"], self.coords["tp"]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        sq_experts = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.params.items():
            owner = plan.chunk_ranks[plan.shared_params[name][0]] if name in plan.shared_params \
                else pp
            counted = name in plan.tp_shards or tp == 0
            if p.grad is not None and owner == pp and counted:
                if name in plan.ep_shards:
                    sq_experts += p.grad.double().pow(2).sum()
                else:
                    sq += p.grad.double().pow(2).sum()
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

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so the global norm is at most `max_norm`; return the norm."""
        max_norm = check_max_norm(max_norm)     # on every rank, before the norm's collectives
        norm = self.global_norm()
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm


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
