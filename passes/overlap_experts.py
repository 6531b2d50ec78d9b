"""overlap_experts: one microbatch's expert all-to-alls run behind another microbatch's compute.

shard_experts leaves each MoE layer as dispatch all-to-all, local experts, combine all-to-all,
each collective posted and waited on in one op: nothing of the same microbatch can run while it
moves (the experts need the dispatched tokens, the next layer the combined ones). Two
microbatches can: Megatron-Core's combined 1F1B and DeepSeek's two-microbatch overlap issue one
microbatch's all-to-all while the other computes. This pass gives every chunk holding expert
all-to-alls a *paired* program (ChunkProgram.paired): the chunk's graph twice, for microbatches
a and b, each collective split into a start (posted async, autopart/ops/ep_async.py) and a wait
placed before the collective's first reader, and the two copies interleaved so that each wait of
one microbatch sits after the other microbatch's compute up to its own next wait:

    a: attention, router, sorted_layout, dispatch_rows_start      (a's tokens leave)
    b: attention, router, sorted_layout, dispatch_rows_start      (runs while a's move)
    a: ep_wait, experts, combine_rows_start
    b: ep_wait, experts, combine_rows_start                       (runs while a's come back)
    a: ep_wait, the residual, the next layer ... dispatch_rows_start
    ...

The backward is one autograd pass over both microbatches' outputs: ep_wait's backward posts the
gradient's all-to-all and the start's backward waits for it, and autograd runs the nodes created
between them (the other microbatch's) in between. Values are the plain ops': the same
all-to-alls of the same tensors. The runtime runs a paired program for two adjacent computes of
one chunk (runtime/executor.py); compile() orders the schedule so that they are adjacent
(autopart/schedule_lowering.py pair_microbatches).

Under the interleaved 1F1B with pp > 1 the schedule already runs a forward next to a backward of
another microbatch (Megatron's slots), and the runtime runs the two as one action instead
(Megatron-Core's combined 1F1B, DualPipe's overlapped F&B; autopart/compiler.py
combines_forward_backward). For that the pass gives each such chunk its forward cut after every
posted all-to-all (ChunkProgram.segments, `forward_segments`): the runtime runs every forward of
the chunk segment by segment, so its backward posts and waits apart too, and for a combined pair
it runs the forward's next segment each time the backward has posted a gradient's all-to-all
(runtime/compute.py forward_backward): the backward's all-to-all moves while the forward
computes, the forward's while the backward computes up to its next post.

Kept as they are, and named in the report: collectives inside a recomputed region (their
replay runs in the backward, one microbatch at a time) and chunks without expert all-to-alls.
Runs on the emitted chunks, after every pass that rewrites them.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from autopart.ir import ChunkProgram, ForwardSegment, Program, graph_module
from autopart.ops import ep as ep_ops
from autopart.ops import ep_async

# each posted-and-waited collective of ops/ep.py -> its start (the same arguments)
STARTS = {ep_ops.dispatch_to_experts: ep_async.dispatch_start,
          ep_ops.combine_from_experts: ep_async.combine_start,
          ep_ops.dispatch_rows: ep_async.dispatch_rows_start,
          ep_ops.combine_rows: ep_async.combine_rows_start}
MICROBATCHES = ("a", "b")


def overlap_experts(program: Program, segments: bool = False):
    """Return (program whose chunks with expert all-to-alls have .paired, or with `segments`
    (the runtime combines forwards with backwards) .segments, report)."""
    report: dict = {"paired_chunks": [], "waits": {}, "kept": {}, "segmented_chunks": []}
    chunks = tuple(_pair_chunk(c, report, segments) for c in program.chunks)
    return program.replace(chunks=chunks), report


def _pair_chunk(chunk: ChunkProgram, report: dict, segments: bool) -> ChunkProgram:
    nested = [n.target for n in chunk.gm.graph.nodes if n.op == "get_attr"
              and isinstance(getattr(chunk.gm, n.target, None), fx.GraphModule)
              and _collectives(getattr(chunk.gm, n.target).graph)]
    for name in nested:
        report["kept"][f"chunk {chunk.chunk}: {name}"] = "in a recomputed region"
    if not _collectives(chunk.gm.graph) or not _returns_tuple(chunk.gm.graph):
        return chunk
    if segments:
        cuts = forward_segments(chunk.gm)
        report["segmented_chunks"].append(chunk.chunk)
        report["waits"][chunk.chunk] = [
            f"segment {i}: {len(s.gm.graph.nodes)} nodes, then posts "
            + (", ".join(p.removesuffix(_PENDING) for p in s.pending) or "nothing (the outputs)")
            for i, s in enumerate(cuts)]
        return dataclasses.replace(chunk, segments=cuts)
    paired, waits = paired_graph(chunk.gm.graph)
    report["paired_chunks"].append(chunk.chunk)
    report["waits"][chunk.chunk] = waits
    gm = graph_module(chunk.gm, paired, class_name=type(chunk.gm).__name__ + "Paired")
    return dataclasses.replace(chunk, paired=gm)


def _collectives(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in STARTS]


def _returns_tuple(graph: fx.Graph) -> bool:
    out = next(n for n in graph.nodes if n.op == "output")
    return isinstance(out.args[0], (tuple, list))


def split_waits(graph: fx.Graph) -> tuple[list, dict]:
    """The graph's compute nodes in order, each collective as (start, wait) items: the start
    where the collective was, the wait just before its first reader. Returns (items, the wait
    item of each collective). An item is ("node", n) or ("start", n) or ("wait", n)."""
    body = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_reader = {n: min(n.users, key=order.__getitem__) for n in body
                    if n.target in STARTS and n.users}
    waits_before: dict = {}
    for n, reader in first_reader.items():
        waits_before.setdefault(reader, []).append(n)
    items = []
    for n in body:
        items += [("wait", c) for c in waits_before.get(n, ())]
        items.append(("start", n) if n.target in STARTS else ("node", n))
        if n.target in STARTS and not n.users:
            items.append(("wait", n))
    return items, first_reader


def interleave(items: list) -> list[tuple[int, tuple]]:
    """Both microbatches' items, ping-pong: run one microbatch up to its next wait, then the
    other up to its own, then the first's wait and on. Returns [(microbatch 0/1, item)]."""
    pos, out, cur, n = [0, 0], [], 0, len(items)
    while pos[0] < n or pos[1] < n:
        other, first = 1 - cur, True
        while pos[cur] < n:
            if items[pos[cur]][0] == "wait" and not first and pos[other] < n:
                break
            out.append((cur, items[pos[cur]]))
            pos[cur] += 1
            first = False
        cur = other
    return out


def forward_segments(gm: fx.GraphModule) -> tuple[ForwardSegment, ...]:
    """`gm`'s forward cut just after each posted all-to-all (split_waits' items), each piece a
    program of the values it reads from earlier pieces (or the placeholders) returning what later
    pieces or the chunk's outputs read; the last piece returns the chunk's outputs."""
    graph = gm.graph
    items, _ = split_waits(graph)
    groups: list[list] = [[]]
    for item in items:
        groups[-1].append(item)
        if item[0] == "start":
            groups.append([])
    out = next(n for n in graph.nodes if n.op == "output")
    final = [_key(v) for v in out.args[0]]
    reads = [_reads(g) for g in groups]
    defined = [[_defines(it) for it in g] for g in groups]
    later: set = set(final)
    needed_after: list[set] = []
    for k in range(len(groups) - 1, -1, -1):      # what each piece's successors read
        needed_after.append(set(later))
        later |= reads[k]
    needed_after.reverse()
    segments = []
    for k, group in enumerate(groups):
        inputs = tuple(sorted(reads[k] - set(defined[k]), key=_order(graph)))
        last = k == len(groups) - 1
        outputs = tuple(final) if last else tuple(d for d in defined[k] if d in needed_after[k])
        gm_k = graph_module(gm, _segment_graph(gm.graph, group, inputs, outputs),
                            class_name=type(gm).__name__ + f"Segment{k}")
        segments.append(ForwardSegment(
            gm_k, inputs, outputs, tuple(o for o in outputs if o.endswith(_PENDING)),
            tuple(i for i in inputs if i not in needed_after[k])))
    return tuple(segments)


_PENDING = ".pending"


def _key(value) -> str:
    """The name a value goes by between pieces: the node's name (a collective's: its waited
    result); a posted collective's Pending is `name.pending`."""
    return value.name


def _defines(item) -> str:
    kind, n = item
    return n.name + _PENDING if kind == "start" else n.name


def _reads(group: list) -> set:
    out = set()
    for kind, n in group:
        if kind == "wait":
            out.add(n.name + _PENDING)
            continue
        for a in n.all_input_nodes:
            if a.op != "get_attr":
                out.add(a.name)
    return out


def _order(graph: fx.Graph):
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    return lambda name: index[name.removesuffix(_PENDING)]


def _segment_graph(graph: fx.Graph, group: list, inputs: tuple, outputs: tuple) -> fx.Graph:
    """One piece as a graph: a placeholder per input, its items copied (a start as the posting
    op, a wait as ep_wait), its outputs returned as a tuple."""
    by_name = {n.name: n for n in graph.nodes}
    new, env = fx.Graph(), {}
    for name in inputs:
        node = new.placeholder(name.replace(".", "_"))
        original = by_name[name.removesuffix(_PENDING)]
        if not name.endswith(_PENDING):
            node.meta = dict(original.meta)
        env[name] = node

    def arg(n: fx.Node):
        if n.op == "get_attr":
            if n.name not in env:
                env[n.name] = new.get_attr(n.target)
                env[n.name].meta = dict(n.meta)
            return env[n.name]
        return env[n.name]
    for kind, n in group:
        if kind == "node":
            env[n.name] = new.node_copy(n, arg)
        elif kind == "start":
            env[n.name + _PENDING] = new.call_function(STARTS[n.target],
                                                       tuple(fx.node.map_arg(n.args, arg)))
        else:
            env[n.name] = new.call_function(ep_async.ep_wait, (env[n.name + _PENDING],))
            env[n.name].meta = dict(n.meta)
    new.output(tuple(env[o] for o in outputs))
    new.lint()
    return new


def paired_graph(graph: fx.Graph) -> tuple[fx.Graph, list[str]]:
    """The paired program's graph: placeholders a_*, then b_*; outputs a's then b's. Returns it
    and, in order, where each wait sits ("a wait dispatch_rows after b's ...")."""
    new = fx.Graph()
    envs: list[dict] = [{}, {}]
    for mb, prefix in enumerate(MICROBATCHES):
        for n in graph.nodes:
            if n.op == "placeholder":
                envs[mb][n] = new.placeholder(f"{prefix}_{n.name}")
                envs[mb][n].meta = dict(n.meta)
    for n in graph.nodes:
        if n.op == "get_attr":
            envs[0][n] = envs[1][n] = new.get_attr(n.target)
            envs[0][n].meta = dict(n.meta)
    items, _ = split_waits(graph)
    starts: list[dict] = [{}, {}]
    waits, since = [], [[], []]     # since[mb]: the other's nodes run since mb's last start
    for mb, (kind, n) in interleave(items):
        env = envs[mb]
        if kind == "node":
            env[n] = new.node_copy(n, env.__getitem__)
            since[1 - mb].append(n.name)
        elif kind == "start":
            starts[mb][n] = new.call_function(STARTS[n.target],
                                              tuple(fx.node.map_arg(n.args, env.__getitem__)))
            since[1 - mb].append(n.name)
            since[mb] = []
        else:
            env[n] = new.call_function(ep_async.ep_wait, (starts[mb][n],))
            env[n].meta = dict(n.meta)
            hidden = since[mb]
            waits.append(f"{MICROBATCHES[mb]}: wait {n.name} after {len(hidden)} ops of "
                         f"{MICROBATCHES[1 - mb]}" + (f" ({hidden[0]} .. {hidden[-1]})"
                                                      if hidden else ""))
    out = next(n for n in graph.nodes if n.op == "output")
    new.output(tuple(v for e in envs for v in fx.node.map_arg(tuple(out.args[0]), e.__getitem__)))
    new.lint()
    return new, waits


__all__ = ["overlap_experts", "forward_segments", "paired_graph", "interleave", "split_waits"]
