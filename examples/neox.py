"""A decoder written from the published descriptions of GPT-J / GPT-NeoX (parallel attention and
MLP from one norm: x + attn(ln(x)) + mlp(ln(x))), BLOOM (ALiBi: no position embeddings, a
per-head linear penalty on distance added to the attention scores, Press et al. 2022) and
NeoX's fused query-key-value projection with interleaved heads (the output is viewed as
[B, T, heads, 3 * head_dim], so each head's q, k and v are adjacent). Attention is written out
(matmul, softmax in float32, matmul), as these codebases do. No parallel code inside.

    from examples.neox import NeoX, config
    logits = NeoX(config("tiny"))(tokens)        # tokens: int64[B, T]
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class NeoXConfig:
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 256
    max_seq_len: int = 64


def config(spec: str = "tiny") -> NeoXConfig:
    """'tiny' or 'tiny,n_layers=2': the default config with fields overridden."""
    _, *overrides = spec.split(",")
    return dataclasses.replace(NeoXConfig(), **{k: int(v) for k, v in
                                                (o.split("=") for o in overrides)})


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The geometric sequence 2^(-8/n), 2^(-16/n), ... (n a power of two), one slope per head."""
    start = 2.0 ** (-8.0 / n_heads)
    return torch.tensor([start ** (i + 1) for i in range(n_heads)])


class ParallelBlock(nn.Module):
    def __init__(self, cfg: NeoXConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.norm = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)          # interleaved: per head q | k | v
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.fc_in = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc_out = nn.Linear(4 * cfg.dim, cfg.dim)

    def attention(self, x, alibi, causal):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.n_heads, 3 * self.head_dim)
        q, k, v = qkv.permute(0, 2, 1, 3).split(self.head_dim, dim=-1)       # [B, H, T, D] each
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + alibi                                              # [H, T, T] broadcast
        scores = scores.masked_fill(causal, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(v)                 # float32 softmax
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.dense(y)

    def forward(self, x, alibi, causal):
        h = self.norm(x)
        return x + self.attention(h, alibi, causal) + self.fc_out(F.gelu(self.fc_in(h)))


class NeoX(nn.Module):
    def __init__(self, cfg: NeoXConfig | str = "tiny"):
        super().__init__()
        cfg = config(cfg) if isinstance(cfg, str) else cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(ParallelBlock(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        distance = (pos[None, :] - pos[:, None]).float()                    # j - i, [T, T]
        alibi = self.slopes[:, None, None] * distance[None]                  # [H, T, T]
        causal = pos[None, :] > pos[:, None]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, alibi, causal)
        return self.head(self.final_norm(x))
