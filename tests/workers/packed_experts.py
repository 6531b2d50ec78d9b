"""Packed documents through a mixture-of-experts model (tests/test_packed_experts.py): an
unmodified Hugging Face Mixtral (4 experts, top-2, random weights from a small config) given a
document mask and per-document positions, registered in tests/workers/common.FAMILIES on import,
and the spawned ranks' function that imports it first."""
from __future__ import annotations

from tests.workers.common import FAMILIES
from tests.workers.cp import _token_loss
from tests.workers.equivalence import run_cases


def _packed_mixtral(case, seed, device):
    """Mixtral on packed rows: (ids, doc, pos) -> logits, through tests/workers/flex.py's
    DocMaskHF (the document mask, causal within each document, built from `doc` and passed as
    a 4-D attention_mask, which Hugging Face takes as given; RoPE reads `pos`, each document's
    positions from 0). Rows packed with documents of random lengths, the last row's tail
    padding (id -1, labels -100); the per-token mean loss. The experts route every token,
    padding included, as the plain model does."""
    import transformers

    from tests.workers.flex import DocMaskHF, _packed_batch
    from tests.workers.moe import hf_moe
    transformers.logging.set_verbosity_error()
    x, doc, pos, y = _packed_batch(case, seed, device)
    return DocMaskHF(hf_moe("hf-mixtral")).to(device), _token_loss, (x, doc, pos), y


FAMILIES.setdefault("packed-mixtral", _packed_mixtral)


def run_packed_expert_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: run_cases with this file's model registered."""
    return run_cases(rank, world, cases)
