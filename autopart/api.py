"""The front door: `parallelize` compiles a model and hands this rank's share to the runtime.

autopart/compiler.py compiles (one process, no groups); runtime/ executes a compiled plan on real
processes and imports no compiler, planner, pass or command-line module; this module is the one
place that does both, in the order a rank needs them: options checked, the mesh chosen (planner)
when asked, the program compiled, the ParallelModel built over the rank's process groups.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from autopart.arguments import check_arguments
from autopart.compiler import compile_checked
from autopart.config import Config, from_options
from autopart.errors import AutopartError
from autopart.materialize import RankWeights, is_meta
from autopart.mesh import Mesh
from autopart.one_program import capture_once
from autopart.runtime.groups import check_world_size
from autopart.runtime.parallel_model import DEFAULT_TIMEOUT, ParallelModel
from autopart.runtime.trace import trace_path


def parallelize(model: nn.Module, mesh: Mesh | str, example_inputs: tuple, *,
                loss_fn: Callable | None = None, target: torch.Tensor | None = None,
                config: Config | None = None, microbatches: int | None = None,
                schedule: str | None = None, virtual_stages: int | None = None,
                sequence_parallel: bool | None = None, recompute: str | None = None,
                memory_budget: str | int | None = None, optimizer: str | None = None,
                timeout: timedelta = DEFAULT_TIMEOUT, seed: int | None = None,
                init_fn: Callable | None = None, trace: str | None = None,
                zero: int | None = None, nonfinite: str | None = None,
                precision: str | None = None, compile: bool | str | None = None,
                zero_bucket_size: int | None = None,
                cp_attention: str | None = None, fp8_scaling: str | None = None,
                fp8_linears: str | None = None, overlap: bool | None = None,
                batch_check_every: int | None = None) -> ParallelModel:
    """Compile `model` for `mesh` and return this rank's ParallelModel (collective: every rank).

    The options are `autopart.Config`'s fields (autopart/config.py: their values, defaults and
    meaning): pass `config=Config(...)`, or any of them as keywords, which override the config's.

    `example_inputs` (and `target`, when `loss_fn` takes one) is a global batch with the shapes
    train_step will get. Rank 0 alone captures the model; the other ranks compile the graph it
    sends (autopart/one_program.py), so every rank compiles one program. `mesh="auto"`: the planner chooses the mesh and, of microbatches,
    schedule, virtual_stages and recompute, those the user left unset, for the world size on the
    `local` cluster (`autopart calibrate`), and says what it chose and what it kept.

        mesh = autopart.Mesh(pp=2, dp=2)
        pm = autopart.parallelize(model, mesh, (tokens,), loss_fn=lm_loss, target=targets,
                                  microbatches=4)
        loss = pm.train_step(tokens, target=targets); opt.step(); opt.zero_grad()

    `trace="t.json"` (or AUTOPART_TRACE=t.json on every rank) records every action each rank
    runs, with start and end times, into one Chrome / Perfetto trace written by rank 0 after
    each train_step (autopart/runtime/trace.py).

    `precision="bf16"`: compute in bf16 under autocast, parameters (the master weights the
    optimizer steps), gradients and the loss in fp32, pipeline transfers in bf16
    (autopart/runtime/step.py).

    `compile=True`: the chunk programs run through Inductor, each distinct layer compiled once
    and reused by its repeats (autopart/runtime/compiled.py); `explain()` then adds this rank's
    compile seconds. `compile="cudagraphs"` (CUDA, static shapes): the compiled segments also
    replay as CUDA graphs. With precision="bf16" each segment is traced under the step's
    autocast, so its graph holds the casts, and AOTAutograd runs the artifact with autocast off.

    A mesh with `cp` > 1 shards the sequence over context-parallel ranks (passes/
    split_context_parallel): each rank holds sequence chunks i and 2*cp-1-i, attention runs as
    `cp_attention="ring"` (K/V passed peer to peer) or `"allgather"`.

    `zero_bucket_size` (zero=1): gradient elements per reduce-scatter and all-gather (default
    40M, Megatron-LM's bucket size); a rank's transient memory for them is one bucket
    (autopart/runtime/optimizer.py).
    """
    given = dict(microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
                 sequence_parallel=sequence_parallel, recompute=recompute,
                 memory_budget=memory_budget, optimizer=optimizer, precision=precision,
                 zero=zero, nonfinite=nonfinite, compile=compile,
                 zero_bucket_size=zero_bucket_size, cp_attention=cp_attention,
                 fp8_scaling=fp8_scaling, fp8_linears=fp8_linears, overlap=overlap,
                 batch_check_every=batch_check_every)
    # option values first, before any process-group call (autopart/config.py)
    cfg = from_options(config, given)
    if not dist.is_initialized():
        raise AutopartError("autopart.parallelize needs torch.distributed.init_process_group "
                            "first (or use autopart.compile to inspect without processes)")
    if isinstance(mesh, str) and mesh == "auto":   # the planner chooses (autopart/planner/auto.py)
        from autopart.planner.auto import choose
        fixed = {**cfg.changed(), **{k: v for k, v in given.items() if v is not None}}
        mesh, cfg = choose(model, example_inputs, loss_fn, target, dist.get_world_size(), cfg,
                           fixed=fixed, rank=dist.get_rank(),
                           broadcast=lambda objs: dist.broadcast_object_list(objs, src=0))
    # before compiling: a rank outside a smaller mesh would otherwise fail on its own, differently
    meta = is_meta(model)
    if meta:   # a meta-device model compiles on meta inputs; each rank allocates only its shards
        example_inputs, target = _on_meta(example_inputs), _on_meta(target)
    example_inputs = check_arguments(model, mesh, example_inputs, loss_fn, target)
    check_world_size(mesh)
    device = _device_of(model)
    to = torch.device("meta") if meta else device
    example_inputs = tuple(t.to(to) for t in example_inputs)
    target = target.to(to) if target is not None else None
    # options and arguments checked above, once: compile_checked does not check them again
    compiled = compile_checked(model, mesh, example_inputs, cfg, loss_fn=loss_fn, target=target,
                               capture_once=lambda capture: capture_once(
                                   capture, model, (*example_inputs, target)),
                               trace_device=torch.device(device.type) if meta else None)
    keys = list(model.state_dict().keys())
    # State no chunk holds (a parameter forward never reads: captured, but in no chunk's graph)
    # never changes in training; full_state_dict returns it as it is now.
    canonical = {a: i.name for i in list(compiled.program.params.values()) +
                 list(compiled.program.buffers.values()) for a in (i.name, *i.aliases)}
    in_chunks = {n for c in compiled.program.chunks for n in c.gm.state_dict()}
    extra_keys = [k for k in keys if canonical.get(k, k) not in in_chunks]
    state = model.state_dict()
    if meta:   # allocated unfilled; values below (seed= or init_fn= given) or from a load
        extra = {k: torch.empty_like(state[k], device="cpu") for k in extra_keys}
        weights = RankWeights(model, canonical)
    else:
        extra = {k: v.detach().cpu() for k, v in state.items() if k in extra_keys}
        weights = None
    pm = ParallelModel(compiled, dist.get_rank(), device, timeout, keys, extra, weights,
                       trace=trace_path(trace))
    if meta and (seed is not None or init_fn is not None):
        pm.init_weights(seed=0 if seed is None else seed, init_fn=init_fn)
    return pm


def _on_meta(x):
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    return tuple(_on_meta(t) for t in x) if isinstance(x, (tuple, list)) else x


def _device_of(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    if p is None or p.device.type == "meta":   # built on meta: each rank allocates its own shards
        from autopart.runtime.launch import rank_device     # where this rank's backend computes
        return rank_device()
    return p.device


__all__ = ["parallelize", "DEFAULT_TIMEOUT"]
