"""Packed documents in context-parallel attention: the per-block document mask.

A row packs several documents; `doc` (batch, seq) gives each token's document id, and a query
sees a key only within its document: SDPA's mask `doc[:, :, None] == doc[:, None, :]` (and
causal). Under cp each rank holds its chunks of `doc` as it holds the tokens' (load-balanced),
so for one block of queries (chunk a) against keys (chunk b) the mask is the equality of the
two chunks' ids, on top of the block's causal shape. The ring passes the key chunk's ids with
its K/V (bit for bit in the same message: ids are exact in any dtype); all-gather gathers them.

Empty blocks are skipped without a matmul: when, in every batch row, the two chunks' id ranges
(min..max) do not meet, no query of the block sees any key. A block whose chunks hold one and
the same document in every row needs no mask at all (the fused kernel's causal path). Both are
decided from the ranges on the host (one small copy per block); a shape-only run (compile-time
fake tensors) decides nothing and masks every block.
"""
from __future__ import annotations

import torch

NEG = float("-inf")


def doc_bits(doc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`doc` as int64, its bytes viewed as `dtype`: what rides in a K/V message bit for bit
    (a bf16 buffer would round ids above 256)."""
    return doc.to(torch.int64).contiguous().view(-1).view(dtype)


def doc_from_bits(bits: torch.Tensor, shape) -> torch.Tensor:
    return bits.contiguous().view(torch.int64).view(shape)


def decide(q_doc, k_doc, concrete: bool) -> tuple[bool, bool]:
    """(empty, one document) of the block whose queries have ids `q_doc` and keys `k_doc`,
    both (batch, n): empty when no row's id ranges meet; one document when every row's two
    chunks hold a single shared id. (False, False) when the values are not known (`concrete`
    False: a shape-only run)."""
    if not concrete:
        return False, False
    ql, qh = torch.aminmax(q_doc, dim=-1)
    kl, kh = torch.aminmax(k_doc, dim=-1)
    empty = ((kh < ql) | (kl > qh)).all()
    one = ((ql == qh) & (kl == kh) & (ql == kl)).all()
    empty, one = torch.stack([empty, one]).tolist()
    return bool(empty), bool(one)


def doc_bias(q_doc, k_doc, dtype) -> torch.Tensor:
    """(batch, 1, lq, lk) additive: 0 where query and key share a document, -inf elsewhere."""
    same = q_doc[:, None, :, None] == k_doc[:, None, None, :]
    return torch.zeros(same.shape, dtype=dtype, device=same.device).masked_fill(~same, NEG)


def block_bias(key_bias, q_doc, k_doc, dtype, concrete: bool):
    """(skip, bias) of one block: skip when it is empty; bias the key padding's (batch, 1, 1,
    lk) and the documents' (batch, 1, lq, lk) added, or None when neither masks anything."""
    if q_doc is None:
        return False, key_bias
    empty, one = decide(q_doc, k_doc, concrete)
    if empty:
        return True, None
    if one:
        return False, key_bias
    bias = doc_bias(q_doc, k_doc, dtype)
    return False, bias if key_bias is None else bias + key_bias


def key_span(q_doc, k_doc, chunk: int, n_keys: int, concrete: bool) -> tuple[int, int]:
    """[lo, hi): the keys among the first `n_keys` (whole chunks of `chunk`) that one query
    chunk may see: from the first key chunk whose ids meet the queries' to the last one (the
    chunks outside hold other documents in every row; all-gather skips them)."""
    if not concrete or q_doc is None:
        return 0, n_keys
    meets = [not decide(q_doc, k_doc[:, s:s + chunk], True)[0]
             for s in range(0, n_keys, chunk)]
    if not any(meets):
        return 0, 0
    first = meets.index(True)
    last = len(meets) - meets[::-1].index(True)
    return first * chunk, last * chunk


def check_doc(doc, q) -> None:
    if doc is not None and tuple(doc.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"doc_ids must be (batch, local_seq) = {(q.shape[0], q.shape[2])}, "
                         f"got {tuple(doc.shape)}")
    if doc is not None and (doc.is_floating_point() or doc.is_complex()):
        raise ValueError(f"doc_ids must be integer document ids, got {doc.dtype}")
