"""Context-parallel attention as differentiable graph ops (ring attention and its all-gather form).

Each op takes a `CPComm`, a small module every context-parallel program holds as `self.cp_comm`;
the runtime binds it to this rank's context-parallel process group. Nothing here is global.

Causal load balancing: a sequence of S positions is cut into 2*cp chunks of S/(2*cp), and rank i
holds chunks i and 2*cp-1-i, concatenated in that order along the sequence dimension. Under a
causal mask an early chunk attends to few keys and a late one to many; pairing them gives every
rank the same work. `load_balanced_indices`, `shard_sequence` and `unshard_sequence` give that
layout (pure tensor functions, no communication).

    ring_attention          q, k, v of this rank's chunks, (batch, heads, local_seq, head_dim);
                            K/V travel around the ring peer to peer, one hop per step, while each
                            rank attends its queries to the block it holds; the partial results
                            are merged with their log-sum-exp. Backward by the same ring, the
                            dK/dV sums travelling with the K/V until they reach their owner.
    allgather_kv_attention  K/V all-gathered (in global order), local queries against the whole
                            sequence; backward reduce-scatters dK/dV to their owners.

Both take k, v with fewer heads than q (GQA/MQA: head h of q reads kv head h // (heads/kv_heads),
as SDPA's enable_gqa), compute scores and softmax in fp32 (fp64 for fp64 inputs), and return the
output in the inputs' dtype. Masks: causal or none, each with padded keys (`key_mask`) and/or
packed documents (`doc_ids`, cp_documents.py); a causal sliding window of `window` keys on top
(cp_window.py: blocks it hides entirely are skipped). Not supported (refused): other masks,
dropout, a sequence not divisible by 2*cp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.mesh import sequence_chunks
from autopart.ops.comm import GroupComm
from autopart.ops.cp_documents import block_bias, check_doc, doc_bits, doc_from_bits, key_span
from autopart.ops.cp_window import add_bias, check_window, first_key, window_block
from autopart.ops.registry import register
from autopart.ops.tp import _all_gather, _reduce_scatter


class CPComm(GroupComm):
    """This program's context-parallel group: size, this rank's index in it, the process group."""

    axis = "context-parallel"
    unbound_ok_when_alone = True   # one rank holds the whole sequence: nothing to exchange


# -- the load-balanced layout -------------------------------------------------------------------

def _chunk_len(seq_len: int, cp: int) -> int:
    n = sequence_chunks(cp)
    if cp < 1 or seq_len <= 0 or seq_len % n:
        raise ValueError(f"context parallelism cuts the sequence into 2*cp = {n} equal "
                         f"chunks (causal load balancing): a sequence of {seq_len} positions "
                         f"is not divisible by {n}; pad it to a multiple of {n}")
    return seq_len // n


def _chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The global chunk indices rank `rank` holds, in its local order."""
    return rank, sequence_chunks(cp) - 1 - rank


def _check_rank(rank: int, cp: int) -> None:
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in a context-parallel group of {cp}")


def load_balanced_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds, in its local order."""
    c = _chunk_len(seq_len, cp)
    _check_rank(rank, cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in _chunk_ids(rank, cp)])


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of `x` (the whole sequence along `dim`): chunks rank and 2*cp-1-rank."""
    c = _chunk_len(x.shape[dim], cp)
    _check_rank(rank, cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in _chunk_ids(rank, cp)], dim)


def unshard_sequence(chunks_list, dim: int, cp: int) -> torch.Tensor:
    """The whole sequence from every rank's part (`chunks_list[r]` from rank r), in global order."""
    if len(chunks_list) != cp:
        raise ValueError(f"unshard_sequence needs the parts of all {cp} ranks, got "
                         f"{len(chunks_list)}")
    local = chunks_list[0].shape[dim]
    if local % 2 or any(t.shape[dim] != local for t in chunks_list):
        raise ValueError(f"every rank's part holds two equal chunks along dim {dim}: lengths "
                         f"{[t.shape[dim] for t in chunks_list]}")
    pieces: list = [None] * sequence_chunks(cp)
    for rank, part in enumerate(chunks_list):
        for i, piece in zip(_chunk_ids(rank, cp), part.chunk(2, dim)):
            pieces[i] = piece
    return torch.cat(pieces, dim)


def _rank_major_to_global(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """An all-gathered tensor (rank 0's part, rank 1's, ...) in global sequence order."""
    return unshard_sequence(list(x.chunk(cp, dim)), dim, cp)


def _global_to_rank_major(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The inverse: what a reduce-scatter needs, rank r's part at block r."""
    return torch.cat([shard_sequence(x, dim, cp, r) for r in range(cp)], dim)


# -- attention of one block of queries against one block of keys -------------------------------

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # scores, softmax and the accumulators in fp32 at least: bf16/fp16 sums lose the tail
    return torch.promote_types(dtype, torch.float32)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads repeated for the query heads that read them (SDPA's enable_gqa order)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of the repeated kv heads summed back onto each kv head."""
    b, h, n, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def _scores(q, k, scale: float, causal: bool, bias=None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if bias is not None:            # (batch, 1, 1, keys): 0 or -inf, the padding of the keys
        s = s + bias
    if causal:
        # bottom-right aligned: the last query sees the last key. A diagonal ring block has
        # lq == lk; all-gather's chunk a has the keys of chunks 0..a, its own last.
        lq, lk = q.shape[-2], k.shape[-2]
        hidden = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fused(q, k, v) -> bool:
    """Can the block run as torch's fused CPU flash attention, which returns the log-sum-exp
    the ring merges with (5-10x faster than the matmuls below, forward and backward, measured
    at 4 heads x 1024 x 32)?"""
    return q.device.type == "cpu" and k.shape[-1] == v.shape[-1]


def _flash_mask(q, k, causal: bool, bias=None):
    """(is_causal, attn_mask) for the fused kernel: its causal mask is top-left aligned, ours
    bottom-right (the same on a square block); a wider block, or keys with padding (`bias`),
    get an additive mask."""
    lq, lk = q.shape[-2], k.shape[-2]
    if bias is None and (not causal or lq == lk):
        return causal, None
    mask = torch.zeros(lq, lk, dtype=q.dtype, device=q.device)
    if causal:
        hidden = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
        mask = mask.masked_fill(hidden, float("-inf"))
    return False, mask if bias is None else (mask + bias.to(q.dtype)).contiguous()


def _block_forward(q, k, v, scale: float, causal: bool, bias=None):
    """(out, lse) of one block. Without `bias` every query row sees at least one key (lk >= lq
    when causal); with it (padded keys) a row may see none: lse -inf, out 0, which _merge
    weighs 0."""
    if _fused(q, k, v):
        is_causal, mask = _flash_mask(q, k, causal, bias)
        out, lse = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        lse = lse.view(q.shape[:-1])
        if mask is not None and bias is not None:   # the kernel gives a row seeing no key lse 0
            lse = lse.masked_fill(torch.isneginf(mask).all(-1), float("-inf"))
    else:
        out, lse = _matmul_block_forward(q, k, v, scale, causal, bias)
    if bias is not None:
        out = torch.where(torch.isfinite(lse).unsqueeze(-1), out, 0.0)
    return out, lse


def _matmul_block_forward(q, k, v, scale: float, causal: bool, bias=None):
    """_block_forward by matmuls, any device (the fused kernel is CPU only)."""
    s = _scores(q, k, scale, causal, bias)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool, out=None,
                    bias=None):
    """(dq, dk, dv) of one block, its probabilities recomputed from the final lse: the block's
    share of the whole softmax, so the blocks' gradients simply add up (FlashAttention-2).
    `out` (the final output of these queries) lets the fused kernel compute delta itself."""
    if out is not None and _fused(q, k, v):
        is_causal, mask = _flash_mask(q, k, causal, bias)
        return _FLASH_CPU_BACKWARD(dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask,
                                   scale=scale)
    return _matmul_block_backward(q, k, v, dout, lse, delta, scale, causal, bias)


def _matmul_block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool, bias=None):
    """_block_backward by matmuls, any device."""
    p = torch.exp(_scores(q, k, scale, causal, bias) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _merge(acc, blk):
    """Two partial attentions over disjoint keys merged by their log-sum-exp."""
    if acc is None:
        return blk
    (out, lse), (b_out, b_lse) = acc, blk
    new = torch.logaddexp(lse, b_lse)
    seen = torch.isfinite(new)      # a row no key of either part was visible to (padding) stays 0

    def weight(x):
        return torch.where(seen, torch.exp(x - new), 0.0).unsqueeze(-1)
    return out * weight(lse) + b_out * weight(b_lse), new


def _visibility(q_chunk: int, k_chunk: int, causal: bool) -> str | None:
    """How a query chunk sees a key chunk, by their global indices: wholly, causally (the
    diagonal), or not at all (a later chunk under a causal mask: the block is skipped)."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "causal" if k_chunk == q_chunk else None


def _ring_block(qa: int, kb: int, c: int, causal: bool, window, key_bias, q_doc, k_doc, dtype,
                concrete: bool, device):
    """(seen, bias) of the ring block of query chunk qa against key chunk kb (global indices,
    chunks of c): seen None when the block is skipped (after the queries, hidden by the window,
    or disjoint documents), else "full" or "causal"; bias the padding's, documents' and
    window's additive masks together (None: none masks anything)."""
    seen = _visibility(qa, kb, causal)
    if seen is None:
        return None, None
    hidden, wbias = window_block(qa * c, c, kb * c, c, window, device, dtype)
    if hidden:
        return None, None
    skip, bias = block_bias(key_bias, q_doc, k_doc, dtype, concrete)
    return (None, None) if skip else (seen, add_bias(bias, wbias))


def _check_inputs(q, k, v, comm, scale, key_mask=None, doc_ids=None) -> float:
    """The softmax scale; ValueError for what these ops do not support."""
    check_doc(doc_ids, q)
    if key_mask is not None and tuple(key_mask.shape) != (q.shape[0], k.shape[2]):
        raise ValueError(f"key_mask must be (batch, local_seq) = {(q.shape[0], k.shape[2])}, "
                         f"got {tuple(key_mask.shape)}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("context-parallel attention takes q, k, v of shape (batch, heads, "
                         f"local_seq, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    b, h, n, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"k and v must match q's batch, local sequence and (k) head_dim: q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"the kv heads ({k.shape[1]}) must divide the query heads ({h})")
    _chunk_len(n * comm.size, comm.size)      # this rank's positions are two equal chunks
    return d ** -0.5 if scale is None else float(scale)


# -- the ring -----------------------------------------------------------------------------------

class _Shift:
    """One hop around the ring: `x` sent to the next rank, the previous rank's received into a
    new buffer, both posted at once (while this rank computes). The buffer is read only after
    wait() waited on every work of the batch (NCCL coalesces the batch into one work); the sent
    tensor is held until then (NCCL reads it whenever its kernel runs)."""

    def __init__(self, x: torch.Tensor, comm: CPComm, tag: int):
        self.sent = x.contiguous()
        self.received = torch.empty_like(self.sent)
        nxt = dist.get_global_rank(comm.group, (comm.rank + 1) % comm.size)
        prev = dist.get_global_rank(comm.group, (comm.rank - 1) % comm.size)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, self.sent, nxt, comm.group, tag),
            dist.P2POp(dist.irecv, self.received, prev, comm.group, tag)])

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


_KV_TAG, _GRAD_TAG = 0, 1      # two kinds of hop in flight at once in the backward


def _pack(*parts: torch.Tensor) -> torch.Tensor:
    """k and v (and the keys' padding), or dk and dv, as one flat buffer: one message per hop."""
    return torch.cat([t.reshape(-1).to(parts[0].dtype) for t in parts])


def _unpack(buf: torch.Tensor, *shapes):
    out, at = [], 0
    for shape in shapes:
        out.append(buf[at:at + shape.numel()].view(shape))
        at += shape.numel()
    return out


def _key_bias(keep: torch.Tensor, dtype) -> torch.Tensor:
    """(batch, 1, 1, keys) additive: 0 where a key is kept, -inf where it is padding."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
        keep == 0, float("-inf"))[:, None, None, :]


def _ring_steps(comm: CPComm) -> int:
    # shape only: one local step gives every shape (and the saved tensors) the ring would
    return comm.size if comm.moves_data else 1


def _held_kv(kv, k, v, heads: int, dtype, keep=None, doc=None):
    """The K/V block this step holds, heads expanded, cut into its two chunks, each chunk's
    key bias (None without padding) and document ids (None without documents)."""
    shapes = [k.shape, v.shape] + ([keep.shape] if keep is not None else []) + \
        ([doc_bits(doc, k.dtype).shape] if doc is not None else [])
    parts = _unpack(kv, *shapes)
    k_s, v_s = parts[:2]
    biases = _key_bias(parts[2], dtype).chunk(2, 3) if keep is not None else (None, None)
    docs = doc_from_bits(parts[-1], doc.shape).chunk(2, 1) if doc is not None else (None, None)
    return (_expand_heads(k_s.to(dtype), heads).chunk(2, 2),
            _expand_heads(v_s.to(dtype), heads).chunk(2, 2), biases, docs)


def _kv(k, v, keep, doc=None):
    """One message: k, v, the keys' padding, their document ids (bit for bit)."""
    return _pack(k, v, *([keep] if keep is not None else []),
                 *([doc_bits(doc, k.dtype)] if doc is not None else []))


def _q_docs(doc):
    return doc.chunk(2, 1) if doc is not None else (None, None)


def _ring_forward(q, k, v, comm: CPComm, causal: bool, scale: float, keep=None, doc=None,
                  window=None):
    cp, rank, heads = comm.size, comm.rank, q.shape[1]
    dtype = _compute_dtype(q.dtype)
    qs, qds = q.to(dtype).chunk(2, 2), _q_docs(doc)
    state = [None, None]                      # (out, lse) so far, per local query chunk
    kv = _kv(k, v, keep, doc)
    steps = _ring_steps(comm)
    for step in range(steps):
        # post the next hop first: the transfer runs while this block is computed
        hop = _Shift(kv, comm, _KV_TAG) if step < steps - 1 else None
        ks, vs, bs, kds = _held_kv(kv, k, v, heads, dtype, keep, doc)
        src = (rank - step) % cp               # whose K/V this rank holds at this step
        for i, qa in enumerate(_chunk_ids(rank, cp)):
            for j, kb in enumerate(_chunk_ids(src, cp)):
                seen, bias = _ring_block(qa, kb, qs[i].shape[2], causal, window, bs[j], qds[i],
                                         kds[j], dtype, comm.moves_data, q.device)
                if seen is not None:
                    blk = _block_forward(qs[i], ks[j], vs[j], scale, seen == "causal", bias)
                    state[i] = _merge(state[i], blk)
        if hop is not None:
            kv = hop.wait()
    out = torch.cat([state[0][0], state[1][0]], 2)
    return out, torch.cat([state[0][1], state[1][1]], 2)


def _ring_block_grads(qs, dos, lses, deltas, ks, vs, rank, src, comm, causal, scale, outs, bs,
                      qds, kds, window=None):
    """One step of the backward ring: this step's dq (per local query chunk), and the dk, dv
    that this rank's queries give the K/V it holds (rank src's)."""
    cp = comm.size
    dq = []
    dk = [torch.zeros_like(t) for t in ks]
    dv = [torch.zeros_like(t) for t in vs]
    for i, qa in enumerate(_chunk_ids(rank, cp)):
        dq_i = torch.zeros_like(qs[i])
        for j, kb in enumerate(_chunk_ids(src, cp)):
            seen, bias = _ring_block(qa, kb, qs[i].shape[2], causal, window, bs[j], qds[i],
                                     kds[j], qs[i].dtype, comm.moves_data, qs[i].device)
            if seen is not None:
                g = _block_backward(qs[i], ks[j], vs[j], dos[i], lses[i], deltas[i], scale,
                                    seen == "causal", outs[i], bias)
                dq_i, dk[j], dv[j] = dq_i + g[0], dk[j] + g[1], dv[j] + g[2]
        dq.append(dq_i)
    return dq, torch.cat(dk, 2), torch.cat(dv, 2)


def _ring_backward(q, k, v, out, lse, dout, comm: CPComm, causal: bool, scale: float,
                   keep=None, doc=None, window=None):
    cp, rank, heads = comm.size, comm.rank, q.shape[1]
    dtype = _compute_dtype(q.dtype)
    dout = dout.to(dtype)
    delta = (dout * out.to(dtype)).sum(-1)     # rowsum(dO * O): softmax's backward term
    qs, dos = q.to(dtype).chunk(2, 2), dout.chunk(2, 2)
    lses, deltas, outs = lse.chunk(2, 2), delta.chunk(2, 2), out.to(dtype).chunk(2, 2)
    dq, qds = [torch.zeros_like(t) for t in qs], _q_docs(doc)
    kv, sums, steps = _kv(k, v, keep, doc), None, _ring_steps(comm)
    for step in range(steps):
        hop = _Shift(kv, comm, _KV_TAG) if step < steps - 1 else None
        ks, vs, bs, kds = _held_kv(kv, k, v, heads, dtype, keep, doc)
        src = (rank - step) % cp
        dq_s, dk, dv = _ring_block_grads(qs, dos, lses, deltas, ks, vs, rank, src, comm,
                                         causal, scale, outs, bs, qds, kds, window)
        dq = [a + b for a, b in zip(dq, dq_s)]
        grads = _pack(_fold_heads(dk, k.shape[1]), _fold_heads(dv, v.shape[1]))
        if sums is not None:                   # the sums of the ranks this K/V passed before
            grads = grads + sums.wait()
        # pass the sums on with the K/V's path; after the last step the hop lands at the owner
        sums = _Shift(grads, comm, _GRAD_TAG) if steps > 1 else None
        if hop is not None:
            kv = hop.wait()
    grads = sums.wait() if sums is not None else grads
    dk, dv = _unpack(grads, k.shape, v.shape)
    return torch.cat(dq, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal, scale, keep, doc, window):
        comm._check()
        out, lse = _ring_forward(q, k, v, comm, causal, scale, keep, doc, window)
        out = out.to(q.dtype)
        ctx.comm, ctx.causal, ctx.scale, ctx.keep, ctx.doc = comm, causal, scale, keep, doc
        ctx.window = window
        ctx.save_for_backward(q, k, v, out, lse)   # lse: (batch, heads, local_seq), fp32
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, ctx.comm, ctx.causal, ctx.scale,
                                    ctx.keep, ctx.doc, ctx.window)
        return dq, dk, dv, None, None, None, None, None, None


# -- the all-gather form ------------------------------------------------------------------------

def _gather_kv(k, v, comm: CPComm):
    """The whole sequence's K and V, in global order (one all-gather of both)."""
    both = torch.cat([k, v], -1)
    if comm.size > 1:
        both = _rank_major_to_global(_all_gather(both, 2, comm), 2, comm.size)
    return both[..., :k.shape[-1]], both[..., k.shape[-1]:]


def _gather_keep(keep, comm: CPComm, dtype=torch.float32):
    """The whole sequence's key padding (batch, seq), or its document ids (dtype int64), in
    global order; or None."""
    if keep is None:
        return None
    x = keep.to(dtype)[:, None, :, None]
    if comm.size > 1:
        x = _rank_major_to_global(_all_gather(x, 2, comm), 2, comm.size)
    return x[:, 0, :, 0]


def _scatter_kv_grads(dk, dv, comm: CPComm):
    """Every rank's dK/dV of the whole sequence summed onto the owners of the positions."""
    both = torch.cat([dk, dv], -1)
    if comm.size > 1:
        both = _reduce_scatter(_global_to_rank_major(both, 2, comm.size), 2, comm)
    return both[..., :dk.shape[-1]], both[..., dk.shape[-1]:]


def _visible_keys(chunk: int, c: int, seq: int, causal: bool) -> int:
    """How many keys (a prefix of the sequence) global query chunk `chunk` attends to."""
    return (chunk + 1) * c if causal else seq


def _gathered_blocks(q, comm, causal, keep, doc, dtype, window=None):
    """Per local query chunk: (its global index, keys [lo, hi) it attends, their bias): the
    causal prefix, narrowed to the key chunks that hold its documents and to the keys its
    window reaches (the rest are hidden blocks, skipped), and the key padding's, documents' and
    window's additive mask over those keys."""
    c, seq = q.shape[2] // 2, q.shape[2] * comm.size
    keep, kdoc = _gather_keep(keep, comm), _gather_keep(doc, comm, torch.int64)
    bias = _key_bias(keep, dtype) if keep is not None else None
    out = []
    for qa, qd in zip(_chunk_ids(comm.rank, comm.size), _q_docs(doc)):
        n = _visible_keys(qa, c, seq, causal)
        lo, hi = key_span(qd, kdoc, c, n, comm.moves_data)
        lo, hi = (0, n) if hi <= lo else (lo, n if causal else hi)  # causal: the last is its own
        lo = max(lo, first_key(qa * c, window))
        kb = None if bias is None else bias[..., lo:hi]
        _, b = block_bias(kb, qd, None if kdoc is None else kdoc[:, lo:hi], dtype, False)
        _, wb = window_block(qa * c, c, lo, hi - lo, window, q.device, dtype)
        out.append((qa, lo, hi, add_bias(b, wb)))
    return out


class _AllGatherKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal, scale, keep, doc, window):
        comm._check()
        dtype, heads = _compute_dtype(q.dtype), q.shape[1]
        kf, vf = (_expand_heads(t.to(dtype), heads) for t in _gather_kv(k, v, comm))
        blocks = _gathered_blocks(q, comm, causal, keep, doc, dtype, window)
        outs, lses = [], []
        for (_, lo, hi, bias), q_chunk in zip(blocks, q.to(dtype).chunk(2, 2)):
            out, lse = _block_forward(q_chunk, kf[:, :, lo:hi], vf[:, :, lo:hi], scale, causal,
                                      bias)
            outs.append(out)
            lses.append(lse)
        out = torch.cat(outs, 2).to(q.dtype)
        ctx.comm, ctx.causal, ctx.scale, ctx.blocks = comm, causal, scale, blocks
        # only the local K/V are kept: the backward gathers them again (as gather_linear_sp)
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, 2))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, dtype, heads = ctx.comm, _compute_dtype(q.dtype), q.shape[1]
        kf, vf = (_expand_heads(t.to(dtype), heads) for t in _gather_kv(k, v, comm))
        dout = dout.to(dtype)
        delta = (dout * out.to(dtype)).sum(-1)
        dkf, dvf, dq = torch.zeros_like(kf), torch.zeros_like(vf), []
        parts = zip(ctx.blocks, q.to(dtype).chunk(2, 2), dout.chunk(2, 2), lse.chunk(2, 2),
                    delta.chunk(2, 2), out.to(dtype).chunk(2, 2))
        for (_, lo, hi, bias), q_chunk, do, ls, dl, o in parts:
            g = _block_backward(q_chunk, kf[:, :, lo:hi], vf[:, :, lo:hi], do, ls, dl,
                                ctx.scale, ctx.causal, o, bias)
            dq.append(g[0])
            dkf[:, :, lo:hi] += g[1]
            dvf[:, :, lo:hi] += g[2]
        dk, dv = _scatter_kv_grads(_fold_heads(dkf, k.shape[1]), _fold_heads(dvf, v.shape[1]),
                                   comm)
        return (torch.cat(dq, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None,
                None, None, None)


# -- the ops ------------------------------------------------------------------------------------

def ring_attention(q, k, v, comm, causal: bool, scale=None, key_mask=None, doc_ids=None,
                   window=None):
    """Attention of this rank's query chunks against the whole sequence, K/V passed around the
    ring of `comm`'s ranks; q, k, v: (batch, heads, local_seq, head_dim) in the load-balanced
    layout. The same result as SDPA over the whole sequence, in this rank's chunks.
    `key_mask` (batch, local_seq), this rank's chunks of a padding mask (non-zero: a key that
    may be attended to), travels with the K/V: SDPA's mask causal & key_mask[:, None, None, :].
    `doc_ids` (batch, local_seq), this rank's chunks of packed documents' ids, travel with the
    K/V too: SDPA's mask causal & (doc[:, :, None] == doc[:, None, :])[:, None], applied per
    block, a block of disjoint documents skipped (cp_documents.py).
    `window` (causal only): each query sees its last `window` keys, SDPA's mask causal &
    (i - j < window), applied per block from the chunks' global positions, a block the window
    hides skipped (cp_window.py)."""
    q, k, v = _autocast(q, k, v)
    scale = _check_inputs(q, k, v, comm, scale, key_mask, doc_ids)
    window = check_window(window, bool(causal))
    return _sdpa_layout(_RingAttention.apply(q, k, v, comm, bool(causal), scale, key_mask,
                                             doc_ids, window))


def allgather_kv_attention(q, k, v, comm, causal: bool, scale=None, key_mask=None,
                           doc_ids=None, window=None):
    """ring_attention's result by one all-gather of K/V (and one reduce-scatter of dK/dV):
    fewer, larger messages, and the whole sequence's K/V held at once (under a `window` each
    query chunk attends only to the keys its window reaches)."""
    q, k, v = _autocast(q, k, v)
    scale = _check_inputs(q, k, v, comm, scale, key_mask, doc_ids)
    window = check_window(window, bool(causal))
    return _sdpa_layout(_AllGatherKVAttention.apply(q, k, v, comm, bool(causal), scale,
                                                    key_mask, doc_ids, window))


def _autocast(q, k, v):
    """Under autocast, q, k and v in its dtype, as autocast casts SDPA's inputs (a model's K/V
    may reach attention in fp32 while its q comes from a bf16 linear)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


def _sdpa_layout(out: torch.Tensor) -> torch.Tensor:
    """`out` laid out in memory as SDPA lays out its result, (batch, seq, heads, dim) viewed as
    (batch, heads, seq, dim): a captured program that reshapes SDPA's output after a transpose
    has no .contiguous() (the export dropped it as a no-op for that layout)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def sequence_positions(comm, length, start=0, dtype=torch.int64, device=None):
    """The global positions of this rank's `length` local sequence positions, from `start`:
    what `arange(start, start + S)` gives the plain model, in this rank's chunks (i and
    2*cp-1-i of S = length * cp). Position ids, RoPE tables and embeddings then see the
    positions the plain model gives these tokens. A group of one, or a shape-only run: arange."""
    if comm.size == 1 or comm.shape_only:
        return torch.arange(start, start + length, dtype=dtype, device=device)
    c = length // 2
    first, second = (i * c + start for i in _chunk_ids(comm.rank, comm.size))
    return torch.cat([torch.arange(first, first + c, dtype=dtype, device=device),
                      torch.arange(second, second + c, dtype=dtype, device=device)])


register(ring_attention, allgather_kv_attention,
         kind="collective", axis="cp", namespace="autopart.cp_ops")
register(sequence_positions, kind="local", axis="cp", namespace="autopart.cp_ops")
