"""The step driver: one training step of one rank, from its share of the batch to local gradients.

It takes this rank's share of the global batch (runtime/batches.py), cuts them into microbatches, and
runs this rank's action list from the schedule (runtime/executor.py). Reducing gradients across
ranks is the GradientReducer's job, not this one's.

precision="bf16": the whole step runs under one torch.autocast(bf16) on the rank's device type.
The rank's parameters stay fp32 (they are the master weights the user's optimizer steps), so
autocast's casts give fp32 .grad: microbatch accumulation and every gradient reduction are fp32.
One context for the step, not one per microbatch, because autocast caches each weight's bf16 copy
until its outermost context exits: each weight is cast once per step. Backward runs inside it too,
as the custom tp ops' backward (gather_linear_sp's matmuls) need their operands cast alike.
"""
from __future__ import annotations

import contextlib

import torch

from autopart.errors import AutopartError
from autopart.ir import REDUCED_DTYPES, Plan, RankProgram
from autopart.runtime.batches import BatchShard, Given, IdRange, LocalInputs, share_count
from autopart.runtime.compiled import cudagraph_steps
from autopart.runtime.compute import StepContext
from autopart.runtime.document_ids import check_document_ids
from autopart.runtime.executor import run_actions


class StepDriver:
    """Runs `actions` (this pipeline rank's list) over `rank_program`'s chunks. `shard`: this
    rank's BatchShard (runtime/batches.py; default: it reads every input)."""

    def __init__(self, plan: Plan, rank_program: RankProgram, actions, input_names: list[str],
                 peer_group, device: torch.device, trace=None, input_specs: tuple = (),
                 shard: BatchShard | None = None):
        self.plan, self.actions, self.input_names = plan, actions, input_names
        self.input_specs = input_specs  # autopart/capture.py InputSpec, per input: what to check
        self.trace = trace          # a runtime.trace.Recorder, or None
        self.coords, self.group, self.device = rank_program.coords, peer_group, device
        self.chunks = {c.chunk: c for c in rank_program.chunks}
        mesh = plan.mesh
        if shard is None:
            rows = plan.global_batch // mesh.dp
            cp, c = mesh.cp, self.coords.get("cp", 0)
            shard = BatchShard(rank_program.rank, tuple(range(self.coords["dp"] * rows,
                                                              (self.coords["dp"] + 1) * rows)),
                               (c, 2 * cp - 1 - c) if cp > 1 else (0,),
                               mesh.sequence_chunks if cp > 1 else 1, True, True,
                               tuple(input_names))
        self.shard = shard
        chunk_inputs = {n for c in rank_program.chunks for n in c.inputs} or set(input_names)
        self.local = LocalInputs(shard, input_names, input_specs, plan.global_batch, mesh.cp,
                                 chunk_inputs)
        # compile="cudagraphs": the step's beginning marked, what outlives it cloned out of the
        # CUDA graph pool at its end (runtime/compiled.py); None otherwise
        self.cudagraphs = cudagraph_steps(rank_program.chunks)
        # a runtime.gradients.GradientReducer: posts gradient buckets while the step runs
        self.reducer = None
        self.watch = None       # a runtime.step_watch.StepWatch: names what a failure waited for
        self.documents = ()     # inputs of packed documents' ids, checked (runtime/document_ids.py)

    def run(self, batch: dict, step: int = 0,
            loss_scale: float | torch.Tensor | None = None) -> StepContext:
        """Forward and backward of every microbatch of this replica (`batch`: replica_rows');
        returns the step's context (microbatch losses, statistics). `step` numbers the
        train_step for error messages; `loss_scale`: each microbatch loss's factor (default
        plan.loss_scale; step_loss_scale), a float or, for a count of the labels' values, a
        float32 0-dim tensor on the device (runtime/batches.py device_loss_scale)."""
        plan, mesh = self.plan, self.plan.mesh
        mbs = plan.microbatch_size
        ctx = StepContext(
            chunks=self.chunks,
            peer=lambda p: mesh.rank(**{**self.coords, "pp": p}),
            microbatch=lambda i: {k: v[i * mbs:(i + 1) * mbs] for k, v in batch.items()},
            batch=mbs, seq=self._local_seq(batch),
            device=self.device, group=self.group, trace=self.trace,
            loss_scale=plan.loss_scale if loss_scale is None else loss_scale,
            step=step, reduced=REDUCED_DTYPES[plan.config.precision],
            grads=self.reducer.overlap(self.actions, self.chunks, self.trace)
            if self.reducer is not None else None, watch=self.watch)
        if self.watch is not None:
            self.watch.ctx = ctx
        if self.cudagraphs is not None:
            self.cudagraphs.begin()
        with compute_precision(plan.config.precision, self.device):
            run_actions(self.actions, ctx)
        if self.cudagraphs is not None:
            self.cudagraphs.end(ctx)
        return ctx

    def replica_rows(self, given: Given, length: int | None = None) -> dict[str, torch.Tensor]:
        """This rank's share of each input its chunks take (and the target), by input name, on
        its device: its data-parallel replica's rows and, under context parallelism, of those
        rows its sequence chunks (i and 2*cp-1-i) of every input whose dim 1 is the sequence;
        a zero-stride stand-in of that shape for one it was not given (its chunks read only
        the shape). `length`: the global sequence length (default: given's)."""
        return self.local.fill(given, given.length if length is None else length, self.device)

    def _local_seq(self, batch: dict) -> int | None:
        """The sequence length this rank's programs see (its share under cp)."""
        for name in self.input_names:
            v = batch.get(name)
            if v is not None:
                return int(v.shape[1]) if v.dim() >= 2 else None
        return None

    def check_inputs(self, inputs: tuple, target, local: bool | None = None) -> Given:
        """The train_step tensors (inputs, then the target), checked against what was compiled
        and resolved into this rank's share (runtime/batches.py LocalInputs): their count, the
        global batch or this rank's share of it (`local`: None decides from the shapes), None
        only where this rank reads none, and check_step_inputs. train_step calls it before it
        touches any gradient, and hands the result to replica_rows."""
        values = self.local.values(inputs, target)
        self.local.check_types(values)
        pairs = [(spec, v) for spec, v in zip(self.input_specs, values) if v is not None]
        ids = check_step_inputs([v for _, v in pairs], tuple(s for s, _ in pairs))
        check_document_ids(self.documents, [s.name for s, _ in pairs], [v for _, v in pairs],
                           self.plan.mesh.rank(**self.coords))
        given = self.local.resolve(values, local)
        given.ids = ids
        return given


def step_loss_scale(plan, counter, names: list[str], values: list) -> float:
    """The factor of each microbatch loss of the whole global batch `values` counted in one
    process (tests and tools; train_step counts each rank's share and sums the counts over the
    ranks: runtime/batches.py agree on the host for a count of shapes alone, device_loss_scale
    on the device for a count of the labels' values): 1 / (microbatches * dp), or for a
    token-weighted loss (passes/weigh_loss_by_tokens.py, `counter` its TokenCount) 1 / the
    elements counted over the global batch, microbatch by microbatch as the program sees them;
    0 if none counts."""
    if counter is None:
        return plan.loss_scale
    total = int(share_count(counter, dict(zip(names, values)), plan.microbatch_size))
    return 1.0 / total if total else 0.0


def check_step_inputs(values: list, specs: tuple) -> tuple[IdRange, ...]:
    """Raise, naming the input, unless each train_step tensor is what was compiled (`specs`,
    autopart/capture.py InputSpec): its dims; each size after the batch equal to the example's,
    or at most it where the capture left it symbolic (a sequence); integer where the example
    was. Returns the range of the ids fed straight to an embedding (one aminmax per such input,
    not read here): train_step runs on them clamped into the tables and refuses the step on
    every rank, after the step's one host read (runtime/state.py step_results), if they index
    past a table's rows (torch's bare "index out of range in self" would come from inside a
    chunk on one rank)."""
    ids = []
    for spec, v in zip(specs, values):
        shape = tuple(v.shape)
        if len(shape) != len(spec.shape):
            raise AutopartError(
                f"train_step input {spec.name!r} has shape {shape}, {len(shape)} dims, but the "
                f"model was compiled with {spec.shape}.\n  remedy: pass inputs shaped as the "
                "example batch given to parallelize")
        for d in range(1, len(shape)):
            n, was = shape[d], spec.shape[d]
            if d in spec.dynamic and n > was:
                raise AutopartError(
                    f"train_step input {spec.name!r} has shape {shape}: {n} at dim {d} (the "
                    f"sequence), longer than the {was} the model was compiled with (the example "
                    "batch's, the most the compiled program takes: positions past it would index "
                    f"past the model's tables).\n  remedy: cut the sequences to at most {was}, or "
                    "parallelize with an example batch of the longest sequence")
            if d not in spec.dynamic and n != was:
                raise AutopartError(
                    f"train_step input {spec.name!r} has shape {shape}: {n} at dim {d}, but the "
                    f"model was compiled with exactly {was} there ({spec.shape}, captured as a "
                    f"fixed size).\n  remedy: pass {was} at dim {d}, or parallelize with an "
                    "example batch of this shape")
        if spec.integer and (v.is_floating_point() or v.is_complex()):
            raise AutopartError(
                f"train_step input {spec.name!r} is {v.dtype}, but the model was compiled with an "
                f"integer {spec.name!r} (ids).\n  remedy: pass it as torch.long, as the example")
        if spec.embeddings and v.numel() and v.dtype != torch.bool:
            ids.append(IdRange(spec.name, tuple(spec.embeddings), *torch.aminmax(v)))
    return tuple(ids)




def compute_precision(precision: str, device: torch.device):
    """The context one training step runs in: autocast to bf16 on `device`'s type (cpu, cuda),
    or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=REDUCED_DTYPES[precision])
