"""Linears by dataflow, however the model wrote them: `x @ w.T` (Falcon's FalconLinear),
`torch.matmul(x, w.t())`, `x @ w.transpose(0, 1)` and `einsum("bsi,oi->bso", x, w)` are
`aten.linear(x, w)`; `einsum("bsi,io->bso", x, w)` is `aten.matmul(x, w)` (output features on
the weight's dim 1). An analysis two passes share (split_tensor_parallel rewrites these forms
into one op; fp8_linears turns them into FP8 GEMMs), so it lives below both.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopart.ops import aten_groups as G
from autopart.placement import ndim

aten = torch.ops.aten

_MATMULS = G.MATMULS - {aten.bmm.default}     # a batch of weights is the experts pass's


def _param(a, params) -> bool:
    return isinstance(a, fx.Node) and a.op == "get_attr" and a.target in params and ndim(a) == 2


def _transposed_param(a, params):
    """The 2-D parameter `a` is the transpose of (w.T, w.t(), w.transpose(0, 1), w.mT), or None."""
    if not isinstance(a, fx.Node) or a.op != "call_function" or not _param(a.args[0], params):
        return None
    t = a.target
    if t in (aten.t.default, aten.numpy_T.default, aten.mT.default, aten.adjoint.default):
        return a.args[0]
    if t is aten.transpose.int and {d % 2 for d in a.args[1:3]} == {0, 1}:
        return a.args[0]
    if t is aten.permute.default and [d % 2 for d in a.args[1]] == [1, 0]:
        return a.args[0]
    return None


def linear_form(n: fx.Node, params):
    """(target, activation, weight) of the op `n` is, written as a linear; None if it is not."""
    if n.op != "call_function":
        return None
    if n.target in _MATMULS and len(n.args) == 2 and not _param(n.args[0], params):
        w = _transposed_param(n.args[1], params)
        if w is not None and ndim(n.args[0]) >= 2:
            return aten.linear.default, n.args[0], w
        return None
    if n.target is aten.einsum.default:
        return _einsum_form(n, params)
    return None


def _einsum_form(n: fx.Node, params):
    equation, operands = n.args[0], n.args[1]
    if len(operands) != 2 or "->" not in equation:
        return None
    ins, out = equation.replace(" ", "").split("->")
    subs = ins.split(",")
    for xi, wi in ((0, 1), (1, 0)):
        x, w, sx, sw = operands[xi], operands[wi], subs[xi], subs[wi]
        if not _param(w, params) or _param(x, params) or len(sw) != 2 or len(sx) < 2:
            continue
        k, o = sx[-1], out[-1]
        if sx[:-1] != out[:-1] or k in out or o in sx or set(sw) != {k, o}:
            continue
        return (aten.linear.default if sw == o + k else aten.matmul.default), x, w
    return None


__all__ = ["linear_form"]
