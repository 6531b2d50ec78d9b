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
from autopart.linear_forms import linear_form


def as_linears(program: Program) -> Program:
    """`program` with every linear written another way as aten.linear / aten.matmul; the same
    program object when there is none."""
    found = [(n, form) for n in program.gm.graph.nodes
             if (form := linear_form(n, program.params)) is not None]
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
