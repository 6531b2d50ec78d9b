"""Models for tests/test_token_loss.py, registered in tests/workers/common.FAMILIES: losses that
are means over the tokens that count, written three ways.

    hf-labels   Hugging Face GPT-2 computing its own loss from `labels` (loss_fn=None): shifts
                them and takes cross_entropy(ignore_index=-100)
    masked-sum  a hand-written LM whose loss is sum(token_loss * mask) / mask.sum()
    ce-aux      the hand-written GPT's cross-entropy plus an auxiliary term (not separable: it
                keeps the microbatch-mean rule, with a warning)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.workers.common import FAMILIES, ignore_labels
from tests.workers.equivalence import run_cases

VOCAB = 128


class _HFLabels(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


class MaskedSumLM(nn.Module):
    """Embedding, two MLP blocks, head; the loss is the masked sum over the mask's sum."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 64),
                                                  nn.GELU(), nn.Linear(64, width))
                                    for _ in range(4))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x, y, mask):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        per_token = F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1),
                                    reduction="none")
        m = mask.reshape(-1).to(per_token.dtype)
        return (per_token * m).sum() / m.sum()


def ce_plus_aux(out, target):
    logits = out
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    return ce + 1e-3 * logits.float().pow(2).mean()


def build(case, seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
    y = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
    if case.ignored:
        y = ignore_labels(y, case.ignored)
    if case.model == "hf-labels":
        import transformers
        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, inputs = _HFLabels(transformers.GPT2LMHeadModel(cfg)), (x, y)
    else:   # masked-sum: the mask is where the labels count
        mask = (y != -100)
        model, inputs = MaskedSumLM(), (x, y.clamp(min=0), mask)
    return model.to(device), None, tuple(t.to(device) for t in inputs), None


FAMILIES.update({"hf-labels": build, "masked-sum": build})


def run_token_cases(rank: int, world: int, cases: list) -> list[dict]:
    return run_cases(rank, world, cases)
