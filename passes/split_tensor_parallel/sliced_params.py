"""Parameters that a rank only ever reads a slice of: Mamba-2's and DeltaNet's per-head A_log, D
and dt_bias, their depthwise conv1d's filters and bias, a gated norm's weight per group of heads.
The region search slices them where they meet the heads (a scatter_to_tp of the replicated
value); when every use of the parameter is such a slice, reached through ops that keep the
sliced dim (a cast, exp, neg, squeeze/unsqueeze, a view), the parameter itself is split
instead: each rank holds its heads' share, and its gradient needs no all-gather."""
from __future__ import annotations

import torch.fx as fx

from autopart.ir import ParamShard, TensorParallelPlan
from autopart.ops import aten_groups as G
from autopart.placement import NoRule, Shard, aten, carry, ndim, shape_of

CHAIN = set(G.ELEMENTWISE) | set(G.RESHAPES) | set(G.TRANSPOSES) | set(G.UNSQUEEZES) | {
    aten.squeeze.dims}


def shard_sliced_params(gm: fx.GraphModule, plan: TensorParallelPlan, params) -> None:
    """Split each parameter whose only readers end in this plan's scatters (see the module)."""
    by_value: dict = {}
    for (consumer, arg), dim in plan.scatters.items():
        by_value.setdefault(arg, set()).add((consumer, dim,
                                             plan.scatter_sections.get((consumer, arg))))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params and node.target not in plan.params:
            _try(node, plan, by_value, order)


def _try(param: fx.Node, plan, by_value, order) -> None:
    chain, ends = _chain(param, by_value)
    if chain is None or not ends:
        return
    for d in range(ndim(param)):
        placed = _carry_along(param, d, sorted(chain, key=order.get), plan.tp)
        if placed is None:
            continue
        wanted = {(end, dim, sections) for end in ends for _, dim, sections in by_value[end.name]}
        # sections cut the parameter's dim as they cut the value's: the same size there
        if all(isinstance(placed.get(e), Shard) and placed[e].dim == dim and (
                sections is None or shape_of(e)[dim] == shape_of(param)[d])
               for e, dim, sections in wanted):
            sections = {s for _, _, s in wanted}
            if len(sections) != 1:
                return
            size = int(shape_of(param)[d])
            plan.params[param.target] = ParamShard(d, sections.pop() or (size,))
            for n, p in placed.items():
                if n is not param:
                    plan.placements[n] = p
            for e in ends:
                for consumer, _, _ in by_value[e.name]:
                    plan.scatters.pop((consumer, e.name), None)
                    plan.scatter_sections.pop((consumer, e.name), None)
            return


def _chain(param: fx.Node, by_value):
    """(the nodes from param to the scattered values, those values), or (None, ()) when some
    reader of the parameter is not on such a path."""
    chain, ends, stack = [], [], [param]
    while stack:
        n = stack.pop()
        if n.name in by_value:
            ends.append(n)
            uses = {c for c, _, _ in by_value[n.name]}
            if any(u.name not in uses and u.target not in G.CHECKS for u in n.users):
                return None, ()
            continue
        for u in n.users:
            if u.target in G.CHECKS:
                continue
            if u.op != "call_function" or u.target not in CHAIN or len(u.all_input_nodes) != 1:
                return None, ()
            chain.append(u)
            stack.append(u)
    return chain, ends


def _carry_along(param: fx.Node, d: int, chain: list, tp: int):
    """The placements of the chain with the parameter split on dim d, or None."""
    placed = {param: Shard(d, None)}
    for n in chain:
        try:
            out = carry(n, placed, tp)
        except NoRule:
            return None
        if not isinstance(out, Shard):
            return None
        placed[n] = out
    return placed
