"""Analysis: per-node FLOPs, bytes and activation sizes as sympy expressions in b (batch) and
s (sequence length), so one analysis serves every microbatch size; and repeated-layer detection.
"""
from __future__ import annotations

import functools
import hashlib
import operator
import re
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autopart.errors import _clean_path
from autopart.ir import BATCH, META_TP, SEQ, NodeCost, Program, sym_shape
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
    """One repeated block: `path` (module path, e.g. transformer.h.3), its nodes and signature."""
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


def detect_layers(program: Program) -> list[Layer]:
    """The repeated blocks: children `prefix.0 .. prefix.N` of one container with equal graphs.

    Chooses the container with the most numbered children; a model with no such container has
    no layers (every op is its own unit for the cut pass).
    """
    groups: dict[str, dict[int, list[fx.Node]]] = {}
    for node in program.gm.graph.nodes:
        if node.op != "call_function":
            continue
        for path in _paths(node):
            m = re.fullmatch(r"(.*?)\.?(\d+)", path)
            if m:
                groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(node)
    if not groups:
        return []
    prefix = max(groups, key=lambda p: (len(groups[p]), -len(p)))
    layers = []
    for idx in sorted(groups[prefix]):
        nodes = groups[prefix][idx]
        sig = hashlib.sha1(repr([(_op_name(n), _arg_kinds(n)) for n in nodes]).encode()).hexdigest()[:12]
        layers.append(Layer(f"{prefix}.{idx}" if prefix else str(idx), tuple(n.name for n in nodes), sig))
    return layers


def _paths(node: fx.Node) -> list[str]:
    return [_clean_path(p) for p, _ in (node.meta.get("nn_module_stack") or {}).values()]


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _arg_kinds(node: fx.Node) -> tuple:
    # Constants (head counts, sizes) are part of a layer's identity; node names are not.
    return tuple(a if isinstance(a, (int, float, str, bool)) else type(a).__name__ for a in node.args)


def layer_of(node: fx.Node, layer_paths: set[str]) -> str | None:
    for p in _paths(node):
        if p in layer_paths:
            return p
    return None


__all__ = ["Layer", "analyze", "node_cost", "evaluate", "detect_layers", "layer_of"]
