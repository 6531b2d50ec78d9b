"""Rank functions and models for tests/test_layers_by_dataflow.py (and layers no module names,
Unnamed, for the compiled segments and recomputation): Hugging Face Whisper (an
encoder of conv stem + layers, a decoder whose layers all read the encoder's output), built from
its own config with random weights (no download), registered as the family "whisper" of the
equivalence harness (tests/workers/equivalence.py) in every process that imports this module.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.workers import common
from tests.workers.equivalence import run_cases, run_group
from tests.workers.family import logits_loss

VOCAB = 128
MELS = 8


def whisper_config():
    """Whisper's architecture, shrunk: 4 encoder and 4 decoder layers as whisper-tiny, width 32,
    128 tokens, a decoder MLP twice the encoder's (so a decoder layer holds twice an encoder
    layer's parameters, and a pp=2 cut at the encoder's end leaves one rank ~2/3 of them); 32
    audio frames (16 positions after the stride-2 conv, as many as the decoder's tokens: a
    layer's compute follows its parameters, so a cut by cost splits them evenly), no dropout."""
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MELS, d_model=32, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=128, max_source_positions=16, max_target_positions=16, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
        begin_suppress_tokens=None)


class Unnamed(nn.Module):
    """Layers without a module of their own: each block's weights sit in ParameterLists and a
    loop applies them with functional ops, so every op's module is the root and detect_layers
    names the layers it finds by dataflow layer.0 .. layer.3 (no module path names them)."""

    def __init__(self, width: int = 16, n: int = 4):
        super().__init__()
        self.inp = nn.Linear(width, width)     # layer 0's input requires grad, as the others'
        self.up = nn.ParameterList(nn.Parameter(torch.randn(2 * width, width) * 0.1)
                                   for _ in range(n))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(width, 2 * width) * 0.1)
                                     for _ in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.inp(x)
        for up, down in zip(self.up, self.down):
            x = x + F.linear(torch.tanh(F.linear(x, up)), down)
        return self.head(x).pow(2).mean()


class Whisper(torch.nn.Module):
    """WhisperForConditionalGeneration called with (audio features, decoder tokens): its logits."""

    def __init__(self, cfg):
        import transformers
        super().__init__()
        self.model = transformers.WhisperForConditionalGeneration(cfg)

    def forward(self, features, decoder_input_ids):
        return self.model(input_features=features, decoder_input_ids=decoder_input_ids).logits


def build_whisper(case, seed: int = 0, device: str = "cpu"):
    """(model, loss_fn, inputs, target), identical in every process."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    cfg = whisper_config()
    model = Whisper(cfg)
    features = torch.randn(case.batch, MELS, 2 * cfg.max_source_positions, generator=g)
    tokens = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
    target = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
    inputs = (features.to(device), tokens.to(device))
    return model.to(device), logits_loss, inputs, target.to(device)


common.FAMILIES["whisper"] = build_whisper


def run_layer_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: the equivalence harness, in a process where "whisper" is registered."""
    return run_cases(rank, world, cases)


def run_layer_group(cache: dict, key, cases: list) -> dict:
    """run_group with this module's rank function: one spawn per key, once per session."""
    return run_group(cache, key, cases, rank_fn=run_layer_cases)
