"""A model that writes into views of tensors it made in forward, the ways real models do.

Per-document positions for packed sequences are written with slice assignment; a padding mask
with `masked_fill_`; a per-row weight with `index_put_`; an activation's first position with a
`copy_` into a slice; and a tensor made from the inputs alone (so every pipeline chunk could
recompute it) is written from an activation, so no chunk but the writer's may recompute it.
torch.export keeps every one of them as an in-place node with no users.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.workers import common
from tests.workers.equivalence import run_cases, run_group

VOCAB, WIDTH = 64, 32


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h, weight):
        return h + self.down(F.gelu(self.up(h))) * weight[..., None]


def doc_positions(doc: torch.Tensor) -> torch.Tensor:
    """Each token's position within its own document (restarting where the document id changes)."""
    start = torch.ones_like(doc, dtype=torch.bool)
    start[:, 1:] = doc[:, 1:] != doc[:, :-1]                       # copy_ into a slice
    idx = torch.arange(doc.shape[1], device=doc.device).expand_as(doc)
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(1).values
    pos = idx - first
    pos.masked_fill_(doc < 0, 0)                                    # padding: position 0
    return pos


class PackedDocs(nn.Module):
    def __init__(self, n_layer: int = 4, width: int = WIDTH, vocab: int = VOCAB, seq: int = 16):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(n_layer))
        self.gate = nn.Linear(width, 1)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(doc_positions(doc))
        weight = torch.ones(doc.shape, dtype=h.dtype, device=doc.device)
        rows = torch.arange(doc.shape[0], device=doc.device)
        weight.index_put_((rows, torch.zeros_like(rows)), torch.full_like(rows, 0.5, dtype=h.dtype))
        h = h.clone()
        h[:, 0] = h[:, 0] * 2.0                                     # an activation's slice
        # made from the inputs alone, then written from an activation: not recomputable
        gate = torch.ones_like(weight)
        gate[:, 1:2] = torch.sigmoid(self.gate(h[:, 1:2])).squeeze(-1)
        for i, block in enumerate(self.blocks):
            h = block(h, weight if i % 2 else gate)
        return self.head(h)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def build(case, seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
    y = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
    doc = torch.cumsum(torch.rand(case.batch, case.seq, generator=g) < 0.25, dim=1)
    doc[:, -2:] = -1                                                # trailing padding
    model = PackedDocs(seq=case.seq).to(device)
    return model, lm_loss, (x.to(device), doc.to(device)), y.to(device)


common.FAMILIES["packed-docs"] = build


def run_view_write_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: run_cases with this model registered in the rank process."""
    return run_cases(rank, world, cases)


def run_view_write_group(cache: dict, key, cases: list) -> dict:
    return run_group(cache, key, cases, rank_fn=run_view_write_cases)
