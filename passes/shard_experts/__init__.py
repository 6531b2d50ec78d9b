"""shard_experts: mixture-of-experts layers found from ops and dataflow, experts sharded over ep.

An *expert matmul* multiplies routed tokens by a parameter stacked over E experts ([E, a, b]),
expert by expert, in one of two layouts:

  experts-major  tokens [E, N, a] (dim 0 the expert): `bmm(x, w)`, a 3-D `matmul`, or an einsum
                 such as "enm,emf->enf" whose expert letter leads both operands and the output
                 (GShard/Switch dense dispatch: examples/switch.py);
  sorted rows    tokens [S, a] sorted by expert with cumulative row offsets per expert [E]:
                 a grouped matmul (`transformers::grouped_mm_fallback`, `aten::_grouped_mm`:
                 Hugging Face Mixtral / Qwen2-MoE / OLMoE, dropless).

Finding them (no rewrite) is autopart/moe_layers.py, an analysis shared with
split_tensor_parallel, which recognizes expert matmuls the same way. Starting from the expert
matmuls, the pass grows a *region* of ops that treat each (expert,
token) row on its own (elementwise ops, activations, feature splits, more expert matmuls). A
region whose inputs are computed from a routing op (top-k, argmax, one-hot, sort) is an MoE
layer. Its rewrite, on every rank:

    entry [E, N, ...]  --dispatch_to_experts-->  [E/ep, ep*N, ...]     (all-to-all)
    region ops with this rank's expert weights [E/ep, ...]
    exit  [E/ep, ep*N, ...]  --combine_from_experts-->  [E, N, ...]   (all-to-all back)

or, for sorted rows, sorted_layout (an all-to-all of row counts), dispatch_rows / combine_rows
(all-to-alls of data-dependent size) and local_offsets for the grouped matmuls. Routing,
capacity, dropping, the combine and the auxiliary losses stay on the rank that owns the tokens
and run exactly as in the plain model. Nothing depends on module or parameter names.

Gradients (the runtime's part): a rank's expert gradient already sums the contributions of the
tokens of all ep ranks of its group; sum it over the dp/ep ranks that hold the same experts and
divide by dp, like the dense gradients (sum over dp, divide by dp).
"""
from __future__ import annotations

from autopart.errors import AutopartError
from autopart.ir import ExpertPlan, Program
from autopart.moe_layers import find_moe_layers, find_regions

from .check import check_groups, check_shardable
from .rewrite import COMM, rewrite


def shard_experts(program: Program, *, ep: int, microbatch_size: int | None = None,
                  dp: int | None = None):
    """Return (program rewritten for one expert-parallel rank, report).

    With `microbatch_size`, every microbatch (microbatch_size * seq tokens) must hold whole
    routing groups of every layer that has them (capacity and dropping are decided per group).
    With `dp`, the ep values an error suggests also divide dp.

    >>> import torch
    >>> from autopart.capture import capture
    >>> from examples.switch import SwitchGPT, config, example_inputs
    >>> cfg = config("tiny,n_layer=2")
    >>> p, report = shard_experts(capture(SwitchGPT(cfg), example_inputs(cfg, 2)), ep=2)
    >>> [(layer["name"], layer["experts_per_rank"]) for layer in report["layers"]]
    [('transformer.h.1.mlp', 2)]
    """
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise AutopartError(f"ep={ep!r} must be a positive integer")
    plan, regions = find_regions(program, ep)
    if ep == 1:
        return program.replace(ep=plan), _report(plan)
    check_shardable(plan, regions, ep, dp)
    if microbatch_size is not None:
        check_groups(program, plan, regions, microbatch_size)
    if COMM in {n.target for n in program.gm.graph.nodes if n.op == "get_attr"}:
        raise AutopartError("shard_experts already ran on this program")
    return program.replace(gm=rewrite(program.gm, regions, ep), ep=plan), _report(plan)


def _report(plan: ExpertPlan) -> dict:
    return {"ep": plan.ep, "layers": [vars(layer) for layer in plan.layers],
            "expert_params": sorted(plan.params), "skipped": plan.skipped}



__all__ = ["shard_experts", "find_moe_layers"]
