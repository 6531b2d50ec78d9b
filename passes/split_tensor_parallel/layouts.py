"""Where a rank's share of a sharded tensor lies in the features of the projection it came from:
the offsets of a projection's parts (a split of a part cuts the projection there), the sections
a replicated operand meeting a known range is sliced by, a concatenation along the sharded dim
(its parts the sections of a new origin), heads merged into the rows (`reshape(-1, head_dim)`
for a row-wise norm, then back), and the check that operands meeting in one op are laid out
alike over the ranks."""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from autopart.ops import aten_groups as G
from autopart.placement import NoRule, Shard, _expr, map_view, ndim, shape_of

aten = torch.ops.aten


class _Reject(Exception):
    def __init__(self, node, reason):
        super().__init__(reason)
        self.node, self.reason = node, reason


def section_scatter(region, key, tp) -> bool:
    """A replicated operand meeting a known range of a projection cut in sections (Falcon-H1's
    `in_proj(x) * mup_vector`, the conv1d filters of x|B|C): each rank takes its 1/tp of each
    section in that range, as its weight shard holds. False when the range is not known."""
    at = region.scatter_at.get(key)
    if at is None:
        return False
    origin, start, size = at
    parts = _parts(region, origin, start, size)
    if parts is None:
        raise _Reject(key[0], f"{key[1]} (replicated) meets features [{start}, {start + size}) "
                      f"of {origin}, which do not follow its sections {region.sections.get(origin)}")
    if len(parts) > 1:
        region.scatter_sections[key] = tuple(parts)
    return True


def track_offset(node, out, marker, region) -> None:
    """Where node's sharded dim lies in its origin's features: a split's outputs and a slice
    at their starts, getitem picking one, an op keeping the dim's size (elementwise, transpose,
    a depthwise conv) at its input's; unknown after a view that changes it (heads)."""
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    base = region.offsets.get(src)
    if marker is not None:
        if isinstance(base, int) or (base is None and sum(marker.sections) ==
                                     region.totals.get(marker.origin)):
            starts = tuple((base or 0) + a for a, _ in marker.pieces)
            if node.target is aten.slice.Tensor:
                region.offsets[node] = starts[0]
            elif isinstance(out, tuple):
                region.offsets[node] = starts
        return
    if node.target is operator.getitem and isinstance(base, tuple):
        region.offsets[node] = base[node.args[1]]
        return
    if not isinstance(out, Shard) or ndim(node) <= out.dim:
        return
    for a in node.all_input_nodes:
        p, off = region.pl.get(a), region.offsets.get(a)
        if isinstance(p, Shard) and isinstance(off, int) and p.origin == out.origin \
                and shape_of(a)[p.dim] == shape_of(node)[out.dim]:
            region.offsets[node] = off
            return


def range_met(node, need, pl, region):
    """(origin, start, size): the features of an origin that a replicated operand of `node`
    meets along need.dim, from a sharded input whose place is known; None if none is."""
    size = shape_of(need.arg)[need.dim]
    for a in node.all_input_nodes:
        p, off = pl.get(a), region.offsets.get(a)
        if isinstance(p, Shard) and p.origin is not None and isinstance(off, int) \
                and shape_of(a)[p.dim] == size:
            return p.origin, off, int(size)
    return None




def _parts(region, origin, start: int, size: int):
    """The sections of `origin` that [start, start + size) spans, or None if it cuts one."""
    sections = region.sections.get(origin, (region.totals.get(origin, start + size),))
    bounds, parts = 0, []
    for v in sections:
        if start <= bounds and bounds + v <= start + size:
            parts.append(v)
        bounds += v
    return tuple(parts) if sum(parts) == size else None


def new_origin(region, node, marker) -> None:
    """A concatenation along the sharded dim: its parts are the sections of a new origin, fixed
    (they come from elsewhere, not from one weight a later cut could follow)."""
    region.sections[node.name] = region.fixed[node.name] = tuple(marker.sections)
    region.totals[node.name] = sum(marker.sections)
    region.pieces[node.name] = set(marker.pieces)
    region.offsets[node] = 0


def _layout(region, node):
    """The sections a rank holds 1/tp of, side by side, when there are several (else None: one
    contiguous 1/tp)."""
    p, off = region.pl.get(node), region.offsets.get(node)
    if not isinstance(p, Shard) or p.origin is None or not isinstance(off, int):
        return None
    parts = _parts(region, p.origin, off, int(shape_of(node)[p.dim]))
    return parts if parts is not None and len(parts) > 1 else None


def check_meets(region) -> None:
    """Sharded operands of one op must hold the same elements on each rank: a tensor holding
    1/tp of each of several sections (a fused projection before its cut, a concatenation along
    the sharded dim) meets only one laid out the same way."""
    for name, ins in region.meets.items():
        layouts = {_layout(region, a) for a in ins}
        if len(layouts) > 1:
            shown = sorted(f"1/tp of each of {v}" if v else "one contiguous 1/tp" for v in layouts)
            raise _Reject(name, "operands laid out differently over the ranks (a rank holds "
                          f"{' against '.join(shown)})")


ROW_WISE = (set(G.ELEMENTWISE) | set(G.CHECKS) | set(G.NORMS)
            | {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction})


def merged_rows(node, region, pl, tp):
    """Heads merged into the rows (`x.reshape(-1, head_dim)` of [b, s, heads, head_dim], as
    DeltaNet's gated norm does): each rank's rows are its heads of every token, not one
    contiguous block, which is right for row-wise ops until a view splits the heads out
    again. The placement of `node` when it merges or un-merges, None otherwise (its rule
    decides); refuses any other op on merged rows."""
    ins = [a for a in node.all_input_nodes if a in region.merged]
    if not ins:
        return _merge(node, pl, region)
    x = ins[0]
    lead, pos = region.merged[x]
    if node.target in G.RESHAPES:
        virtual = tuple(lead) + tuple(shape_of(x)[1:])
        try:
            return Shard(map_view(virtual, shape_of(node), pos, tp), pl[x].origin)
        except NoRule as e:
            raise _Reject(node.name, f"heads merged into the rows, then {e}") from None
    if node.target not in ROW_WISE:
        raise _Reject(node.name, f"{node.target} on heads merged into the rows")
    for a in node.all_input_nodes:
        if isinstance(pl.get(a), Shard) and region.merged.get(a) != region.merged[x]:
            raise _Reject(node.name, "heads merged into the rows meet a tensor sharded otherwise")
        if not isinstance(pl.get(a), Shard) and ndim(a) == ndim(node) and shape_of(a)[0] != 1:
            raise _Reject(node.name, "a replicated operand along rows merged from heads")
    return None


def _merge(node, pl, region):
    if node.target not in G.RESHAPES or not isinstance(pl.get(node.args[0]), Shard):
        return None
    x, s = node.args[0], pl[node.args[0]]
    ins, outs = shape_of(x), shape_of(node)
    if s.dim == 0 or not outs or sympy.Mul(*(_expr(v) for v in ins[:s.dim])) == 1:
        return None
    if sympy.Mul(*(_expr(v) for v in ins[:s.dim + 1])) != _expr(outs[0]) \
            or tuple(outs[1:]) != tuple(ins[s.dim + 1:]):
        return None
    region.merged[node] = (tuple(ins[:s.dim + 1]), s.dim)
    return Shard(0, s.origin)


def keep_merged(node, out, region) -> None:
    """A row-wise op's output keeps its input's merged rows."""
    ins = [a for a in node.all_input_nodes if a in region.merged]
    if ins and node not in region.merged and isinstance(out, Shard) and out.dim == 0 \
            and node.target not in G.RESHAPES and shape_of(node)[:1] == shape_of(ins[0])[:1]:
        region.merged[node] = region.merged[ins[0]]
