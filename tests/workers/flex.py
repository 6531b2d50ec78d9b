"""An unmodified Hugging Face Llama with attn_implementation="flex_attention" fed packed
documents (tests/test_flex_attention.py), registered in tests/workers/common.FAMILIES on
import, and the spawned ranks' function that imports it first."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests.workers.common import FAMILIES
from tests.workers.cp import _token_loss, packed_batch
from tests.workers.equivalence import run_cases


def flex_llama(attention: str = "flex_attention"):
    """A small Llama from a config, random weights (GQA: 4 query heads, 2 key/value heads)."""
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation=attention)
    return transformers.LlamaForCausalLM(cfg)


class PackedHF(nn.Module):
    """Packed rows as Hugging Face's packed-sequence path takes them: token ids and
    position_ids restarting at 0 per document, no attention_mask; HF finds the documents from
    the positions (a new one wherever a position is not the previous one + 1) and masks each
    query to the earlier keys of its own document."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, pos):
        return self.model(input_ids=idx, position_ids=pos, use_cache=False).logits

    def plain_twin(self) -> "PackedHF":
        """The same model and weights with attn_implementation="sdpa", what the tests train as
        the plain model: torch refuses flex_attention's backward on the CPU in eager mode
        ("FlexAttention does not support backward on CPU", torch/nn/attention/
        flex_attention.py _validate_device), and HF's SDPA path builds the same document mask
        from the same position_ids."""
        twin = copy.deepcopy(self)
        twin.model.set_attn_implementation("sdpa")
        return twin


class DocMaskHF(nn.Module):
    """The remedy cp's refusal of flex_attention names: attn_implementation="sdpa", the
    documents given as ids and their mask passed as a 4-D attention_mask (HF passes it
    through), the positions as position_ids."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, doc, pos):
        t = idx.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        mask = (doc[:, :, None] == doc[:, None, :])[:, None] & causal
        return self.model(input_ids=idx, attention_mask=mask, position_ids=pos,
                          use_cache=False).logits


def _packed_batch(case, seed, device):
    """(token ids, doc, pos, labels) of packed rows, labels -100 on the padding."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 128, (case.batch, case.seq), generator=g)
    doc, pos = packed_batch(case.batch, case.seq, g)
    y = torch.randint(0, 128, (case.batch, case.seq), generator=g).masked_fill(doc < 0, -100)
    return x.to(device), doc.to(device), pos.to(device), y.to(device)


def _packed_flex(case, seed, device):
    x, _, pos, y = _packed_batch(case, seed, device)
    return PackedHF(flex_llama()).to(device), _token_loss, (x, pos), y


def _doc_mask_sdpa(case, seed, device):
    x, doc, pos, y = _packed_batch(case, seed, device)
    return DocMaskHF(flex_llama("sdpa")).to(device), _token_loss, (x, doc, pos), y


FAMILIES.setdefault("hf-flex-packed", _packed_flex)
FAMILIES.setdefault("hf-sdpa-doc-mask", _doc_mask_sdpa)


def run_flex_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: run_cases with this file's model registered."""
    return run_cases(rank, world, cases)
