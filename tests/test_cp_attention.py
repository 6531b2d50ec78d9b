"""Context-parallel attention (autopart/ops/cp.py) against plain single-process SDPA.

Every multi-rank case shards the same whole-sequence q, k, v and output gradient over the ranks
(causal load balancing), runs ring_attention or allgather_kv_attention and its backward on Gloo,
and the test process puts the ranks' outputs and gradients back in global order and compares
them with torch.nn.functional.scaled_dot_product_attention over the whole sequence. The cases of
one world size share one spawn (rank start-up is most of their time). assert_close keeps its
default equal_nan=False: a NaN anywhere fails. Sliding-window cases also count the blocks each
rank computed, against the blocks the dense mask leaves any key visible in.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from autopart.ops.cp import (CPComm, allgather_kv_attention, load_balanced_indices,
                             ring_attention, shard_sequence, unshard_sequence)

SPAWN_TIMEOUT = 120.0      # per spawn: a hang fails the test, never a stuck run
PG_TIMEOUT = 30.0          # each process group's: a missing peer raises within it
OPS = {"ring": ring_attention, "allgather": allgather_kv_attention}


@dataclass(frozen=True)
class Case:
    name: str
    op: str                        # "ring" or "allgather"
    causal: bool
    world: int = 2
    heads: int = 4
    kv_heads: int = 4
    seq: int = 16
    v_dim: int = 8
    dtype: torch.dtype = torch.float64
    scale: float | None = None
    groups: tuple = ()             # context-parallel groups (sorted global ranks); (): the world
    padded: bool = False           # a key padding mask (_keep): whole chunks, a rank's block
    docs: bool = False             # packed documents (_docs): one across chunks, padding chunks
    window: int | None = None      # a causal sliding window of this many keys


def _grid(world: int, seq: int) -> list[Case]:
    return [Case(f"{op}-{'causal' if causal else 'full'}-{kind}-cp{world}", op, causal, world,
                 kv_heads=kv, seq=seq)
            for op in OPS for causal in (True, False) for kind, kv in (("mha", 4), ("gqa", 2))]


TWO = _grid(2, 16) + [
    Case("ring-causal-mqa-fp32-vdim-scale", "ring", True, kv_heads=1, v_dim=6,
         dtype=torch.float32, scale=0.3),
    Case("allgather-causal-mqa-fp32-vdim", "allgather", True, kv_heads=1, v_dim=6,
         dtype=torch.float32),
    Case("ring-causal-gqa-padded", "ring", True, kv_heads=2, padded=True),
    Case("allgather-causal-gqa-padded", "allgather", True, kv_heads=2, padded=True),
    Case("ring-full-mha-padded-fp32", "ring", False, padded=True, dtype=torch.float32),
    Case("allgather-full-mha-padded", "allgather", False, padded=True),
    Case("ring-causal-gqa-docs", "ring", True, kv_heads=2, docs=True),
    Case("allgather-causal-gqa-docs", "allgather", True, kv_heads=2, docs=True),
    Case("ring-full-mha-docs-fp32", "ring", False, docs=True, dtype=torch.float32),
    Case("allgather-full-mha-docs", "allgather", False, docs=True),
    # sliding windows over chunks of 4: shorter than a chunk (chunk 3's blocks against chunks
    # 0 and 1 hidden, skipped), across chunks, and longer than the sequence (the causal mask)
    Case("ring-window3-gqa", "ring", True, kv_heads=2, window=3),
    Case("allgather-window3-gqa", "allgather", True, kv_heads=2, window=3),
    Case("ring-window6-mha-fp32", "ring", True, dtype=torch.float32, window=6),
    Case("allgather-window6-mqa", "allgather", True, kv_heads=1, window=6),
    Case("ring-window40-gqa", "ring", True, kv_heads=2, window=40),
    Case("allgather-window40-mha", "allgather", True, window=40),
    # (7: every query still sees a kept key; with less some rows would see none, NaN in SDPA)
    Case("ring-window7-gqa-padded", "ring", True, kv_heads=2, padded=True, window=7),
    Case("allgather-window5-gqa-docs", "allgather", True, kv_heads=2, docs=True, window=5),
    Case("ring-window7-mha-docs", "ring", True, docs=True, window=7),
]
# four ranks: the whole world as one ring of 4, and two rings of 2 whose group ranks are not
# their global ranks ({0, 2} and {1, 3}); NCCL's batch_isend_irecv contract kept over Gloo
FOUR = [
    Case("ring-causal-gqa-cp4", "ring", True, 4, kv_heads=2, seq=32),
    Case("ring-full-mha-cp4", "ring", False, 4, seq=32),
    Case("allgather-causal-gqa-cp4", "allgather", True, 4, kv_heads=2, seq=32),
    Case("ring-causal-gqa-subgroups", "ring", True, 4, kv_heads=2, groups=((0, 2), (1, 3))),
    Case("allgather-full-gqa-subgroups", "allgather", False, 4, kv_heads=2,
         groups=((0, 2), (1, 3))),
    Case("ring-causal-gqa-padded-cp4", "ring", True, 4, kv_heads=2, seq=32, padded=True),
    Case("allgather-causal-mha-padded-cp4", "allgather", True, 4, seq=32, padded=True),
    Case("ring-causal-gqa-docs-cp4", "ring", True, 4, kv_heads=2, seq=32, docs=True),
    Case("allgather-causal-mha-docs-cp4", "allgather", True, 4, seq=32, docs=True),
    Case("ring-window5-gqa-cp4", "ring", True, 4, kv_heads=2, seq=32, window=5),
    Case("allgather-window9-mha-cp4", "allgather", True, 4, seq=32, window=9),
]


def _keep(case: Case) -> torch.Tensor | None:
    """(batch 2, seq) keys that may be attended to: row 0 right-padded over its last 3/8 (whole
    chunks of some ranks hold only padding), row 1 with a padded run in the middle; key 0 is
    always kept, so every query sees a key (a row seeing none is NaN in SDPA too)."""
    if not case.padded:
        return None
    keep = torch.ones(2, case.seq, dtype=torch.bool)
    keep[0, case.seq - 3 * case.seq // 8:] = False
    keep[1, case.seq // 4: case.seq // 2 + 1] = False
    return keep


def _docs(case: Case) -> torch.Tensor | None:
    """(batch 2, seq) packed documents' ids: row 0 three documents, the middle one across most
    chunks; row 1 two short documents, then padding (id -1, a document of its own) over the
    last half (whole chunks of padding). Some blocks are empty in both rows."""
    if not case.docs:
        return None
    n = case.seq
    row0 = [0] * (n // 8 + 1) + [1] * (n - n // 4 - 2) + [2] * (n // 8 + 1)
    row1 = [5] * (n // 4 + 2) + [9] * (n // 4 - 2) + [-1] * (n // 2)
    return torch.tensor([row0, row1])


def _doc_mask(doc: torch.Tensor, causal: bool) -> torch.Tensor:
    n = doc.shape[1]
    same = (doc[:, :, None] == doc[:, None, :])[:, None]
    return same & torch.ones(n, n, dtype=torch.bool).tril() if causal else same


def _window_mask(n: int, causal: bool, window: int | None) -> torch.Tensor:
    """(n, n) True where query i may see key j: causal or all, and i - j < window."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (j <= i) if causal else torch.ones(n, n, dtype=torch.bool)
    return visible & (i - j < window) if window is not None else visible


def _dense_mask(case: Case) -> torch.Tensor | None:
    """The whole (batch, 1, seq, seq) boolean mask SDPA gets, or None (is_causal alone)."""
    if not (case.padded or case.docs or case.window):
        return None
    mask = _window_mask(case.seq, case.causal, case.window)[None, None]
    if _keep(case) is not None:
        mask = mask & _keep(case)[:, None, None, :]
    if _docs(case) is not None:
        mask = mask & (_docs(case)[:, :, None] == _docs(case)[:, None, :])[:, None]
    return mask


def _inputs(case: Case):
    """The whole-sequence q, k, v and output gradient: the same on every rank and here."""
    g = torch.Generator().manual_seed(1234)
    shapes = [(2, case.heads, case.seq, 8), (2, case.kv_heads, case.seq, 8),
              (2, case.kv_heads, case.seq, case.v_dim), (2, case.heads, case.seq, case.v_dim)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(case.dtype) for s in shapes]


# -- on the ranks -------------------------------------------------------------------------------

def _my_group(case: Case, rank: int, world: int, made: dict):
    """(process group, its global ranks, this rank's index in it) of this rank's
    context-parallel group. Every rank makes every group (new_group is collective), in the
    same order."""
    import torch.distributed as dist
    if not case.groups:
        return dist.group.WORLD, tuple(range(world)), rank
    if case.groups not in made:
        made[case.groups] = [dist.new_group(list(m), timeout=timedelta(seconds=PG_TIMEOUT))
                             for m in case.groups]
    i = next(i for i, m in enumerate(case.groups) if rank in m)
    return made[case.groups][i], case.groups[i], dist.get_rank(made[case.groups][i])


def _counting(blocks: dict) -> None:
    """Record the (queries, keys) of every block this process computes, forward and backward,
    in blocks["forward"] / blocks["backward"] (wrapping the kernels' block functions)."""
    from autopart.ops import cp
    for what, name in (("forward", "_block_forward"), ("backward", "_block_backward")):
        real = getattr(cp, name)

        def counted(q, k, *a, real=real, what=what, **kw):
            blocks[what].append((q.shape[2], k.shape[2]))
            return real(q, k, *a, **kw)
        setattr(cp, name, counted)


def _run_cases(rank: int, world: int, cases: list, nccl_contract: bool) -> dict:
    """Rank function: each case's local output and gradients, keyed by case name, and the
    blocks it computed."""
    if nccl_contract:
        from tests.nccl_contract import install
        install()
    made, results, blocks = {}, {}, {"forward": [], "backward": []}
    _counting(blocks)
    for case in cases:
        group, members, cp_rank = _my_group(case, rank, world, made)
        cp = len(members)
        comm = CPComm(cp, cp_rank).bind(group, cp_rank)
        q, k, v, dout = (shard_sequence(t, 2, cp, cp_rank) for t in _inputs(case))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        keep = _keep(case)
        keep = shard_sequence(keep, 1, cp, cp_rank) if keep is not None else None
        doc = _docs(case)
        doc = shard_sequence(doc, 1, cp, cp_rank) if doc is not None else None
        blocks["forward"].clear()
        blocks["backward"].clear()
        out = OPS[case.op](q, k, v, comm, case.causal, scale=case.scale, key_mask=keep,
                           doc_ids=doc, window=case.window)
        out.backward(dout)
        results[case.name] = dict(members=members, cp_rank=cp_rank, out=out.detach(),
                                  dq=q.grad, dk=k.grad, dv=v.grad,
                                  blocks={w: list(b) for w, b in blocks.items()})
    return results


# -- in the test process ------------------------------------------------------------------------

def _spawned(cache: dict, cases: list[Case], nccl_contract: bool) -> list[dict]:
    """Every rank's results for `cases` (one world size), from one spawn per session."""
    from autopart.runtime.launch import spawn
    key = ("cp_attention", cases[0].world)
    if key not in cache:
        try:
            cache[key] = spawn(_run_cases, cases[0].world, cases, nccl_contract,
                               timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)
        except Exception as e:  # noqa: BLE001  (every test of the spawn reports it)
            cache[key] = e
    if isinstance(cache[key], Exception):
        raise cache[key]
    return cache[key]


def _reference(case: Case) -> dict:
    """Plain SDPA over the whole sequence, in float64, and its gradients."""
    q, k, v, dout = (t.double().requires_grad_() for t in _inputs(case))
    mask = _dense_mask(case)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                         is_causal=case.causal and mask is None, scale=case.scale,
                                         enable_gqa=case.kv_heads != case.heads)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.detach())
    return dict(out=out.detach(), dq=dq, dk=dk, dv=dv)


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)


def _assert_matches_sdpa(case: Case, per_rank: list[dict]) -> None:
    ref, results = _reference(case), [r[case.name] for r in per_rank]
    rings = sorted({r["members"] for r in results})
    assert sorted(m for ring in rings for m in ring) == list(range(case.world)), rings
    for ring in rings:
        mine = sorted((r for r in results if r["members"] == ring), key=lambda r: r["cp_rank"])
        assert [r["cp_rank"] for r in mine] == list(range(len(ring))), (ring, mine)
        for what in ("out", "dq", "dk", "dv"):
            got = unshard_sequence([r[what] for r in mine], 2, len(ring))
            assert got.dtype == case.dtype, (what, got.dtype)
            torch.testing.assert_close(got.double(), ref[what], **_tolerance(case.dtype),
                                       msg=lambda m: f"{case.name} ranks {ring} {what}: {m}")
        if case.window is not None and not case.docs:   # documents skip blocks of their own
            for r in mine:
                assert r["blocks"] == _expected_blocks(case, len(ring), r["cp_rank"]), \
                    (case.name, r["cp_rank"], r["blocks"])


def _expected_blocks(case: Case, cp: int, rank: int) -> dict:
    """The (queries, keys) of the blocks rank `rank` must compute, from the dense causal-window
    mask (padding hides keys but skips nothing): ring, each (own query chunk, key chunk) pair
    with a visible key, in the ring's order; all-gather, per own query chunk, the keys from its
    first visible one to its last."""
    from autopart.ops.cp import load_balanced_indices
    n, c = case.seq, case.seq // (2 * cp)
    seen = _window_mask(n, case.causal, case.window)
    mine = load_balanced_indices(n, cp, rank).view(2, c)
    if case.op == "allgather":
        spans = []
        for rows in mine:
            cols = seen[rows].any(0).nonzero().flatten()
            spans.append((c, int(cols[-1]) - int(cols[0]) + 1))
        return {"forward": spans, "backward": spans}
    pairs = [(c, c) for step in range(cp) for rows in mine
             for cols in load_balanced_indices(n, cp, (rank - step) % cp).view(2, c)
             if seen[rows][:, cols].any()]
    return {"forward": pairs, "backward": pairs}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", TWO, ids=lambda c: c.name)
def test_two_ranks_match_sdpa(spawn_cache, case):
    _assert_matches_sdpa(case, _spawned(spawn_cache, TWO, nccl_contract=False))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", FOUR, ids=lambda c: c.name)
def test_four_ranks_match_sdpa_keeping_nccl_contract(spawn_cache, case):
    _assert_matches_sdpa(case, _spawned(spawn_cache, FOUR, nccl_contract=True))


# -- one process: the block math, the layout, shapes and refusals -------------------------------

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_one_rank_unbound_matches_sdpa(op, causal, kv_heads):
    """cp=1 needs no process group: the block attention and its backward alone."""
    case = Case("one", op, causal, 1, kv_heads=kv_heads, seq=10, v_dim=6)
    q, k, v, dout = _inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = OPS[op](q, k, v, CPComm(1), causal)
    out.backward(dout)
    ref = _reference(case)
    for what, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(got, ref[what], rtol=1e-9, atol=1e-9, msg=what)


def test_bf16_inputs_give_bf16_output_close_to_sdpa():
    case = Case("bf16", "ring", True, 1, kv_heads=2, dtype=torch.bfloat16)
    q, k, v, _ = _inputs(case)
    out = ring_attention(q, k, v, CPComm(1), True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(case)["out"], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seq, cp, rank, expected", [
    (8, 2, 0, [0, 1, 6, 7]), (8, 2, 1, [2, 3, 4, 5]),
    (8, 4, 0, [0, 7]), (8, 4, 1, [1, 6]), (8, 4, 2, [2, 5]), (8, 4, 3, [3, 4]),
    (6, 1, 0, [0, 1, 2, 3, 4, 5]),
])
def test_load_balanced_indices(seq, cp, rank, expected):
    assert load_balanced_indices(seq, cp, rank).tolist() == expected


@pytest.mark.parametrize("seq, cp", [(8, 1), (8, 2), (24, 3), (32, 4), (16, 8)])
def test_every_position_held_once_and_round_trip(seq, cp):
    held = torch.cat([load_balanced_indices(seq, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))
    x = torch.randn(3, seq, 5)
    parts = [shard_sequence(x, 1, cp, r) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part, x.index_select(1, load_balanced_indices(seq, cp, r)))
    assert torch.equal(unshard_sequence(parts, 1, cp), x)
    assert torch.equal(unshard_sequence([p.movedim(1, -1) for p in parts], -1, cp),
                       x.movedim(1, -1))


@pytest.mark.parametrize("call, says", [
    (lambda: load_balanced_indices(10, 2, 0), "not divisible by 4"),
    (lambda: shard_sequence(torch.zeros(2, 6), 1, 2, 0), "not divisible by 4"),
    (lambda: load_balanced_indices(8, 2, 2), "rank 2 is not in"),
    (lambda: unshard_sequence([torch.zeros(4)], 0, 2), "all 2 ranks"),
    (lambda: unshard_sequence([torch.zeros(3), torch.zeros(3)], 0, 2), "two equal chunks"),
    # 3 local positions per rank: a sequence of 6 is not 4 equal chunks
    (lambda: ring_attention(*_qkv(3), CPComm(2, 0, shape_only=True), True), "divisible by 4"),
    (lambda: allgather_kv_attention(*_qkv(3), CPComm(2, 0, shape_only=True), True),
     "divisible by 4"),
    (lambda: ring_attention(*_qkv(4, kv_heads=3), CPComm(2, 0, shape_only=True), True),
     "must divide the query heads"),
    (lambda: ring_attention(torch.zeros(4, 4, 8), *_qkv(4)[1:], CPComm(1), True), "shape"),
    (lambda: ring_attention(_qkv(4)[0].float(), *_qkv(4)[1:], CPComm(1), True), "dtype"),
    (lambda: ring_attention(*_qkv(4), CPComm(1), False, window=3), "causal attention only"),
    (lambda: allgather_kv_attention(*_qkv(4), CPComm(1), True, window=0),
     "positive number of keys, got 0"),
])
def test_refusals_say_why(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def _qkv(local: int, heads: int = 4, kv_heads: int = 2, v_dim: int = 5, **kw):
    return (torch.randn(2, heads, local, 8, dtype=torch.float64, **kw),
            torch.randn(2, kv_heads, local, 8, dtype=torch.float64, **kw),
            torch.randn(2, kv_heads, local, v_dim, dtype=torch.float64, **kw))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fake", [False, True])
def test_shape_only_gives_shapes_without_a_process_group(op, fake):
    """What the compile-time checker does: fake tensors, a comm of 4 that moves nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() if fake else contextlib.nullcontext():
        q, k, v = _qkv(6, requires_grad=True)
        out = OPS[op](q, k, v, CPComm(4, 1, shape_only=True), True)
        assert out.shape == (2, 4, 6, 5) and out.dtype == torch.float64
        out.sum().backward()
        assert [t.grad.shape for t in (q, k, v)] == [t.shape for t in (q, k, v)]


def test_unbound_comm_of_two_is_refused():
    with pytest.raises(RuntimeError, match="context-parallel program is not bound"):
        ring_attention(*_qkv(4), CPComm(2, 0), True)


@pytest.mark.parametrize("lq, lk, causal", [(8, 8, True), (8, 24, True), (8, 16, False)])
def test_fused_cpu_blocks_equal_the_portable_ones(lq, lk, causal):
    """On CPU a block runs as torch's fused flash kernel; on other devices as matmuls (the
    ring and all-gather logic around them is the same): both give the same output, log-sum-exp
    and gradients, for square and wide (bottom-right causal) blocks."""
    from autopart.ops import cp
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (lq, lk, lk))
    scale = 8 ** -0.5
    out, lse = cp._block_forward(q, k, v, scale, causal)
    ref_out, ref_lse = cp._matmul_block_forward(q, k, v, scale, causal)
    torch.testing.assert_close((out, lse), (ref_out, ref_lse))
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    delta = (dout * out).sum(-1)
    torch.testing.assert_close(cp._block_backward(q, k, v, dout, lse, delta, scale, causal, out),
                               cp._matmul_block_backward(q, k, v, dout, lse, delta, scale, causal))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matmuls"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("docs, blocks", [
    # a document across the two chunks, padding of its own: every causal block is computed
    ([[0] * 5 + [1] * 6 + [2] * 5, [3] * 3 + [4] * 5 + [-1] * 8], 3),
    # the second chunk holds other documents (and all padding) in both rows: its block
    # against the first chunk is empty, skipped without a matmul
    ([[0] * 8 + [1] * 8, [2] * 4 + [3] * 4 + [-1] * 8], 2),
])
def test_document_blocks_match_masked_sdpa_and_skip_empty_ones(op, docs, blocks, fused,
                                                               monkeypatch):
    """One rank (no spawn) holds both chunks of a 16-token sequence: the per-block document
    mask, and the empty-block skip, against plain SDPA with the whole mask, forward and
    backward, by the fused CPU kernel and by the matmuls other devices run (rows of a block
    that see no key: no NaN); the blocks computed are counted (3 causal blocks, 2 when one is
    empty)."""
    from autopart.ops import cp
    if not fused:
        monkeypatch.setattr(cp, "_fused", lambda *a: False)
    calls = []
    real = cp._block_forward
    monkeypatch.setattr(cp, "_block_forward", lambda q, k, *a: calls.append(k.shape[2]) or
                        real(q, k, *a))
    case = Case("docs", op, True, 1, kv_heads=2, seq=16)
    doc = torch.tensor(docs)
    q, k, v, dout = _inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = OPS[op](q, k, v, CPComm(1), True, doc_ids=doc)
    out.backward(dout)
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=_doc_mask(doc, True),
                                         enable_gqa=True)
    ref.backward(dout)
    for what, got, want in (("out", out, ref), ("dq", q.grad, q2.grad), ("dk", k.grad, k2.grad),
                            ("dv", v.grad, v2.grad)):
        assert torch.isfinite(got).all(), what
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=what)
    # ring: one call per block; all-gather: one per query chunk over the keys it can see
    keys = 8 * blocks if op == "ring" else 8 + (16 if blocks == 3 else 8)
    assert sum(calls) == keys, calls


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matmuls"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("window", [1, 3, 12, 40])
def test_window_blocks_match_masked_sdpa_and_skip_hidden_ones(op, window, fused, monkeypatch):
    """One rank (no spawn) holds both chunks (8 positions each) of a 16-token sequence: the
    per-block sliding-window mask against plain SDPA with the dense mask causal & i - j < w,
    forward and backward, by the fused CPU kernel and by the matmuls other devices run. Window
    1: each query sees itself (the block of chunk 1 against chunk 0 skipped); 3: shorter than a
    chunk (rows of that block see no key: no NaN); 12: across the chunks; 40: longer than the
    sequence, the causal mask. The blocks computed, forward and backward, are the dense mask's
    (all-gather narrows chunk 1's keys to the ones its window reaches)."""
    from autopart.ops import cp
    if not fused:
        monkeypatch.setattr(cp, "_fused", lambda *a: False)
    blocks = {"forward": [], "backward": []}
    for what, name in (("forward", "_block_forward"), ("backward", "_block_backward")):
        real = getattr(cp, name)
        monkeypatch.setattr(cp, name, lambda q, k, *a, real=real, what=what:
                            blocks[what].append((q.shape[2], k.shape[2])) or real(q, k, *a))
    case = Case("window", op, True, 1, kv_heads=2, seq=16, window=window)
    q, k, v, dout = _inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = OPS[op](q, k, v, CPComm(1), True, window=window)
    out.backward(dout)
    ref = _reference(case)
    for what, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(got).all(), what
        torch.testing.assert_close(got, ref[what], rtol=1e-9, atol=1e-9, msg=what)
    assert blocks == _expected_blocks(case, 1, 0), blocks
    skipped = {1: 1, 3: 0, 12: 0, 40: 0}[window] if op == "ring" else None
    if skipped is not None:          # the count the dense mask gives, written out
        assert len(blocks["forward"]) == 3 - skipped


# -- a sliding window, packed documents and padded keys together --------------------------------

# a window, documents and padded keys at once: the masks are _wdp_masks' (with _keep's and
# _docs' patterns together some queries would see no key)
WDP = [Case(f"{op}-window{w}-docs-padded-cp{cp}", op, True, cp, kv_heads=2, seq=8 * cp,
            window=w) for cp in (2, 4) for op in OPS for w in (3, 6)]


def _wdp_masks(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc, keep), each (batch 2, n): row 0 three documents across chunk boundaries, two keys
    padded just after the second starts; row 1 two documents, then padding (id -1) over the
    last half, a key padded in each. Ids increase along a row and the tail starts at a chunk
    boundary, so two chunks' id ranges meet exactly where they share a document."""
    a, b = 3 * n // 8, n // 8 + 1
    doc = torch.tensor([[0] * a + [1] * (a + 1) + [2] * (n - 2 * a - 1),
                        [3] * b + [4] * (n // 2 - b) + [-1] * (n // 2)])
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[0, a + 1: a + 3] = False
    keep[1, [b + 1, n // 2 + 2]] = False
    return doc, keep


def _wdp_dense(case: Case, with_keep: bool = True) -> torch.Tensor:
    """The (batch, 1, seq, seq) boolean mask SDPA gets: causal window & documents (& keep)."""
    doc, keep = _wdp_masks(case.seq)
    mask = _window_mask(case.seq, True, case.window)[None, None] & \
        (doc[:, :, None] == doc[:, None, :])[:, None]
    return mask & keep[:, None, None, :] if with_keep else mask


def _wdp_run(rank: int, world: int, cases: list) -> dict:
    """Rank function: each case's local output and gradients and the blocks it computed."""
    import torch.distributed as dist
    results, blocks = {}, {"forward": [], "backward": []}
    _counting(blocks)
    for case in cases:
        comm = CPComm(world, rank).bind(dist.group.WORLD, rank)
        q, k, v, dout = (shard_sequence(t, 2, world, rank) for t in _inputs(case))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        doc, keep = (shard_sequence(t, 1, world, rank) for t in _wdp_masks(case.seq))
        blocks["forward"].clear()
        blocks["backward"].clear()
        out = OPS[case.op](q, k, v, comm, True, key_mask=keep, doc_ids=doc, window=case.window)
        out.backward(dout)
        results[case.name] = dict(members=tuple(range(world)), cp_rank=rank, out=out.detach(),
                                  dq=q.grad, dk=k.grad, dv=v.grad,
                                  blocks={w: list(b) for w, b in blocks.items()})
    return results


def _wdp_expected_blocks(case: Case, rank: int) -> dict:
    """The (queries, keys) of the blocks rank `rank` must compute, from the dense masks alone:
    ring, each (own query chunk, key chunk) pair in which causal & window & documents leave a
    key visible in some row (padding hides keys but skips no block); all-gather, per own query
    chunk, keys from the later of the first key chunk its documents reach and the first key its
    window reaches, to its own chunk's end."""
    cp, n = case.world, case.seq
    c = n // (2 * cp)
    seen = _wdp_dense(case, with_keep=False).any(0)[0]          # (n, n), any row
    same_doc = _wdp_dense(Case("", case.op, True, cp, seq=n, window=n + 1),
                          with_keep=False).any(0)[0]
    mine = load_balanced_indices(n, cp, rank).view(2, c)
    if case.op == "allgather":
        spans = []
        for rows in mine:
            first_doc = int(same_doc[rows].any(0).nonzero()[0]) // c * c
            lo = max(first_doc, int(rows[0]) - case.window + 1, 0)
            spans.append((c, int(rows[-1]) + 1 - lo))
        return {"forward": spans, "backward": spans}
    pairs = [(c, c) for step in range(cp) for rows in mine
             for cols in load_balanced_indices(n, cp, (rank - step) % cp).view(2, c)
             if seen[rows][:, cols].any()]
    return {"forward": pairs, "backward": pairs}


@pytest.mark.full                # two spawns, about 2 minutes on this machine
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", WDP, ids=lambda c: c.name)
def test_window_documents_and_padding_together_match_sdpa(spawn_cache, case):
    """The three masks at once against plain SDPA over the whole sequence with the dense mask
    (float64: output and dq, dk, dv), at cp=2 (chunks of 4) and cp=4, window 3 (shorter than a
    chunk) and 6 (across chunks); each rank's computed blocks, forward and backward, counted
    against the blocks the dense mask leaves a key visible in (ring) or the span its documents
    and window reach (all-gather). Every query sees a key (checked): no NaN in SDPA either."""
    from autopart.runtime.launch import spawn
    assert bool(_wdp_dense(case).any(-1).all()), "setup: a query that sees no key"
    key = ("cp_attention_wdp", case.world)
    cases = [c for c in WDP if c.world == case.world]
    if key not in spawn_cache:
        try:
            spawn_cache[key] = spawn(_wdp_run, case.world, cases, timeout=SPAWN_TIMEOUT,
                                     pg_timeout=PG_TIMEOUT)
        except Exception as e:  # noqa: BLE001  (every test of the spawn reports it)
            spawn_cache[key] = e
    if isinstance(spawn_cache[key], Exception):
        raise spawn_cache[key]
    per_rank = [r[case.name] for r in spawn_cache[key]]
    q, k, v, dout = (t.requires_grad_() for t in _inputs(case))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_wdp_dense(case), enable_gqa=True)
    want = dict(zip(("out", "dq", "dk", "dv"),
                    (ref.detach(), *torch.autograd.grad(ref, (q, k, v), dout))))
    mine = sorted(per_rank, key=lambda r: r["cp_rank"])
    for what in ("out", "dq", "dk", "dv"):
        got = unshard_sequence([r[what] for r in mine], 2, case.world)
        assert torch.isfinite(got).all(), what
        torch.testing.assert_close(got, want[what], rtol=1e-9, atol=1e-9,
                                   msg=lambda m: f"{case.name} {what}: {m}")
    for r in mine:
        assert r["blocks"] == _wdp_expected_blocks(case, r["cp_rank"]), \
            (case.name, r["cp_rank"], r["blocks"])
