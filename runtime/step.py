"""The step driver: one training step of one rank, from the global batch to local gradients.

It takes this data-parallel replica's rows of the global batch, cuts them into microbatches, and
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
from autopart.ops.cp import shard_sequence
from autopart.runtime.compiled import cudagraph_steps
from autopart.runtime.executor import StepContext, run_actions


class StepDriver:
    """Runs `actions` (this pipeline rank's list) over `rank_program`'s chunks."""

    def __init__(self, plan: Plan, rank_program: RankProgram, actions, input_names: list[str],
                 peer_group, device: torch.device, trace=None, input_specs: tuple = ()):
        self.plan, self.actions, self.input_names = plan, actions, input_names
        self.input_specs = input_specs  # autopart/capture.py InputSpec, per input: what to check
        self.trace = trace          # a runtime.trace.Recorder, or None
        self.coords, self.group, self.device = rank_program.coords, peer_group, device
        self.chunks = {c.chunk: c for c in rank_program.chunks}
        # compile="cudagraphs": the step's beginning marked, what outlives it cloned out of the
        # CUDA graph pool at its end (runtime/compiled.py); None otherwise
        self.cudagraphs = cudagraph_steps(rank_program.chunks)
        # a runtime.gradients.GradientReducer: posts gradient buckets while the step runs
        self.reducer = None
        self.watch = None       # a runtime.step_watch.StepWatch: names what a failure waited for

    def run(self, inputs: tuple, target: torch.Tensor | None, step: int = 0,
            checked: list | None = None, loss_scale: float | None = None) -> StepContext:
        """Forward and backward of every microbatch of this replica; returns the step's context
        (microbatch losses, statistics). `step` numbers the train_step for error messages;
        `checked`: what check_inputs returned for these tensors (not checked again);
        `loss_scale`: each microbatch loss's factor (default plan.loss_scale; step_loss_scale)."""
        plan, mesh = self.plan, self.plan.mesh
        batch = self.replica_rows(inputs, target, checked)
        mbs = plan.microbatch_size
        ctx = StepContext(
            chunks=self.chunks,
            peer=lambda p: mesh.rank(**{**self.coords, "pp": p}),
            microbatch=lambda i: {k: v[i * mbs:(i + 1) * mbs] for k, v in batch.items()},
            batch=mbs, seq=self._local_seq(inputs),
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

    def replica_rows(self, inputs: tuple, target, checked: list | None = None
                     ) -> dict[str, torch.Tensor]:
        """This data-parallel replica's rows of each input (and the target), by input name;
        under context parallelism, of those rows this rank's sequence chunks (i and 2*cp-1-i)
        of every input whose dim 1 is the sequence."""
        values = checked if checked is not None else self.check_inputs(inputs, target)
        rows = self.plan.microbatch_size * self.plan.config.microbatches
        dp = self.coords["dp"]
        out = {name: v[dp * rows:(dp + 1) * rows] for name, v in zip(self.input_names, values)}
        cp = self.plan.mesh.cp
        if cp > 1:
            out = {name: shard_sequence(v, 1, cp, self.coords["cp"]) if self._on_sequence(i) else v
                   for i, (name, v) in enumerate(out.items())}
        return {name: v.to(self.device) for name, v in out.items()}

    def _on_sequence(self, i: int) -> bool:
        """Is dim 1 of input `i` the sequence (captured symbolic)?"""
        return i < len(self.input_specs) and 1 in self.input_specs[i].dynamic

    def _local_seq(self, inputs: tuple) -> int | None:
        """The sequence length this rank's programs see (its share under cp)."""
        if not inputs or inputs[0].dim() < 2:
            return None
        cp = self.plan.mesh.cp if self._on_sequence(0) else 1
        return int(inputs[0].shape[1]) // cp

    def check_inputs(self, inputs: tuple, target) -> list[torch.Tensor]:
        """The train_step tensors (inputs, then the target), checked against what was compiled:
        their count, the global batch and check_step_inputs. On the global batch, so every rank
        refuses alike (no rank is left waiting on another). train_step calls it before it
        touches any gradient, and hands the result to run."""
        names, plan = self.input_names, self.plan
        values = list(inputs) + ([target] if target is not None else [])
        if len(values) != len(names):
            raise AutopartError(f"train_step got {len(values)} tensors (inputs and target) but the "
                                f"model was compiled with {len(names)}: {names}")
        for name, v in zip(names, values):
            if not isinstance(v, torch.Tensor):
                raise AutopartError(f"train_step input {name!r} is a {type(v).__name__}, not a "
                                    "tensor: pass tensors shaped as the example batch")
            if v.dim() == 0 or v.shape[0] != plan.global_batch:
                raise AutopartError(f"train_step input {name!r} has batch "
                                    f"{v.shape[0] if v.dim() else 'none (a scalar)'}, but the "
                                    f"model was compiled for the global batch {plan.global_batch}")
        check_step_inputs(values, self.input_specs)
        cp, n = plan.mesh.cp, plan.mesh.sequence_chunks
        for i, (name, v) in enumerate(zip(names, values)):
            if cp > 1 and self._on_sequence(i) and v.shape[1] % n:
                raise AutopartError(
                    f"train_step input {name!r} has {v.shape[1]} positions; context parallelism "
                    f"(cp={cp}) cuts the sequence into 2*cp = {n} equal chunks.\n  remedy: "
                    f"pad the sequence to a multiple of {n} (padding labels -100)")
        return values


def step_loss_scale(plan, counter, names: list[str], values: list) -> float:
    """The factor of each microbatch loss: 1 / (microbatches * dp) (a mean of microbatch
    means), or for a token-weighted loss (passes/weigh_loss_by_tokens.py, `counter` its
    TokenCount) 1 / the elements counted over the whole global batch, which every rank holds
    and counts alike, microbatch by microbatch as the program sees them; 0 if none counts."""
    if counter is None:
        return plan.loss_scale
    by_name = dict(zip(names, values))
    mbs = plan.microbatch_size
    with torch.no_grad():
        counts = [counter.gm(*(by_name[n][k * mbs:(k + 1) * mbs] for n in counter.inputs))
                  for k in range(plan.global_batch // mbs)]
        total = int(torch.stack([c.reshape(()).to(torch.float64) for c in counts]).sum())
    return 1.0 / total if total else 0.0


def check_step_inputs(values: list, specs: tuple) -> None:
    """Raise, naming the input, unless each train_step tensor is what was compiled (`specs`,
    autopart/capture.py InputSpec): its dims; each size after the batch equal to the example's,
    or at most it where the capture left it symbolic (a sequence); integer where the example
    was; and ids fed straight to an embedding within its rows. Torch's bare "index out of range
    in self" would come from inside a chunk on one rank. Cost: one aminmax per such input."""
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
            low, high = (int(x) for x in torch.aminmax(v))
            for table, rows in spec.embeddings:
                if low < 0 or high >= rows:
                    raise AutopartError(
                        f"train_step input {spec.name!r} holds ids from {low} to {high}, but it "
                        f"indexes the embedding table {table}, which has {rows} rows.\n  remedy: "
                        f"use ids in [0, {rows}) (the model's vocabulary), or build the model "
                        f"with at least {high + 1} rows")




def compute_precision(precision: str, device: torch.device):
    """The context one training step runs in: autocast to bf16 on `device`'s type (cpu, cuda),
    or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=REDUCED_DTYPES[precision])
