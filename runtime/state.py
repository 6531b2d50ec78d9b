"""The state gatherer: what one rank holds, put back together as the plain model's.

The global loss and statistics of a step (computed on the last pipeline rank's tp rank 0) and
the plain model's state dict (tensor shards reassembled, expert shards concatenated, tied names
restored) from every rank's share: on every rank (all_gather_object of each share: for small
models), or onto one rank one tensor at a time (full_state_dict_iter: for models no rank can
hold twice, or at all when the caller writes each tensor out).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from autopart.ir import Plan, Program, RankProgram
from autopart.localize import unshard_tensor
from autopart.runtime import nonfinite


def _p2p(op, tensor: torch.Tensor, peer: int, group) -> None:
    """One send or receive through batch_isend_irecv: NCCL runs a batch on the group's own
    communicator, where a plain send/recv would build a 2-rank communicator for every pair of
    ranks (pytorch/pytorch#129140); wait on whatever works come back (NCCL: one per batch)."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)]):
        work.wait()


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
        self._stat_meta: list | None = None      # [(shape, dtype)] of the statistics outputs

    def step_results(self, losses: list[torch.Tensor], scale=None, per_microbatch: list[tuple] = (),
                     check: list | None = None, relearn: bool = False,
                     ids: torch.Tensor | None = None, read_ids: bool = False
                     ) -> tuple[torch.Tensor, dict, bool | None, bool | None]:
        """The step's global-batch loss (the microbatch losses, each times `scale`, default
        plan.loss_scale, a float or a 0-dim device tensor; runtime/step.py step_loss_scale), its
        statistics summed over the global batch, whether a loss or a gradient (`check`: this
        rank's gradients, None when not checked) was non-finite on any rank, and whether any
        rank was given embedding ids out of range (`ids`: this rank's count of such inputs, an
        int64 0-dim device tensor, runtime/batches.py ids_out_of_range; `read_ids`: whether the
        model has such inputs at all, the same on every rank), each on every rank (None when not
        checked). One all-reduce of [loss, flags, ids], one more per dtype of the statistics
        (`relearn`: the batch shapes changed, so the statistics' shapes are gathered again: one
        all_gather_object); one host read, only when something is checked: the step's one."""
        total = torch.zeros(3, dtype=torch.float32, device=self.device)
        if self.holds_loss:
            scale = self.plan.loss_scale if scale is None else scale
            total[0] += torch.stack(losses).float().sum() * scale
        if check is not None:
            nonfinite.local_flag(check, total[1:2])
        if ids is not None:
            total[2] += ids.to(self.device)
        dist.all_reduce(total, group=self.groups.world)
        stats = self._stats(per_microbatch, relearn) if self.plan.stats else {}
        if check is None and not read_ids:
            return total[0], stats, None, None
        values = total.tolist()     # the step's one host read (the optimizer steps next)
        return (total[0], stats, nonfinite.flagged(values) if check is not None else None,
                values[2] > 0 if read_ids else None)

    def _stats(self, per_microbatch: list[tuple], relearn: bool) -> dict[str, torch.Tensor]:
        """The statistics outputs summed over the global batch (their shapes and dtypes are the
        model's: counts stay integers). The ranks that do not compute them add zeros of the
        shapes learnt once (the first step, and when the batch shapes change)."""
        names = self.plan.stats
        mine = None
        if self.holds_loss and per_microbatch:
            mine = [torch.stack([mb[i] for mb in per_microbatch]).sum(0) for i in range(len(names))]
        if relearn or self._stat_meta is None:
            gathered: list = [None] * dist.get_world_size(self.groups.world)
            meta = None if mine is None else [(tuple(t.shape), t.dtype) for t in mine]
            dist.all_gather_object(gathered, meta, group=self.groups.world)
            self._stat_meta = next(g for g in gathered if g is not None)
        out = {}
        for dtype in dict.fromkeys(d for _, d in self._stat_meta):     # one all-reduce per dtype
            idx = [i for i, (_, d) in enumerate(self._stat_meta) if d == dtype]
            flat = torch.cat([mine[i].reshape(-1).to(self.device) if mine is not None else
                              torch.zeros(math.prod(self._stat_meta[i][0]), dtype=dtype, device=self.device)
                              for i in idx])
            dist.all_reduce(flat, group=self.groups.world)
            for i, part in zip(idx, flat.split([math.prod(self._stat_meta[i][0]) for i in idx])):
                out[names[i]] = part.view(self._stat_meta[i][0])
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's complete state dict (every key, full shapes), on every rank."""
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._my_part(), group=self.groups.world)
        return self.assemble(gathered)

    def _my_part(self) -> dict[str, torch.Tensor]:
        return {n: t.cpu() for n, t in self._held().items()}

    def _held(self) -> dict[str, torch.Tensor]:
        """What this rank contributes: replica 0 sends its dense state, the first ep ranks (one
        per expert slice) their experts (this rank's own tensors, detached)."""
        dp = self.mine.coords["dp"]
        if dp >= self.plan.mesh.ep or self.mine.coords["cp"]:   # cp ranks are replicas
            return {}
        return {n: t.detach() for c in self.mine.chunks for n, t in c.gm.state_dict().items()
                if dp == 0 or n in self.plan.ep_shards}

    # -- onto one rank, one tensor at a time ----------------------------------------------------
    def full_state_dict_iter(self, dst: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, full tensor) of the plain model's state dict, in its key order, on global rank
        `dst`; the other ranks yield nothing. Each tensor's pieces are sent to `dst` point to
        point when it is reached, so `dst` holds one full tensor (plus its pieces) beyond what
        the caller keeps and no other rank ever holds a full tensor it does not own. Collective:
        every rank must exhaust the iterator, in step."""
        pieces, held = self._pieces(), self._held()
        me, keys = self.mine.rank, self._key_names(pieces)
        left = {}                   # canonical name -> keys still to yield (a tie: one tensor)
        for name in keys.values():
            left[name] = left.get(name, 0) + 1
        cache: dict[str, torch.Tensor | None] = {}   # gathered once, kept until its last key
        for key, name in keys.items():
            if name is None:        # state no chunk holds: every rank has it as it was built
                if me == dst:
                    yield key, self.extra_state[key]
                continue
            if name not in cache:
                cache[name] = self._gather_one(name, pieces[name], held, dst)
            full = cache[name]
            left[name] -= 1
            if not left[name]:
                cache[name] = None
            if me == dst:
                yield key, full

    def _pieces(self) -> dict[str, dict[tuple, tuple]]:
        """name -> {(ep index, tp index): (global rank, shape, dtype)}: the rank sending each
        piece of each tensor (the lowest holding it), the same on every rank (metadata only)."""
        mine = {n: (tuple(t.shape), t.dtype) for n, t in self._held().items()}
        every: list = [None] * self.plan.mesh.world_size
        dist.all_gather_object(every, mine, group=self.groups.world)
        out: dict = {}
        for rank, part in enumerate(every):
            for name, meta in part.items():
                out.setdefault(name, {}).setdefault(self._piece_at(name, rank), (rank, *meta))
        return out

    def _piece_at(self, name: str, rank: int) -> tuple[int, int]:
        """(ep index, tp index) of the piece of `name` that global rank `rank` holds."""
        mesh, plan = self.plan.mesh, self.plan
        return (mesh.ep_rank(rank) if name in plan.ep_shards else 0,
                mesh.coords(rank)["tp"] if name in plan.tp_shards else 0)

    def _key_names(self, pieces: dict) -> dict[str, str | None]:
        """State dict key -> canonical name of the tensor gathered for it (None: extra state),
        in the plain model's key order, the keys `assemble` would return."""
        out: dict = {}
        for info in list(self.program.params.values()) + list(self.program.buffers.values()):
            if info.persistent and info.name in pieces:
                out.update({key: info.name for key in (info.name, *info.aliases)})
        out.update({k: None for k in self.extra_state if k not in out})
        return {k: out[k] for k in self.key_order if k in out}

    def _gather_one(self, name: str, where: dict, held: dict, dst: int) -> torch.Tensor | None:
        """The full tensor `name` on `dst` (None elsewhere): each piece's rank sends it."""
        me, group = self.mine.rank, self.groups.world
        parts = {}
        for at in sorted(where):
            src, shape, dtype = where[at]
            if src == me == dst:    # a whole tensor held here is copied: the result must not
                # alias a parameter the next optimizer step changes
                parts[at] = held[name] if len(where) > 1 else held[name].clone()
            elif me == dst:
                parts[at] = torch.empty(shape, dtype=dtype, device=self.device)
                _p2p(dist.irecv, parts[at], src, group)
            elif me == src:
                _p2p(dist.isend, held[name].contiguous(), dst, group)
        return self._join(name, parts).cpu() if me == dst else None

    def _join(self, name: str, parts: dict) -> torch.Tensor:
        """Pieces keyed (ep index, tp index) -> the full tensor: localize cuts experts (dim 0)
        first, then tensor-parallel shards within them; undone in the reverse order."""
        plan, mesh = self.plan, self.plan.mesh
        spec = plan.tp_shards.get(name)
        by_ep = {e: (unshard_tensor([parts[e, t] for t in range(mesh.tp)], spec.dim, spec.sections)
                     if spec is not None else parts[e, 0]) for e in sorted({e for e, _ in parts})}
        if name in plan.ep_shards:
            return torch.cat([by_ep[e] for e in range(mesh.ep)], dim=0)
        return by_ep[0]

    def assemble(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every rank's part (in global rank order) -> the plain model's state dict."""
        pieces: dict = {}       # name -> {(ep index, tp index): tensor}, as _pieces keys them
        for rank, part in enumerate(parts):
            for name, tensor in part.items():
                pieces.setdefault(name, {})[self._piece_at(name, rank)] = tensor
        full = {name: self._join(name, by_at) for name, by_at in pieces.items()}
        out = {}
        for info in list(self.program.params.values()) + list(self.program.buffers.values()):
            for key in (info.name, *info.aliases):
                if info.persistent and info.name in full:
                    out[key] = full[info.name]
        out.update({k: v for k, v in self.extra_state.items() if k not in out})
        return {k: out[k] for k in self.key_order if k in out}
