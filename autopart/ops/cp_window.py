"""A causal sliding window in context-parallel attention: the per-block window mask.

Under a window of w keys a query at global position i sees the keys j with 0 <= i - j < w
(Mistral, Gemma 2/3, GPT-OSS). The load-balanced layout is unchanged (rank r holds chunks r and
2*cp-1-r), so every block (queries at global positions [q0, q0 + lq), keys at [k0, k0 + lk)) is
decided from those positions alone: integers on the host, no data and no device sync, the same
in a shape-only run as in a real one.

- every key of the block at least w before every query: the block is skipped (no matmul);
- every key within w of every query: no window mask (the block's causal shape, if any, stays);
- otherwise an additive (lq, lk) mask, -inf where i - j >= w, added to the block's other masks
  (padding, documents). A row of such a block may see no key; the blocks' shared path for that
  (log-sum-exp -inf, output 0, weighed 0 by the merge) keeps it finite.

Causality is the block's own (the kernels' `causal`): a window is only accepted with it.
"""
from __future__ import annotations

import torch

NEG = float("-inf")


def check_window(window, causal: bool) -> int | None:
    """`window` as an int (None: no window); ValueError for what the kernels do not compute."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive number of keys, got {window!r}")
    if not causal:
        raise ValueError(f"a sliding window ({window} keys) is computed on causal attention "
                         "only (each query sees its last `window` keys): pass causal=True")
    return window


def window_block(q0: int, lq: int, k0: int, lk: int, window: int | None, device, dtype):
    """(skip, bias) of the block of queries at global positions [q0, q0 + lq) against keys at
    [k0, k0 + lk): skip when the window hides all of it; bias (lq, lk), -inf where the key is
    `window` or more positions before the query, or None when the window hides none of it."""
    if window is None:
        return False, None
    nearest = q0 - (k0 + lk - 1)          # the smallest query - key distance in the block
    farthest = q0 + lq - 1 - k0
    if nearest >= window:
        return True, None
    if farthest < window:
        return False, None
    dist = torch.arange(q0, q0 + lq, device=device)[:, None] - \
        torch.arange(k0, k0 + lk, device=device)[None, :]
    return False, torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill(dist >= window, NEG)


def first_key(q0: int, window: int | None) -> int:
    """The first key any query from global position q0 on may see (all-gather narrows its keys
    to start there)."""
    return 0 if window is None else max(0, q0 - window + 1)


def add_bias(a, b):
    """Two additive masks (either None) as one; they broadcast ((batch, 1, 1, lk) padding,
    (batch, 1, lq, lk) documents, (lq, lk) window)."""
    if a is None or b is None:
        return b if a is None else a
    return a + b
