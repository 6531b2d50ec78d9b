"""examples/llama.py (Llama 3 in today's style) for tests/test_llama_example.py: its `tiny`
config registered as the case model `llama3` (and `llama3-mha`, one k/v head per query head),
returning logits scored by the example's own lm_loss, and the rank function that runs the
equivalence cases with it registered."""
from __future__ import annotations

import torch

from tests.workers import common
from tests.workers.equivalence import run_cases, run_group

SPECS = {"llama3": "tiny", "llama3-mha": "tiny-mha"}


def build_llama(case, seed: int = 0, device: str = "cpu"):
    """(model, loss_fn, inputs, target) of a case, identical in every process."""
    from examples.llama import Llama, config, lm_loss
    torch.manual_seed(seed)
    model = Llama(config(SPECS[case.model]))
    g = torch.Generator().manual_seed(seed + 1)
    vocab = model.config.vocab_size
    x, y = (torch.randint(0, vocab, (case.batch, case.seq), generator=g) for _ in range(2))
    return model.to(device), lm_loss, (x.to(device),), y.to(device)


common.FAMILIES.update({name: build_llama for name in SPECS})


def run_llama_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: tests.workers.equivalence.run_cases, the Llama models registered."""
    return run_cases(rank, world, cases)


def run_llama_group(cache: dict, key, cases: list) -> dict:
    """run_group for the Llama cases: one spawn per world size, once per session."""
    return run_group(cache, key, cases, rank_fn=run_llama_cases)
