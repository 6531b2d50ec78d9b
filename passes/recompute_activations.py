"""recompute_activations: which parts of each layer rerun in backward instead of being kept.

Runs on the emitted chunk programs. Per layer (a repeated block, from the chunk's layers) and per
chunk, one of:

  none       keep what autograd saves (the default);
  selective  rerun only the attention core (Korthikanti et al. 2022): the scaled-dot-product
             attention op, or a matmul -> softmax -> matmul chain between two activations, found
             from ops and dataflow (never names), with what lies between (scale, mask, dropout);
  full       keep only the layer's inputs; the whole layer reruns in backward.

`auto` chooses per layer and pipeline rank the cheapest (fewest recomputed FLOPs) choice that fits
`budget` bytes per rank, with autopart.memory's model (which counts the microbatches the schedule
really keeps in flight on each rank).

Each recomputed region becomes a submodule of the chunk program, called through
`torch.utils.checkpoint.checkpoint(self.recompute_<layer>, *inputs, use_reentrant=False)`: the
printed program shows which nodes rerun, and torch's non-reentrant checkpoint replays the forward
RNG state (dropout masks are bitwise the same) and keeps only the region's inputs. Parameters stay
attributes of the chunk under the plain model's names and enter the region as arguments, so the
runtime, the localizer and checkpoints see the same parameters as without recomputation.
"""
from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx as fx
import torch.utils.checkpoint

from autopart.aliasing import storage_root, written_args
from autopart.analysis import layer_of
from autopart.config import Config, choices
from autopart.errors import AutopartError
from autopart.ir import META_LAYER, ChunkProgram, Program, RecomputePlan, graph_module
from autopart.ops import op_info
from autopart.ops import aten_groups as G

aten = torch.ops.aten
MODES = choices("recompute")           # written once, in autopart/config.py
CHOICES = ("none", "selective", "full")      # cheapest first (recomputed FLOPs)

_SDPA = G.SDPAS
_MATMUL = G.MATMULS_BATCHED | {aten.baddbmm.default}
_SOFTMAX = G.SOFTMAXES | {aten._safe_softmax.default}
# What may lie between the scores matmul and the softmax, and between softmax and the second
# matmul: scaling, masking, casts and dropout (elementwise, one activation operand).
_BETWEEN = G.CASTS | G.COPIES | {
    aten.div.Tensor, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.where.self, aten.dropout.default, aten.native_dropout.default,
    operator.getitem}


def recompute_activations(program: Program, *, config: Config = Config(), mesh=None,
                          schedule=None, microbatch_size: int = 1):
    """Return (program with rewritten .chunks and .recompute, report): each layer recomputed
    as config.recompute says ("auto": the cheapest that fits config.memory_budget)."""
    mode = config.recompute
    layers = {c.chunk: _layer_nodes(c) for c in program.chunks}
    if mode == "auto":
        from autopart import memory
        rewritten = {(c.chunk, kind): rewrite_chunk(c, dict.fromkeys(layers[c.chunk], kind))[:2]
                     for c in program.chunks for kind in CHOICES}
        choices = memory.choose_recompute(program, layers, rewritten, mesh=mesh,
                                          schedule=schedule, microbatch_size=microbatch_size,
                                          config=config)
    else:
        choices = {(c, layer): mode for c, per in layers.items() for layer in per}
    plan = RecomputePlan(mode=mode, optimizer=config.optimizer, budget=config.memory_budget,
                         zero=config.zero, precision=config.precision)
    chunks = []
    for c in program.chunks:
        mine = {layer: choices.get((c.chunk, layer), "none") for layer in layers[c.chunk]}
        new, regions, skipped = rewrite_chunk(c, mine)
        chunks.append(new)
        plan.regions[c.chunk] = regions
        plan.skipped += [(c.chunk, layer, why) for layer, why in skipped]
        applied = {layer for layer, _, _ in regions.values()}
        plan.choices.update({(c.chunk, layer): (kind if layer in applied else "none")
                             for layer, kind in mine.items()})
        plan.recompute_flops[c.chunk] = _region_flops(program, regions)
    # the budget itself is checked by compile() after the program check, whose fake runs count
    # the saved tensors once per distinct chunk (memory.check_budget)
    report = {"mode": mode, "recomputed": {f"{c}:{layer}": kind for (c, layer), kind
                                           in plan.choices.items() if kind != "none"},
              "skipped": plan.skipped}
    return program.replace(chunks=tuple(chunks), recompute=plan), report


def _layer_nodes(chunk: ChunkProgram) -> dict[str, list[fx.Node]]:
    """layer path -> its compute nodes in this chunk (graph order), p2p markers excluded."""
    paths = set(chunk.layers)
    out: dict[str, list[fx.Node]] = {}
    for node in chunk.gm.graph.nodes:
        if node.op != "call_function" or _is_p2p(node):
            continue
        layer = layer_of(node, paths)
        if layer is not None:
            out.setdefault(layer, []).append(node)
    return out


def _is_p2p(node: fx.Node) -> bool:
    info = op_info(node.target)
    return info is not None and info.kind == "p2p"


def rewrite_chunk(chunk: ChunkProgram, choices: dict[str, str]):
    """A copy of `chunk` whose layers marked selective/full run under checkpoint.

    Returns (chunk, {submodule: (layer, kind, node names)}, [(layer, reason) not rewritten])."""
    if all(kind == "none" for kind in choices.values()):
        return chunk, {}, []        # nothing to rewrite: no copy (a budget check alone)
    graph = fx.Graph()
    out = graph.graph_copy(chunk.gm.graph, {})
    graph.output(out)
    gm = graph_module(chunk.gm, graph, class_name=type(chunk.gm).__name__)
    per_layer = _layer_nodes(dataclasses.replace(chunk, gm=gm))
    regions, skipped = {}, []
    for layer, kind in choices.items():
        if kind == "none" or layer not in per_layer:
            continue
        found = [per_layer[layer]] if kind == "full" else attention_cores(per_layer[layer])
        if not found:
            skipped.append((layer, "no attention core (SDPA or matmul-softmax-matmul) found"))
            continue
        for i, nodes in enumerate(found):
            name = "recompute_" + layer.replace(".", "_") + ("" if kind == "full" else
                                                               f"_attn{'' if i == 0 else i}")
            why = extract_region(gm, nodes, name, layer, kind)
            if why:
                skipped.append((layer, why))
            else:
                regions[name] = (layer, kind, tuple(n.name for n in nodes))
    gm.graph.lint()
    gm.recompile()
    return dataclasses.replace(chunk, gm=gm), regions, skipped


def attention_cores(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The attention cores among a layer's nodes: each SDPA op (with the getitems of its
    outputs), or each softmax fed by a matmul of two activations and feeding a matmul, with the
    elementwise ops between them. By ops and dataflow only."""
    mine = set(nodes)
    cores = []
    for n in nodes:
        if n.target in _SDPA:
            cores.append([n] + [u for u in n.users if u.target is operator.getitem])
        elif n.target in _SOFTMAX:
            first, last = _producer_matmul(n, mine), _consumer_matmul(n, mine)
            if first is not None and last is not None:
                between = _descendants(first, mine) & _ancestors(last, mine)
                # export's dtype assertions on a core value go with it (they compute nothing)
                between |= {u for m in between for u in m.users if u.target in _CHECKS}
                cores.append([m for m in nodes if m in between])
    return cores


_CHECKS = G.CHECKS


def _producer_matmul(softmax: fx.Node, mine: set) -> fx.Node | None:
    node = softmax.args[0]
    while isinstance(node, fx.Node) and node in mine:
        if node.target in _MATMUL:
            return node if not any(_is_weight(a) for a in node.all_input_nodes) else None
        if node.target not in _BETWEEN and not _is_view(node):
            return None
        acts = [a for a in node.all_input_nodes if a in mine]
        node = acts[0] if len(acts) == 1 else None
    return None


def _consumer_matmul(softmax: fx.Node, mine: set) -> fx.Node | None:
    node = softmax
    for _ in range(8):
        users = [u for u in node.users if u in mine and u.target not in _CHECKS]
        if len(users) != 1:
            return None
        node = users[0]
        if node.target in _MATMUL:
            return node if not any(_is_weight(a) for a in node.all_input_nodes) else None
        if node.target not in _BETWEEN and not _is_view(node):
            return None
    return None


def _is_weight(node: fx.Node) -> bool:
    """A parameter, possibly through views (a linear written as matmul with weight.t())."""
    while node.op == "call_function" and _is_view(node):
        node = node.args[0]
    return node.op == "get_attr"


_VIEW_OPS = G.RESHAPES | G.TRANSPOSES | G.BROADCASTS | G.UNSQUEEZES | G.COPIES


def _is_view(node: fx.Node) -> bool:
    return node.target in _VIEW_OPS


def _descendants(start: fx.Node, mine: set) -> set:
    return _reach(start, mine, lambda n: n.users)


def _ancestors(start: fx.Node, mine: set) -> set:
    return _reach(start, mine, lambda n: n.all_input_nodes)


def _reach(start: fx.Node, mine: set, step) -> set:
    """The nodes of `mine` reachable from `start` along `step` (users or inputs), start included."""
    seen, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n in seen or n not in mine:
            continue
        seen.add(n)
        stack.extend(step(n))
    return seen


def extract_region(gm: fx.GraphModule, region: list[fx.Node], name: str, layer: str,
                   kind: str) -> str | None:
    """Move `region` (graph order) into submodule `name`, called through a non-reentrant
    checkpoint at the region's place. Returns why it could not, or None."""
    rset = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in rset))
    outputs = [n for n in region if any(u not in rset for u in n.users)]
    if not outputs:
        return "the region's results are unused"
    outside = [a.name for n in region for a in written_args(n) if storage_root(a) not in rset]
    if outside:     # the recomputation would write them a second time, after they were read
        return f"it writes in place into {outside}, made before it"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_use = min((u for n in outputs for u in n.users if u not in rset), key=order.__getitem__)
    late = [a.name for a in inputs if order[a] > order[first_use]]
    if late:    # an input computed after the region's first use depends on the region itself
        return f"not a contiguous region: {late} computed from it feed it"
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in region:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    sub.lint()
    gm.add_submodule(name, graph_module(torch.nn.Module(), sub, class_name="Recompute"))
    with gm.graph.inserting_before(first_use):
        fn = gm.graph.get_attr(name)
        call = gm.graph.create_node("call_function", torch.utils.checkpoint.checkpoint,
                                    (fn, *inputs), {"use_reentrant": False}, name=name + "_out")
        # the layer's mark (analysis.layer_of: a layer no module names, layer.<i>, too) and
        # module path (explain), so both see the call as the layer's
        call.meta = {"nn_module_stack": region[0].meta.get("nn_module_stack", {}),
                     META_LAYER: layer, "recompute": (layer, kind)}
        results = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for old, new in zip(outputs, results):
        new.meta = dict(old.meta)
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in rset)
    for n in reversed(region):
        gm.graph.erase_node(n)
    return None


def _region_flops(program: Program, regions: dict) -> sympy.Expr:
    """Extra forward FLOPs per microbatch that recomputation adds to a chunk."""
    total = sympy.Integer(0)
    for _, _, names in regions.values():
        total += sum((program.costs[n].flops for n in names if n in program.costs), sympy.Integer(0))
    return total


__all__ = ["recompute_activations", "rewrite_chunk", "attention_cores", "extract_region",
           "MODES", "CHOICES"]
