"""Vmap traced inline, folded into one node per region.

torch.export's pre-dispatch graph records `torch.vmap` as calls that move functorch's nesting
level (`_vmap_increment_nesting` / `_vmap_decrement_nesting`: no outputs, only side effects)
around `_add_batch_dim` / `_remove_batch_dim`. `create_block_mask` (flex_attention's BlockMask,
which Hugging Face's `attn_implementation="flex_attention"` builds in forward) vmaps its
mask_mod over batch, head, query and key so. The passes copy nodes by dataflow and would drop
the level calls (nothing uses their outputs), leaving the batch-dim calls outside any vmap.

Each outermost region (level up to level down) becomes one node here: `run_vmap_region(sub,
*inputs)`, `sub` a submodule holding the region's nodes in their order, its outputs the region's
values used after it (read with getitem). It computes what the region computed.
"""
from __future__ import annotations

import operator

import torch.fx as fx
from torch._functorch import predispatch

_UP, _DOWN = predispatch._vmap_increment_nesting, predispatch._vmap_decrement_nesting


def run_vmap_region(sub: fx.GraphModule, *inputs):
    """The region's values used after it, as a tuple (what the inlined vmap computed)."""
    return tuple(sub(*inputs))


def fold_vmap_regions(graph: fx.Graph, attrs: dict) -> None:
    """Replace each outermost vmap region of `graph` by one run_vmap_region node, its submodule
    added to `attrs` (the GraphModule's attributes) as `vmap_region<i>`."""
    for i, region in enumerate(_regions(graph)):
        _fold(graph, attrs, region, f"vmap_region{i}")


def _regions(graph: fx.Graph) -> list[list[fx.Node]]:
    out, depth, current = [], 0, []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _UP:
            depth += 1
        if depth:
            current.append(n)
        if n.op == "call_function" and n.target is _DOWN:
            depth -= 1
            if depth == 0:
                out.append(current)
                current = []
    return out


def _fold(graph: fx.Graph, attrs: dict, region: list[fx.Node], name: str) -> None:
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes
                                if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub, env = fx.Graph(), {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in region:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[o] for o in outputs))
    attrs[name] = fx.GraphModule(attrs, sub)
    last = outputs[-1] if outputs else region[-1]
    with graph.inserting_after(region[-1]):
        sub_node = graph.get_attr(name)
    with graph.inserting_after(sub_node):
        call = graph.call_function(run_vmap_region, (sub_node, *inputs))
    call.meta = {k: v for k, v in last.meta.items() if k in ("stack_trace", "nn_module_stack")}
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    for k, o in enumerate(outputs):
        with graph.inserting_after(call):
            got = graph.call_function(operator.getitem, (call, k))
        got.meta = dict(o.meta)
        o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region):
        graph.erase_node(n)
