"""The tensor-parallel rule table (autopart/placement.py RULES), one row per rule: a tiny function
exported with torch.export, the placement of its inputs, and the placement the rule must give its
op's output (or NoRule / a Need). Every rule function in the table has a row here."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopart.placement import RULES, R, Need, NoRule, Shard, SplitOnShard, carry

aten = torch.ops.aten
S = Shard
COVERED: set = set()


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _place(fn, inputs, placements: dict, op, tp=2):
    """The placement `carry` gives the first node calling `op`, inputs placed as given."""
    ep = torch.export.export(_Fn(fn), tuple(inputs), strict=False)
    pl = {}
    users = set(ep.graph_signature.user_inputs)     # not a lifted constant (an index list)
    for i, n in enumerate(n for n in ep.graph.nodes if n.op == "placeholder" and n.name in users):
        pl[n] = placements.get(i, R)
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is op:
            if op in RULES:
                COVERED.add(RULES[op])
            return carry(n, pl, tp)
        pl[n] = carry(n, pl, tp)
    raise AssertionError(f"{op} not in the exported graph:\n{ep.graph}")


def _flex(q, k, v, score_mod=None):
    """flex_attention with a causal BlockMask built in forward, as Hugging Face builds it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, q.shape[2], k.shape[2],
                             device=q.device)
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)


def x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _expand_repeat_kv(t):          # repeat_kv: [B, T, Hkv, D] -> [B, T, 2*Hkv, D]
    b, s, h, d = t.shape
    return t[:, :, :, None, :].expand(b, s, h, 2, d).reshape(b, s, h * 2, d)


def _add_into_viewed(a, b):      # a view of the tensor written, read after the write
    c = a.clone()
    seen = c.view(-1)
    c.add_(b)
    return seen * 2


def _depthwise(a, w, b):       # Mamba-2's causal conv: one filter per channel
    return F.conv1d(a, w, b, padding=2, groups=8)


ROWS = [
    # (id, fn, inputs, input placements, op, expected output placement)
    ("add-broadcast-bias-needs-slice", lambda a, b: a + b, [x(2, 4, 8), x(8)], {0: S(2)},
     aten.add.Tensor, "need1:0"),
    ("add-broadcast-other-dim", lambda a, b: a + b, [x(2, 4, 8), x(4, 1)], {0: S(2)},
     aten.add.Tensor, S(2)),
    ("mul-two-shards", lambda a, b: a * b, [x(2, 4, 8), x(2, 4, 8)], {0: S(2), 1: S(2)},
     aten.mul.Tensor, S(2)),
    ("silu", F.silu, [x(2, 8)], {0: S(1)}, aten.silu.default, S(1)),
    ("rsqrt", torch.rsqrt, [x(2, 8)], {0: S(1)}, aten.rsqrt.default, S(1)),
    ("pow", lambda a: a.pow(2), [x(2, 8)], {0: S(1)}, aten.pow.Tensor_Scalar, S(1)),
    ("float-round-trip", lambda a: a.float().type_as(a), [x(2, 8)], {0: S(1)},
     aten._assert_tensor_metadata.default, S(1)),
    ("to-dtype", lambda a: a.to(torch.float64), [x(2, 8)], {0: S(1)}, aten.to.dtype, S(1)),
    ("view-heads", lambda a: a.view(2, 4, 4, 2), [x(2, 4, 8)], {0: S(2)}, aten.view.default,
     S(2)),
    ("view-merge-into-preceding", lambda a: a.view(8, 8), [x(2, 4, 8)], {0: S(1)},
     aten.view.default, NoRule),
    ("reshape-after-transpose", lambda a: a.transpose(1, 2).reshape(2, 4, 8),
     [x(2, 2, 4, 4)], {0: S(1)}, aten.reshape.default, S(2)),
    ("reshape-merging-shard-into-preceding", lambda a: a.reshape(8, 4), [x(2, 4, 4)], {0: S(1)},
     aten.reshape.default, NoRule),
    ("transpose", lambda a: a.transpose(1, 2), [x(2, 4, 2, 8)], {0: S(2)}, aten.transpose.int,
     S(1)),
    ("t", lambda a: a.t(), [x(4, 8)], {0: S(1)}, aten.t.default, S(0)),
    ("permute", lambda a: a.permute(0, 2, 1, 3), [x(2, 4, 2, 8)], {0: S(2)},
     aten.permute.default, S(1)),
    ("unsqueeze", lambda a: a.unsqueeze(1), [x(2, 8)], {0: S(1)}, aten.unsqueeze.default, S(2)),
    ("expand-repeat-kv", _expand_repeat_kv, [x(2, 4, 2, 8)], {0: S(2)}, aten.expand.default,
     S(2)),
    ("repeat-kv-reshape", _expand_repeat_kv, [x(2, 4, 2, 8)], {0: S(2)}, aten.reshape.default,
     S(2)),
    ("repeat-interleave-kv-heads", lambda a: a.repeat_interleave(2, dim=1), [x(2, 2, 4, 8)],
     {0: S(1)}, aten.repeat_interleave.self_int, S(1)),
    ("repeat-interleave-other-dim", lambda a: a.repeat_interleave(2, dim=2), [x(2, 2, 4, 8)],
     {0: S(1)}, aten.repeat_interleave.self_int, S(1)),
    ("repeat-interleave-flattening", lambda a: a.repeat_interleave(2), [x(2, 2, 4, 8)],
     {0: S(1)}, aten.repeat_interleave.self_int, NoRule),
    ("view-as-complex", lambda a: torch.view_as_complex(a.reshape(2, 4, 4, 2)), [x(2, 4, 8)],
     {0: S(1)}, aten.view_as_complex.default, S(1)),
    ("view-as-complex-over-pairs", lambda a: torch.view_as_complex(a), [x(2, 4, 2)], {0: S(2)},
     aten.view_as_complex.default, NoRule),
    ("view-as-real", lambda a: torch.view_as_real(torch.view_as_complex(a)), [x(2, 4, 2)],
     {0: S(1)}, aten.view_as_real.default, S(1)),
    ("flatten", lambda a: a.flatten(2), [x(2, 4, 8, 2)], {0: S(1)}, aten.flatten.using_ints,
     S(1)),
    ("squeeze", lambda a: a.squeeze(1), [x(2, 1, 8)], {0: S(2)}, aten.squeeze.dim, S(1)),
    ("mean-rmsnorm", lambda a: a.pow(2).mean(-1, keepdim=True), [x(2, 4, 8)], {0: S(1)},
     aten.mean.dim, S(1)),
    ("mean-over-shard", lambda a: a.mean(-1), [x(2, 4, 8)], {0: S(2)}, aten.mean.dim, NoRule),
    ("sum-drops-dim", lambda a: a.sum(1), [x(2, 4, 8)], {0: S(2)}, aten.sum.dim_IntList, S(1)),
    ("softmax-other-dim", lambda a: a.softmax(-1), [x(2, 4, 8)], {0: S(1)}, aten.softmax.int,
     S(1)),
    ("softmax-over-shard", lambda a: a.softmax(-1), [x(2, 4, 8)], {0: S(2)}, aten.softmax.int,
     NoRule),
    ("layer-norm-over-shard", lambda a: F.layer_norm(a, (8,)), [x(2, 4, 8)], {0: S(2)},
     aten.layer_norm.default, NoRule),
    ("layer-norm-per-head", lambda a: F.layer_norm(a, (8,)), [x(2, 4, 8)], {0: S(1)},
     aten.layer_norm.default, S(1)),
    ("split-sharded-dim", lambda a: a.split(4, -1)[0], [x(2, 12)], {0: S(1)},
     aten.split.Tensor, "split"),
    ("split-other-dim", lambda a: a.split(1, 0)[0], [x(2, 12)], {0: S(1)}, aten.split.Tensor,
     (S(1), S(1))),
    ("slice-other-dim", lambda a: a[:, :2], [x(2, 4, 8)], {0: S(2)}, aten.slice.Tensor, S(2)),
    ("slice-sharded-dim", lambda a: a[..., :2], [x(2, 4, 8)], {0: S(2)}, aten.slice.Tensor,
     NoRule),
    ("slice-section-of-a-projection", lambda a: a[..., :2], [x(2, 4, 8)], {0: S(2, "qkv")},
     aten.slice.Tensor, "slice"),
    ("slice-section-not-divisible", lambda a: a[..., 3:], [x(2, 4, 8)], {0: S(2, "qkv")},
     aten.slice.Tensor, NoRule),
    ("new-empty-like-the-shard", lambda a: a.new_empty(2, 4, 8), [x(2, 4, 8)], {0: S(1)},
     aten.new_empty.default, S(1)),
    ("new-empty-other-shape", lambda a: a.new_empty(2, 2, 8), [x(2, 4, 8)], {0: S(1)},
     aten.new_empty.default, NoRule),
    ("max-dim-other-dim", lambda a: a.max(-1, keepdim=True).values, [x(2, 4, 8)], {0: S(1)},
     aten.max.dim, (S(1), S(1))),
    ("max-dim-drops-an-earlier-dim", lambda a: a.max(0).values, [x(2, 4, 8)], {0: S(1)},
     aten.max.dim, (S(0), S(0))),
    ("max-dim-over-shard", lambda a: a.max(-1).values, [x(2, 4, 8)], {0: S(2)}, aten.max.dim,
     NoRule),
    ("inplace-div-on-the-shard", lambda a, b: a.clone().div_(b), [x(2, 4, 8), x(8)],
     {0: S(1)}, aten.div_.Tensor, S(1)),
    ("inplace-add-into-a-fresh-replicated-slices-it", lambda a, b: a.clone().add_(b),
     [x(2, 4, 8), x(2, 4, 8)], {1: S(1)}, aten.add_.Tensor, "need0:1"),
    ("inplace-add-into-replicated-read-through-a-view", _add_into_viewed,
     [x(2, 4, 8), x(2, 4, 8)], {1: S(1)}, aten.add_.Tensor, NoRule),
    ("inplace-add-into-an-input", lambda a, b: a.add_(b), [x(2, 4, 8), x(2, 4, 8)], {1: S(1)},
     aten.add_.Tensor, NoRule),
    ("stack-new-last-dim", lambda a, b: torch.stack((a, b), -1), [x(2, 4, 8), x(2, 4, 8)],
     {0: S(1), 1: S(1)}, aten.stack.default, S(1)),
    ("stack-new-dim-before-the-shard", lambda a, b: torch.stack((a, b), 0),
     [x(2, 4, 8), x(2, 4, 8)], {0: S(1), 1: S(1)}, aten.stack.default, S(2)),
    ("stack-needs-the-replicated-part-sliced", lambda a, b: torch.stack((a, b), -1),
     [x(2, 4, 8), x(2, 4, 8)], {0: S(1)}, aten.stack.default, "need1:1"),
    ("stack-shards-on-different-dims", lambda a, b: torch.stack((a, b), -1),
     [x(2, 4, 4), x(2, 4, 4)], {0: S(1), 1: S(2)}, aten.stack.default, NoRule),
    ("unbind-other-dim", lambda a: a.unbind(2)[0], [x(2, 4, 3, 4, 2)], {0: S(3)},
     aten.unbind.int, (S(2), S(2), S(2))),
    ("unbind-sharded-dim", lambda a: a.unbind(1)[0], [x(2, 4, 8)], {0: S(1)}, aten.unbind.int,
     NoRule),
    ("index-unsharded-dim-keeps-the-shard", lambda a: a[:, :, :, [1]],
     [x(2, 4, 2, 3, 8)], {0: S(2)}, aten.index.Tensor, S(2)),
    ("index-before-the-shard", lambda a: a[:, [0, 2, 3]], [x(2, 4, 8)], {0: S(2)},
     aten.index.Tensor, S(2)),
    ("index-two-dims-apart-go-in-front", lambda a: a[[0, 1], :, [0, 1]], [x(2, 4, 2)],
     {0: S(1)}, aten.index.Tensor, S(1)),
    ("index-by-a-mask", lambda a: a[:, torch.tensor([True, False, True, True])],
     [x(2, 4, 8)], {0: S(2)}, aten.index.Tensor, NoRule),
    ("index-sharded-dim-unknown-values", lambda a, i: a[:, i], [x(2, 4, 8), torch.tensor([0, 2])],
     {0: S(1)}, aten.index.Tensor, NoRule),
    ("index-by-a-sharded-index", lambda a, i: a[i], [x(8, 4), torch.tensor([[0, 2]])],
     {1: S(1)}, aten.index.Tensor, NoRule),
    ("broadcast-to-keeps-the-shard", lambda a: torch.broadcast_to(a, (2, 4, 3, 8)),
     [x(2, 4, 1, 8)], {0: S(1)}, aten.broadcast_to.default, S(1)),
    ("view-fused-qkv-with-a-split-dim", lambda a: a.view(2, 4, 3, 2, 4), [x(2, 4, 24)],
     {0: S(2, "qkv")}, aten.view.default, "fused"),
    ("view-fused-qkv-heads-not-divisible", lambda a: a.view(2, 4, 3, 1, 8), [x(2, 4, 24)],
     {0: S(2, "qkv")}, aten.view.default, NoRule),
    ("view-split-dim-of-no-projection", lambda a: a.view(2, 4, 3, 2, 4), [x(2, 4, 24)],
     {0: S(2)}, aten.view.default, NoRule),
    ("copy-into-the-shard-slices-the-source", lambda a, b: a.clone().copy_(b),
     [x(2, 4, 8), x(2, 4, 8)], {0: S(1)}, aten.copy_.default, "need1:1"),
    ("select-shifts", lambda a: a[0], [x(2, 4, 8)], {0: S(2)}, aten.select.int, S(1)),
    ("cat-other-dim-needs-shard", lambda a, b: torch.cat([a, b], 1), [x(2, 4, 8), x(2, 4, 8)],
     {0: S(2)}, aten.cat.default, "need1:2"),
    ("cat-sharded-dim-makes-sections", lambda a, b: torch.cat([a, b], 2),
     [x(2, 4, 8), x(2, 4, 4)], {0: S(2), 1: S(2)}, aten.cat.default, "cat"),
    ("cat-sharded-dim-not-divisible", lambda a, b: torch.cat([a, b], 2),
     [x(2, 4, 8), x(2, 4, 3)], {0: S(2), 1: S(2)}, aten.cat.default, NoRule),
    ("tril-over-positions", lambda a: a.tril(-1), [x(2, 4, 8, 8)], {0: S(1)},
     aten.tril.default, S(1)),
    ("triu-over-the-shard", lambda a: a.triu(1), [x(2, 4, 8)], {0: S(2)}, aten.triu.default,
     NoRule),
    ("sdpa-heads", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     [x(2, 4, 8, 8), x(2, 4, 8, 8), x(2, 4, 8, 8)], {0: S(1), 1: S(1), 2: S(1)}, aten.scaled_dot_product_attention.default,
     S(1)),
    ("sdpa-needs-kv", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
     [x(2, 4, 8, 8), x(2, 4, 8, 8), x(2, 4, 8, 8)], {0: S(1)}, aten.scaled_dot_product_attention.default, "need1:1"),
    # flex_attention (Hugging Face's attn_implementation="flex_attention") is per head while
    # its mods do not read the head index: out, log-sum-exp and max split by heads
    ("flex-heads", lambda q, k, v: _flex(q, k, v),
     [x(2, 4, 8, 8), x(2, 4, 8, 8), x(2, 4, 8, 8)], {0: S(1), 1: S(1), 2: S(1)},
     torch.ops.higher_order.flex_attention, (S(1),) * 3),
    ("flex-needs-kv", lambda q, k, v: _flex(q, k, v),
     [x(2, 4, 8, 8), x(2, 4, 8, 8), x(2, 4, 8, 8)], {0: S(1)},
     torch.ops.higher_order.flex_attention, "need1:1"),
    ("flex-score-mod-reads-the-head",
     lambda q, k, v: _flex(q, k, v, lambda s, b, h, i, j: s - h),
     [x(2, 4, 8, 8), x(2, 4, 8, 8), x(2, 4, 8, 8)], {0: S(1), 1: S(1), 2: S(1)},
     torch.ops.higher_order.flex_attention, NoRule),
    ("matmul-per-head-alibi", lambda q, k: q @ k.transpose(-1, -2), [x(2, 4, 8, 8), x(2, 4, 8, 8)],
     {0: S(1), 1: S(1)}, aten.matmul.default, S(1)),
    ("matmul-contracting-shard", lambda a, b: a @ b, [x(2, 4, 8, 8), x(2, 4, 8, 8)], {0: S(3), 1: S(2)},
     aten.matmul.default, NoRule),
    ("cumsum-along-the-sequence", lambda a: a.cumsum(1), [x(2, 4, 8)], {0: S(2)},
     aten.cumsum.default, S(2)),
    ("cumsum-along-the-shard", lambda a: a.cumsum(-1), [x(2, 8)], {0: S(1)},
     aten.cumsum.default, NoRule),
    ("depthwise-conv1d-needs-its-filters-sliced", _depthwise, [x(2, 8, 5), x(8, 1, 3), x(8)],
     {0: S(1)}, aten.conv1d.default, "need1:0"),
    ("depthwise-conv1d-on-the-channels", _depthwise, [x(2, 8, 5), x(8, 1, 3), x(8)],
     {0: S(1), 1: S(0), 2: S(0)}, aten.conv1d.default, S(1)),
    ("conv1d-mixing-channels", lambda a: F.conv1d(a, torch.ones(8, 2, 3), groups=4),
     [x(2, 8, 5)], {0: S(1)}, aten.conv1d.default, NoRule),
    ("pad-the-sequence", lambda a: F.pad(a, (0, 0, 0, 3)), [x(2, 4, 8)], {0: S(2)},
     aten.pad.default, S(2)),
    ("pad-the-shard", lambda a: F.pad(a, (1, 0)), [x(2, 4, 8)], {0: S(2)}, aten.pad.default,
     NoRule),
    ("einsum-per-head", lambda a, b: torch.einsum("bclhn,bcshn->bclsh", a, b),
     [x(2, 1, 4, 2, 3), x(2, 1, 4, 2, 3)], {0: S(3), 1: S(3)}, aten.einsum.default, S(4)),
    ("einsum-needs-the-other-per-head", lambda a, b: torch.einsum("bhd,bhe->bhde", a, b),
     [x(2, 4, 3), x(2, 4, 3)], {0: S(1)}, aten.einsum.default, "need1:1"),
    ("einsum-contracting-the-shard", lambda a, b: torch.einsum("bln,bsn->bls", a, b),
     [x(2, 4, 8), x(2, 4, 8)], {0: S(2), 1: S(2)}, aten.einsum.default, NoRule),
    ("zeros-like-the-shard", lambda a: torch.zeros_like(a) + a, [x(2, 8)], {0: S(1)},
     aten.zeros_like.default, S(1)),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_rule(row):
    _, fn, inputs, placements, op, expected = row
    if expected is NoRule:
        with pytest.raises(NoRule):
            _place(fn, inputs, placements, op)
        if op in RULES:
            COVERED.add(RULES[op])
        return
    out = _place(fn, inputs, placements, op)
    if expected == "split":
        marker, parts = out
        assert isinstance(marker, SplitOnShard) and marker.sections == (4, 4, 4)
        assert parts == (S(1),) * 3
    elif expected == "slice":      # a[..., :2] of 8 features: section [0, 2) of (2, 6)
        marker, part = out
        assert isinstance(marker, SplitOnShard) and marker.sections == (2, 6), marker
        assert marker.pieces == ((0, 2),) and part == S(2, "qkv")
    elif expected == "fused":      # (.., 24) -> (.., 3, 2, 4): q|k|v sections, heads split
        marker, part = out
        assert isinstance(marker, SplitOnShard) and marker.sections == (8, 8, 8), marker
        assert marker.pieces == ((0, 8), (8, 16), (16, 24)) and part == S(3, "qkv")
    elif expected == "cat":        # parts of 8 and 4 along the shard: the cat's own sections
        marker, part = out
        assert isinstance(marker, SplitOnShard) and marker.sections == (8, 4), marker
        assert marker.origin == part.origin and marker.pieces == ((0, 8), (8, 12))
    elif isinstance(expected, str) and expected.startswith("need"):
        arg, dim = (int(v) for v in expected[4:].split(":"))
        assert isinstance(out, Need) and out.dim == dim, out
    else:
        got = tuple(Shard(p.dim) for p in out) if isinstance(out, tuple) else out
        assert got == expected if not isinstance(got, Shard) else Shard(got.dim) == expected


def test_every_rule_in_the_table_has_a_row():
    for row in ROWS:          # when run alone, the rows still fill COVERED
        if RULES.get(row[4]) not in COVERED and row[5] is not NoRule:
            test_rule(row)
    missing = {fn.__name__ for fn in RULES.values()} - {fn.__name__ for fn in COVERED}
    assert not missing, f"rules without a unit test row: {sorted(missing)}"
