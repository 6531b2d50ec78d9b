"""The one rule for what a rank keeps of its parameters' state: the bytes of params, grads, master
weights and optimizer state, by optimizer and ZeRO level.

Three readers ask it at three levels of detail, and none of them spells the rule again:

    the memory table   per tensor, on the compiled programs (per_rank.state_bytes builds a
                       `Held` from the rank's tensors)
    the pipeline cut   per parameter byte, before any program exists (passes/cut_pipeline_stages.py:
                       `copies_per_byte`)
    the planner        per element of a model profile, for layouts never compiled
                       (planner/cost.py: `Held.uniform`)

so what ZeRO shards, what an optimizer keeps, and what a master weight is are decided here once.

    zero=0   params and grads as held; master: none in autopart (fp32 parameters are the masters;
             the planner's bf16 layouts keep a separate fp32 master, `master_size`); optimizer:
             4 bytes per state per element (sgd 0, sgd-momentum 1, adam 2) and Adam's one
             4-byte `step` per tensor it steps
    zero=1   the optimizer state and an fp32 master copy of this rank's slice only
    zero=2   and the gradients of the slice only
    zero=3   and the parameters of the slice only (an fp32 slice is the master itself, counted
             there), plus the most the program holds gathered at once
"""
from __future__ import annotations

from dataclasses import dataclass

from .units import ADAM_STEP, OPTIMIZER_STATES


@dataclass(frozen=True)
class Held:
    """What one rank holds of the parameters, in bytes and elements."""
    params: float            # every parameter and buffer it holds, at their dtypes
    trainable: float         # the trainable parameters among them, at their dtypes
    grads: float             # their full gradients
    elements: float          # their elements
    slice: float             # elements of this rank's ZeRO slices of them (zero >= 1)
    slice_grads: float       # the gradients of those elements
    slice_reduced: float     # bytes of the slices of parameters that are not fp32 (zero=3 keeps
                             # them as parameters beside the fp32 master)
    stepped: int = 0         # tensors the optimizer steps (Adam's `step` is one per tensor)
    gathered: float = 0.0    # zero=3: the most parameter bytes gathered at once
    master_size: int = 0     # zero=0: bytes per element of a separate master copy

    @classmethod
    def uniform(cls, elements: float, part: float, *, param_size: float, grad_size: float,
                master_size: int = 0, gathered: float = 0.0, stepped: int = 0) -> "Held":
        """Trainable parameters of one dtype, `elements` of them, `part` of them in this rank's
        ZeRO slice (the planner's layouts; the cut per byte)."""
        return cls(params=elements * param_size, trainable=elements * param_size,
                   grads=elements * grad_size, elements=elements, slice=part,
                   slice_grads=part * grad_size,
                   slice_reduced=0.0 if param_size == 4 else part * param_size,
                   stepped=stepped, gathered=gathered, master_size=master_size)


def state(held: Held, optimizer: str, zero: int) -> dict[str, float]:
    """params / grads / master / optimizer bytes of a rank holding `held` (module docstring).
    `optimizer` and `zero` are checked values (autopart.Config, or the command line's choices)."""
    per, step = 4 * OPTIMIZER_STATES[optimizer], ADAM_STEP if optimizer == "adam" else 0
    if not zero:
        return {"params": held.params, "grads": held.grads,
                "master": held.master_size * held.elements,
                "optimizer": per * held.elements + step * held.stepped}
    params = held.params
    if zero == 3:
        params += held.gathered - held.trainable + held.slice_reduced
    return {"params": params, "grads": held.slice_grads if zero >= 2 else held.grads,
            "master": 4 * held.slice, "optimizer": per * held.slice + step * held.stepped}


def copies_per_byte(optimizer: str, zero: int, shards: int) -> float:
    """State bytes a rank keeps per byte of fp32 trainable parameter it holds (the cut's estimate,
    before any program exists; zero=3's gathered layers and Adam's `step` scalars left out):
    adam 4, adam with zero=1 over 2 ranks 2 + 3/2."""
    return sum(state(Held.uniform(0.25, 0.25 / shards, param_size=4, grad_size=4), optimizer,
                     zero).values())
