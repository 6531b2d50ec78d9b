"""A stateful loader that reads from a token file only this rank's share of each global batch.

    loader = TokenLoader("corpus.tokens", seq=64, global_batch=16, shard=pm.batch_shard, seed=0)
    for batch in loader:                              # this rank's rows and sequence chunks
        loss = pm.train_step(*batch.inputs, target=batch.target, local=True)
    pm.save("ckpt", optimizer=opt, loader=loader)     # the position goes with the checkpoint

The samples. The corpus's tokens are cut into `(tokens - 1) // seq` windows of seq + 1 tokens,
window i starting at token i * seq (inputs its first seq tokens, targets its last seq: the next
token of each). Epoch e visits every window once, in the order of
`numpy.random.default_rng([seed, e]).permutation(windows)`; the stream of samples is epoch 0's
order, then epoch 1's, and so on. Global step t's batch is samples t*B .. t*B + B - 1 of that
stream (B = global_batch), row j being sample t*B + j. Nothing of it depends on the mesh, so
the stream is the same on every mesh, and a checkpoint made on one resumes on another.

A rank's share. `shard` (autopart's `pm.batch_shard`) names the rows of the global batch this
rank's train_step reads, the equal sequence chunks of each row (context parallelism's load-
balanced layout: chunks i and 2cp-1-i), and whether it reads inputs, targets, both or neither.
The loader reads from the file exactly those tokens: per row and chunk, the chunk's seq/n
tokens of inputs and, for targets, the same range shifted by one (both: one read of seq/n + 1
tokens). A middle pipeline stage reads nothing. `shard=None` is the whole global batch (the
plain model's, one process).

The state is the position in the stream (`samples_seen`), with what fixes the stream (seed,
seq, the corpus's size and dtype), the same on every rank: `state_dict()` / `load_state_dict()`,
saved by `pm.save(..., loader=)` and restored by `pm.load(..., loader=)`.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from autopart.errors import AutopartError

from .tokens import TokenFile


class Batch(NamedTuple):
    """One step's share, as `pm.local_batch(tokens, target=targets)` gives it: `inputs` the
    tuple to unpack into train_step, `(tokens,)` or `(None,)` where this rank reads no input;
    `target` the targets or None; `step` the 0-based global step it belongs to."""
    inputs: tuple
    target: torch.Tensor | None
    step: int


class SampleOrder:
    """The stream of sample indices: window numbers, epoch by epoch in a seeded permutation."""

    def __init__(self, windows: int, seed: int):
        self.windows, self.seed = windows, seed
        self._epoch, self._perm = -1, None

    def __getitem__(self, k: int) -> int:
        epoch, offset = divmod(k, self.windows)
        if epoch != self._epoch:     # one permutation held at a time: 8 bytes per window
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._epoch = epoch
        return int(self._perm[offset])


class TokenLoader:
    """Yields `Batch`es of this rank's share of consecutive global batches (see the module)."""

    def __init__(self, corpus: str | os.PathLike | TokenFile, seq: int, global_batch: int,
                 shard=None, seed: int = 0, device: str | torch.device = "cpu"):
        self.corpus = corpus if isinstance(corpus, TokenFile) else TokenFile(corpus)
        self.seq, self.global_batch, self.seed = seq, global_batch, seed
        self.device = torch.device(device)
        self.shard = shard
        windows = (len(self.corpus) - 1) // seq if seq > 0 else 0
        _check(self.corpus, seq, global_batch, shard, windows)
        self.order = SampleOrder(windows, seed)
        self.samples_seen = 0

    # -- the stream ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The global step the next batch belongs to (0-based)."""
        return self.samples_seen // self.global_batch

    @property
    def epoch(self) -> int:
        return self.samples_seen // self.order.windows

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.samples_seen)
        self.samples_seen += self.global_batch
        return batch

    def batch_at(self, first: int) -> Batch:
        """This rank's share of the global batch whose row 0 is sample `first` of the stream."""
        rows, chunks, total, want_x, want_y = self._layout()
        n = self.seq // total
        xs, ys = [], []
        for r in rows:
            start = self.order[first + r] * self.seq
            x_parts, y_parts = [], []
            for c in chunks:
                a = start + c * n
                if want_x and want_y:           # one read covers both: n + 1 tokens
                    w = self.corpus.read(a, a + n + 1)
                    x_parts.append(w[:-1])
                    y_parts.append(w[1:])
                elif want_x:
                    x_parts.append(self.corpus.read(a, a + n))
                elif want_y:
                    y_parts.append(self.corpus.read(a + 1, a + n + 1))
            xs.append(np.concatenate(x_parts) if x_parts else None)
            ys.append(np.concatenate(y_parts) if y_parts else None)
        x = self._tensor(xs) if want_x else None
        y = self._tensor(ys) if want_y else None
        return Batch(inputs=(x,), target=y, step=first // self.global_batch)

    def _layout(self):
        s = self.shard
        if s is None:
            return range(self.global_batch), (0,), 1, True, True
        return s.rows, s.seq_chunks, s.seq_chunks_total, s.needs_inputs, s.needs_targets

    def _tensor(self, rows: list) -> torch.Tensor:
        if not rows:
            return torch.zeros(0, self.seq, dtype=torch.long, device=self.device)
        return torch.from_numpy(np.stack(rows)).to(self.device)

    @property
    def bytes_read(self) -> int:
        """Bytes this loader's reads took from the token file so far."""
        return self.corpus.bytes_read

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position in the stream and what fixes the stream; the same on every rank."""
        return {"samples_seen": self.samples_seen, "seed": self.seed, "seq": self.seq,
                "global_batch": self.global_batch, "corpus": self.corpus.describe()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position. The stream must be the same (seed, seq, corpus); the
        global batch may differ (the stream is counted in samples)."""
        if not isinstance(state, dict) or "samples_seen" not in state:
            raise AutopartError(f"TokenLoader.load_state_dict: {type(state).__name__} is not a "
                                "TokenLoader state (no 'samples_seen').\n  remedy: pass what "
                                "loader.state_dict() returned, or pm.load(path, loader=loader)")
        mine = self.state_dict()
        for key in ("seed", "seq", "corpus"):
            if state.get(key) != mine[key]:
                raise AutopartError(
                    f"TokenLoader.load_state_dict: the saved loader's {key} is "
                    f"{state.get(key)!r}, this one's is {mine[key]!r}: resuming would give "
                    "another sequence of samples.\n  remedy: build the loader with the saved "
                    f"corpus, seq and seed ({state.get('corpus')}, seq={state.get('seq')}, "
                    f"seed={state.get('seed')})")
        self.samples_seen = int(state["samples_seen"])


def _check(corpus: TokenFile, seq: int, global_batch: int, shard, windows: int) -> None:
    if not isinstance(seq, int) or seq < 1 or not isinstance(global_batch, int) \
            or global_batch < 1:
        raise AutopartError(f"TokenLoader: seq={seq!r} and global_batch={global_batch!r} must "
                            "be positive integers")
    if windows < 1:
        raise AutopartError(f"TokenLoader: {corpus.path} holds {len(corpus)} tokens, fewer than "
                            f"one sample of seq + 1 = {seq + 1}.\n  remedy: a longer corpus, or "
                            f"seq <= {max(len(corpus) - 1, 0)}")
    if shard is None:
        return
    total = shard.seq_chunks_total
    if seq % total:
        raise AutopartError(f"TokenLoader: seq={seq} does not divide into the "
                            f"{total} sequence chunks this rank's shard is cut in (context "
                            f"parallelism: 2*cp).\n  remedy: seq a multiple of {total}")
    bad = [r for r in shard.rows if not 0 <= r < global_batch]
    if bad:
        raise AutopartError(f"TokenLoader: the shard names rows {bad[:4]} of a global batch of "
                            f"{global_batch}.\n  remedy: global_batch= the batch the model was "
                            "compiled for (pm.compiled.plan.global_batch)")
