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
from autopart.runtime.executor import StepContext, run_actions


class StepDriver:
    """Runs `actions` (this pipeline rank's list) over `rank_program`'s chunks."""

    def __init__(self, plan: Plan, rank_program: RankProgram, actions, input_names: list[str],
                 peer_group, device: torch.device, trace=None):
        self.plan, self.actions, self.input_names = plan, actions, input_names
        self.trace = trace          # a runtime.trace.Recorder, or None
        self.coords, self.group, self.device = rank_program.coords, peer_group, device
        self.chunks = {c.chunk: c for c in rank_program.chunks}

    def run(self, inputs: tuple, target: torch.Tensor | None, step: int = 0) -> StepContext:
        """Forward and backward of every microbatch of this replica; returns the step's context
        (microbatch losses, statistics). `step` numbers the train_step for error messages."""
        plan, mesh = self.plan, self.plan.mesh
        batch = self.replica_rows(inputs, target)
        mbs = plan.microbatch_size
        ctx = StepContext(
            chunks=self.chunks,
            peer=lambda p: mesh.rank(pp=p, dp=self.coords["dp"], tp=self.coords["tp"]),
            microbatch=lambda i: {k: v[i * mbs:(i + 1) * mbs] for k, v in batch.items()},
            batch=mbs, seq=int(inputs[0].shape[1]) if inputs and inputs[0].dim() > 1 else None,
            device=self.device, loss_scale=plan.loss_scale, group=self.group, trace=self.trace,
            step=step, reduced=REDUCED_DTYPES[plan.precision])
        with compute_precision(plan.precision, self.device):
            run_actions(self.actions, ctx)
        return ctx

    def replica_rows(self, inputs: tuple, target) -> dict[str, torch.Tensor]:
        """This data-parallel replica's rows of each input (and the target), by input name."""
        names, plan = self.input_names, self.plan
        values = list(inputs) + ([target] if target is not None else [])
        if len(values) != len(names):
            raise AutopartError(f"train_step got {len(values)} tensors (inputs and target) but the "
                                f"model was compiled with {len(names)}: {names}")
        rows = plan.microbatch_size * plan.microbatches
        dp = self.coords["dp"]
        out = {}
        for name, v in zip(names, values):
            if v.shape[0] != plan.global_batch:
                raise AutopartError(f"train_step input {name!r} has batch {v.shape[0]}, but the "
                                    f"model was compiled for the global batch {plan.global_batch}")
            out[name] = v[dp * rows:(dp + 1) * rows].to(self.device)
        return out




def compute_precision(precision: str, device: torch.device):
    """The context one training step runs in: autocast to bf16 on `device`'s type (cpu, cuda),
    or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=REDUCED_DTYPES[precision])
