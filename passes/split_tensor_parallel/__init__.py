"""split_tensor_parallel: Megatron-style tensor parallelism found from ops and dataflow.

For each linear whose input is replicated, the pass tries a *region*: shard the linear's output
features (column-parallel) and carry the shard forward op by op (activations, head splits,
attention per head, views rewritten to local sizes) until every path ends in a linear that
contracts over the sharded features (row-parallel: partial sums, one all-reduce) or in a
cross-entropy over a sharded vocabulary (vocabulary-parallel loss). A region that cannot close
that way is left replicated. Attention inputs a region needs sharded are pulled in from their own
linears (separate q/k/v projections) or, when they cannot be (grouped-query k/v with fewer heads
than tp), sliced locally from the replicated tensor. Embedding tables tied to a vocabulary-parallel
head, or large ones, become vocabulary-parallel (masked local lookup + all-reduce).

With sequence_parallel, the reductions become reduce-scatters along the sequence, the residual
stream between regions runs on sequence shards, and each column-parallel linear all-gathers its
input inside a fused op that re-gathers it in backward instead of keeping the gathered copy.
"""
from __future__ import annotations

from autopart.ir import Program, TensorParallelPlan

from .check import check_heads, check_sequence, check_share
from .find import decide, find_linears
from .linears import as_linears
from .per_piece import batch_per_piece_norms
from .rewrite import rewrite


def split_tensor_parallel(program: Program, *, tp: int, sequence_parallel: bool = False):
    """Return (program rewritten for one tensor-parallel rank, report)."""
    if tp == 1:
        return program.replace(tp=TensorParallelPlan(1, sequence_parallel)), {"tp": 1}
    program = as_linears(program)       # x @ w.T, einsum: linears by dataflow (linears.py)
    program = batch_per_piece_norms(program)    # one LayerNorm per head, batched (per_piece.py)
    plan = decide(program, tp, sequence_parallel)
    check_heads(program, plan, tp)
    check_share(program, plan, tp)
    if sequence_parallel:
        check_sequence(program, plan, tp)
    gm = rewrite(program, plan)
    report = {"tp": tp, "column": sorted(plan.column), "row": sorted(plan.row),
              "vocab_parallel": sorted(plan.vocab_embedding | plan.vocab_loss),
              "replicated_linears": plan.skipped, "sequence_parallel": sequence_parallel}
    return program.replace(gm=gm, tp=plan), report


__all__ = ["split_tensor_parallel", "decide", "find_linears", "as_linears"]
