"""Tensor placements over the tensor-parallel axis and how ATen ops carry them.

A tensor is Replicate (every tp rank holds all of it), Shard(dim) (each rank holds 1/tp of `dim`)
or Partial (each rank holds a summand; a reduction makes it whole). `carry()` answers, for one op
and the placements of its inputs, what its output placement is, or what it needs first.
Decisions come from ops and shapes only, never from module or attribute names.

The types, RULES and carry() live in autopart/placement_base.py (re-exported here); this module
holds the common ops' rules, autopart/placement_scan.py the recurrent layers'.
"""
from __future__ import annotations

import functools
import operator

import sympy
import torch
import torch.fx as fx

from autopart import placement_scan  # noqa: F401  (registers the recurrent layers' rules)
from autopart.ops import aten_groups as G
from autopart.placement_base import (  # noqa: F401  (re-exported: callers import them here)
    ELEMENTWISE, NORMS_LAST, RULES, VIEWS, Need, NoRule, P, Partial, R, Replicate, Shard,
    SplitOnShard, _aligned_dim, _expr, _map_view, _need_shard, aten, carry, map_view, ndim,
    norm_dim, placed_alike, rule, shape_of)


@rule(*ELEMENTWISE)
def _elementwise_rule(node, x, s, pl, tp):
    return _elementwise(node, pl, tp)


# In-place arithmetic as export's training IR keeps it (Falcon's `scores /= sqrt(d)`,
# `mlp_output += attention_output`): elementwise, as long as the tensor written is the shard.
# Slicing a replicated `self` would write into a copy, not the tensor later ops read.
INPLACE = G.INPLACE_ARITH
NEW_LIKE = G.NEW_LIKE


@rule(*INPLACE)
def _inplace_rule(node, x, s, pl, tp):
    out = _elementwise(node, pl, tp)
    if isinstance(out, Need) and out.arg is node.args[0] and not written_fresh(node):
        raise NoRule(f"{node.target} writes into a replicated tensor with a sharded operand, "
                     "and that tensor is read after the write or through a view")
    return out


def written_fresh(node: fx.Node) -> bool:
    """Whether the tensor an in-place op writes (`mlp_output += attention_output`) is one the
    graph computed (not an input, a weight or a view of another tensor) that nothing reads
    after the write or through a view: writing into a local slice of it instead is then seen
    only through the op's own output, which takes the shard of the operand added."""
    target = node.args[0]
    if target.op != "call_function" or target.target in G.ALIASING:
        return False
    before, n = set(), node.prev
    while n is not target and n.op != "root":
        before.add(n)
        n = n.prev
    return all(u is node or (u in before and u.target not in G.ALIASING) for u in target.users)


@rule(*NEW_LIKE)
def _new_like(node, x, s, pl, tp):
    """A buffer shaped like the shard's source (DeepSeek-V3 fills `kv.new_empty(...)` per head
    with copy_): sharded along the same dim, its size there made local by the rewrite."""
    s = _need_shard(s, node)
    if ndim(node) != ndim(x) or shape_of(node)[s.dim] != shape_of(x)[s.dim]:
        raise NoRule(f"{node.target} of another shape than its sharded source")
    return Shard(s.dim, s.origin)


@rule(*G.CHECKS)
def _assert_metadata(node, x, s, pl, tp):
    # export's dtype/device/layout assertion before a cast: it checks no size, so a shard passes
    return s


@rule(*VIEWS)
def _view(node, x, s, pl, tp):
    s = _need_shard(s, node)
    try:
        return Shard(map_view(shape_of(x), shape_of(node), s.dim, tp), s.origin)
    except NoRule:
        fused = _fused_view(x, node, s, tp)
        if fused is None:
            raise
        return fused


def _fused_view(x, node, s: Shard, tp: int):
    """A fused projection's features viewed (.., k, h, ..) with k not divisible by tp
    (ModernBERT's Wqkv viewed (.., 3, -1, head_dim), the 3 being q|k|v): the weight is split
    per section of features/k, so each rank's local features are its 1/tp of each section and
    its local view is (.., k, h/tp, ..): the shard moves to h. None if the view is not that."""
    ins, outs = shape_of(x), shape_of(node)
    size = ins[s.dim] if ins else None
    if s.origin is None or s.dim != len(ins) - 1 or not isinstance(size, int):
        return None
    start, lead = sympy.Mul(*(_expr(v) for v in ins[:-1])), sympy.Integer(1)
    for e, d in enumerate(outs[:-1]):
        if lead == start:
            k, h = outs[e], outs[e + 1]
            if not (isinstance(k, int) and isinstance(h, int) and k > 1 and k % tp and h % tp == 0):
                return None
            if sympy.Mul(*(_expr(v) for v in outs[e:])) != size or size % k:
                return None
            sections = (size // k,) * k
            pieces = tuple((i * size // k, (i + 1) * size // k) for i in range(k))
            return SplitOnShard(s.origin, sections, pieces), Shard(e + 1, s.origin)
        lead = lead * _expr(d)
    return None


@rule(aten.flatten.using_ints, aten.unflatten.int, aten.view_as_complex.default,
      aten.view_as_real.default, aten.squeeze.dim, aten.squeeze.dims)
def _view_like(node, x, s, pl, tp):
    """Ops that only regroup dims (complex views pair the last dim with a new dim of 2): the
    shard moves as for a view of the same shapes."""
    s = _need_shard(s, node)
    if node.target is aten.view_as_complex.default and s.dim == ndim(x) - 1:
        raise NoRule("view_as_complex over the sharded (real, imaginary) dim")
    if node.target is aten.view_as_real.default:
        return Shard(s.dim, s.origin)          # a trailing dim of 2 is appended
    return Shard(map_view(shape_of(x), shape_of(node), s.dim, tp), s.origin)


@rule(aten.transpose.int)
def _transpose(node, x, s, pl, tp):
    d0, d1 = (norm_dim(d, ndim(x)) for d in node.args[1:3])
    return Shard({d0: d1, d1: d0}.get(s.dim, s.dim), s.origin)


@rule(aten.t.default)
def _t(node, x, s, pl, tp):
    return Shard(1 - s.dim, s.origin)


@rule(aten.permute.default)
def _permute(node, x, s, pl, tp):
    perm = [norm_dim(d, ndim(x)) for d in node.args[1]]
    return Shard(perm.index(s.dim), s.origin)


@rule(aten.unsqueeze.default)
def _unsqueeze(node, x, s, pl, tp):
    d = norm_dim(node.args[1], ndim(node))
    return Shard(s.dim + (1 if d <= s.dim else 0), s.origin)


@rule(*G.SPLITS)
def _split_rule(node, x, s, pl, tp):
    return _split(node, s, tp)


@rule(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def _slice(node, x, s, pl, tp):
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim(x))
    if d == s.dim:
        if node.target is aten.slice.Tensor and shape_of(node)[d] == shape_of(x)[d]:
            return s               # x[:, :] keeps the whole dim: export's no-op slice
        if node.target is aten.slice.Tensor:
            return _slice_section(node, x, s, d, tp)
        raise NoRule(f"{node.target} along the sharded dim {d}")
    shift = -1 if node.target is aten.select.int and d < s.dim else 0
    return Shard(s.dim + shift, s.origin)


def slice_range(node, size: int) -> tuple[int, int]:
    """[start, end) of an aten.slice.Tensor over a dim of `size`, Python's clamping applied."""
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end = args[2] or 0, size if args[3] is None else args[3]
    start, end = (max(0, min(size, v + size if v < 0 else v)) for v in (start, end))
    return start, end


def _slice_section(node, x, s, d, tp):
    """A fused projection cut by slices (Phi3's `qkv[..., :q_pos]`): the slice is a section of
    the projection's output features, split over tp like the sections of a split."""
    size, step = shape_of(x)[d], node.args[4] if len(node.args) > 4 else 1
    if s.origin is None or step != 1 or not isinstance(size, int):
        raise NoRule(f"{node.target} along the sharded dim {d}")
    start, end = slice_range(node, size)
    sections = tuple(v for v in (start, end - start, size - end) if v)
    if any(v % tp for v in sections):
        raise NoRule(f"slice [{start}:{end}] of the sharded dim ({size}) does not divide by tp={tp}")
    return SplitOnShard(s.origin, sections, ((start, end),)), Shard(s.dim, s.origin)


@rule(aten.stack.default)
def _stack(node, x, s, pl, tp):
    """torch.stack of tensors placed alike (interleaved rotary embeddings' `stack((a*cos -
    b*sin, a*sin + b*cos), -1)`): the shard keeps its dim, one further when the new dim lies
    before it; a replicated part is needed sliced like the others."""
    parts = [a for a in node.args[0] if isinstance(a, fx.Node)]
    dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim(node))
    shard, need = placed_alike(parts, pl, "stacking")
    return need or Shard(shard.dim + (1 if dim <= shard.dim else 0), shard.origin)




@rule(aten.index.Tensor)
def _index(node, x, s, pl, tp):
    """x[idx] with index tensors (Falcon's `qkv[:, :, :, [-2]]`): indexing other dims keeps the
    shard, its dim moved where the indexed dims' result goes (in their place when they are
    adjacent, else in front); indexing the sharded dim needs a per-group index (_index_groups)."""
    indices = list(node.args[1])
    if any(isinstance(pl.get(i), Shard) for i in indices if isinstance(i, fx.Node)):
        raise NoRule("an index tensor is sharded")
    s = _need_shard(s, node)
    at = [d for d, i in enumerate(indices) if i is not None]
    if any(_dtype(indices[d]) in (torch.bool, torch.uint8) for d in at):
        raise NoRule("a boolean mask indexes a sharded tensor")
    if s.dim in at:
        return _index_groups(node, x, s, at, tp)
    k = ndim(node) - (ndim(x) - len(at))        # the dims the broadcast indices make
    if at == list(range(at[0], at[-1] + 1)):
        return Shard(s.dim if s.dim < at[0] else s.dim - len(at) + k, s.origin)
    return Shard(k + s.dim - sum(d < s.dim for d in at), s.origin)


def _dtype(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _index_groups(node, x, s: Shard, at: list, tp: int):
    """x[..., idx] along the sharded dim (n positions, n/tp per rank): runs on the shard when
    idx is a constant whose tp blocks pick, each from its own rank's n/tp positions, the same
    local positions; every rank then indexes its block with idx's first block (the rewrite
    slices it)."""
    if at != [s.dim] or s.origin is None:      # (a sequence shard: the rewrite keeps its index)
        raise NoRule("an index over the sharded dim and other dims together, or of a sequence")
    idx, n = constant_value(node.args[1][s.dim]), shape_of(x)[s.dim]
    if idx is None or idx.dim() != 1 or not isinstance(n, int):
        raise NoRule("an index of the sharded dim whose values are not a constant of one dim")
    m, shown = idx.numel(), idx.tolist()[:8]
    if m % tp or n % tp:
        raise NoRule(f"the index {shown} picks {m} of the sharded dim's {n} positions, not a "
                     f"multiple of tp={tp}: what it picks cannot be split over the ranks (a k/v "
                     "head every query head shares stays whole: use a multiple of tp k/v heads)")
    blocks = idx.remainder(n).view(tp, m // tp) - torch.arange(tp)[:, None] * (n // tp)
    first = idx[: m // tp]
    if not bool((blocks == first).all()) or not bool(((first >= 0) & (first < n // tp)).all()):
        raise NoRule(f"the index {shown} of the sharded dim ({n} positions) does not pick the "
                     f"same positions of each rank's {n // tp}, so no one program runs on every rank")
    return Shard(s.dim, s.origin)


def constant_value(node) -> torch.Tensor | None:
    """The value of a constant tensor the graph holds (a lifted constant read by get_attr,
    maybe through lift_fresh_copy), or None."""
    while isinstance(node, fx.Node) and node.target is aten.lift_fresh_copy.default:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr" or node.graph.owning_module is None:
        return None
    try:
        value = functools.reduce(getattr, node.target.split("."), node.graph.owning_module)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) and not value.is_floating_point() else None


@rule(aten.unbind.int)
def _unbind(node, x, s, pl, tp):
    """Unbinding another dim than the shard's (q, k, v out of a fused (.., 3, h, d) view)."""
    s = _need_shard(s, node)
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim(x))
    if d == s.dim:
        raise NoRule(f"unbind along the sharded dim {d}")
    out = Shard(s.dim - (1 if d < s.dim else 0), s.origin)
    return tuple(out for _ in range(int(shape_of(x)[d])))


@rule(aten.max.dim, aten.min.dim)
def _max_dim(node, x, s, pl, tp):
    """(values, indices) over another dim than the shard's (GPT-OSS's attention sinks take the
    max over the keys of each head): both keep the shard."""
    d = norm_dim(node.args[1], ndim(x))
    if d == s.dim:
        raise NoRule(f"{node.target} over the sharded dim {d}")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    out = Shard(s.dim - (0 if keep or d > s.dim else 1), s.origin)
    return (out, out)


@rule(aten.expand.default, aten.broadcast_to.default)
def _expand(node, x, s, pl, tp):
    return Shard(s.dim + (ndim(node) - ndim(x)), s.origin)


@rule(aten.repeat_interleave.self_int)
def _repeat_interleave(node, x, s, pl, tp):
    """Each element repeated along a dim (k/v heads repeated for their query heads, as gpt-fast
    writes grouped-query attention): a rank's contiguous 1/tp of the kv heads becomes the same
    1/tp of the query heads, so the shard stays on its dim."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        raise NoRule("repeat_interleave without dim flattens the sharded tensor")
    return s         # an output_size along the sharded dim is made local by the rewrite


@rule(*G.SOFTMAXES, *G.LOG_SOFTMAXES)
def _softmax(node, x, s, pl, tp):
    if norm_dim(node.args[1], ndim(x)) == s.dim:
        raise NoRule("softmax over the sharded dim")
    return s


@rule(*NORMS_LAST)
def _norm_last(node, x, s, pl, tp):
    if s.dim >= ndim(x) - len(node.args[1]):
        raise NoRule("normalization over the sharded dim")
    return s


@rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction)
def _reduce(node, x, s, pl, tp):
    """A reduction over other dims keeps the shard (RMSNorm's mean over features of a head)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        raise NoRule(f"{node.target} over all dims of a sharded tensor")
    dims = [norm_dim(d, ndim(x)) for d in ([dims] if isinstance(dims, int) else dims)]
    if s.dim in dims:
        raise NoRule(f"{node.target} over the sharded dim {s.dim}")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return Shard(s.dim - (0 if keep else sum(d < s.dim for d in dims)), s.origin)


@rule(aten.scaled_dot_product_attention.default)
def _sdpa_rule(node, x, s, pl, tp):
    return _sdpa(node, pl)


@rule(torch.ops.higher_order.flex_attention)
def _flex_rule(node, x, s, pl, tp):
    """flex_attention (q, k, v, score_mod, block_mask, scale, kernel_options, score_mod buffers,
    mask_mod buffers) is per head, like SDPA, while its mods do not read the head index (a
    rank's local head h is global head r * H / tp + h) and its BlockMask is one for every
    head (H=None: size 1 there); its outputs (out, log-sum-exp, max) are sharded alike."""
    from autopart.localize import attribute
    block_mask = node.args[4]
    for mod, head in ((node.args[3], 2), (block_mask[-1], 1)):   # (score, b, h, ..), (b, h, ..)
        graph = attribute(node.graph.owning_module, mod.target).graph
        if graph.find_nodes(op="placeholder")[head].users:
            raise NoRule("flex_attention whose score_mod or mask_mod reads the head index")
    if any(isinstance(t, fx.Node) and ndim(t) > 1 and shape_of(t)[1] != 1
           for t in block_mask[2:10]):
        raise NoRule("flex_attention with a BlockMask per head")
    for a in node.args[:3]:
        if not isinstance(pl.get(a), Shard):
            return Need(a, 1)
        if pl[a].dim != 1:
            raise NoRule("attention with q/k/v sharded on a dim other than the heads")
    return tuple(Shard(1, pl[node.args[0]].origin) for _ in range(3))


@rule(*G.MATMULS_BATCHED)
def _matmul_rule(node, x, s, pl, tp):
    return _batched_matmul(node, pl)


def _split(node, s: Shard, tp: int):
    t, x = node.target, node.args[0]
    n = ndim(x)
    dim = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), n)
    if dim != s.dim:
        count = len(node.meta["val"])
        return tuple(s for _ in range(count))
    size = shape_of(x)[dim]
    if t is aten.split.Tensor:
        sections = (node.args[1],) * (int(size) // node.args[1])
    elif t is aten.chunk.default:
        sections = (int(size) // node.args[1],) * node.args[1]
    else:
        sections = tuple(node.args[1])
    if any(int(sec) % tp for sec in sections):
        raise NoRule(f"split of the sharded dim into sections {sections}, not divisible by tp={tp}")
    bounds = [0]
    for v in sections:
        bounds.append(bounds[-1] + int(v))
    return SplitOnShard(s.origin, tuple(int(v) for v in sections),
                        tuple(zip(bounds, bounds[1:]))), tuple(Shard(dim, s.origin)
                                                               for _ in sections)


def _elementwise(node, pl, tp):
    out_nd = ndim(node)
    shard_dims = {(a, out_nd - ndim(a) + pl[a].dim) for a in node.all_input_nodes
                  if isinstance(pl.get(a), Shard)}
    dims = {d for _, d in shard_dims}
    if len(dims) != 1:
        raise NoRule(f"operands sharded along different dims {sorted(dims)}")
    dim = dims.pop()
    for a in node.all_input_nodes:
        if not isinstance(pl.get(a), Shard) and ndim(a) > 0 and _aligned_dim(a, out_nd, dim) is not None:
            return Need(a, _aligned_dim(a, out_nd, dim))
    # the projection's name, never a locally sliced operand's None (a set's order picked either,
    # and a split keyed by None cut no weight)
    return Shard(dim, next((pl[a].origin for a in node.all_input_nodes
                            if isinstance(pl.get(a), Shard) and pl[a].origin), None))


def _sdpa(node, pl):
    q, k, v = node.args[:3]
    for a in (q, k, v):
        if not isinstance(pl.get(a), Shard):
            return Need(a, 1)
        if pl[a].dim != 1:
            raise NoRule("attention with q/k/v sharded on a dim other than the heads")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node) and not isinstance(pl.get(mask), Shard):
        d = _aligned_dim(mask, 4, 1)
        if d is not None:
            return Need(mask, d)
    return Shard(1, pl[q].origin)


def _batched_matmul(node, pl):
    a, b = node.args[:2]
    if ndim(a) < 3 or ndim(b) < 3:
        raise NoRule("matmul of a sharded activation with a 2-D operand")
    sa, sb = pl.get(a), pl.get(b)
    for this, other, s in ((a, b, sa), (b, a, sb)):
        if isinstance(s, Shard) and s.dim >= ndim(this) - 2:
            raise NoRule("matmul contracting or producing along the sharded dim")
    if not isinstance(sa, Shard):
        return Need(a, sb.dim)
    if not isinstance(sb, Shard):
        return Need(b, sa.dim)
    if sa.dim != sb.dim:
        raise NoRule("matmul operands sharded along different batch dims")
    return Shard(sa.dim, sa.origin)

