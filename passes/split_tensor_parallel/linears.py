"""Linears by dataflow: a matmul or einsum of an activation with a 2-D parameter is a linear
however the model wrote it. `x @ w.T` (Falcon's FalconLinear), `torch.matmul(x, w.t())`,
`x @ w.transpose(0, 1)` and `einsum("bsi,oi->bso", x, w)` become `aten.linear(x, w)`;
`einsum("bsi,io->bso", x, w)` becomes `aten.matmul(x, w)`, which find.py already takes as a
linear with its output features on the weight's dim 1. The same math, one op: the region
search, the rules and the rewrite then see one kind of linear."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopart.ir import Program, copied_graph, graph_module
from autopart.placement import ndim
from autopart.ops import aten_groups as G

aten = torch.ops.aten

_MATMULS = G.MATMULS - {aten.bmm.default}     # a batch of weights is the experts pass's


def as_linears(program: Program) -> Program:
    """`program` with every linear written another way as aten.linear / aten.matmul; the same
    program object when there is none."""
    found = [(n, form) for n in program.gm.graph.nodes
             if (form := _linear_form(n, program.params)) is not None]
    if not found:
        return program
    graph, env = copied_graph(program.gm)
    for old, (target, x, w) in found:
        node = env[old]
        with graph.inserting_before(node):
            new = graph.create_node("call_function", target, (env[x], env[w]),
                                    name=target.__name__.split(".")[0])
        new.meta = {k: node.meta[k] for k in ("val", "stack_trace", "nn_module_stack")
                    if k in node.meta}
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for a in old.all_input_nodes:     # the transpose nothing reads now
            if a.op == "call_function" and not env[a].users:
                graph.erase_node(env[a])
    return program.replace(gm=graph_module(program.gm, graph))


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


def _linear_form(n: fx.Node, params):
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
