"""Non-finite losses and gradients, found on the rank where they appear and reported on every rank
with the step, the pipeline stage and the microbatch (Megatron checks the same by default).

Each rank's verdict is a device tensor (`local_flag`: one multi-tensor max-norm over its gradients
and the microbatch losses, no host sync) that rides in the step's one all-reduce of the loss
(runtime/state.py `StepResults`); the one host sync per step is reading that sum, which must
happen before train_step returns (the user's optimizer steps next). Only when it is non-zero do
the ranks look for the details and exchange them for the message.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopart.config import choices
from autopart.errors import AutopartError

MODES = choices("nonfinite")       # written once, in autopart/config.py


def local_problems(losses: list[torch.Tensor], grads: dict, pp_rank: int) -> list[str]:
    """What is non-finite on this rank: microbatch losses (last stage) and gradients (`grads`:
    {parameter name: this rank's gradient of it})."""
    out = [f"the loss of microbatch {i} is {float(loss)} (pipeline stage {pp_rank})"
           for i, loss in enumerate(losses) if not math.isfinite(float(loss))]
    for name in _nonfinite_grads(grads):
        bad = int((~torch.isfinite(grads[name])).sum())
        out.append(f"the gradient of {name} has {bad} non-finite value(s) (pipeline stage "
                   f"{pp_rank})")
    return out


def _nonfinite_grads(grads: dict, block: int = 1 << 20) -> list[str]:
    """Names of the parameters whose gradient holds a non-finite element. Gradients of at most
    `block` elements are checked together: one multi-tensor max-norm (NaN and inf carry through
    a max of absolute values, and a max of finite values cannot overflow) and one host sync for
    all of them, where a check per tensor was ~10% of a small model's step; larger ones a block
    at a time (_all_finite)."""
    grads = [(name, g) for name, g in grads.items() if g is not None]
    small = [(name, g) for name, g in grads if g.numel() <= block]
    bad = [name for name, g in grads if g.numel() > block and not _all_finite(g, block)]
    if small:
        norms = torch._foreach_norm([g for _, g in small], float("inf"))
        finite = torch.isfinite(torch.stack([n.float() for n in norms]))
        if not bool(finite.all()):
            bad += [name for (name, _), ok in zip(small, finite.tolist()) if not ok]
    return bad


def _all_finite(t: torch.Tensor, block: int = 1 << 20) -> bool:
    """torch.isfinite(t).all() a block of elements at a time: isfinite makes temporaries the size
    of `t` (measured +343 MiB inside train_step for a 50257 x 1024 embedding's gradient)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(block))


def local_flag(losses: list[torch.Tensor], grads: dict, device) -> torch.Tensor:
    """1.0 when a microbatch loss or a gradient on this rank is non-finite, else 0.0; computed on
    `device` without a host sync. A max-norm carries NaN and inf through, cannot overflow on
    finite values and makes no temporary the size of a gradient (measured: 4.6 MiB of resident
    memory for a 50257 x 1024 gradient, where isfinite made 346 MiB)."""
    # one stack of 0-d values (it promotes bf16 norms): per-value casts and reshapes were half
    # of the check's 157 us on a 2-layer GPT's pp=2 rank (16 gradients; now 110 us, of which
    # the multi-tensor norm, a loop per tensor on CPU, is 76)
    parts = [loss.detach().reshape(()) for loss in losses]
    parts = [p if p.device == device else p.to(device) for p in parts]
    grads = [g for g in grads.values() if g is not None]
    if grads:
        parts += torch._foreach_norm(grads, float("inf"))
    if not parts:
        return torch.zeros((), device=device)
    return torch.isfinite(torch.stack(parts)).logical_not().any().float()


def gather_report(step: int, mine: list[str], rank: int, group) -> str:
    """Every rank's problems as one report, the same on every rank (collective; called only
    when the step's summed flag said something is non-finite somewhere)."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (rank, mine), group=group)
    lines = [f"  rank {r}: {p}" for r, problems in everyone for p in problems]
    return f"non-finite values at step {step}:\n" + "\n".join(lines)


def handle(report: str | None, mode: str, drop) -> bool:
    """Raise, or drop the gradients (`drop()`) as `mode` says; True when the step was skipped."""
    if report is None:
        return False
    if mode == "raise":
        raise AutopartError(report + "\n  remedy: lower the learning rate, check the data of "
                            "that step, or pass nonfinite='skip' to drop such steps")
    drop()          # optimizers leave parameters without a gradient as they are
    return True
