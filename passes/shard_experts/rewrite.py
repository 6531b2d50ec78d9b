"""The rewrite: each MoE region's entries dispatched to this rank's experts, its exits combined
back, the region's ops running on E/ep experts (an EPComm the program holds as `self.ep_comm`)."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopart.errors import node_error
from autopart.ir import EP_LOCAL, META_EP, graph_module
from autopart.localize import attribute
from autopart.ops import ep as ep_ops

COMM = "ep_comm"


def rewrite(old: fx.GraphModule, regions: list, ep: int) -> fx.GraphModule:
    """A copy of `old` in which every region runs on this rank's experts."""
    return _Rewriter(old, regions, ep).run()


class _Rewriter:
    def __init__(self, old: fx.GraphModule, regions: list, ep: int):
        self.old, self.ep = old, ep
        self.region_of = {n: r for r in regions for n in r.nodes}
        self.g = fx.Graph()
        self.comm = self.g.get_attr(COMM)
        self.env: dict = {}       # old node -> new node (the value its own consumers see)
        self.local: dict = {}     # entry -> dispatched, for region consumers
        self.combined: dict = {}  # exit -> combined, for consumers outside
        self.layouts: dict = {}   # sorted rows: region -> (layout, local offsets)

    def run(self) -> fx.GraphModule:
        for node in self.old.graph.nodes:
            r = self.region_of.get(node)
            if r is None:
                self.env[node] = self.g.node_copy(node, lambda a: self.combined.get(a, self.env[a]))
            else:
                self._copy_in_region(node, r)
        self.g.lint()
        root = {n.target: attribute(self.old, n.target) for n in self.old.graph.nodes
                if n.op == "get_attr"}
        root[COMM] = ep_ops.EPComm(self.ep)
        gm = graph_module(root, self.g)
        gm.recompile()
        return gm

    def _copy_in_region(self, node: fx.Node, r) -> None:
        def arg(a):
            if r.offsets is not None and a is r.offsets:
                return self._layout(r)[1]
            if a in r.entries:
                return self._dispatched(a, r)
            return self.env[a]
        new = self.g.node_copy(node, arg)
        if r.offsets is None:
            new.meta["val"] = _local_val(node.meta.get("val"), self.ep)
        new.meta[META_EP] = EP_LOCAL
        self.env[node] = new
        if node in r.exits:
            self.combined[node] = self._combine(node, new, r)

    def _combine(self, node: fx.Node, new: fx.Node, r) -> fx.Node:
        if r.offsets is None:
            return _call(self.g, ep_ops.combine_from_experts, (new, self.comm), node,
                         node.meta.get("val"))
        lay, _ = self._layout(r)
        return _call(self.g, ep_ops.combine_rows, (new, self.env[r.offsets], lay,
                                                   self.env[r.entries[0]], self.comm),
                     node, node.meta.get("val"))

    def _layout(self, r):
        """Sorted rows: the all-to-all'd row counts and this rank's expert offsets, once."""
        if id(r) not in self.layouts:
            if r.offsets not in self.env:
                raise node_error(r.first, "the expert row offsets are computed after the "
                                 "tokens enter the experts", "compute the offsets first")
            offsets = self.env[r.offsets]
            lay = _call(self.g, ep_ops.sorted_layout, (offsets, self.comm), r.offsets, None)
            offs = _call(self.g, ep_ops.local_offsets, (lay, offsets), r.offsets,
                         r.offsets.meta.get("val"))
            self.layouts[id(r)] = (lay, offs)
        return self.layouts[id(r)]

    def _dispatched(self, a: fx.Node, r) -> fx.Node:
        if a not in self.local:
            if r.offsets is None:
                self.local[a] = _call(self.g, ep_ops.dispatch_to_experts, (self.env[a], self.comm),
                                      a, _local_val(a.meta.get("val"), self.ep))
            else:
                lay, _ = self._layout(r)
                self.local[a] = _call(self.g, ep_ops.dispatch_rows,
                                      (self.env[a], self.env[r.offsets], lay, self.comm),
                                      a, a.meta.get("val"))
        return self.local[a]


def _call(g, fn, args, like: fx.Node, val) -> fx.Node:
    out = g.create_node("call_function", fn, tuple(args), {})
    out.meta = {k: like.meta[k] for k in ("stack_trace", "nn_module_stack") if k in like.meta}
    if val is not None:
        out.meta["val"] = val
    return out


def _local_val(val, ep: int):
    """The fake tensor a rank sees: [E/ep, ep*N, ...] for the global [E, N, ...]."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return val
    shape = (val.shape[0] // ep, val.shape[1] * ep, *val.shape[2:])
    try:
        return val.new_empty(shape)
    except Exception:  # noqa: BLE001  (a plain meta tensor, or no fake mode: keep the global one)
        return val
