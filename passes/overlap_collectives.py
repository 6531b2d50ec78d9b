"""overlap_collectives: tensor parallelism's backward all-reduce runs behind the weight gradients.

Megatron-LM starts a column-parallel linear's input-gradient all-reduce (the backward of its f)
before it computes the weight gradient, and waits for it after. In a rank program emitted by
split_tensor_parallel, f (tp_ops.copy_to_tp) and the linears that read it are separate ops, so
autograd runs the all-reduce after both of each linear's matmuls, with nothing to hide it. This
pass fuses each copy_to_tp whose readers are all aten.linear ops taking it as their input (q, k
and v of one attention; gate and up of one MLP; a fused qkv) into one op, tp_ops.copy_linears_tp,
whose backward sums the input gradient, starts its all-reduce, computes the weight gradients and
only then waits (autopart/ops/tp.py). The matmuls are the unfused ones, in autograd's order.

Sequence parallelism's gather_linear_sp overlaps its own backward collectives (ops/tp.py). Left
as they are, and named in the report: a copy_to_tp read by anything but a linear (a norm's
weight, a gather of experts), and FP8 linears (not aten.linear after fp8_linears). Schedules that
split the backward into I and W (zero-bubble) do not run this pass: W runs the weight gradients
later, away from the all-reduce, which then has the I pass's compute beside it instead.

Runs on the emitted chunks, last but split_backward (after recomputation's regions and ZeRO-3's
gathers, whose bodies it rewrites too), so every earlier pass sees the plain ops.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopart.ir import ChunkProgram, Program, copied_graph, graph_module
from autopart.ops import tp as tp_ops

aten = torch.ops.aten


def overlap_collectives(program: Program):
    """Return (program with fused copy_to_tp + linears in every chunk and .overlap, report)."""
    fused: dict[str, tuple[str, ...]] = {}
    kept: dict[str, str] = {}
    chunks = tuple(_rewrite_chunk(c, fused, kept) for c in program.chunks)
    return program.replace(chunks=chunks, overlap=dict(fused)), \
        {"tp_backward_overlapped": fused, "kept": kept}


def _rewrite_chunk(chunk: ChunkProgram, fused: dict, kept: dict) -> ChunkProgram:
    gm = _rewrite(chunk.gm, fused, kept)
    return chunk if gm is chunk.gm else dataclasses.replace(chunk, gm=gm)


def _rewrite(gm: fx.GraphModule, fused: dict, kept: dict) -> fx.GraphModule:
    """gm with each fusable copy_to_tp fused, nested graph modules (recomputed regions) too;
    gm itself where nothing changed."""
    bodies = {n.target: _rewrite(getattr(gm, n.target), fused, kept) for n in gm.graph.nodes
              if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), fx.GraphModule)}
    copies = [n for n in gm.graph.nodes if n.target is tp_ops.copy_to_tp]
    readers = {n: _linear_readers(n) for n in copies}
    for n, linears in readers.items():
        if linears is None:
            kept[n.name] = "read by " + ", ".join(sorted(str(u.target) for u in n.users
                                                         if u.target is not aten.linear.default))
    todo = [n for n in copies if readers[n]]
    if not todo and all(body is getattr(gm, name) for name, body in bodies.items()):
        return gm
    graph, env = copied_graph(gm)
    for old in todo:
        fused[old.name] = tuple(u.name for u in readers[old])
        _fuse(graph, env[old], [env[u] for u in readers[old]])
    graph.lint()
    out = graph_module(gm, graph, class_name=type(gm).__name__)
    for name, body in bodies.items():
        setattr(out, name, body)
    return out


def _linear_readers(copy: fx.Node) -> list[fx.Node] | None:
    """The linears reading `copy` as their input, in graph order, if nothing else reads it."""
    users = list(copy.users)
    if not users or any(u.target is not aten.linear.default or u.args[0] is not copy
                        or copy in u.args[1:] or u.kwargs for u in users):
        return None
    order = {n: i for i, n in enumerate(copy.graph.nodes)}
    return sorted(users, key=order.__getitem__)


def _fuse(graph: fx.Graph, copy: fx.Node, linears: list[fx.Node]) -> None:
    """copy_to_tp(x, comm) -> linear_i(., w_i, b_i) as one copy_linears_tp(x, comm, w_0, b_0, ...)
    placed at the last linear's operands' latest point (before the first linear), its outputs
    read by getitem where the linears were."""
    x, comm = copy.args
    operands = [a for u in linears for a in (u.args[1], u.args[2] if len(u.args) > 2 else None)]
    _hoist_before(graph, linears[0], [a for a in operands if isinstance(a, fx.Node)])
    with graph.inserting_before(linears[0]):
        new = graph.call_function(tp_ops.copy_linears_tp, (x, comm, *operands))
        new.meta = {**copy.meta, "val": tuple(u.meta.get("val") for u in linears)}
        for i, u in enumerate(linears):
            item = graph.call_function(operator.getitem, (new, i))
            item.meta = dict(u.meta)
            u.replace_all_uses_with(item)
    for u in linears:
        graph.erase_node(u)
    graph.erase_node(copy)


def _hoist_before(graph: fx.Graph, anchor: fx.Node, needed: list[fx.Node]) -> None:
    """Move the nodes computing `needed` (a later linear's weight: its ZeRO-3 gather, its cast)
    that come after `anchor` to just before it, with what they read, in order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    late, stack = set(), [n for n in needed if order[n] > order[anchor]]
    while stack:
        n = stack.pop()
        if n not in late:
            late.add(n)
            stack += [a for a in n.all_input_nodes if order[a] > order[anchor]]
    for n in sorted(late, key=order.__getitem__):
        anchor.prepend(n)
