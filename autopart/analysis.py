"""Analysis: per-node FLOPs, bytes and activation sizes as sympy expressions in b (batch) and
s (sequence length), so one analysis serves every microbatch size; and the repeated layers, found
from the graph's structure (detect_layers).
"""
from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autopart.errors import _clean_path
from autopart.ir import BATCH, META_LAYER, META_TP, SEQ, NodeCost, Program, sym_shape
from autopart.ops import op_info
from autopart.placement import Partial, Shard
from autopart.ops import aten_groups as G

aten = torch.ops.aten

# Ops that only re-view memory: no FLOPs, no new activation.
_VIEWS = (G.RESHAPES | G.TRANSPOSES | G.BROADCASTS | G.SPLITS | G.UNSQUEEZES | G.SLICES
          | G.ALIASES | {aten.unbind.int, aten.contiguous.default, aten.flatten.using_ints,
                         aten.sym_size.int, aten.dropout.default})
# FLOPs per output element of the common non-matmul ops (forward).
_PER_ELEMENT = {aten.layer_norm.default: 8, aten.native_layer_norm.default: 8,
                aten.rms_norm.default: 4, aten._softmax.default: 5, aten.softmax.int: 5,
                aten.gelu.default: 8, aten.silu.default: 4, aten.tanh.default: 4,
                aten.log_softmax.int: 5}


@dataclass(frozen=True)
class Layer:
    """One repeated block (detect_layers): `path` names it (the module its nodes share, e.g.
    transformer.h.3, else layer.<i>), `nodes` are its node names in graph order."""
    path: str
    nodes: tuple[str, ...]
    signature: str           # equal signatures = same graph (the same layer, compiled once)


def _shape(node, symbols) -> tuple:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return sym_shape(val, symbols) if isinstance(val, torch.Tensor) else ()


def _numel(shape) -> sympy.Expr:
    return sympy.prod(shape) if shape else sympy.Integer(1)


def _nbytes(node, symbols) -> sympy.Expr:
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else [vals]
    total = sympy.Integer(0)
    for v in vals:
        if isinstance(v, torch.Tensor):
            total += _numel(sym_shape(v, symbols)) * v.element_size()
    return total


def _matmul_flops(node, symbols) -> sympy.Expr | None:
    t = node.target
    if t in G.MATMULS or t is aten.linear.default:
        k = _shape(node.args[0], symbols)[-1]
        return 2 * _numel(_shape(node, symbols)) * k
    if t in (aten.addmm.default, aten.baddbmm.default):
        k = _shape(node.args[1], symbols)[-1]
        return 2 * _numel(_shape(node, symbols)) * k
    if t in (aten.scaled_dot_product_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default):
        q, k = _shape(node.args[0], symbols), _shape(node.args[1], symbols)
        return 4 * _numel(q) * k[-2]      # Q K^T and (attention) V
    return None


def node_cost(node: fx.Node, symbols: dict) -> NodeCost:
    """FLOPs and bytes of one call_function node, symbolic in b and s."""
    zero = sympy.Integer(0)
    if node.op != "call_function" or node.target in _VIEWS or node.target is operator.getitem:
        return NodeCost(zero, zero, zero)
    info = op_info(node.target)
    if info is not None and info.communicates:
        return NodeCost(zero, zero, zero)     # communication: its bytes are reported apart
    out = _nbytes(node, symbols)
    read = sum((_nbytes(a, symbols) for a in node.all_input_nodes), zero)
    flops = _matmul_flops(node, symbols)
    if flops is None:
        shape = _shape(node, symbols)
        per = _PER_ELEMENT.get(node.target, 1 if isinstance(node.meta.get("val"), torch.Tensor) else 0)
        flops = per * _numel(shape) if shape or per else zero
        if node.target in (aten.embedding.default, aten.index_select.default):
            flops = zero
    return NodeCost(sympy.expand(flops), out, out + read)


def analyze(program: Program) -> dict[str, NodeCost]:
    """node name -> NodeCost for every call_function node of the program, per rank: after
    split_tensor_parallel, work on sharded or partial tensors is 1/tp of the whole."""
    symbols = program.symbols
    tp = program.tp.tp if program.tp is not None else 1   # before split_tensor_parallel: whole ops
    out = {}
    for n in program.gm.graph.nodes:
        if n.op == "call_function":
            cost = node_cost(n, symbols)
            if tp > 1 and _split_over_tp(n):
                cost = NodeCost(cost.flops / tp, cost.out_bytes / tp, cost.bytes_moved / tp)
            out[n.name] = cost
    return out


def _split_over_tp(node: fx.Node) -> bool:
    if op_info(node.target) is not None:      # our collectives: their cost is communication
        return False
    return isinstance(node.meta.get(META_TP), (Shard, Partial, tuple))


def evaluate(expr, b: int, s: int | None) -> float:
    """A cost expression at a concrete batch and sequence length."""
    return _evaluate(expr, b, s or 1)


@functools.lru_cache(maxsize=1 << 16)
def _evaluate(expr, b: int, s: int) -> float:
    # Cached by expression: a model repeats the same few expressions in every layer, and sympy's
    # subs costs ~0.1 ms a call, which made the 175B cut pass evaluate ~20k of them in seconds.
    return float(sympy.sympify(expr).subs({BATCH: b, SEQ: s}))


# -- layers: the graph's repeated structure ------------------------------------------------

_PERIODS_TRIED = 16      # candidate periods per range: the commonest parameter-read spacings
_SLACK = 2               # nodes where a run of copies may differ: a first or last copy's own
                         # op or two (an auxiliary loss summed from a Python 0: add(aux, 0.0)
                         # where every later copy adds add(total, aux))
_SHARE = 1 / 3           # of a range's parameter reads, a group of layers holds at least this
                         # (an encoder's layers and a decoder's hold nearly half each)


def detect_layers(program: Program) -> list[Layer]:
    """The repeated blocks, found from the graph's structure alone, in graph order.

    The nodes computed from a trainable parameter (the stream: what the layers compute, not the
    masks and positions made from the inputs), in graph order, each labelled by its op and its
    arguments' kinds (constants by value, a parameter by its shape). A group of layers is a run
    of k >= 2 consecutive copies of one period whose labels repeat and whose dataflow repeats
    (each argument read `period` nodes later in the next copy, or the same value read by both),
    each copy reading parameters and the next reading its output. The group covering the most
    nodes is taken first, then the ranges before and after it are searched again (an encoder's
    layers, then a decoder's). Where a copy starts is where the fewest values cross: the
    residual stream between layers. A block next to a group with the same parameter shapes,
    chained to it, is a layer of it too, with its own signature (an activation swapped). A
    copy whose first stretch between residual-stream boundaries begins again inside it is cut
    there into layers of two kinds (_kinds: Switch's dense and MoE blocks). Copies may differ in
    _SLACK nodes (a first copy that adds its auxiliary loss to a Python 0).
    Module paths only name a layer found so (the deepest module all its nodes share), never
    decide one: names lie (numbered submodules that are not layers, layers without numbers),
    the graph does not. Every call_function node gets meta[META_LAYER] (its layer's path or
    None), which layer_of reads. Near-linear in the nodes: a few passes per candidate period.
    """
    graph = program.gm.graph
    stream = _parameter_stream(graph)
    shape = _Structure(graph, stream)
    layers = [Layer("", tuple(n.name for n in stream[a:b]), shape.signature(a, b))
              for a, b in shape.layers(0, len(stream))]
    layers = _with_inputs_only_they_read(graph, layers, set(stream))
    layers = _named(graph, layers)
    _mark(graph, layers)
    return layers


def _parameter_stream(graph: fx.Graph) -> list[fx.Node]:
    """The call_function nodes computed (transitively) from a trainable parameter, in order."""
    reached: set[fx.Node] = {n for n in graph.nodes if n.op == "get_attr" and _trainable(graph, n)}
    out = []
    for n in graph.nodes:
        if n.op == "call_function" and any(a in reached for a in n.all_input_nodes):
            reached.add(n)
            out.append(n)
    return out


def _trainable(graph: fx.Graph, node: fx.Node) -> bool:
    t = _attr_value(graph, node)
    return isinstance(t, torch.nn.Parameter) and t.requires_grad


def _attr_value(graph: fx.Graph, node: fx.Node):
    try:
        return functools.reduce(getattr, node.target.split("."), graph.owning_module)
    except AttributeError:
        return None


class _Structure:
    """The stream's labels and dataflow, and the search for repeated runs in it."""

    def __init__(self, graph: fx.Graph, stream: list[fx.Node]):
        self.graph, self.pos = graph, {n: i for i, n in enumerate(stream)}
        self.keys: dict = {}
        self.names: dict = {}               # label -> key, built once for signature()
        self.labels, self.args, self.params = [], [], []
        for n in stream:
            flat = _flatten((n.args, n.kwargs))
            kinds = tuple(self._kind(a) for a in flat)
            self.labels.append(self.keys.setdefault((_op_name(n), kinds), len(self.keys)))
            self.args.append([a for a in flat if isinstance(a, fx.Node)])
            self.params.append(tuple(k for a, k in zip(flat, kinds) if isinstance(a, fx.Node)
                                     and a.op == "get_attr" and _trainable(graph, a)))
        self.reads = [bool(k) for k in self.params]
        self.cross = _crossing_counts(stream, self.pos)

    def _kind(self, a):
        if not isinstance(a, fx.Node):
            return a if isinstance(a, (int, float, bool, str, type(None))) else str(a)
        if a.op == "get_attr":
            t = _attr_value(self.graph, a)
            return ("attr", tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__)
        return "value"     # an input, or computed: which one is checked along the dataflow (_same)

    def signature(self, a: int, b: int) -> str:
        """Equal for stream[a:b] and any span of the same labels (a layer and its copies)."""
        if len(self.names) != len(self.keys):
            self.names = {v: k for k, v in self.keys.items()}
        text = repr([self.names[x] for x in self.labels[a:b]])
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def layers(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The spans [a, b) of the layers in stream[lo:hi], in order: each group's copies, and
        the variants next to them (_variant), each cut into the layers of its kinds (_kinds)."""
        found = self._best(lo, hi) if hi - lo >= 2 else None
        if found is None or not self._holds_the_range(found, lo, hi):
            return []
        start, p, copies = found
        first, end = start, start + p * copies
        while first - p >= lo and self._variant(first - p, p):
            first -= p
        while end + p <= hi and self._variant(end - p, p):
            end += p
        starts = range(first, end, p)
        cuts = [*self._kinds(starts, p), p]
        return [*self.layers(lo, first),
                *((a + x, a + y) for a in starts for x, y in zip(cuts, cuts[1:])),
                *self.layers(end, hi)]

    def _holds_the_range(self, found, lo: int, hi: int) -> bool:
        """A group of layers reads at least _SHARE of its range's parameters (counted as reads):
        repeats of a piece inside one layer that is not itself repeated (GQA's k and v
        projections, equal shapes side by side, in a model of two different layers) read few."""
        start, p, copies = found
        reads = sum(len(k) for k in self.params[lo:hi])
        return sum(len(k) for k in self.params[start:start + p * copies]) >= _SHARE * reads

    def _kinds(self, starts, p: int) -> list[int]:
        """Where layers begin inside each copy of the period: 0, and each offset where the
        copy's first stretch between residual-stream boundaries begins again. A boundary is a
        gap where no more values cross than at either end of every copy; a period of dense and
        MoE blocks (Switch: one copy holds both) begins its attention again where the MoE block
        starts, while a block's own MLP never begins like its attention, and two kinds that
        differ from their first op on (a sliding window before the attention) stay one layer
        of two blocks."""
        bounds = [q for q in range(1, p)
                  if all(self.cross[a + q] <= min(self.cross[a], self.cross[a + p]) for a in starts)]
        reads = next((q for q in bounds if any(self.reads[starts[0]:starts[0] + q])), None)
        if reads is None:
            return [0]
        head, edges = reads, {*bounds, p}       # the first stretch that reads a parameter
        cuts = [0]
        for q in bounds:
            if q - cuts[-1] >= head and q + head in edges and all(
                    self.labels[a + q:a + q + head] == self.labels[a:a + head] for a in starts):
                cuts.append(q)
        return cuts

    def _variant(self, a: int, p: int) -> bool:
        """stream[a:a+p] and stream[a+p:a+2p] are two layers of one stack whose ops may differ
        (an activation swapped): the same parameter shapes in the same order, the second reading
        the first."""
        if [k for k in self.params[a:a + p] if k] != [k for k in self.params[a + p:a + 2 * p] if k]:
            return False
        return any(a <= self.pos[x] < a + p for i in range(a + p, a + 2 * p)
                   for x in self.args[i] if x in self.pos)

    def _best(self, lo: int, hi: int):
        """The group covering the most nodes of stream[lo:hi] (the shorter period on a tie)."""
        runs = []
        for p in self._periods(lo, hi):
            same = [x == y for x, y in zip(self.labels[lo:hi - p], self.labels[lo + p:hi])]
            runs += [((b - a + p) // p * p, -p, a, b) for a, b in _runs(same, lo, _SLACK)
                     if b - a >= p]
        for _, p, a, b in sorted(runs, reverse=True)[:_PERIODS_TRIED]:
            found = self._refined(a, b, -p)
            if found is not None:
                return found
        return None

    def _periods(self, lo: int, hi: int) -> list[int]:
        """The commonest spacings between nodes of one label that read a parameter, one and two
        occurrences apart: a layer's period is the spacing of each label it holds once; layers
        alternating in two kinds (sliding and full attention) repeat every second one."""
        last: dict[int, tuple[int, int]] = {}
        count = (collections.Counter(), collections.Counter())
        for i in range(lo, hi):
            if self.reads[i]:
                label = self.labels[i]
                before = last.get(label, (-1, -1))
                for c, j in zip(count, before):
                    if j >= 0:
                        c[i - j] += 1
                last[label] = (i, before[0])
        one = [p for p, _ in count[0].most_common(_PERIODS_TRIED)]
        return one + [p for p, _ in count[1].most_common(_PERIODS_TRIED // 2) if p not in one]

    def _refined(self, a: int, b: int, p: int):
        """Within a run of equal labels (stream[i] ~ stream[i + p] for i in [a, b)), the longest
        run whose dataflow repeats too, started where the fewest values cross; None if it is no
        group of layers (fewer than two copies, no parameter, copies not chained)."""
        same = [self.labels[i] == self.labels[i + p] and self._same(i, p) for i in range(a, b)]
        longest = max(_runs(same, a, _SLACK), key=lambda r: r[1] - r[0], default=None)
        if longest is None:
            return None
        found = self._phase(a, *longest, p)
        if found is None:
            return None
        start, copies = found
        if not any(self.reads[start:start + p]):
            return None
        first = range(start, start + p)
        if not any(self.pos[x] in first for i in range(start + p, start + 2 * p)
                   for x in self.args[i] if x in self.pos):
            return None                  # the copies are side by side, not one after the other
        return start, p, copies

    def _same(self, i: int, p: int) -> bool:
        """Node i + p reads what node i reads, shifted by one copy (or the very same value)."""
        for x, y in zip(self.args[i], self.args[i + p]):
            if x is not y and (x in self.pos or y in self.pos) \
                    and self.pos.get(y, -1) - self.pos.get(x, -1) != p:
                return False
        return True

    def _phase(self, lo: int, a: int, b: int, p: int):
        """(start, copies) of the group whose copies after the first lie in [a, b + p), where
        each node matches the next copy's (_same): the start with the fewest values crossing
        between copies, then the most copies, then the earliest; None if no two copies. The
        first copy may begin up to a period before a: its reads of what precedes it (the
        embedding where later copies read the copy before) are the chain, not a mismatch."""
        best = None
        for s in range(max(lo, a - p), min(a + p, b)):
            copies = 1 + (b - s) // p if s >= a else \
                2 + (b - s - p) // p if self._first_copy_matches(s, p) else 0
            if copies >= 2:
                best = min(best or (float("inf"),), (self.cross[s + p], -copies, s))
        return (best[2], -best[1]) if best else None

    def _first_copy_matches(self, s: int, p: int) -> bool:
        """stream[s:s+p] is a copy of the next one, but for reads of what precedes it and at
        most _SLACK nodes of its own."""
        own = 0
        for i in range(s, s + p):
            if self.labels[i] != self.labels[i + p] or any(
                    x is not y and (x in self.pos or y in self.pos)
                    and self.pos.get(y, -1) - self.pos.get(x, -1) != p
                    and not (self.pos.get(x, -1) < s <= self.pos.get(y, -1) < s + p)
                    for x, y in zip(self.args[i], self.args[i + p])):
                own += 1
                if own > _SLACK:
                    return False
        return True


def _flatten(args) -> list:
    if isinstance(args, (tuple, list)):
        return [x for a in args for x in _flatten(a)]
    if isinstance(args, dict):
        return [x for k in sorted(args) for x in [k, *_flatten(args[k])]]
    return [args]


def _runs(flags: list[bool], offset: int, slack: int = 0) -> list[tuple[int, int]]:
    """The maximal runs [a, b) of True in flags, as positions offset + index, each bridging at
    most `slack` False in all."""
    out, begin = [], None
    for i, f in enumerate(flags):
        if f and begin is None:
            begin = i
        elif not f and begin is not None:
            out.append((offset + begin, offset + i))
            begin = None
    if begin is not None:
        out.append((offset + begin, offset + len(flags)))
    return _bridged(out, slack) if slack else out


def _bridged(runs: list[tuple[int, int]], slack: int) -> list[tuple[int, int]]:
    merged: list[list[int]] = []           # [a, b, Falses bridged]
    for a, b in runs:
        if merged and a - merged[-1][1] <= slack - merged[-1][2]:
            merged[-1][2] += a - merged[-1][1]
            merged[-1][1] = b
        else:
            merged.append([a, b, 0])
    return [(a, b) for a, b, _ in merged]


def _crossing_counts(stream: list[fx.Node], pos: dict) -> list[int]:
    """cross[g]: stream values made before position g and read at or after it (a difference
    array: O(n))."""
    diff = [0] * (len(stream) + 2)
    for i, n in enumerate(stream):
        last = max((pos.get(u, len(stream)) for u in n.users), default=i)
        if last > i:
            diff[i + 1] += 1
            diff[last + 1] -= 1
    return list(itertools.accumulate(diff))[:len(stream) + 1]


def _with_inputs_only_they_read(graph: fx.Graph, layers: list[Layer], stream: set) -> list[Layer]:
    """Each layer with the nodes made from the inputs alone that only it reads (a mask the layer
    builds for itself); one read by several layers or outside them belongs to none."""
    owner = {name: i for i, layer in enumerate(layers) for name in layer.nodes}
    extra: dict[int, list[str]] = {}
    for n in reversed(graph.nodes):
        if n.op != "call_function" or n in stream or not n.users:
            continue
        users = {owner.get(u.name, -1) if u.op == "call_function" else -1 for u in n.users}
        if len(users) == 1 and -1 not in users:
            owner[n.name] = users.pop()
            extra.setdefault(owner[n.name], []).append(n.name)
    if not extra:
        return layers
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    return [Layer(layer.path, tuple(sorted([*layer.nodes, *extra.get(i, [])], key=order.get)),
                  layer.signature) for i, layer in enumerate(layers)]


def _named(graph: fx.Graph, layers: list[Layer]) -> list[Layer]:
    """Each layer named by the deepest module all its nodes share (transformer.h.3), for display;
    `layer.<i>` where that is no module or another layer's too."""
    nodes = {n.name: n for n in graph.nodes}
    names = []
    for layer in layers:
        common = None
        for name in layer.nodes:
            paths = _paths(nodes[name])
            if paths:
                common = paths if common is None else _common_prefix(common, paths)
        names.append(common[-1] if common else "")
    count = collections.Counter(names)
    return [Layer(name if name and count[name] == 1 else f"layer.{i}", layer.nodes, layer.signature)
            for i, (name, layer) in enumerate(zip(names, layers))]


def _common_prefix(a: list, b: list) -> list:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def _mark(graph: fx.Graph, layers: list[Layer]) -> None:
    owner = {name: layer.path for layer in layers for name in layer.nodes}
    for n in graph.nodes:
        if n.op == "call_function":
            n.meta[META_LAYER] = owner.get(n.name)


def _paths(node: fx.Node) -> list[str]:
    return [_clean_path(p) for p, _ in (node.meta.get("nn_module_stack") or {}).values()]


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def layer_of(node: fx.Node, layer_paths: set[str]) -> str | None:
    """The layer among `layer_paths` that `node` belongs to: detect_layers' mark (META_LAYER).
    A node it never saw (a node a later pass made without copying the mark) is matched by its
    module path."""
    if META_LAYER in node.meta:
        layer = node.meta[META_LAYER]
        return layer if layer in layer_paths else None
    for p in _paths(node):
        if p in layer_paths:
            return p
    return None


__all__ = ["Layer", "META_LAYER", "analyze", "node_cost", "evaluate", "detect_layers", "layer_of"]
