"""Expert tensor parallelism: expert matmuls as linears (Megatron-Core's ETP).

An expert matmul multiplies routed tokens by a weight stacked over experts (shard_experts'
layouts: `bmm(x [E, N, a], w [E, a, b])`, a 3-D matmul, or a grouped matmul of rows sorted by
expert `grouped_mm(x [S, a], w [E, a, b], offsets)`), the weight possibly seen through views
that keep the expert dim first (Hugging Face's `gate_up_proj.transpose(-2, -1)`). Each expert is
a small MLP, so the region search splits it like the dense one: the first matmul's output
features column-parallel (the fused gate|up as two sections when a chunk cuts it), the second
contracting them row-parallel, one all-reduce over tp after it (before the combine). Whether
the experts are all on this rank (ep=1) or shard_experts kept E/ep of them does not matter
here: dim 0 is never cut by tp. Found by ops and shapes, never by names.
"""
from __future__ import annotations

import torch
import torch.fx as fx

# the expert pass's notion of "a parameter seen through views keeping dim 0" and of the
# grouped matmul ops: one definition for both passes, in the analysis below them
from autopart.moe_layers import (GROUPED_MM, PARAM_VIEWS, dtype_check as _dtype_check,
                                 find_moe_layers, param_source as _param_source)
from autopart.placement import ndim
from autopart.ops import aten_groups as G

aten = torch.ops.aten
_BATCHED = G.MATMULS_BATCHED


def moe_matmuls(program) -> frozenset[str]:
    """The expert matmuls of the MoE layers shard_experts finds (routed tokens: a batched
    matmul with a stacked weight and no routing before it is no expert), by node name: from its
    plan when it ran (ep > 1; the rewrite keeps the names), else found here."""
    plan = program.ep
    if plan is None:
        if not any(expert_matmul(n, program.params) for n in program.gm.graph.nodes):
            return frozenset()      # no stacked weight read by a matmul: skip the search
        plan = find_moe_layers(program)
    return frozenset(m for layer in plan.layers for m in layer.matmuls)


def expert_matmul(n: fx.Node, params):
    """(activation, weight name, out dim, contracted dim) of an expert matmul, the dims in the
    weight's own coordinates; None for any other node."""
    if n.op != "call_function" or len(n.args) < 2:
        return None
    x, w = n.args[:2]
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or ndim(w) != 3:
        return None
    if _param_source(x, params) is not None:
        return None
    grouped = isinstance(n.target, torch._ops.OpOverload) and \
        n.target._schema.name in GROUPED_MM
    if not (grouped and ndim(x) == 2) and not (n.target in _BATCHED and ndim(x) == 3):
        return None
    src = _param_source(w, params)
    if src is None:
        return None
    name, views = src
    return x, name, _through(views, 2), _through(views, 1)


def _through(views: list, dim: int) -> int:
    """Dim `dim` of the matmul's weight operand as a dim of the parameter: `views` run from the
    matmul back to the parameter (transposes and permutes move dims; casts do not)."""
    for v in views:
        if v.target is aten.transpose.int:
            d0, d1 = (d % ndim(v) for d in v.args[1:3])
            dim = {d0: d1, d1: d0}.get(dim, dim)
        elif v.target is aten.permute.default:
            dim = v.args[1][dim] % ndim(v)
    return dim


def weight_users(gm: fx.GraphModule, params) -> dict[str, list]:
    """param name -> the ops that read it, looking through views that keep dim 0 (a transpose
    of stacked expert weights is the expert matmul's operand, not a use of its own)."""
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        users, stack = out.setdefault(n.target, []), list(n.users)
        while stack:
            u = stack.pop()
            if n.target in params and u.target in PARAM_VIEWS and \
                    _param_source(u, params) is not None:
                stack.extend(u.users)
            elif not _dtype_check(u):
                users.append(u)
    return out
