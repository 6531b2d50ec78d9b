"""emit_rank_programs: one readable GraphModule per (pipeline rank, chunk).

Each chunk program takes the tensors received from the previous chunk, then the user inputs it
needs, and returns the tensors the next chunk needs (or the loss, on the last chunk). Parameters
are attributes under the plain model's names, and a chunk holds only the parameters it uses.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopart.aliasing import storage_root, writers_by_root
from autopart.ir import META_TP, Boundary, ChunkProgram, Program, graph_module, sym_shape
from autopart.localize import attribute
from autopart.ops import p2p
from autopart.placement import Shard


def emit_rank_programs(program: Program):
    """Return (program with .chunks = one ChunkProgram per chunk, report)."""
    plan = program.stages
    graph = _GraphIndex(program.gm.graph, plan.chunk_of)
    chunks = tuple(_emit_chunk(program, plan, c, graph) for c in range(plan.num_chunks))
    report = {"chunks": [{"chunk": c.chunk, "rank": c.rank, "nodes": len(c.gm.graph.nodes),
                          "params": len(c.params), "recv": len(c.recvs), "send": len(c.sends)}
                         for c in chunks]}
    return program.replace(chunks=chunks), report


def _boundary(node: fx.Node, program: Program, peer_rank: int, peer_chunk: int) -> Boundary:
    """The tensor as this rank holds it: a dim sharded over tp (sequence parallelism) is 1/tp."""
    val = node.meta["val"]
    shape = list(sym_shape(val, program.symbols))
    placement, tp_plan = node.meta.get(META_TP), program.tp
    if isinstance(placement, Shard) and tp_plan is not None:
        shape[placement.dim] = shape[placement.dim] / tp_plan.tp
    return Boundary(node.name, tuple(shape), val.dtype, peer_rank, peer_chunk)


class _GraphIndex:
    """The program graph read once for all chunks (a pass per chunk over every node of a
    3072-rank, 128-layer program is most of this pass's time): nodes by name, graph positions,
    placeholders, the output node and each chunk's nodes in graph order."""

    def __init__(self, graph: fx.Graph, chunk_of: dict):
        self.nodes = {n.name: n for n in graph.nodes}
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in reversed(graph.nodes) if n.op == "output")
        self.writers = writers_by_root(graph)
        self.by_chunk: dict = {}
        for n in graph.nodes:
            c = chunk_of.get(n.name)
            if c is not None:
                self.by_chunk.setdefault(c, []).append(n)


def _emit_chunk(program: Program, plan, c: int, graph: _GraphIndex) -> ChunkProgram:
    """Chunk c's program: received tensors, then user inputs, then its nodes (and the
    input-derived ones it needs, recomputed), then the tensors the next chunk needs."""
    nodes = graph.nodes
    recv_names = plan.crossings[c - 1] if c > 0 else ()
    send_names = plan.crossings[c] if c < plan.num_chunks - 1 else ()
    prev_rank = plan.rank_of_chunk(c - 1) if c > 0 else None
    next_rank = plan.rank_of_chunk(c + 1) if send_names else None
    out_node = graph.output
    mine = graph.by_chunk.get(c, [])
    # the last chunk also computes outputs made from the inputs alone
    needed_repl = _replicated_needed(mine + ([out_node] if not send_names else []),
                                     set(plan.replicated), graph.writers)
    inputs = _user_inputs(graph.placeholders, mine, needed_repl)
    b = _ChunkBuilder(program)
    received = [b.placeholder(nodes[name], name) for name in recv_names]
    for node in graph.placeholders:
        if node.name in inputs:
            b.env[node] = b.placeholder(node, node.name)
    for name, ph in zip(recv_names, received):
        b.env[nodes[name]] = _mark(b.g, p2p.recv, ph, prev_rank, c - 1, nodes[name])
    copied = set(mine) | {nodes[name] for name in needed_repl}
    for node in sorted(copied, key=graph.position.__getitem__):   # graph order, as before
        b.env[node] = b.g.node_copy(node, b.lookup)
    if send_names:
        b.g.output(tuple(_mark(b.g, p2p.send, b.env[nodes[n]], next_rank, c + 1, nodes[n])
                         for n in send_names))
    else:
        b.g.output(tuple(b.env[a] for a in out_node.args[0]))
    return ChunkProgram(
        chunk=c, rank=plan.rank_of_chunk(c), gm=b.module(f"Chunk{c}"),
        recvs=tuple(_boundary(nodes[n], program, prev_rank, c - 1) for n in recv_names),
        inputs=tuple(inputs), sends=tuple(_boundary(nodes[n], program, next_rank, c + 1)
                                          for n in send_names),
        is_last=not send_names, layers=plan.chunk_layers[c],
        params=tuple(sorted(t for t in b.attrs if t in program.params)))


class _ChunkBuilder:
    """A new graph copying nodes of the program's, taking the attributes they read along."""

    def __init__(self, program: Program):
        self.program, self.g = program, fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.attrs: dict[str, torch.Tensor] = {}

    def placeholder(self, like: fx.Node, name: str) -> fx.Node:
        ph = self.g.placeholder(name)
        ph.meta = dict(like.meta)
        return ph

    def lookup(self, n: fx.Node) -> fx.Node:
        if n not in self.env and n.op == "get_attr":
            gm = self.program.gm
            self.attrs[n.target] = gm.get_parameter(n.target) if _has_param(gm, n.target) \
                else attribute(gm, n.target)
            self.env[n] = self.g.get_attr(n.target)
            self.env[n].meta = dict(n.meta)
        return self.env[n]

    def module(self, class_name: str) -> fx.GraphModule:
        self.g.lint()
        return graph_module(self.attrs, self.g, class_name=class_name)   # code made on first use


def _mark(g: fx.Graph, fn, node: fx.Node, peer: int, chunk: int, src: fx.Node) -> fx.Node:
    out = g.call_function(fn, (node,), {"src" if fn is p2p.recv else "dst": peer, "chunk": chunk})
    out.meta = {k: v for k, v in src.meta.items() if k == "val"}
    return out


def _replicated_needed(mine: list[fx.Node], replicated: set[str], writers: dict) -> set[str]:
    """The replicated (input-derived) nodes `mine` reads, and what they read. A tensor written in
    place (`start[:, 1:] = ...`, captured as a `copy_` into a view, with no users) takes its
    writers along: without them the chunk would read the tensor unwritten."""
    need: set[str] = set()
    stack = [a for n in mine for a in n.all_input_nodes if a.name in replicated]
    while stack:
        n = stack.pop()
        if n.name not in need:
            need.add(n.name)
            stack.extend(a for a in n.all_input_nodes if a.name in replicated)
            stack.extend(w for w in writers.get(storage_root(n), ()) if w.name in replicated)
    return need


def _user_inputs(placeholders: list[fx.Node], mine: list[fx.Node],
                 needed_repl: set[str]) -> list[str]:
    users = set(n.name for n in mine) | needed_repl
    return [n.name for n in placeholders if any(u.name in users for u in n.users)]


def _has_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False

