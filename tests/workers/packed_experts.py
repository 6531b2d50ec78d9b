"""Packed documents through a mixture-of-experts model (tests/test_packed_experts.py): an
unmodified Hugging Face Mixtral (4 experts, top-2, random weights from a small config) given a
document mask and per-document positions, registered in tests/workers/common.FAMILIES on import,
and the spawned ranks' function that imports it first."""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.workers.common import FAMILIES
from tests.workers.cp import _token_loss, packed_batch
from tests.workers.equivalence import run_cases


class PackedMixtral(nn.Module):
    """Mixtral on packed rows: (ids, doc, pos) -> logits. The attention mask is built from the
    documents' ids (causal within each document, a (batch, 1, seq, seq) boolean mask, which
    Hugging Face's masking takes as given) and RoPE reads `pos`, each document's positions
    from 0. The experts route every token, padding included, as the plain model does."""

    def __init__(self):
        super().__init__()
        from tests.workers.moe import hf_moe
        self.model = hf_moe("hf-mixtral")

    def forward(self, idx, doc, pos):
        t = idx.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        mask = (doc[:, :, None] == doc[:, None, :])[:, None] & causal
        return self.model(input_ids=idx, attention_mask=mask, position_ids=pos,
                          use_cache=False).logits


def _packed_mixtral(case, seed, device):
    """Rows packed with documents of random lengths (the last row ends in padding: id -1,
    labels -100), and the per-token mean loss over the labelled tokens."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 128, (case.batch, case.seq), generator=g)
    doc, pos = packed_batch(case.batch, case.seq, g)
    y = torch.randint(0, 128, (case.batch, case.seq), generator=g).masked_fill(doc < 0, -100)
    return PackedMixtral().to(device), _token_loss, \
        (x.to(device), doc.to(device), pos.to(device)), y.to(device)


FAMILIES.setdefault("packed-mixtral", _packed_mixtral)


def run_packed_expert_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: run_cases with this file's model registered."""
    return run_cases(rank, world, cases)
