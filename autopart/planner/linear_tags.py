"""The FP8 tags of a profiled part's matmuls (profile.Part.linears), what the cost model's FP8 rule
reads (fp8_costs.Fp8Pricing.fp8_mask) instead of the graph.

Per GEMM, () for a matmul that is no linear, else its tags:
    "linear"             an activation times a 2-D trainable parameter (passes/fp8_linears.py's test)
    "column" / "row"     tp splits its N / its K (the split_tensor_parallel plan of the capture)
    "entry" / "exit"     no linear comes before / after it in the part's dataflow (autopart's rule
                         keeps the model's first and last linears in bf16)
    "small"              a weight side under fp8_linears.MIN_FEATURES (launch-bound: kept bf16)
    "misaligned"         a weight side not a multiple of fp8_linears.ALIGN (torch._scaled_mm's need)
The sizes are the whole weight's, as the pass checks them before tp splits it.
"""
from __future__ import annotations


def linear_tags(nodes, gemm_nodes, program) -> list[list[str]]:
    """Per GEMM of a part (`gemm_nodes`, in `gemms` order), what precision="fp8" decides by
    (Part.linears): the linears as passes/fp8_linears.py finds them (an activation times a 2-D
    trainable parameter), which of their dims tp splits, whether another linear of the part comes
    before or after them in its dataflow, and the rule's size checks on the whole weight."""
    # imported here, not at the top: a cached profile is read without torch or the passes
    from autopart.passes.fp8_linears import ALIGN, MIN_FEATURES, _without_linear, operands
    found = {n.name: operands(n, program.params) for n in gemm_nodes}
    found = {k: v for k, v in found.items() if v is not None}
    entry = _without_linear(list(nodes), found, lambda n: n.all_input_nodes)
    exit_ = _without_linear(list(reversed(nodes)), found, lambda n: n.users)
    tp = program.tp
    out = []
    for n in gemm_nodes:
        if n.name not in found:
            out.append([])
            continue
        _, w, _, out_dim = found[n.name]
        shape = [int(d) for d in program.params[w.target].shape]
        n_out, k_in = shape[out_dim], shape[1 - out_dim]
        tags = ["linear"]
        if tp is not None and n.name in tp.column:
            tags.append("column")
        elif tp is not None and n.name in tp.row:
            tags.append("row")
        tags += [t for t, on in (("entry", n.name in entry), ("exit", n.name in exit_),
                                 ("small", min(n_out, k_in) < MIN_FEATURES),
                                 ("misaligned", bool(n_out % ALIGN or k_in % ALIGN))) if on]
        out.append(tags)
    return out


__all__ = ["linear_tags"]
