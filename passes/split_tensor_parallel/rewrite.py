"""The rewrite: one tensor-parallel rank's graph, with sharded linears, local view sizes and the
collectives where placements disagree (a TPComm the program holds as `self.tp_comm`)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopart.errors import node_error
from autopart.ir import META_TP, Program, TensorParallelPlan, graph_module
from autopart.localize import attribute
from autopart.ops import tp as tp_ops
from autopart.placement import (NEW_LIKE, P, R, Shard, ndim, norm_dim, shape_of, slice_range)
from autopart.ops import aten_groups as G

aten = torch.ops.aten

COMM = "tp_comm"


def rewrite(program: Program, plan: TensorParallelPlan) -> fx.GraphModule:
    old = program.gm
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    comm = g.get_attr(COMM)
    cache: dict = {}
    for node in old.graph.nodes:
        local = _redistributed_inputs(g, node, plan, env, cache, comm)

        def mapped(n, local=local):
            return local.get(n, env[n])

        if node.name in plan.column:
            env[node] = _column(g, node, mapped, comm, cache, plan)
        elif node.name in plan.row:
            env[node] = _row(g, node, mapped, comm, plan.seq_shards.get(node.name))
        elif node.name in plan.vocab_loss:
            args = list(node.args) + [None] * (5 - len(node.args))
            ignore = node.kwargs.get("ignore_index", -100 if args[4] is None else args[4])
            reduction = node.kwargs.get("reduction", 1 if args[3] is None else args[3])
            env[node] = _call(g, tp_ops.vocab_parallel_cross_entropy,
                              (mapped(node.args[0]), mapped(node.args[1]), comm, ignore,
                               "sum" if reduction == 2 else "mean"), node, R)
        elif node.name in plan.vocab_embedding:
            part = _call(g, tp_ops.vocab_parallel_embedding,
                         (mapped(node.args[0]), mapped(node.args[1]), comm,
                          *_padding_idx(node)), node, P)
            env[node] = _reduce(g, part, comm, plan.seq_shards.get(node.name), node)
        else:
            new = g.node_copy(node, mapped)
            _localize_args(new, node, plan)
            env[node] = new
    g.lint()
    root = {name: attribute(old, name) for name in _attr_targets(old)}
    root[COMM] = tp_ops.TPComm(plan.tp)
    return graph_module(root, g)


def _padding_idx(embedding: fx.Node) -> tuple:
    """(padding_idx,) of an aten.embedding that has one (its row gets no gradient), else ()."""
    pad = embedding.args[2] if len(embedding.args) > 2 else embedding.kwargs.get("padding_idx", -1)
    if pad is None or pad < 0:
        return ()
    return (pad,)


def _redistributed_inputs(g, node, plan, env, cache, comm) -> dict:
    """Inputs `node` reads through a local slice (R -> Shard) or an all-gather (Shard -> R)."""
    local = {}
    for a in node.all_input_nodes:
        if (node.name, a.name) in plan.partial_grads:     # backward: the shares summed over tp
            key = ("copy", a.name)
            if key not in cache:
                cache[key] = _call(g, tp_ops.copy_to_tp, (env[a], comm), a, R)
            local[a] = cache[key]
        dim = plan.scatters.get((node.name, a.name))
        if dim is not None:
            sections = plan.scatter_sections.get((node.name, a.name))
            key = ("scatter", a.name, dim, sections)
            if key not in cache:
                args = (env[a], dim, comm) + ((list(sections),) if sections else ())
                cache[key] = _call(g, tp_ops.scatter_to_tp, args, a, Shard(dim))
            local[a] = cache[key]
            if node.target in G.INPLACE_ARITH and a is node.args[0]:
                # written in place: its own copy (autograd refuses in-place writes into a view
                # a custom Function returned, and another reader keeps the slice unwritten)
                local[a] = _call(g, aten.clone.default, (cache[key],), a, Shard(dim))
        dim = plan.gathers.get((node.name, a.name))
        if dim is not None:
            key = ("gather", a.name, dim)
            if key not in cache:
                cache[key] = _call(g, tp_ops.gather_from_tp, (env[a], dim, comm), a, R)
            local[a] = cache[key]
    return local


def _reduce(g, partial, comm, seq_dim, like):
    """Partial sums made whole: all-reduce, or reduce-scatter along the sequence (SP)."""
    if seq_dim is None:
        return _call(g, tp_ops.reduce_from_tp, (partial, comm), like, R)
    return _call(g, tp_ops.reduce_scatter_tp, (partial, seq_dim, comm), like, Shard(seq_dim))


def _call(g, fn, args, like: fx.Node, placement, name: str | None = None) -> fx.Node:
    out = g.create_node("call_function", fn, tuple(args), {}, name=name)
    out.meta = {k: like.meta[k] for k in ("val", "stack_trace", "nn_module_stack") if k in like.meta}
    out.meta[META_TP] = placement
    return out


def _column(g, node, mapped, comm, cache, plan) -> fx.Node:
    xi = 1 if node.target is aten.addmm.default else 0
    x = node.args[xi]
    seq_dim = plan.seq_shards.get(x.name)
    if seq_dim is not None and (node.name, x.name) not in plan.gathers:
        w, b = node.args[1], node.args[2] if len(node.args) > 2 else None
        new = _call(g, tp_ops.gather_linear_sp, (mapped(x), mapped(w), mapped(b) if b is not None
                                                 else None, seq_dim, comm), node, None, node.name)
    else:
        key = ("copy", x.name)
        if key not in cache:
            cache[key] = _call(g, tp_ops.copy_to_tp, (mapped(x), comm), x, R)
        args = [cache[key] if i == xi else mapped(a) if isinstance(a, fx.Node) else a
                for i, a in enumerate(node.args)]
        new = g.create_node("call_function", node.target, tuple(args), dict(node.kwargs),
                            name=node.name)
        new.meta = dict(node.meta)
    new.meta[META_TP] = Shard(ndim(node) - 1, node.name)
    return new


def _row(g, node, mapped, comm, seq_dim) -> fx.Node:
    if node.target is aten.addmm.default:
        bias, x, w = node.args[:3]
        partial = _call(g, aten.mm.default, (mapped(x), mapped(w)), node, P, node.name)
    elif node.target is aten.linear.default:
        x, w = node.args[:2]
        bias = node.args[2] if len(node.args) > 2 else None
        partial = _call(g, node.target, (mapped(x), mapped(w)), node, P, node.name)
    else:       # mm, matmul, an expert matmul (a grouped one keeps its row offsets): no bias
        bias = None
        partial = _call(g, node.target, fx.map_arg(node.args, mapped), node, P, node.name)
        partial.kwargs = fx.map_arg(node.kwargs, mapped)
    reduced = _reduce(g, partial, comm, seq_dim, node)
    if isinstance(bias, fx.Node):    # added once, after the reduction
        reduced = _call(g, aten.add.Tensor, (reduced, mapped(bias)), node, reduced.meta[META_TP])
    return reduced


def _localize_args(new: fx.Node, old: fx.Node, plan: TensorParallelPlan) -> None:
    """Rewrite a view's / split's / expand's global sizes along the sharded dim to local ones."""
    s = plan.placements.get(old)
    if old.name in plan.seq_shards:
        s = Shard(plan.seq_shards[old.name])
    tp = plan.tp
    new.meta[META_TP] = s if s is not None else R
    if not isinstance(s, (Shard, tuple)):
        return
    t = old.target
    if t in G.RESHAPES or t in G.BROADCASTS or t in NEW_LIKE or t is aten.broadcast_to.default:
        sizes = list(new.args[1])
        d = s.dim
        if isinstance(sizes[d], int) and sizes[d] != -1:
            if sizes[d] % tp:
                raise node_error(old, f"view size {sizes[d]} along the sharded dim does not "
                                 f"divide by tp={tp}", f"use a tp that divides {sizes[d]}")
            sizes[d] //= tp
        elif isinstance(sizes[d], fx.Node):     # a run-time size (the sequence length, SP)
            with new.graph.inserting_before(new):
                sizes[d] = new.graph.call_function(operator.floordiv, (sizes[d], tp))
        new.args = (new.args[0], sizes, *new.args[2:])
    elif t is aten.slice.Tensor:
        src = plan.placements.get(old.args[0])
        dim = norm_dim(old.args[1] if len(old.args) > 1 else 0, ndim(old.args[0]))
        if isinstance(src, Shard) and src.dim == dim and shape_of(old)[dim] != shape_of(old.args[0])[dim]:
            start, end = slice_range(old, int(shape_of(old.args[0])[dim]))   # one whole section
            new.args = (new.args[0], dim, start // tp, end // tp, *new.args[4:])
    elif t is aten.index.Tensor:
        _localize_index(new, old, plan)
    elif t is aten.conv1d.default:      # depthwise: one group per channel, this rank's
        args = list(new.args) + [None, [1], [0], [1], 1][len(new.args) - 2:]
        new.args = (*args[:6], args[6] // tp)
    elif t is aten.repeat_interleave.self_int:
        _localize_output_size(new, old, s, tp)
    elif t is aten.split.Tensor:
        src = plan.placements.get(old.args[0])
        dim = old.args[2] if len(old.args) > 2 else 0
        dim = norm_dim(dim, ndim(old.args[0]))
        if isinstance(src, Shard) and src.dim == dim:
            new.args = (new.args[0], old.args[1] // tp, *new.args[2:])
    elif t is aten.split_with_sizes.default:
        src = plan.placements.get(old.args[0])
        dim = old.args[2] if len(old.args) > 2 else 0
        dim = norm_dim(dim, ndim(old.args[0]))
        if isinstance(src, Shard) and src.dim == dim:
            new.args = (new.args[0], [v // tp for v in old.args[1]], *new.args[2:])


def _localize_output_size(new: fx.Node, old: fx.Node, s, tp: int) -> None:
    """repeat_interleave along the sharded dim with output_size: this rank's size."""
    dim = old.args[2] if len(old.args) > 2 else old.kwargs.get("dim")
    if dim is None or norm_dim(dim, ndim(old.args[0])) != s.dim:
        return
    if len(new.args) > 3 and new.args[3] is not None:
        new.args = (*new.args[:3], new.args[3] // tp, *new.args[4:])
    elif new.kwargs.get("output_size") is not None:
        new.kwargs = {**new.kwargs, "output_size": new.kwargs["output_size"] // tp}


def _localize_index(new: fx.Node, old: fx.Node, plan: TensorParallelPlan) -> None:
    """x[..., idx] along x's sharded dim: each rank indexes its block with idx's first 1/tp
    (placement._index_groups checked those are every rank's local positions)."""
    src = plan.placements.get(old.args[0])
    if not isinstance(src, Shard) or len(old.args[1]) <= src.dim or old.args[1][src.dim] is None:
        return
    indices = list(new.args[1])
    idx = indices[src.dim]
    with new.graph.inserting_before(new):
        indices[src.dim] = new.graph.call_function(
            aten.slice.Tensor, (idx, 0, 0, int(shape_of(old.args[1][src.dim])[0]) // plan.tp))
    new.args = (new.args[0], indices, *new.args[2:])


def _attr_targets(gm) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target != COMM]
