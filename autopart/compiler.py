"""autopart.compile: capture, analyse, run the pass list, emit one program per rank.

Runs in one process with no process group, for any mesh size; on the meta device a model with
hundreds of billions of parameters compiles without being allocated.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from autopart import schedule as sched
from autopart._version import __version__
from autopart.arguments import check_arguments
from autopart.config import Config, check_fp8, choices, from_options
from autopart.capture import capture, check_on_example, input_specs
from autopart.errors import AutopartError
from autopart.gc_paused import gc_paused
from autopart.ir import REDUCED_DTYPES, ContextParallelPlan, Plan, Program, RankProgram
from autopart.localize import localize_chunk
from autopart.mesh import Mesh
from autopart.pass_runner import Pass, PassResult, run_passes
from autopart.passes.analyze_costs import analyze_costs
from autopart.passes.cut_pipeline_stages import cut_pipeline_stages
from autopart.passes.emit_rank_programs import emit_rank_programs
from autopart.passes.recompute_activations import recompute_activations
from autopart.passes.gather_parameters import gather_parameters
from autopart.passes.fp8_linears import fp8_linears
from autopart.passes.overlap_collectives import overlap_collectives
from autopart.passes.overlap_experts import overlap_experts
from autopart.passes.shard_experts import shard_experts
from autopart.passes.split_context_parallel import prove_token_islands, split_context_parallel
from autopart.passes.split_context_parallel.documents import document_inputs
from autopart.passes.split_tensor_parallel import split_tensor_parallel
from autopart.passes.split_backward import split_backward
from autopart.passes.weigh_loss_by_tokens import weigh_loss_by_tokens


def pass_list(mesh: Mesh, config: Config = Config(), *, microbatch_size: int,
              chunk_ranks: tuple[int, ...], schedule: sched.Schedule | None = None) -> list[Pass]:
    """The compiler's passes in order, with the Program fields each reads and fills.

    shard_experts runs first (ep > 1 only), so that split_tensor_parallel counts each expert
    weight as 1/ep of a rank's; the cost analysis runs after both, so costs, activation sizes and
    boundary shapes are per rank; the cut sees what each rank really sends. weigh_loss_by_tokens
    runs before them all: it rewrites the loss the tensor-parallel pass then splits.
    split_context_parallel runs after tensor parallelism (it replaces attention on each rank's
    heads) and before the costs, which it makes per rank: each rank's sequence is S / cp.
    The memory-model passes are handed `config` whole (checked where the user wrote it,
    autopart/config.py) and `mesh`; the others the numbers they read."""
    c = config
    budget, sequence_parallel = c.memory_budget, c.sequence_parallel    # bytes per rank
    memory = dict(config=c, mesh=mesh, schedule=schedule, microbatch_size=microbatch_size)
    splits = c.microbatches * mesh.dp * mesh.cp     # the pieces the global batch is cut into
    experts = [Pass("shard_experts", shard_experts, requires=(), provides=("ep",),
                    options=dict(ep=mesh.ep, microbatch_size=microbatch_size, dp=mesh.dp))]
    cp_options = dict(cp=mesh.cp, tp=mesh.tp, sequence_parallel=sequence_parallel)
    return [
        Pass("weigh_loss_by_tokens", weigh_loss_by_tokens, requires=(), provides=("loss_rule",),
             options=dict(splits=splits)),
        # on the plain model: shard_experts' all-to-alls and tp's splits cannot run in one process
        *([Pass("prove_token_islands", prove_token_islands, requires=(),
                provides=("cp_islands",), options=cp_options)] if mesh.cp > 1 else []),
        *(experts if mesh.ep > 1 else []),
        Pass("split_tensor_parallel", split_tensor_parallel, requires=(), provides=("tp",),
             options=dict(tp=mesh.tp, sequence_parallel=sequence_parallel),
             after=("shard_experts", "weigh_loss_by_tokens")),
        *([Pass("split_context_parallel", split_context_parallel,
                requires=("tp", "loss_rule", "cp_islands"), provides=("cp",),
                options=dict(cp_options, attention=c.cp_attention))]
          if mesh.cp > 1 else []),
        Pass("analyze_costs", analyze_costs, requires=("tp",), provides=("costs",),
             after=("split_context_parallel",)),
        Pass("cut_pipeline_stages", cut_pipeline_stages, requires=("costs",), provides=("stages",),
             options=dict(memory, chunk_ranks=chunk_ranks)),
        Pass("emit_rank_programs", emit_rank_programs, requires=("stages", "tp"),
             provides=("chunks",)),
        # precision="fp8": the emitted chunks' linears as FP8 GEMMs (the cut and costs are the
        # bf16 program's); before split_backward, which traces the final chunks
        *([Pass("fp8_linears", fp8_linears, requires=("chunks",), provides=("fp8",),
                options=dict(scaling=c.fp8_scaling, layers=c.fp8_linears, zero=c.zero))]
          if c.precision == "fp8" else []),
        # after emit: it rewrites the emitted chunks, and its memory model needs the cut and
        # costs; only when asked (a recompute mode, or a budget to check)
        *([Pass("recompute_activations", recompute_activations,
                requires=("chunks", "costs", "stages"), provides=("recompute",),
                options=memory)]
          if c.recompute != "none" or budget is not None else []),
        # zero=3: where each layer's parameters are all-gathered and freed; after recompute,
        # whose regions then read gathered parameters in their replay too
        # (under a budget it weighs which groups stay gathered with the memory model, which
        # reads the cut and the costs)
        *([Pass("gather_parameters", gather_parameters,
                requires=("chunks",) + (("costs", "stages") if budget is not None else ()),
                provides=("param_groups",), options=memory,
                after=("recompute_activations",))] if c.zero == 3 else []),
        # zero-bubble schedules only (I/W actions): the chunks' backwards as I and W programs,
        # traced from the final chunks (recomputation's rewrite included)
        # tp's backward all-reduce behind the weight gradients: last, on the final chunks (every
        # pass before sees the plain ops); not where W runs the weight gradients apart
        *([Pass("overlap_collectives", overlap_collectives, requires=("chunks", "tp"),
                provides=("overlap",),
                after=("recompute_activations", "gather_parameters", "fp8_linears"))]
          if c.overlap and mesh.tp > 1 and not _splits_backward(schedule) else []),
        # ep's all-to-alls behind the other microbatch of a pair (runtime/executor.py runs a
        # pair where the schedule has two computes of a chunk adjacent: pairs_microbatches)
        # (pairs_microbatches), or beside another microbatch's backward where the schedule
        # combines them (combines_forward_backward: the forwards cut into segments)
        *([Pass("overlap_experts", overlap_experts, requires=("chunks", "ep"), provides=(),
                options=dict(segments=combines_forward_backward(c, mesh)),
                after=("recompute_activations", "gather_parameters", "fp8_linears",
                       "overlap_collectives"))]
          if combines_forward_backward(c, mesh)
          or (pairs_microbatches(c, mesh) and takes_pairs(schedule)) else []),
        *([Pass("split_backward", split_backward, requires=("chunks",),
                provides=("split_backward",), options=dict(microbatch_size=microbatch_size),
                after=("recompute_activations", "fp8_linears"))] if _splits_backward(schedule) else []),
    ]


def pairs_microbatches(config: Config, mesh: Mesh) -> bool:
    """Whether the schedule takes microbatches two at a time (overlap_experts): ep > 1 with
    the overlap on, an even number of microbatches, a schedule whose backward is one B, and
    not zero=3 (the runtime swaps its chunk programs' parameters for gathered shards:
    runtime/param_shards.py; a paired program built before would read the slices)."""
    return bool(config.overlap and mesh.ep > 1 and config.microbatches % 2 == 0
                and config.schedule in ("1f1b", "gpipe", "interleaved-1f1b") and config.zero != 3
                and not combines_forward_backward(config, mesh))


def combines_forward_backward(config: Config, mesh: Mesh) -> bool:
    """Whether the runtime runs each forward that the schedule puts next to a backward of
    another microbatch beside it, each side's all-to-alls behind the other's compute
    (runtime/executor.py combined_computes): ep > 1 with the overlap on, the interleaved 1F1B
    under pipeline parallelism, and not zero=3 (as pairs_microbatches). Interleaved 1F1B's
    steady state already runs a forward of one chunk and a backward of another with no
    transfer between them (Megatron's slots), as Megatron-Core's combined 1F1B needs (it
    overlaps the all-to-alls under pp only with virtual stages too): no schedule change, no
    more activations. A plain 1F1B has no such pair that a rank can run without waiting for
    its neighbour's pair (its forward's input comes from that pair's forward, its
    backward's gradient from that pair's end): there the microbatches go two at a time
    (pairs_microbatches)."""
    return bool(config.overlap and mesh.ep > 1 and mesh.pp > 1
                and config.schedule == "interleaved-1f1b" and config.zero != 3)


def takes_pairs(schedule: sched.Schedule | None) -> bool:
    """Whether each rank's computes come two at a time, microbatch 2u then 2u + 1."""
    if schedule is None:
        return False
    for actions in schedule.ranks:
        computes = [a for a in actions if a.kind in (sched.Kind.F, sched.Kind.B)]
        if len(computes) % 2 or any((a.chunk, a.kind, a.microbatch + 1) != (b.chunk, b.kind,
                                                                           b.microbatch)
                                    or a.microbatch % 2 for a, b in zip(computes[::2],
                                                                        computes[1::2])):
            return False
    return True


def make_schedule(config: Config, mesh: Mesh) -> sched.Schedule:
    """The schedule compile() runs: config's, or with pairs_microbatches its pair of each
    action (autopart/schedule_lowering.py pair_microbatches) where that unit schedule exists."""
    args = (config.schedule, mesh.pp, config.microbatches, config.virtual_stages)
    if pairs_microbatches(config, mesh):
        from autopart.schedule_lowering import pair_microbatches
        try:
            return pair_microbatches(*args)
        except sched.ScheduleError:     # e.g. interleaved 1F1B over microbatches / 2 units
            pass
    return sched.make_schedule(*args)


def _splits_backward(schedule: sched.Schedule | None) -> bool:
    return schedule is not None and any(a.kind in (sched.Kind.I, sched.Kind.W)
                                        for actions in schedule.ranks for a in actions)


def _check_zero(zero: int, mesh: Mesh, schedule: sched.Schedule) -> None:
    """Refuse what zero=3 does not train right: a backward split into I and W programs (the
    zero-bubble schedules) traces the gather ops' autograd away."""
    if zero == 3 and _splits_backward(schedule):
        raise AutopartError(
            f"zero=3 with schedule={schedule.name!r}: the zero-bubble schedules run each "
            "chunk's backward as separate input-gradient (I) and weight-gradient (W) programs, "
            "which do not re-gather zero=3's freed parameters.\n  remedy: zero=2 with "
            f"{schedule.name!r} (parameters whole, gradients and optimizer state sharded), or "
            "zero=3 with a fused-backward schedule (1f1b, interleaved-1f1b, gpipe)")


_DEVICES = "cuda|xpu|mps|hpu|npu|mtia|meta|cpu|privateuseone"
_DEVICE_INDEX = re.compile(rf"device\(type='({_DEVICES})', index=\d+\)")
_DEVICE_TEXT = re.compile(rf"""(['"])({_DEVICES}):\d+\1""")


def device_free(code: str) -> str:
    """`code` with device indices dropped (`device(type='cuda', index=3)` -> `device(type='cuda')`,
    'cuda:3' -> 'cuda'): the text every rank of one program prints, whichever GPU it runs on."""
    return _DEVICE_TEXT.sub(r"\1\2\1", _DEVICE_INDEX.sub(r"device(type='\1')", code))


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
    # saved-tensor counts of the distinct chunks, made by the program check's fake runs and
    # read by the memory table (one fake run per distinct chunk serves both)
    activation_runs: Any = field(repr=False, default=None)
    # what train_step must be given, per input: shapes, dtypes, embedding tables (capture.py)
    input_specs: tuple = field(repr=False, default=())
    # a hash of the captured graph's code (parallelize: the one rank 0 captured): ranks whose
    # programs differ while this agrees received the same capture, so their options or autopart
    # versions differ (runtime/groups.check_same_program says which)
    traced: str = field(repr=False, default="")
    # the program check's report: {"checked": distinct programs run, "skipped": [...]}
    check: dict = field(repr=False, default_factory=dict)

    @property
    def config(self) -> Config:
        """The options it was compiled with (and the runtime's: nonfinite, compile, bucket
        size): the plan's, the one copy."""
        return self.plan.config

    @functools.cached_property
    def memory(self):
        """rank -> {params, grads, master, optimizer, activations, buffers, total} in bytes, for
        any global rank, built on first access (autopart.memory)."""
        from autopart.memory import MemoryTable
        return MemoryTable(self)

    def digest(self) -> str:
        """A short hash of what every rank must agree on: autopart's version, the plan, each
        chunk's code, and every parameter's name, shape and dtype. Ranks whose digests differ
        compiled different programs (another model, configuration or autopart version). Device
        indices are not part of it: rank r on cuda:r prints `device(type='cuda', index=r)`
        for ops like `arange`, the same program on every rank (device_free)."""
        # sets print in an order that depends on the process's string hash seed: sort them
        plan = dataclasses.replace(self.plan, sp_grad_reduce=tuple(sorted(self.plan.sp_grad_reduce)))
        h = hashlib.sha256(f"{__version__}\n{plan!r}\n".encode())
        for chunk in self.program.chunks:
            h.update(device_free(chunk.code).encode())
        for info in self.program.params.values():
            h.update(f"{info.name}{tuple(info.shape)}{info.dtype}".encode())
        return h.hexdigest()[:16]

    def explain(self) -> str:
        from autopart.explain import explain_table
        return explain_table(self)

    def to_json(self) -> dict:
        from autopart.explain import explain_json
        return explain_json(self)


@gc_paused
def compile(model: nn.Module, mesh: Mesh, example_inputs: tuple, *, loss_fn: Callable | None = None,
            target: torch.Tensor | None = None, config: Config | None = None,
            microbatches: int | None = None, schedule: str | None = None,
            virtual_stages: int | None = None, sequence_parallel: bool | None = None,
            dump_dir: str | None = None, recompute: str | None = None,
            memory_budget: str | int | None = None, optimizer: str | None = None,
            precision: str | None = None, zero: int | None = None, cp_attention: str | None = None,
            fp8_scaling: str | None = None, fp8_linears: str | None = None,
            overlap: bool | None = None,
            capture_once: Callable[[Callable[[], Program]], Program] | None = None,
            trace_device: torch.device | str | None = None) -> Compiled:
    """Compile `model` for `mesh`; `example_inputs` is one global batch (dim 0 = batch).

    The options are `autopart.Config`'s fields (autopart/config.py, where their values and
    defaults are written): pass `config=Config(...)`, or any of them as keywords, which override
    the config's. A wrong value fails here, before anything is traced.

    `capture_once` (parallelize passes one): given the capture (a function of no arguments
    returning the captured Program), returns the Program every rank compiles: rank 0 captures,
    the others receive its graph (autopart/one_program.py).

    `trace_device` (a meta-device model; parallelize passes the ranks' device type): trace its
    forward as if on that device, so code that branches on a tensor's device takes the ranks'
    branch (autopart/capture.py).

    >>> import torch, autopart
    >>> from examples.gpt import GPT
    >>> c = autopart.compile(GPT("tiny"), autopart.Mesh(pp=2), (torch.zeros(4, 64, dtype=torch.long),),
    ...                      microbatches=2)
    >>> len(c.programs), c.programs[1].chunks[0].is_last
    (2, True)
    """
    start = time.perf_counter()
    cfg = from_options(config, dict(
        microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
        sequence_parallel=sequence_parallel, recompute=recompute, memory_budget=memory_budget,
        optimizer=optimizer, precision=precision, zero=zero, cp_attention=cp_attention,
        fp8_scaling=fp8_scaling, fp8_linears=fp8_linears, overlap=overlap))
    example_inputs = check_arguments(model, mesh, example_inputs, loss_fn, target)
    return compile_checked(model, mesh, example_inputs, cfg, loss_fn=loss_fn, target=target,
                           dump_dir=dump_dir, capture_once=capture_once,
                           trace_device=trace_device, start=start)


@gc_paused
def compile_checked(model: nn.Module, mesh: Mesh, example_inputs: tuple, cfg: Config, *,
                    loss_fn: Callable | None = None, target: torch.Tensor | None = None,
                    dump_dir: str | None = None,
                    capture_once: Callable[[Callable[[], Program]], Program] | None = None,
                    trace_device: torch.device | str | None = None,
                    start: float | None = None) -> Compiled:
    """`compile` past its checks: `cfg` is the checked Config and `example_inputs` the tuple
    check_arguments returned, both checked where the user wrote them (compile, or parallelize,
    which checks them before any process-group call and hands them here unchecked again)."""
    start = time.perf_counter() if start is None else start
    mbs = _microbatch_size(example_inputs, mesh, cfg.microbatches)
    if cfg.sequence_parallel and mesh.tp == 1:
        raise AutopartError("sequence_parallel=True shards the sequence over the tp axis, but the "
                            f"mesh has tp=1 ({mesh}).\n  remedy: use a mesh with tp > 1, or drop "
                            "sequence_parallel")
    the_schedule = make_schedule(cfg, mesh)
    _check_zero(cfg.zero, mesh, the_schedule)
    check_fp8(cfg, mesh)

    def captured() -> Program:
        return _capture(model, example_inputs, loss_fn, target, mbs, trace_device)

    program = captured() if capture_once is None else capture_once(captured)
    # what check_same_program compares when the ranks' programs differ
    traced = "" if capture_once is None else hashlib.sha1(
        device_free(program.gm.code).encode()).hexdigest()[:16]
    # what train_step must be given; before the passes rewrite the embeddings
    specs = input_specs(program, example_inputs + ((target,) if target is not None else ()))
    passes = pass_list(mesh, cfg, microbatch_size=mbs, chunk_ranks=the_schedule.chunk_ranks,
                       schedule=the_schedule)
    # no cp axis: the packed documents' ids the masks read, proved on the plain program, for
    # train_step's check (runtime/document_ids.py); under cp split_context_parallel records them
    documents = document_inputs(program) if mesh.cp == 1 else ()
    program, results = run_passes(program, passes, dump_dir)
    if program.cp is None:
        program = program.replace(cp=ContextParallelPlan(1, cfg.cp_attention, documents=documents))
    stages = program.stages
    if stages.num_chunks != the_schedule.num_chunks:
        raise AutopartError(f"internal: the stage plan has {stages.num_chunks} chunks but the "
                            f"{the_schedule.name} schedule runs {the_schedule.num_chunks}")
    plan = Plan(mesh, cfg, global_batch=int(example_inputs[0].shape[0]), microbatch_size=mbs,
                chunk_ranks=stages.chunk_ranks, chunk_layers=stages.chunk_layers,
                shared_params=stages.shared_params,
                tp_shards=dict(program.tp.params) if mesh.tp > 1 else {},
                ep_shards=dict(program.ep.params) if mesh.ep > 1 else {},
                sp_grad_reduce=frozenset(program.tp.sp_grad_reduce), stats=program.stats,
                loss_rule=program.loss_rule)
    sim = _simulate(the_schedule, stages.chunk_cost)
    compiled = Compiled(program, plan, RankPrograms(plan, program.chunks), the_schedule, sim,
                        results, time.perf_counter() - start, program.costs,
                        input_specs=specs, traced=traced)
    # every distinct rank program runs forward and backward on fake tensors before it is handed
    # out: a program that cannot run fails here, naming the node (autopart/check_programs.py)
    from autopart.check_programs import check_rank_programs
    from autopart.memory import ActivationCache
    compiled.activation_runs = ActivationCache(REDUCED_DTYPES[cfg.precision])
    compiled.check = check_rank_programs(compiled, compiled.activation_runs)
    from autopart.memory import check_budget
    check_budget(compiled)      # after the check: its fake runs count the activations
    compiled.seconds = time.perf_counter() - start
    return compiled


PRECISIONS = choices("precision")          # written once, in autopart/config.py
CP_ATTENTIONS = choices("cp_attention")


class RankPrograms(Mapping):
    """rank -> RankProgram, made on first access: with tensor parallelism each (pp, tp) pair
    holds its own weight shards, and a 3072-rank mesh need not build 3072 programs to inspect
    one of them. With expert parallelism each expert-parallel rank also holds its own experts.

    `programs[rank]` views the full weights (inspection); `programs.instantiate(rank)` is a
    fresh copy that owns its shards, for a rank that runs it."""

    def __init__(self, plan: Plan, chunks: tuple):
        self.plan, self.mesh, self.chunks = plan, plan.mesh, chunks
        self._cache: dict[tuple[int, int, int], tuple] = {}

    def __getitem__(self, rank: int) -> RankProgram:
        c = self.mesh.coords(rank)
        key = (c["pp"], c["tp"], self.mesh.ep_rank(rank))
        if key not in self._cache:
            self._cache[key] = self._chunks(rank, copy=False)
        return RankProgram(rank, c, self._cache[key])

    def instantiate(self, rank: int) -> RankProgram:
        """Rank `rank`'s program with its own copies of its weight shards (not cached)."""
        return RankProgram(rank, self.mesh.coords(rank), self._chunks(rank, copy=True))

    def _chunks(self, rank: int, copy: bool) -> tuple:
        c = self.mesh.coords(rank)
        made: dict = {}     # one slice per shared tensor on this rank (see localize_module)
        return tuple(localize_chunk(ch, self.plan, c["tp"], self.mesh.ep_rank(rank), copy=copy,
                                    made=made)
                     for ch in self.chunks if ch.rank == c["pp"])

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
    if batch % (mesh.dp * microbatches):
        per = mesh.dp * microbatches
        ok = [m for m in range(1, batch + 1) if batch % (mesh.dp * m) == 0]
        raise AutopartError(
            f"global batch {batch} does not split into dp={mesh.dp} replicas x {microbatches} "
            f"microbatches (needs a multiple of {per}).\n  remedy: use a global batch that is a "
            f"multiple of {per}, or microbatches in {ok or '[none: change dp]'}")
    return batch // (mesh.dp * microbatches)


def _capture(model, inputs, loss_fn, target, mbs, device=None) -> Program:
    """Capture at a microbatch (at least 2 rows, so the batch size stays symbolic)."""
    rows = max(mbs, 2)

    def take(t):
        if t is None:
            return None
        reps = -(-rows // t.shape[0])
        t = t.repeat(reps, *([1] * (t.dim() - 1))) if reps > 1 else t
        return t[:rows]

    args = tuple(take(t) for t in inputs)
    whole = tuple(inputs) + ((target,) if target is not None else ())
    program = capture(model, args, loss_fn=loss_fn, target=take(target), device=device)
    if not program.dynamic and rows != mbs:   # static graph: it must be the microbatch's own
        args = tuple(t[:mbs] for t in inputs)
        program = capture(model, args, loss_fn=loss_fn,
                          target=None if target is None else target[:mbs], device=device)
        target = None if target is None else target[:mbs]
    else:
        target = take(target)
    check_on_example(program, args + ((target,) if target is not None else ()), whole)
    return program


def _simulate(schedule, chunk_cost):
    per_chunk_f = [c / 3.0 for c in chunk_cost]      # forward is a third of forward+backward
    per_chunk_b = [2.0 * c / 3.0 for c in chunk_cost]
    return sched.simulate(schedule, forward_cost=per_chunk_f, backward_cost=per_chunk_b)


__all__ = ["Compiled", "Plan", "RankProgram", "RankPrograms", "compile", "compile_checked",
           "pass_list"]
