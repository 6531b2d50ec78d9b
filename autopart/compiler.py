"""autopart.compile: capture, analyse, run the pass list, emit one program per rank.

Runs in one process with no process group, for any mesh size; on the meta device a model with
hundreds of billions of parameters compiles without being allocated.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from autopart import schedule as sched
from autopart.analysis import analyze_costs, evaluate
from autopart.capture import Program, capture
from autopart.errors import AutopartError
from autopart.mesh import Mesh
from autopart.pass_runner import PassResult, run_passes
from autopart.localize import localize_module
from autopart.ep_ops import localize_experts
from autopart.passes.shard_experts import COMM as EP_COMM
from autopart.passes.cut_pipeline_stages import cut_pipeline_stages
from autopart.passes.emit_rank_programs import ChunkProgram, emit_rank_programs
from autopart.passes.shard_experts import shard_experts
from autopart.passes.split_tensor_parallel import split_tensor_parallel


@dataclass(frozen=True)
class Plan:
    """What was decided, as plain printable data."""
    mesh: Mesh
    schedule: str
    microbatches: int
    virtual_stages: int
    global_batch: int
    microbatch_size: int
    chunk_ranks: tuple[int, ...]           # chunk k -> pipeline rank
    chunk_layers: tuple[tuple[str, ...], ...]
    shared_params: dict[str, tuple[int, ...]]
    sequence_parallel: bool = False
    tp_shards: dict = field(default_factory=dict)   # param name -> ParamShard (tensor parallel)
    ep_shards: dict = field(default_factory=dict)   # expert param name -> ParamShard(0, (E,))


@dataclass
class RankProgram:
    """Everything one global rank runs: its chunks, in chunk order."""
    rank: int
    coords: dict[str, int]
    chunks: tuple[ChunkProgram, ...]

    @property
    def code(self) -> str:
        return "\n".join(c.code for c in self.chunks)

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by the plain model's names (each tensor once)."""
        out: dict[str, torch.Tensor] = {}
        for c in self.chunks:
            for name in c.params:
                out.setdefault(name, c.gm.get_parameter(name))
        return out


@dataclass
class Compiled:
    """The result of `autopart.compile`: per-rank programs, the plan and the pass reports."""
    program: Program
    plan: Plan
    programs: dict[int, RankProgram]
    schedule: Any
    simulation: Any
    passes: list[PassResult]
    seconds: float
    costs: dict = field(repr=False, default_factory=dict)

    def explain(self) -> str:
        from autopart.explain import explain_table
        return explain_table(self)

    def to_json(self) -> dict:
        from autopart.explain import explain_json
        return explain_json(self)


def compile(model: nn.Module, mesh: Mesh, example_inputs: tuple, *, loss_fn: Callable | None = None,
            target: torch.Tensor | None = None, microbatches: int = 1, schedule: str = "1f1b",
            virtual_stages: int = 1, sequence_parallel: bool = False,
            dump_dir: str | None = None) -> Compiled:
    """Compile `model` for `mesh`; `example_inputs` is one global batch (dim 0 = batch).

    >>> import torch, autopart
    >>> from examples.gpt import GPT
    >>> c = autopart.compile(GPT("tiny"), autopart.Mesh(pp=2), (torch.zeros(4, 64, dtype=torch.long),),
    ...                      microbatches=2)
    >>> len(c.programs), c.programs[1].chunks[0].is_last
    (2, True)
    """
    start = time.perf_counter()
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    mbs = _microbatch_size(example_inputs, mesh, microbatches)
    if sequence_parallel and mesh.tp == 1:
        raise AutopartError("sequence_parallel=True shards the sequence over the tp axis, but the "
                            f"mesh has tp=1 ({mesh}).\n  remedy: use a mesh with tp > 1, or drop "
                            "sequence_parallel")
    the_schedule = sched.make_schedule(schedule, mesh.pp, microbatches, virtual_stages)
    program = _capture(model, example_inputs, loss_fn, target, mbs)
    # shard_experts first: split_tensor_parallel then counts each expert weight as 1/ep a rank's
    # (the rewritten graphs are the same in either order)
    experts = [("shard_experts", shard_experts, dict(ep=mesh.ep, microbatch_size=mbs, dp=mesh.dp))] \
        if mesh.ep > 1 else []
    passes = [
        *experts,
        ("split_tensor_parallel", split_tensor_parallel,
         dict(tp=mesh.tp, sequence_parallel=sequence_parallel)),
        ("analyze_costs", analyze_costs, {}),
        ("cut_pipeline_stages", cut_pipeline_stages,
         dict(pp=mesh.pp, virtual_stages=virtual_stages, microbatch_size=mbs)),
        ("emit_rank_programs", emit_rank_programs, {}),
    ]
    program, results = run_passes(program, passes, dump_dir)
    stages = program.decisions["stages"]
    tp_plan = program.decisions.get("tp")
    ep_plan = program.decisions.get("ep")
    plan = Plan(mesh, the_schedule.name, microbatches, virtual_stages,
                int(example_inputs[0].shape[0]), mbs,
                tuple(stages.rank_of_chunk(c) for c in range(stages.num_chunks)),
                stages.chunk_layers, stages.shared_params, sequence_parallel,
                dict(tp_plan.params) if tp_plan is not None else {},
                dict(ep_plan.params) if ep_plan is not None and mesh.ep > 1 else {})
    programs = RankPrograms(mesh, tuple(program.decisions["chunks"]), tp_plan, ep_plan)
    sim = _simulate(the_schedule, stages.chunk_cost)
    return Compiled(program, plan, programs, the_schedule, sim, results,
                    time.perf_counter() - start, program.decisions["costs"])


class RankPrograms(Mapping):
    """rank -> RankProgram, made on first access: with tensor parallelism each (pp, tp) pair
    holds its own weight shards, and a 3072-rank mesh need not build 3072 programs to inspect
    one of them. With expert parallelism each expert-parallel rank (dp index mod ep) also holds
    its own experts."""

    def __init__(self, mesh: Mesh, chunks: tuple, tp_plan, ep_plan=None):
        self.mesh, self.chunks, self.tp_plan, self.ep_plan = mesh, chunks, tp_plan, ep_plan
        self._cache: dict[tuple[int, int, int], tuple] = {}

    def __getitem__(self, rank: int) -> RankProgram:
        c = self.mesh.coords(rank)
        ep_rank = c["dp"] % self.mesh.ep
        key = (c["pp"], c["tp"], ep_rank)
        if key not in self._cache:
            mine = [ch for ch in self.chunks if ch.rank == c["pp"]]
            if self.tp_plan is not None and self.mesh.tp > 1:
                mine = [dataclasses.replace(ch, gm=localize_module(
                    ch.gm, self.tp_plan.params, self.mesh.tp, c["tp"], copy=False)) for ch in mine]
            if self.ep_plan is not None and self.mesh.ep > 1:
                mine = [dataclasses.replace(ch, gm=localize_experts(
                    ch.gm, self.ep_plan.params, self.mesh.ep, ep_rank, copy=False))
                    if hasattr(ch.gm, EP_COMM) else ch for ch in mine]
            self._cache[key] = tuple(mine)
        return RankProgram(rank, c, self._cache[key])

    def __iter__(self):
        return iter(range(self.mesh.world_size))

    def __len__(self) -> int:
        return self.mesh.world_size

    def distinct(self) -> list[RankProgram]:
        """One program per (pipeline rank, tensor-parallel rank, expert-parallel rank): the ones
        that differ."""
        return [self[self.mesh.rank(pp=p, dp=e, tp=t)] for p in range(self.mesh.pp)
                for e in range(self.mesh.ep) for t in range(self.mesh.tp)]


def _microbatch_size(inputs: tuple, mesh: Mesh, microbatches: int) -> int:
    if not inputs or not isinstance(inputs[0], torch.Tensor) or inputs[0].dim() == 0:
        raise AutopartError("example_inputs must hold at least one tensor whose dim 0 is the batch")
    batch = int(inputs[0].shape[0])
    if microbatches < 1:
        raise AutopartError(f"microbatches={microbatches} must be >= 1")
    if batch % (mesh.dp * microbatches):
        per = mesh.dp * microbatches
        ok = [m for m in range(1, batch + 1) if batch % (mesh.dp * m) == 0]
        raise AutopartError(
            f"global batch {batch} does not split into dp={mesh.dp} replicas x {microbatches} "
            f"microbatches (needs a multiple of {per}).\n  remedy: use a global batch that is a "
            f"multiple of {per}, or microbatches in {ok or '[none: change dp]'}")
    return batch // (mesh.dp * microbatches)


def _capture(model, inputs, loss_fn, target, mbs) -> Program:
    """Capture at a microbatch (at least 2 rows, so the batch size stays symbolic)."""
    rows = max(mbs, 2)

    def take(t):
        if t is None:
            return None
        reps = -(-rows // t.shape[0])
        t = t.repeat(reps, *([1] * (t.dim() - 1))) if reps > 1 else t
        return t[:rows]

    program = capture(model, tuple(take(t) for t in inputs), loss_fn=loss_fn, target=take(target))
    if not program.dynamic and rows != mbs:   # static graph: it must be the microbatch's own
        program = capture(model, tuple(t[:mbs] for t in inputs), loss_fn=loss_fn,
                          target=None if target is None else target[:mbs])
    return program


def _simulate(schedule, chunk_cost):
    per_chunk_f = [c / 3.0 for c in chunk_cost]      # forward is a third of forward+backward
    per_chunk_b = [2.0 * c / 3.0 for c in chunk_cost]
    return sched.simulate(schedule, forward_cost=per_chunk_f, backward_cost=per_chunk_b)


__all__ = ["compile", "Compiled", "Plan", "RankProgram", "evaluate", "json"]
