"""A Llama in the style of Meta's first release (Touvron et al. 2023), written small from its
published description: pre-norm RMSNorm written by hand, rotary position embeddings applied as a
complex multiplication (`view_as_complex`, `view_as_real`, `flatten`, computed in float32 then cast
back with `type_as`), grouped-query attention with k/v repeated by `expand` + `reshape`, and a
SwiGLU feed-forward. No parallel code inside.

    from examples.llama_meta import Llama, config, lm_loss
    model = Llama(config("tiny"))
    loss = lm_loss(model(tokens), targets)       # tokens, targets: int64[B, T]
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None      # None: as many as query heads
    vocab_size: int = 256
    multiple_of: int = 32              # the SwiGLU hidden size is rounded up to this
    norm_eps: float = 1e-5
    max_seq_len: int = 64
    rope_theta: float = 10000.0


CONFIGS = {
    "tiny": LlamaConfig(),
    "tiny-gqa": LlamaConfig(n_kv_heads=2),
    "llama-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000,
                            multiple_of=256, max_seq_len=2048),
}


def config(spec: str = "tiny") -> LlamaConfig:
    """'tiny' or 'tiny,n_layers=4,n_kv_heads=2': a named config with fields overridden."""
    name, *overrides = spec.split(",")
    cfg = CONFIGS[name]
    fields = {f.name: f.type for f in dataclasses.fields(cfg)}
    changes = {}
    for item in overrides:
        key, value = item.split("=")
        changes[key] = None if value == "none" else (float(value) if "." in value else int(value))
    assert set(changes) <= set(fields), f"unknown fields {set(changes) - set(fields)}"
    return dataclasses.replace(cfg, **changes)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalised in float32, as the reference does, then cast back
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """complex64 [end, head_dim/2]: e^{i t theta^(-2j/d)}."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, head_dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    """Rotate pairs of features of q and k [B, T, H, D] by complex multiplication."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))   # [B, T, H, D/2]
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])               # broadcast over B, H
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, T, Hkv*n_rep, D], each kv head repeated n_rep times."""
    if n_rep == 1:
        return x
    b, t, h, d = x.shape
    return x[:, :, :, None, :].expand(b, t, h, n_rep, d).reshape(b, t, h * n_rep, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        xq = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        xk = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        rep = self.n_heads // self.n_kv_heads
        keys, values = repeat_kv(xk, rep), repeat_kv(xv, rep)
        q, k, v = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().reshape(b, t, -1)     # reshape after transpose
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hidden = int(2 * (4 * cfg.dim) / 3)
        hidden = cfg.multiple_of * ((hidden + cfg.multiple_of - 1) // cfg.multiple_of)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))       # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig | str = "tiny"):
        super().__init__()
        cfg = config(cfg) if isinstance(cfg, str) else cfg
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # a buffer, not a parameter: the rotation table is the same on every rank
        self.register_buffer("freqs_cis", precompute_freqs_cis(
            cfg.dim // cfg.n_heads, cfg.max_seq_len * 2, cfg.rope_theta), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tok_embeddings(tokens)                     # [B, T, dim]
        freqs_cis = self.freqs_cis[:t]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()           # logits [B, T, vocab]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
