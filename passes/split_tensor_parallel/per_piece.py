"""Per-piece norms batched: a tensor split into single slices along a dim, each slice through a
LayerNorm of its own (the same shape and eps, each with its own weight and bias), then the
slices concatenated back along that dim. StableLM's `qk_layernorm` writes per-head norms so
(`torch.split(q, 1, dim=1)`, one nn.LayerNorm per head, `torch.cat`). As written, each tp rank
would need other modules than its peers (those of its own heads); as one LayerNorm without
affine times the stacked weights (plus the stacked biases), it is one op on the head shard and
an elementwise product with a [heads, ...] weight, which the rules slice per rank. The same
math: LayerNorm's affine is that product and sum."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._guards import detect_fake_mode

from autopart.ir import Program, copied_graph, graph_module
from autopart.placement import ndim

aten = torch.ops.aten


def batch_per_piece_norms(program: Program) -> Program:
    """`program` with every per-piece LayerNorm pattern as one LayerNorm times stacked weights;
    the same program object when there is none."""
    found = [f for n in program.gm.graph.nodes if (f := _pattern(n, program.params))]
    if not found:
        return program
    graph, env = copied_graph(program.gm)
    for cat, x, dim, norms in found:
        _replace(graph, env[cat], env[x], dim, [tuple(env.get(a, a) for a in nrm) for nrm in norms])
    return program.replace(gm=graph_module(program.gm, graph))


def _param(a, params) -> bool:
    return isinstance(a, fx.Node) and a.op == "get_attr" and a.target in params


def _pattern(cat: fx.Node, params):
    """(cat, x, dim, [(weight, bias, shape, eps)] per piece) for cat(layer_norm_i(split(x, 1,
    dim)[i]) for i), or None."""
    if cat.op != "call_function" or cat.target is not aten.cat.default:
        return None
    pieces = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else 0
    norms, split = [], None
    for i, ln in enumerate(pieces):
        if not (isinstance(ln, fx.Node) and ln.target is aten.layer_norm.default
                and len(ln.users) == 1):
            return None
        item = ln.args[0]
        if item.target is not operator.getitem or item.args[1] != i or len(item.users) != 1:
            return None
        split = split if split is not None else item.args[0]
        if item.args[0] is not split:
            return None
        args = list(ln.args) + [None] * (5 - len(ln.args))
        weight, bias, eps = args[2], args[3], args[4] if args[4] is not None else 1e-5
        if weight is not None and not _param(weight, params) or \
                bias is not None and not _param(bias, params):
            return None
        norms.append((weight, bias, tuple(args[1]), eps))
    if split is None or split.target is not aten.split.Tensor or split.args[1] != 1:
        return None
    x = split.args[0]
    dim = dim % ndim(cat)
    sdim = (split.args[2] if len(split.args) > 2 else 0) % ndim(x)
    if sdim != dim or len(pieces) != int(x.meta["val"].shape[dim]) or len(split.users) != len(pieces):
        return None
    shape = norms[0][2]
    if any(n[2] != shape or n[3] != norms[0][3] for n in norms) or dim >= ndim(x) - len(shape):
        return None
    for k in (0, 1):    # weights all there or all absent, biases too
        if len({n[k] is None for n in norms}) != 1:
            return None
    return cat, x, dim, norms


def _replace(graph: fx.Graph, cat: fx.Node, x: fx.Node, dim: int, norms: list) -> None:
    shape, eps = norms[0][2], norms[0][3]
    pieces = len(norms)
    # the stacked weights broadcast against x: `pieces` at `dim`, 1 up to the normalized dims
    view = [pieces] + [1] * (ndim(x) - dim - 1 - len(shape)) + list(shape)
    mode = detect_fake_mode([x.meta["val"]])
    with graph.inserting_before(cat), mode:
        out = _node(graph, aten.layer_norm.default, (x, list(shape), None, None, eps),
                    lambda v: F.layer_norm(v[0], shape, eps=eps), cat)
        for k, op in ((0, aten.mul.Tensor), (1, aten.add.Tensor)):
            if norms[0][k] is None:
                continue
            params = [n[k] for n in norms]
            stacked = _node(graph, aten.stack.default, (params, 0),
                            lambda v: torch.stack(v[0], 0), cat)
            shaped = _node(graph, aten.view.default, (stacked, view),
                           lambda v: v[0].view(view), cat)
            out = _node(graph, op, (out, shaped), lambda v: v[0] * v[1] if k == 0 else v[0] + v[1],
                        cat)
    norms_in, = cat.args[:1]
    items = [ln.args[0] for ln in norms_in]
    cat.replace_all_uses_with(out)
    graph.erase_node(cat)
    for dead in [*norms_in, *items, items[0].args[0]]:     # the pieces, then the split
        graph.erase_node(dead)


def _node(graph, target, args, fake, like: fx.Node) -> fx.Node:
    """A call_function node with its fake value (`fake` run on its inputs' values) and `like`'s
    source line and module stack."""
    node = graph.call_function(target, args)
    vals = fx.map_arg(args, lambda a: a.meta["val"])
    node.meta = {k: like.meta[k] for k in ("stack_trace", "nn_module_stack") if k in like.meta}
    node.meta["val"] = fake(vals)
    return node
