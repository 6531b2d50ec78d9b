"""The rewrite: attention cores become context-parallel attention, positions the rank's own.

Each core's output node is replaced by one call of `autopart.cp_ops.ring_attention` (or
`allgather_kv_attention`) on the core's q, k, v (k transposed back when the core read k^T; a
batch of (batch*heads, s, d) matrices gets a heads dim of one; a sliding window proved by
masks.py as `window=w`); the ops that only built the
core and its mask are then dead and removed. Aranges over the sequence become
`sequence_positions` (the global positions of the rank's chunks), and a table sliced to the
sequence length (a RoPE cache, a position table) is indexed at those positions instead.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopart.ir import Program, graph_module
from autopart.localize import attribute
from autopart.ops import aten_groups as G
from autopart.ops import cp as cp_ops

aten = torch.ops.aten

COMM = "cp_comm"
KERNELS = {"ring": cp_ops.ring_attention, "allgather": cp_ops.allgather_kv_attention}


def _impure(node: fx.Node) -> bool:
    """fx's rule, except that a dropout of p=0 (HF's eager attention calls one on the
    probabilities of a replaced core) draws nothing and may go."""
    if node.target == aten.dropout.default and not node.args[1]:
        return False
    return node.is_impure()


def rewrite(program: Program, cores: list, aranges: list, slices: list, cp: int,
            attention: str) -> fx.GraphModule:
    gm = program.gm
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    comm = g.get_attr(COMM)
    by_last = {c.last: c for c in cores}
    aranges, slices = set(aranges), set(slices)
    positions: dict = {}         # one positions tensor per (length node, dtype, device)
    for node in gm.graph.nodes:
        if node.op == "output":
            env[node] = g.node_copy(node, lambda n: env[n])
        elif node in by_last:
            env[node] = _core(g, by_last[node], env, comm, attention, node)
        elif node in aranges:
            env[node] = _arange(g, node, env, comm, positions)
        elif node in slices:
            env[node] = _table_rows(g, node, env, comm, positions)
        elif node.target in G.CHECKS:
            continue    # export's dtype asserts: one on a replaced core's softmax would keep it
        else:
            env[node] = g.node_copy(node, lambda n: env[n])
    g.eliminate_dead_code(_impure)     # the masks and the replaced cores' inner ops
    g.lint()
    root = {n.target: attribute(gm, n.target) for n in g.nodes
            if n.op == "get_attr" and n.target != COMM}
    root[COMM] = cp_ops.CPComm(cp)
    return graph_module(root, g)


def _meta(new: fx.Node, old: fx.Node) -> fx.Node:
    new.meta.update({k: v for k, v in old.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                               "val", "source_fn_stack")})
    return new


def _core(g: fx.Graph, core, env: dict, comm: fx.Node, attention: str, old: fx.Node) -> fx.Node:
    q, k, v = env[core.q], env[core.k], env[core.v]
    if core.k_transposed:
        k = g.call_function(aten.transpose.int, (k, -2, -1))
    flat = core.q.meta["val"].dim() == 3       # (batch*heads, s, d): a heads dim of one
    if flat:
        q, k, v = (g.call_function(aten.unsqueeze.default, (t, 1)) for t in (q, k, v))
    args = (q, k, v, comm, core.causal, core.scale)
    if core.key_mask is not None or core.doc_ids is not None:
        args += (env[core.key_mask] if core.key_mask is not None else None,)
    if core.doc_ids is not None:
        args += (env[core.doc_ids],)
    kwargs = {"window": core.window} if core.window is not None else {}
    out = g.call_function(KERNELS[attention], args, kwargs)
    if flat:
        out = g.call_function(aten.squeeze.dim, (out, 1))
    return _meta(out, old)


def _length(g, node: fx.Node, env: dict):
    """(start, length) of an arange over the sequence, as nodes or numbers of the new graph."""
    args = [env[a] if isinstance(a, fx.Node) else a for a in node.args]
    if node.target == aten.arange.default:
        return 0, args[0]
    start, end = args[0], args[1]
    if isinstance(start, int) and start == 0:
        return 0, end
    return start, g.call_function(operator.sub, (end, start))


def _positions(g, comm, length, start, dtype, device, cache: dict) -> fx.Node:
    key = (length, start, dtype, device)
    if key not in cache:
        cache[key] = g.call_function(cp_ops.sequence_positions, (comm, length, start),
                                     {"dtype": dtype, "device": device})
    return cache[key]


def _arange(g, node: fx.Node, env: dict, comm, cache: dict) -> fx.Node:
    start, length = _length(g, node, env)
    val = node.meta["val"]
    out = _positions(g, comm, length, start, node.kwargs.get("dtype", val.dtype),
                     node.kwargs.get("device", val.device), cache)
    return _meta(out, node)


def _table_rows(g, node: fx.Node, env: dict, comm, cache: dict) -> fx.Node:
    table, dim = env[node.args[0]], node.args[1] if len(node.args) > 1 else 0
    end = node.args[3] if len(node.args) > 3 else None
    length = env[end] if isinstance(end, fx.Node) else node.meta["val"].shape[dim]
    device = g.call_function(getattr, (table, "device"))     # the table's, wherever it runs
    idx = _positions(g, comm, length, 0, torch.int64, device, cache)
    return _meta(g.call_function(aten.index_select.default, (table, dim, idx)), node)
