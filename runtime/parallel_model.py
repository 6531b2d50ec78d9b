"""parallelize(): this rank's ParallelModel, which trains the emitted programs on real processes."""
from __future__ import annotations

import math
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from autopart.compiler import Compiled, RankProgram, compile as compile_model
from autopart.localize import unshard_tensor
from autopart.errors import AutopartError
from autopart.mesh import Mesh
from autopart.runtime.executor import StepContext, run_actions
from autopart.runtime.groups import RankGroups, build_groups, check_world_size
from autopart.runtime.tensor_parallel import (all_reduce_flat, localize_chunks,
                                               reduce_sequence_parallel_grads)
from autopart.runtime.expert_parallel import localize_expert_chunks

DEFAULT_TIMEOUT = timedelta(minutes=5)


class ParallelModel:
    """This rank's share of a parallelized model. Build it with `autopart.parallelize`."""

    def __init__(self, compiled: Compiled, rank: int, device: torch.device, timeout: timedelta,
                 extra_state: dict[str, torch.Tensor]):
        self.compiled = compiled
        self.mesh: Mesh = compiled.plan.mesh
        self.rank = rank
        self.coords = self.mesh.coords(rank)
        self.device = device
        self._tp = compiled.program.decisions.get("tp")
        self._groups: RankGroups = build_groups(self.mesh, compiled.plan.shared_params,
                                                compiled.plan.chunk_ranks, timeout)
        mine = [c for c in compiled.program.decisions["chunks"] if c.rank == self.coords["pp"]]
        # with tensor parallelism: this rank's own copies of its weight shards, comms bound
        mine = localize_chunks(mine, self._tp, self.coords["tp"], self._groups.tp)
        # with expert parallelism: this rank's own experts (dp index mod ep), comms bound
        self._experts = compiled.plan.ep_shards
        self.ep_rank = self.coords["dp"] % self.mesh.ep
        mine = localize_expert_chunks(mine, self._experts, self.mesh.ep, self.ep_rank,
                                      self._groups.ep)
        self.program = RankProgram(rank, self.coords, tuple(mine))
        self._chunks = {c.chunk: c for c in self.program.chunks}
        for c in self.program.chunks:
            c.gm.to(device)
        self._params = self.program.parameters()
        self._extra_state = extra_state
        # a model returning (loss, {name: tensor}): after each train_step, the tensors summed over
        # the microbatches and data-parallel replicas of the global batch, on every rank
        self._stat_names = compiled.program.decisions.get("stats", ())
        self.last_stats: dict[str, torch.Tensor] = {}

    # -- training ---------------------------------------------------------------------------
    def train_step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward over the global batch; returns its mean loss on every rank.

        Leaves fully reduced gradients in `.grad` of this rank's parameters, as loss.backward()
        would on the plain model; it neither steps nor zeroes (the optimizer does)."""
        plan = self.compiled.plan
        batch = self._shard(inputs, target)
        ctx = StepContext(
            chunks=self._chunks,
            peer=lambda p: self.mesh.rank(pp=p, dp=self.coords["dp"], tp=self.coords["tp"]),
            microbatch=lambda i: {k: v[i * plan.microbatch_size:(i + 1) * plan.microbatch_size]
                                  for k, v in batch.items()},
            batch=plan.microbatch_size, seq=self._seq_len(inputs), device=self.device,
            loss_scale=1.0 / (plan.microbatches * self.mesh.dp), group=self._groups.pp)
        # Reduce this step's gradients only. What .grad already holds (a train_step not yet zeroed,
        # as after two loss.backward() calls) was reduced then; reducing it again would count it
        # once per replica or per stage sharing it. It is added back after the reduction.
        earlier = {n: p.grad for n, p in self._params.items() if p.grad is not None}
        for p in self._params.values():
            p.grad = None
        losses = run_actions(self.compiled.schedule.ranks[self.coords["pp"]], ctx)
        self._reduce_gradients()
        if self._stat_names:
            self.last_stats = self._global_stats(ctx.stats)
        for name, grad in earlier.items():
            p = self._params[name]
            p.grad = grad if p.grad is None else grad.add_(p.grad)
        return self._global_loss(losses)

    def _shard(self, inputs, target) -> dict[str, torch.Tensor]:
        names = self.compiled.program.inputs
        values = list(inputs) + ([target] if target is not None else [])
        if len(values) != len(names):
            raise AutopartError(f"train_step got {len(values)} tensors (inputs and target) but the "
                                f"model was compiled with {len(names)}: {names}")
        plan = self.compiled.plan
        rows = plan.microbatch_size * plan.microbatches
        out = {}
        for name, v in zip(names, values):
            if v.shape[0] != plan.global_batch:
                raise AutopartError(f"train_step input {name!r} has batch {v.shape[0]}, but the "
                                    f"model was compiled for the global batch {plan.global_batch}")
            out[name] = v[self.coords["dp"] * rows:(self.coords["dp"] + 1) * rows].to(self.device)
        return out

    def _seq_len(self, inputs) -> int | None:
        return int(inputs[0].shape[1]) if inputs and inputs[0].dim() > 1 else None

    def _reduce_gradients(self) -> None:
        reduce_sequence_parallel_grads(self._params, self._tp, self._groups.tp)
        for name, group in self._groups.shared.items():
            p = self._params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        # The loss was scaled by 1/(microbatches * dp): summing gives the mean. Dense gradients
        # sum over the dp replicas; an expert gradient already holds every token of its ep group,
        # so it sums over the dp/ep ranks holding the same experts only.
        dense = [p.grad for n, p in self._params.items()
                 if p.grad is not None and n not in self._experts]
        experts = [p.grad for n, p in self._params.items()
                   if p.grad is not None and n in self._experts]
        all_reduce_flat(dense, self._groups.dp)
        all_reduce_flat(experts, self._groups.ep_replica)

    def _global_stats(self, per_microbatch: list[tuple]) -> dict[str, torch.Tensor]:
        """The statistics outputs summed over the global batch (their shapes and dtypes are
        the model's: counts stay integers). Only the last pipeline rank's tp rank 0 holds them."""
        plan = self.compiled.plan
        holds = self.coords["pp"] == plan.chunk_ranks[-1] and self.coords["tp"] == 0
        mine = None
        if holds and per_microbatch:
            mine = [torch.stack([mb[i] for mb in per_microbatch]).sum(0).cpu()
                    for i in range(len(self._stat_names))]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=self._groups.world)
        parts = [g for g in gathered if g is not None]
        return {name: sum(p[i] for p in parts) for i, name in enumerate(self._stat_names)}

    def _global_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        plan = self.compiled.plan
        holds_loss = self.coords["pp"] == plan.chunk_ranks[-1] and self.coords["tp"] == 0
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if holds_loss:
            total += torch.stack(losses).float().sum() / (plan.microbatches * self.mesh.dp)
        dist.all_reduce(total, group=self._groups.world)
        return total

    # -- parameters -------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the plain model's names, each once."""
        return iter(self._params.items())

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self._params.values())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over all shards, each shared parameter counted once."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        sq_experts = torch.zeros((), dtype=torch.float64, device=self.device)
        plan = self.compiled.plan
        for name, p in self._params.items():
            owner = plan.chunk_ranks[plan.shared_params[name][0]] if name in plan.shared_params \
                else self.coords["pp"]
            # a tensor-parallel shard counts on every tp rank; a replicated weight on tp rank 0
            counted = name in plan.tp_shards or self.coords["tp"] == 0
            if p.grad is not None and owner == self.coords["pp"] and counted:
                if name in self._experts:
                    sq_experts += p.grad.double().pow(2).sum()
                else:
                    sq += p.grad.double().pow(2).sum()
        if self._groups.ep is not None:      # each ep rank holds 1/ep of the experts
            dist.all_reduce(sq_experts, group=self._groups.ep)
        sq += sq_experts
        if self._groups.model is not None:
            dist.all_reduce(sq, group=self._groups.model)
        norm = sq.sqrt().float()
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in self._params.values():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's complete state dict (every key, full shapes), on every rank."""
        mine = {}
        ep = self.mesh.ep
        if self.coords["dp"] < ep:       # replica 0: dense state from dp 0, experts from its ep group
            mine = {n: t.detach().cpu() for c in self.program.chunks
                    for n, t in c.gm.state_dict().items()
                    if self.coords["dp"] == 0 or n in self._experts}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=self._groups.world)
        full, shards, expert_parts = {}, {}, {}
        for rank, part in enumerate(gathered):
            tp_rank = self.mesh.coords(rank)["tp"]
            for name, tensor in part.items():
                if name in self._experts:
                    expert_parts.setdefault(name, {})[self.mesh.coords(rank)["dp"] % ep] = tensor
                elif name in self.compiled.plan.tp_shards:
                    shards.setdefault(name, {})[tp_rank] = tensor
                else:
                    full[name] = tensor
        for name, parts in shards.items():      # tensor-parallel shards, reassembled
            spec = self.compiled.plan.tp_shards[name]
            full[name] = unshard_tensor([parts[t] for t in range(self.mesh.tp)], spec.dim,
                                        spec.sections)
        for name, parts in expert_parts.items():     # expert shards, dim 0 in ep-rank order
            full[name] = torch.cat([parts[e] for e in range(ep)], dim=0)
        program = self.compiled.program
        out = {}
        for info in list(program.params.values()) + list(program.buffers.values()):
            for key in (info.name, *info.aliases):
                if info.persistent and info.name in full:
                    out[key] = full[info.name]
        out.update({k: v for k, v in self._extra_state.items() if k not in out})
        return {k: out[k] for k in self._key_order if k in out}

    def explain(self) -> str:
        return self.compiled.explain()


def parallelize(model: nn.Module, mesh: Mesh, example_inputs: tuple, *,
                loss_fn: Callable | None = None, target: torch.Tensor | None = None,
                microbatches: int = 1, schedule: str = "1f1b", virtual_stages: int = 1,
                sequence_parallel: bool = False,
                timeout: timedelta = DEFAULT_TIMEOUT) -> ParallelModel:
    """Compile `model` for `mesh` and return this rank's ParallelModel (collective: every rank).

    `example_inputs` (and `target`, when `loss_fn` takes one) is a global batch with the shapes
    train_step will get.

        mesh = autopart.Mesh(pp=2, dp=2)
        pm = autopart.parallelize(model, mesh, (tokens,), loss_fn=lm_loss, target=targets,
                                  microbatches=4)
        loss = pm.train_step(tokens, target=targets); opt.step(); opt.zero_grad()
    """
    if not dist.is_initialized():
        raise AutopartError("autopart.parallelize needs torch.distributed.init_process_group "
                            "first (or use autopart.compile to inspect without processes)")
    # before compiling: a rank outside a smaller mesh would otherwise fail on its own, differently
    check_world_size(mesh)
    device = _device_of(model)
    example_inputs = tuple(t.to(device) for t in example_inputs)
    target = target.to(device) if target is not None else None
    compiled = compile_model(model, mesh, example_inputs, loss_fn=loss_fn, target=target,
                             microbatches=microbatches, schedule=schedule,
                             virtual_stages=virtual_stages, sequence_parallel=sequence_parallel)
    keys = list(model.state_dict().keys())
    # State no chunk holds (a parameter forward never reads: captured, but in no chunk's graph)
    # never changes in training; full_state_dict returns it as it is now.
    canonical = {a: i.name for i in list(compiled.program.params.values()) +
                 list(compiled.program.buffers.values()) for a in (i.name, *i.aliases)}
    in_chunks = {n for c in compiled.program.decisions["chunks"] for n in c.gm.state_dict()}
    extra = {k: v.detach().cpu() for k, v in model.state_dict().items()
             if canonical.get(k, k) not in in_chunks}
    pm = ParallelModel(compiled, dist.get_rank(), device, timeout, extra)
    pm._key_order = keys
    return pm


def _device_of(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    if p is None or p.device.type == "meta":
        raise AutopartError("parallelize needs a model with real weights (not on the meta device); "
                            "use autopart.compile to inspect a meta-device model")
    return p.device


__all__ = ["parallelize", "ParallelModel", "math"]
