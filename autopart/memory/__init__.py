"""The memory model: per rank, bytes of state and activations as sympy formulas in b and s.

    state        what the runtime holds after a step (see `state_bytes`): params (parameters
                 and buffers the rank holds, its shards only), grads (one per trainable element,
                 full-shaped also with ZeRO), master weights (without ZeRO none: the fp32
                 parameters are the masters; with zero=1 the distributed optimizer's fp32 copy of
                 this rank's 1/dp slice) and optimizer state (sgd 0, sgd-momentum 1, adam 2 fp32
                 tensors per parameter, or per element of the 1/dp slice with zero=1, plus Adam's
                 one-element `step` tensor per tensor it steps);
    activations  what autograd saves for backward per microbatch per chunk, measured from the
                 graph itself: each chunk program runs forward on fake tensors (nothing allocated)
                 under torch.autograd.graph.saved_tensors_hooks, and every storage a backward
                 would read is counted once, weights excluded. Recomputed regions save only their
                 inputs (torch's checkpoint saves them through the same hooks), so the count
                 follows the recompute choice. Each storage's size is a formula in b and s (its
                 producing node's shape), so one run serves every microbatch and sequence size;
                 times the microbatches the schedule really keeps in flight on the rank: this
                 rank's action list is walked in order, adding a chunk's bytes at its forward and
                 dropping them at its backward, and while a backward runs, the recomputed region
                 being rerun (its own saved tensors) is added on top;
    buffers      pipeline p2p buffers: a chunk's sent outputs, held until its backward, and one
                 set of received gradients.

Precision changes no state byte: bf16 (autopart.compiler.PRECISIONS) runs forward and backward under autocast
with fp32 parameters, which are the master weights, and fp32 gradients. It changes the
activations: the fake run is made under the same autocast, so what autograd saves is counted in
the dtypes it has then (bf16 matmul outputs, fp32 where autocast keeps fp32).

The package: `units.py` (state kinds, optimizer states, ZeRO levels), `state.py` (the one rule for what a
rank keeps of its parameters' state, which the cut and the planner read too), `activations.py` (what autograd
saves, measured on fake tensors), `per_rank.py` (state, the activation peak, the memory
table), `budget.py` (the budget check and recomputation under it)."""
from __future__ import annotations

from autopart.config import fmt_bytes, parse_bytes  # noqa: F401  (sizes are options' business)
from .units import KEYS, OPTIMIZER_STATES, ZERO_LEVELS  # noqa: F401
from .activations import (ActivationCache, ChunkActivations, SavedCounter,  # noqa: F401
                          boundary_bytes, chunk_activations, chunk_inputs, chunk_signature,
                          storage_key)
from .per_rank import (MemoryTable, activation_peak, buffer_bytes, local_shaper,  # noqa: F401
                       state_bytes)
from .budget import check_budget, choose_recompute, rank_memory  # noqa: F401

__all__ = ["KEYS", "OPTIMIZER_STATES", "ZERO_LEVELS",
           "ChunkActivations", "ActivationCache", "MemoryTable", "chunk_activations",
           "chunk_signature",
           "activation_peak", "state_bytes", "parse_bytes", "check_budget", "choose_recompute"]
