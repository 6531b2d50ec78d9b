"""The state gatherer: what one rank holds, put back together as the plain model's.

The global loss and statistics of a step (computed on the last pipeline rank's tp rank 0) and
the plain model's state dict (tensor shards reassembled, expert shards concatenated, tied names
restored) from every rank's share.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.ir import Plan, Program, RankProgram
from autopart.localize import unshard_tensor


class StateGatherer:
    """Gathers one rank's results and state over `groups.world` (a RankGroups)."""

    def __init__(self, plan: Plan, program: Program, rank_program: RankProgram, groups,
                 device: torch.device, key_order: list[str], extra_state: dict[str, torch.Tensor]):
        self.plan, self.program, self.mine, self.groups = plan, program, rank_program, groups
        self.device, self.key_order, self.extra_state = device, key_order, extra_state
        coords = rank_program.coords
        # the last chunk's rank computes the loss and the statistics; its tp ranks compute the
        # same numbers, so tp rank 0 alone reports them
        self.holds_loss = coords["pp"] == plan.last_rank and coords["tp"] == 0

    def loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The global-batch mean loss, on every rank."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.holds_loss:
            total += torch.stack(losses).float().sum() * self.plan.loss_scale
        dist.all_reduce(total, group=self.groups.world)
        return total

    def stats(self, per_microbatch: list[tuple]) -> dict[str, torch.Tensor]:
        """The statistics outputs summed over the global batch (their shapes and dtypes are the
        model's: counts stay integers), on every rank."""
        names = self.plan.stats
        mine = None
        if self.holds_loss and per_microbatch:
            mine = [torch.stack([mb[i] for mb in per_microbatch]).sum(0).cpu()
                    for i in range(len(names))]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=self.groups.world)
        parts = [g for g in gathered if g is not None]
        return {name: sum(p[i] for p in parts) for i, name in enumerate(names)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's complete state dict (every key, full shapes), on every rank."""
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._my_part(), group=self.groups.world)
        return self.assemble(gathered)

    def _my_part(self) -> dict[str, torch.Tensor]:
        """What this rank contributes: replica 0 sends its dense state, the first ep ranks (one
        per expert slice) their experts."""
        dp = self.mine.coords["dp"]
        if dp >= self.plan.mesh.ep:
            return {}
        return {n: t.detach().cpu() for c in self.mine.chunks for n, t in c.gm.state_dict().items()
                if dp == 0 or n in self.plan.ep_shards}

    def assemble(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every rank's part (in global rank order) -> the plain model's state dict."""
        mesh, plan = self.plan.mesh, self.plan
        full, shards, expert_parts = {}, {}, {}
        for rank, part in enumerate(parts):
            for name, tensor in part.items():
                if name in plan.ep_shards:
                    expert_parts.setdefault(name, {})[mesh.ep_rank(rank)] = tensor
                elif name in plan.tp_shards:
                    shards.setdefault(name, {})[mesh.coords(rank)["tp"]] = tensor
                else:
                    full[name] = tensor
        for name, by_rank in shards.items():      # tensor-parallel shards, reassembled
            spec = plan.tp_shards[name]
            full[name] = unshard_tensor([by_rank[t] for t in range(mesh.tp)], spec.dim,
                                        spec.sections)
        for name, by_rank in expert_parts.items():     # expert shards, dim 0 in ep-rank order
            full[name] = torch.cat([by_rank[e] for e in range(mesh.ep)], dim=0)
        out = {}
        for info in list(self.program.params.values()) + list(self.program.buffers.values()):
            for key in (info.name, *info.aliases):
                if info.persistent and info.name in full:
                    out[key] = full[info.name]
        out.update({k: v for k, v in self.extra_state.items() if k not in out})
        return {k: out[k] for k in self.key_order if k in out}
