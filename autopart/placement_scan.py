"""Tensor-parallel rules for the ops of recurrent (state-space and linear-attention) layers, split
by heads as Megatron splits Mamba layers: a depthwise causal conv1d whose channels follow the
heads, padding and cumulative sums along the sequence, einsum contractions per head, triangular
masks (the chunked scan of Mamba-2 and gated DeltaNet as torch writes it without the fused
kernels), and concatenation (along the sharded dim: DeltaNet's cat((q, k, v), -1)).
Registered into autopart.placement.RULES; each has a row in tests/test_placement_rules.py."""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from autopart.placement_base import (Need, NoRule, Shard, SplitOnShard, _expr, ndim, norm_dim,
                                placed_alike, rule, shape_of)

aten = torch.ops.aten


def _arg(node, i, name, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


@rule(aten.conv1d.default)
def _depthwise_conv1d(node, x, s, pl, tp):
    """A depthwise conv1d (groups == channels, one filter per channel: Mamba-2's and DeltaNet's
    short causal conv) on channels split over tp: each rank convolves its own channels with
    their filters (weight and bias sliced like the channels; the rewrite divides groups)."""
    weight, bias = node.args[1], _arg(node, 2, "bias")
    groups, channels = _arg(node, 6, "groups", 1), shape_of(x)[1] if ndim(x) == 3 else None
    if not isinstance(s, Shard) or s.dim != 1:
        raise NoRule("conv1d with its input not split over the channels")
    if groups != channels or tuple(shape_of(weight)[:2]) != (channels, 1):
        raise NoRule(f"conv1d mixing channels (groups={groups} of {channels} channels): only a "
                     "depthwise conv runs on a rank's own channels")
    for operand in (weight, bias):
        if isinstance(operand, fx.Node) and not isinstance(pl.get(operand), Shard):
            return Need(operand, 0)
        if isinstance(operand, fx.Node) and pl[operand].dim != 0:
            raise NoRule("conv1d filters split along another dim than their channels")
    return Shard(1, s.origin)


@rule(aten.pad.default, aten.constant_pad_nd.default)
def _pad(node, x, s, pl, tp):
    """Padding other dims (the sequence up to a multiple of the chunk) keeps the shard."""
    pads = list(node.args[1])
    d = ndim(x) - 1 - s.dim             # pads run (left, right) from the last dim backwards
    if 2 * d + 1 < len(pads) and (pads[2 * d] or pads[2 * d + 1]):
        raise NoRule(f"padding the sharded dim {s.dim} by {pads[2 * d:2 * d + 2]}")
    return s


@rule(aten.cumsum.default, aten.cumprod.default)
def _cumulative(node, x, s, pl, tp):
    """A running sum along another dim (the decay along the sequence) keeps the shard."""
    if norm_dim(node.args[1], ndim(x)) == s.dim:
        raise NoRule(f"{node.target} along the sharded dim {s.dim}")
    return s


@rule(aten.einsum.default)
def _einsum(node, x, s, pl, tp):
    """einsum with every sharded operand split along the same index (the heads, 'h' in
    'bclhn,bcshn->bclsh'), kept in the output: per-head work, the shard moves to that index's
    place in the output; a replicated operand with that index is sliced to meet it."""
    equation, operands = node.args[0].replace(" ", ""), list(node.args[1])
    if "..." in equation or "->" not in equation:
        raise NoRule(f"einsum {equation!r} without explicit output indices")
    ins, out = equation.split("->")
    ins = ins.split(",")
    letters = {ins[i][pl[a].dim] for i, a in enumerate(operands) if isinstance(pl.get(a), Shard)}
    if len(letters) != 1:
        raise NoRule(f"einsum {equation!r} with operands sharded along different indices")
    letter = letters.pop()
    if letter not in out:
        raise NoRule(f"einsum {equation!r} contracts index {letter!r}, the sharded dim: a "
                     "tensor every head reads (Mamba-2's B and C with fewer groups than tp) "
                     "is split along its features, not by heads")
    for sub, a in zip(ins, operands):
        if not isinstance(pl.get(a), Shard) and letter in sub:
            return Need(a, sub.index(letter))
    return Shard(out.index(letter), s.origin if isinstance(s, Shard) else None)


@rule(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
      aten.full_like.default)
def _like(node, x, s, pl, tp):
    """A fresh tensor shaped like the shard (the scan's zero initial state): sharded alike."""
    if not isinstance(s, Shard):
        raise NoRule(f"{node.target} of a replicated tensor with a sharded operand")
    return s


@rule(aten.tril.default, aten.triu.default)
def _triangle(node, x, s, pl, tp):
    """A triangular mask over the last two dims (positions in a chunk) keeps a shard elsewhere."""
    if s.dim >= ndim(x) - 2:
        raise NoRule(f"{node.target} over the sharded dim {s.dim}")
    return s


@rule(aten.cat.default)
def _cat(node, x, s, pl, tp):
    """Concatenation along another dim than the shard, or along it: rank r's local cat then
    holds its 1/tp of each part side by side, so the parts are the sections of a new origin,
    the cat (the region follows what meets it per section). Empty inputs (a fresh cache) drop
    out."""
    parts = [a for a in node.args[0] if isinstance(a, fx.Node) and _numel(a) != 0]
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim(node))
    shard, need = placed_alike(parts, pl, "concatenating")
    if need or shard.dim != dim:
        return need or shard
    sizes = tuple(int(shape_of(a)[dim]) for a in parts)
    if any(v % tp for v in sizes):
        raise NoRule(f"concatenation along the sharded dim of parts {sizes}, not divisible by "
                     f"tp={tp}")
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return SplitOnShard(node.name, sizes, tuple(zip(bounds, bounds[1:]))), Shard(dim, node.name)


def _numel(node) -> int | None:
    shape = shape_of(node)
    try:
        return int(sympy.prod([_expr(d) for d in shape])) if shape else 1
    except TypeError:
        return None
