"""Tensor placements over the tensor-parallel axis, and the rule table that carries them.

The types (Replicate, Shard, Partial, Need, SplitOnShard, NoRule), the shape helpers, RULES and
`carry()`. The rules themselves register into RULES from autopart/placement.py (the common ops)
and autopart/placement_scan.py (recurrent layers); both import this module and never each other's
way round, so no import cycle. Callers import autopart.placement, which loads both rule sets.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autopart.ops import aten_groups as G

aten = torch.ops.aten


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int
    origin: str | None = None      # the column-parallel linear (or embedding) the split came from

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


R, P = Replicate(), Partial()


@dataclass(frozen=True)
class Need:
    """The op can run sharded once input `arg` (a node) is Shard(dim)."""
    arg: fx.Node
    dim: int


@dataclass(frozen=True)
class SplitOnShard:
    """A split or slice along the sharded dim: the origin's weight is split per section, and
    `pieces` are the [start, end) ranges the op reads as tensors of their own (each must stay
    one section: a rank's share of a piece is then its 1/tp of that section)."""
    origin: str
    sections: tuple
    pieces: tuple = ()


class NoRule(Exception):
    """No sharding rule lets this op run on a sharded input."""


# the op groups (autopart/ops/aten.py): elementwise ops pass a Shard through unchanged
ELEMENTWISE = G.ELEMENTWISE
VIEWS = G.RESHAPES
NORMS_LAST = G.NORMS


def shape_of(node) -> tuple:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def ndim(node) -> int:
    return len(shape_of(node))


def _expr(d):
    return sympy.sympify(d.node.expr) if isinstance(d, torch.SymInt) else sympy.Integer(int(d))


def map_view(in_shape: tuple, out_shape: tuple, dim: int, tp: int) -> int:
    """Where dim `dim` of a view's input lands in its output, keeping a contiguous 1/tp block.

    Raises NoRule when the sharded dim merges into a preceding dim (its block would not be
    contiguous) or splits into a leading factor that tp does not divide."""
    return _map_view(tuple(_expr(d) for d in in_shape), tuple(_expr(d) for d in out_shape), dim, tp)


@functools.lru_cache(maxsize=4096)
def _map_view(ins: tuple, outs: tuple, dim: int, tp: int) -> int:
    # Sizes are products of integers and the symbols b, s: sympy keeps those canonical, so
    # equality and exact division need no simplify() (which dominated compile time).
    start = sympy.Mul(*ins[:dim])
    acc = sympy.Integer(1)
    for e, size in enumerate(outs):
        if acc == start and size != 1:
            if size == ins[dim]:
                return e
            ratio = ins[dim] / size
            if ratio.is_Integer and size.is_Integer and int(size) % tp == 0:
                return e            # the dim splits: the shard goes to its leading factor
            ratio = size / ins[dim]
            if ratio.is_Integer or (ratio.is_number is False and ins[dim].is_Integer):
                return e            # the dim merges with the dims after it: still contiguous
            break
        acc = acc * size
    raise NoRule(f"the view from {tuple(ins)} to {tuple(outs)} moves sharded dim {dim} "
                 "where its 1/tp block is not contiguous")


def norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _aligned_dim(other: fx.Node, out_nd: int, dim: int) -> int | None:
    """The dim of a broadcast operand that lines up with output dim `dim` (None if absent/1)."""
    nd = ndim(other)
    d = dim - (out_nd - nd)
    if d < 0 or shape_of(other)[d] == 1:
        return None
    return d


# -- the rule table ------------------------------------------------------------------------------
#
# One row per op: op -> rule(node, x, s, pl, tp), where x is the op's first tensor input and s its
# placement (Shard, or R when only another operand is sharded). A rule returns the output
# placement (or a tuple for multi-output ops), a Need, or (SplitOnShard, placements); it raises
# NoRule when the op cannot run on the shard. As DTensor's op strategies, each row is small and
# has its own unit test (tests/test_placement_rules.py).

RULES: dict = {}


def rule(*ops):
    """Register the decorated function as the rule of `ops`."""
    def register(fn):
        for op in ops:
            RULES[op] = fn
        return fn
    return register


def carry(node: fx.Node, pl: dict, tp: int):
    """The output placement of `node` given its inputs' placements in `pl`.

    Returns a placement, a tuple of placements (multi-output ops), a Need (an input must be
    sharded first) or a SplitOnShard marker with the placement; raises NoRule."""
    t = node.target
    if t is operator.getitem:
        src = pl.get(node.args[0], R)
        return src[node.args[1]] if isinstance(src, tuple) else src
    shards = [a for a in node.all_input_nodes if isinstance(pl.get(a), Shard)]
    if not shards:
        return R
    x = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else shards[0]
    fn = RULES.get(t)
    if fn is None:
        raise NoRule(f"no tensor-parallel rule for {t} on a sharded input")
    return fn(node, x, pl.get(x, R), pl, tp)


def _need_shard(s, node):
    if not isinstance(s, Shard):
        raise NoRule(f"{node.target} with a replicated input and a sharded operand")
    return s

def placed_alike(parts, pl, what: str):
    """(the shard the parts of a stack or cat share, a Need for the first replicated part or
    None); raises NoRule when parts are sharded along different dims."""
    shard = next(pl[a] for a in parts if isinstance(pl.get(a), Shard))
    for a in parts:
        if not isinstance(pl.get(a), Shard):
            return shard, Need(a, shard.dim)
        if pl[a].dim != shard.dim:
            raise NoRule(f"{what} tensors sharded along different dims")
    return shard, None
