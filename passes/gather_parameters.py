"""gather_parameters (zero=3): where each chunk's parameters are all-gathered and freed.

Under zero=3 a rank keeps only its 1/dp slice of every parameter (runtime/sharding.py). This pass
groups a chunk's parameters by the layer that first reads them and rewrites the chunk's program:

    gather_params(self.param_shards, g)     before the first node that touches group g
    release_params(self.param_shards, g)    after the last one (the forward is done with it)
    regather_on_backward(y, ..., g)         on every output y of a node that reads g: autograd
                                            runs its backward, which gathers g again, just before
                                            that node's backward, which reads g's parameters

and the runtime frees a group again once the backward has accumulated all its gradients
(runtime/param_shards.py), so a rank holds about one layer's full parameters at a time, in the
forward and in the backward, as FSDP2 with reshard_after_forward does. Each gather also starts
the next group's (the backward: the previous one's), so the all-gather overlaps the layer.

Which groups stay gathered past the forward (release_params' `after`), decided per group:

    "forward"   freed after its last reader, gathered again for the backward (the default)
    "backward"  kept until its gradients are in: one all-gather fewer per microbatch, its bytes
                held from the forward to the backward
    "step"      kept across the step's microbatches (pipelines: each microbatch would gather
                again), freed when the step ends: one gather per step

The groups released after the last gather of the chunk that computes the loss are kept to the
backward always: its backward starts right after its forward and gathers them first, so keeping
them costs no byte at the peak and saves their re-gather. Under a memory budget the pass keeps
more, the most that fits each pipeline rank by the memory model (memory.rank_memory): first
every group for the step (microbatches > 1), else the most groups to the backward, last ones
first. The report and explain() say which.

Decided by dataflow only: a node "touches" a parameter when it reads its get_attr, directly or
through views; a recomputed region (recompute_activations' checkpoint call) is one node that reads
every parameter passed to it (its body reads them as inputs), so its replay in the backward finds
them gathered.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from collections import Counter

import torch
import torch.fx as fx

from autopart.analysis import layer_of
from autopart.config import Config
from autopart.ir import ChunkProgram, Program, copied_graph, graph_module
from autopart.ops.zero import (ParamShards, gather_params, regather_on_backward,
                               release_params)
from autopart.ops import aten_groups as G

aten = torch.ops.aten
# ops whose output aliases their input's storage: a parameter read through them is still the
# parameter (a linear written as x @ w.t())
_VIEWS = G.ALIASING
SHARDS = "param_shards"
# ops autocast runs in the reduced precision on CPU and CUDA alike, casting every floating input
# (weight and bias too): a parameter read only by these may be gathered in bf16, the values
# autocast would compute with anyway. One read by any other op (a norm, an embedding, an add)
# is gathered in fp32, as the bf16 recipe (fp32 weights under autocast) reads it there.
REDUCED_OPS = G.AUTOCAST_REDUCED


def gather_parameters(program: Program, *, config: Config = Config(), mesh=None,
                      schedule=None, microbatch_size: int = 1):
    """Return (program with rewritten .chunks and .param_groups, report). config.zero < 3: as
    is. .param_groups: chunk -> [(group label, when it is freed)], in the forward's order;
    under config.memory_budget, the most kept gathered that fits."""
    budget = config.memory_budget
    if config.zero != 3:
        return program.replace(param_groups={}), {}
    staged = program.replace(chunks=tuple(rewrite_chunk(c)[0] for c in program.chunks))
    keep = _free_keeps(staged)
    if budget is not None:
        weigh = _Weigher(staged, budget, dict(mesh=mesh, schedule=schedule, config=config,
                                              microbatch_size=microbatch_size))
        free, microbatches = dict(keep), schedule.microbatches if schedule else 1
        for pp in range(mesh.pp):
            keep.update(weigh.most_kept(pp, microbatches, free))
    for chunk in staged.chunks:
        if _group_count(chunk):
            set_releases(chunk, _releases_of(chunk, keep))
            chunk.gm.recompile()
    groups = {c.chunk: list(zip(c.gm.param_shards.labels, c.gm.param_shards.after))
              for c in staged.chunks if _group_count(c)}
    report = {f"chunk {c}": dict(Counter(after for _, after in rows))
              for c, rows in groups.items()}
    return staged.replace(param_groups=groups), report


def rewrite_chunk(chunk: ChunkProgram) -> tuple[ChunkProgram, list[str]]:
    """A copy of `chunk` whose program gathers and frees its parameters (module docstring)."""
    graph, _ = copied_graph(chunk.gm)
    order = {n: i for i, n in enumerate(graph.nodes)}
    touches = _touches(graph, set(chunk.params))
    if not touches:
        return chunk, []
    groups = _groups(touches, order, set(chunk.layers))
    shards = ParamShards([names for _, names in groups], [label for label, _ in groups],
                         reduced=_reduced_only(touches))
    group_of = {name: g for g, (_, names) in enumerate(groups) for name in names}
    users = [sorted((n for n, names in touches.items() if any(group_of[x] == g for x in names)),
                    key=order.__getitem__) for g in range(len(groups))]
    with graph.inserting_before(users[0][0]):      # group 0 is the first touched
        handle = graph.get_attr(SHARDS)
    for g, nodes in enumerate(users):
        with graph.inserting_before(nodes[0]):
            graph.call_function(gather_params, (handle, g))
        with graph.inserting_after(nodes[-1]):
            graph.call_function(release_params, (handle, g))
    for node, names in touches.items():
        if node.target not in _VIEWS:
            for out in _tensor_outputs(node):
                for g in sorted({group_of[x] for x in names}):
                    _regather(graph, out, handle, g)
    graph.lint()
    root = copy.copy(chunk.gm)          # the input program keeps its modules as they were
    root._modules = {**root._modules, SHARDS: shards}
    gm = graph_module(root, graph, class_name=type(chunk.gm).__name__)
    return dataclasses.replace(chunk, gm=gm), [label for label, _ in groups]


def _group_count(chunk: ChunkProgram) -> int:
    shards = getattr(chunk.gm, SHARDS, None)
    return len(shards.groups) if isinstance(shards, ParamShards) else 0


def _releases(chunk: ChunkProgram) -> dict[int, fx.Node]:
    return {n.args[1]: n for n in chunk.gm.graph.nodes if n.target is release_params}


def _releases_of(chunk: ChunkProgram, keep: dict[tuple[int, int], str]) -> list[str]:
    """Per group of `chunk`, when it is freed: `keep`'s say, else after the forward."""
    return [keep.get((chunk.chunk, g), "forward") for g in range(_group_count(chunk))]


def set_releases(chunk: ChunkProgram, after: list[str]) -> None:
    """Say in `chunk`'s graph (its release_params calls) and its ParamShards when each group
    is freed (its code once the caller recompiles it: the memory model reads the graph). Mutates
    the chunk: only this pass's own copies are handed to it."""
    if not after:
        return
    for g, node in _releases(chunk).items():
        node.kwargs = {} if after[g] == "forward" else {"after": after[g]}
    chunk.gm.param_shards.after = list(after)


def _free_keeps(program: Program) -> dict[tuple[int, int], str]:
    """(chunk, group) -> "backward" for the loss chunk's groups released after its last
    gather_params: its backward gathers them again first thing (module docstring)."""
    last = max(program.chunks, key=lambda c: c.chunk)
    nodes = list(last.gm.graph.nodes)
    gathers = [i for i, n in enumerate(nodes) if n.target is gather_params]
    if not gathers:
        return {}
    return {(last.chunk, g): "backward" for g, n in _releases(last).items()
            if nodes.index(n) > gathers[-1]}


class _Weigher:
    """The memory model over candidate releases of one program's groups (pipeline rank by
    rank): the most kept that fits `budget`, by memory.rank_memory."""

    def __init__(self, program: Program, budget: int, options: dict):
        from autopart.ir import REDUCED_DTYPES
        from autopart.memory import ActivationCache
        self.program, self.budget, self.options = program, budget, options
        self.cache = ActivationCache(REDUCED_DTYPES[options["config"].precision])

    def fits(self, pp: int, keep: dict) -> bool:
        from autopart.memory import rank_memory
        mine = [c for c in self.program.chunks if c.rank == pp]
        for c in mine:
            set_releases(c, _releases_of(c, keep))
        return rank_memory(self.program, pp, cache=self.cache, **self.options)["total"] \
            <= self.budget

    def most_kept(self, pp: int, microbatches: int,
                  free: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
        """Every group for the step if that fits and there is more than one microbatch; else
        the largest k such that the rank's last k groups kept to the backward fit, besides
        the `free` keeps (_free_keeps)."""
        order = [(c.chunk, g) for c in sorted(self.program.chunks, key=lambda c: c.chunk)
                 if c.rank == pp for g in range(_group_count(c))]
        base = {k: v for k, v in free.items() if k in order}
        whole = dict.fromkeys(order, "step")
        if microbatches > 1 and self.fits(pp, whole):
            return whole
        lo, hi = 0, len(order)          # lo fits (the free keeps: no byte more), find the most
        while lo < hi:
            k = (lo + hi + 1) // 2
            if self.fits(pp, {**base, **dict.fromkeys(order[len(order) - k:], "backward")}):
                lo = k
            else:
                hi = k - 1
        return {**base, **dict.fromkeys(order[len(order) - lo:], "backward")}


def _touches(graph: fx.Graph, params: set[str]) -> dict[fx.Node, set[str]]:
    """Every non-get_attr node that reads a parameter (directly or through views) -> the
    parameters it reads; views of a parameter count as touching it too."""
    source: dict[fx.Node, set[str]] = {}    # parameter or view of one -> parameter names
    touches: dict[fx.Node, set[str]] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            if node.target in params:
                source[node] = {node.target}
            continue
        read = set().union(*(source.get(a, set()) for a in node.all_input_nodes))
        if not read:
            continue
        touches[node] = read
        if node.target in _VIEWS:
            source[node] = read
    return touches


def _reduced_only(touches: dict[fx.Node, set[str]]) -> list[str]:
    """The parameters whose every reader (past views) is one of REDUCED_OPS."""
    readers: dict[str, set] = {}
    for node, names in touches.items():
        if node.target not in _VIEWS:
            for name in names:
                readers.setdefault(name, set()).add(node.target)
    return sorted(n for n, ops in readers.items() if ops <= REDUCED_OPS)


def _groups(touches: dict, order: dict, layers: set[str]) -> list[tuple[str, list[str]]]:
    """(label, parameter names) per group, in the order the forward first touches them: the
    parameters first read by one layer's nodes form its group; those read first by one node
    outside every layer (an embedding, a final norm's weight and bias) form one too."""
    first: dict[str, fx.Node] = {}
    for node in sorted(touches, key=order.__getitem__):
        for name in sorted(touches[node]):
            first.setdefault(name, node)
    out: dict[str, list[str]] = {}
    for name, node in sorted(first.items(), key=lambda kv: (order[kv[1]], kv[0])):
        out.setdefault(layer_of(node, layers) or node.name, []).append(name)
    return [(label if label in layers else ", ".join(names), names)
            for label, names in out.items()]


def _tensor_outputs(node: fx.Node) -> list[fx.Node]:
    """The nodes holding `node`'s tensor results: itself, or its getitem users (a tuple)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [node]
    return [u for u in node.users if u.target is operator.getitem and
            isinstance(u.meta.get("val"), torch.Tensor)]


def _regather(graph: fx.Graph, out: fx.Node, handle: fx.Node, g: int) -> None:
    with graph.inserting_after(out):
        hooked = graph.call_function(regather_on_backward, (out, handle, g))
    hooked.meta = dict(out.meta)
    out.replace_all_uses_with(hooked, delete_user_cb=lambda user: user is not hooked)


__all__ = ["gather_parameters", "rewrite_chunk", "set_releases"]
