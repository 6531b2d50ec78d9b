"""One op order on every rank: a captured graph put in the order rank 0 traced.

torch.export records ops in the order Python runs them, and a forward that loops over a Python
set (Gemma3 builds one rotary table per attention type over `set(config.layer_types)`;
ModernBERT and T5Gemma do the same) runs them in an order that depends on the process's string
hash seed. Ranks then capture the same computation in different orders, number its nodes
differently and compile different programs. Each node here gets a structural key that depends
on what it computes (its op, its constants and its inputs' keys), not on where it was traced;
a rank whose graph differs from rank 0's only in order rebuilds rank 0's graph, node for node
and name for name, from its own nodes of the same keys (`follow`). A model that computes different things on different ranks is left as it is, for
the digest check (runtime/groups.py) to report.
"""
from __future__ import annotations

import hashlib
import torch
import torch.fx as fx

from autopart.ir import Program
from autopart.layer_reuse import base_name


def structure(graph: fx.Graph) -> list[tuple[str, tuple[int, ...]]]:
    """Per node in graph order: (its structural key, the graph positions of the nodes it reads,
    in argument order). The key hashes the node's op, target, constants and its inputs' keys,
    so equal keys mean the same computation wherever it was traced."""
    keys: dict[fx.Node, str] = {}
    index: dict[fx.Node, int] = {}
    out = []
    for i, n in enumerate(graph.nodes):
        if n.op in ("placeholder", "get_attr"):
            text = f"{n.op}:{n.target}"      # inputs and state have process-independent names
        else:
            args = fx.map_arg((n.args, n.kwargs), lambda a: _Key(keys[a]))
            text = f"{n.op}:{_target(n)}:{_device_free(args)!r}"
        keys[n], index[n] = hashlib.sha1(text.encode()).hexdigest()[:16], i
        out.append((keys[n], tuple(index[a] for a in _arg_nodes(n))))
    return out


def _arg_nodes(n: fx.Node) -> list[fx.Node]:
    """The nodes `n` reads in argument order, repeats included (map_arg's order)."""
    found: list[fx.Node] = []
    fx.map_arg((n.args, n.kwargs), found.append)
    return found


class _Key(str):
    def __repr__(self) -> str:
        return f"<{str(self)}>"


def _target(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__qualname__", None) and \
        f"{getattr(t, '__module__', '')}.{t.__qualname__}" or str(t)


def _device_free(value):
    """Constants with device indices dropped: rank r traces arange(device=cuda:r)."""
    if isinstance(value, torch.device):
        return f"device:{value.type}"
    if isinstance(value, (tuple, list)):
        return type(value)(_device_free(v) for v in value)
    if isinstance(value, dict):
        return {k: _device_free(v) for k, v in value.items()}
    return value


def follow(program: Program, reference: list) -> tuple[Program, bool]:
    """`program` rebuilt as the graph `reference` (rank 0's `structure`) describes, each node
    made from one of this graph's nodes of the same key (its op, constants and metadata) and
    named as a trace in that order names it; (program, True) if that changed anything.
    Unchanged when the structures already agree, or when they are not the same computation
    (the digest check then names the ranks that differ)."""
    reference = [(key, tuple(inputs)) for key, inputs in reference]
    graph = program.gm.graph
    mine = structure(graph)
    if mine == reference or sorted(k for k, _ in mine) != sorted(k for k, _ in reference) \
            or any(i >= at for at, (_, inputs) in enumerate(reference) for i in inputs):
        return program, False
    template = {key: node for (key, _), node in zip(mine, graph.nodes)}
    return program.replace(gm=_rebuilt(program.gm, reference, template)), True


def _rebuilt(gm: fx.GraphModule, reference: list, template: dict) -> fx.GraphModule:
    """The graph `reference` describes, each node copied from its key's template with its
    inputs replaced, in argument order, by the reference's; call_function nodes numbered per
    op in that order (linear, linear_1, ...) as capture numbers them."""
    graph = fx.Graph()
    made: list[fx.Node] = []
    for key, inputs in reference:
        node = template[key]
        feed = iter(made[i] for i in inputs)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda _: next(feed))
        name = base_name(node.name) if node.op == "call_function" else node.name
        new = graph.create_node(node.op, node.target, args, kwargs, name=name,
                                type_expr=node.type)
        new.meta = dict(node.meta)
        made.append(new)
    graph.lint()
    return fx.GraphModule(gm, graph)
