"""Aliasing: which nodes write in place into which tensors, read from the ops' own schemas.

torch.export's training IR keeps in-place writes: `start[:, 1:] = x` is captured as
`copy_(slice(slice(start)), x)`, a node with no users whose effect is on `start`. Any pass that
keeps or copies the nodes a value needs by walking inputs backwards (the rank programs' replicated
nodes, the cut's input-derived set) must keep those writes too, or the write is silently lost.

An op's schema says both facts: an argument annotated `Tensor(a!)` is written, and a result
annotated `Tensor(a)` is a view of the argument with the same alias set. Deciding by the schema,
not by op names, covers every view and every in-place op ATen has.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx


def _schema(node: fx.Node):
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return node.target._schema


def written_args(node: fx.Node) -> list[fx.Node]:
    """The tensor arguments `node` writes in place (`copy_`'s self, `index_put_`'s self, ...)."""
    schema = _schema(node)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            out.append(value)
    return out


def view_source(node: fx.Node) -> fx.Node | None:
    """The tensor `node` is a view of (slice, view, transpose, ...), or None if it is not a view.
    A view's result shares an alias set with one read-only argument: that argument."""
    if node.op == "call_function" and node.target is operator.getitem:
        return _list_view_source(node.args[0])   # split(x)[i], unbind(x)[i]: views of x
    schema = _schema(node)
    if schema is None or schema.is_mutable or not schema.returns:
        return None
    ret = schema.returns[0].alias_info
    if ret is None or ret.is_write or not ret.before_set:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set & ret.before_set:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, fx.Node) else None
    return None


def _list_view_source(node) -> fx.Node | None:
    """x, when `node` returns a list of views of x (`Tensor(a)[] split(Tensor(a) self, ...)`)."""
    schema = _schema(node) if isinstance(node, fx.Node) else None
    if schema is None or schema.is_mutable or not schema.returns:
        return None
    if not isinstance(schema.returns[0].type, torch.ListType):
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and not arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, fx.Node) else None
    return None


def storage_root(node: fx.Node) -> fx.Node:
    """The node that made the storage `node` views (itself, if it is no view)."""
    while (src := view_source(node)) is not None:
        node = src
    return node


def writers_by_root(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """For each tensor written in place through itself or one of its views: the writing nodes,
    in graph order."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        for arg in written_args(n):
            out.setdefault(storage_root(arg), []).append(n)
    return out


def written_from_outside(graph: fx.Graph, inside: set[str]) -> set[str]:
    """The nodes of `inside` whose storage a node outside `inside` writes in place, and every view
    of that storage: values that cannot be recomputed from `inside` alone."""
    roots = {root for root, writers in writers_by_root(graph).items()
             if root.name in inside and any(w.name not in inside for w in writers)}
    return {n.name for n in graph.nodes if n.name in inside and storage_root(n) in roots}
