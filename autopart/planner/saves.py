"""Which activations autograd keeps for the backward, by op: the planner's activation memory.

A value is kept when an op's backward reads it: a matmul, a product or a power reads its inputs, a
norm its input, an activation function its input (silu, gelu) or its output (tanh, exp, rsqrt,
softmax), an attention core its q, k, v and output. Sums, casts, concatenations and views read
nothing (a view's reader keeps the base it views). Counted once per value, whoever reads it. This
replaces the older bound (every op's output kept) that held the seven intermediates of a
hand-written RMSNorm as if autograd kept them all.

>>> import torch
>>> keeps_inputs(torch.ops.aten.mm.default), keeps_inputs(torch.ops.aten.add.Tensor)
(True, False)
"""
from __future__ import annotations

import torch

from autopart.ops import aten_groups as G

aten = torch.ops.aten

# backward reads the op's tensor inputs
_READS_INPUTS = (G.MATMULS | G.LINEARS | G.NORMS | G.SDPAS | frozenset({
    aten.mul.Tensor, aten.div.Tensor, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.silu.default,
    aten.gelu.default, aten.native_layer_norm.default, aten.embedding.default, aten.baddbmm.default,
    aten.relu.default, aten.sin.default, aten.cos.default, aten.log.default, aten.abs.default,
    aten.masked_fill.Scalar, aten.where.self, aten.index.Tensor, aten.gather.default,
    aten.convolution.default, aten.cross_entropy_loss.default, aten.nll_loss.default,
    aten.nll_loss_forward.default, aten._scaled_dot_product_flash_attention_for_cpu.default}))
# backward reads the op's output
_READS_OUTPUT = (G.SOFTMAXES | G.LOG_SOFTMAXES | G.SDPAS | frozenset({
    aten.tanh.default, aten.exp.default, aten.rsqrt.default, aten.sqrt.default, aten.sigmoid.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default}))
_PRODUCTS = frozenset({aten.mul.Tensor, aten.div.Tensor})
_THROUGH = G.RESHAPES | G.TRANSPOSES | G.BROADCASTS | G.UNSQUEEZES | G.SPLITS | G.SLICES | G.ALIASES


def keeps_inputs(target) -> bool:
    return target in _READS_INPUTS


def kept_values(nodes) -> set:
    """The nodes (of `nodes` or their inputs) whose outputs autograd keeps: bases of views."""
    import operator
    kept = set()

    def base(n):
        for _ in range(64):
            if getattr(n, "op", None) != "call_function" or not (n.target in _THROUGH or n.target is operator.getitem):
                return n
            ins = [a for a in n.all_input_nodes]
            if not ins:
                return n
            n = ins[0]
        return n

    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target in _READS_INPUTS:
            tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            if n.target in _PRODUCTS and len(tensors) < 2:
                continue             # a product with a number keeps nothing (its grad is the number's)
            kept.update(base(a) for a in tensors
                        if a.op == "call_function" and a.meta["val"].is_floating_point())
        if n.target in _READS_OUTPUT:
            kept.add(n)
    return kept


_GEMMS = G.MATMULS | G.LINEARS | frozenset({aten.baddbmm.default, aten.convolution.default})


def stays_under_selective(n, mine: set, core: set) -> bool:
    """Whether a kept value stays kept under selective recomputation: produced outside the part
    (its input), by a GEMM outside the attention cores, or by a core and read after it."""
    if n not in mine:
        return True
    if n in core:
        return any(u not in core for u in n.users)
    return n.target in _GEMMS


__all__ = ["kept_values", "keeps_inputs", "stays_under_selective"]
