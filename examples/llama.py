"""A Llama 3 written as models are written today: grouped-query attention through
`F.scaled_dot_product_attention` (is_causal, so GPUs run it fused), rotary embeddings in the
half-split form Hugging Face uses (`rotate_half`, cos/sin tables), `nn.RMSNorm`, a SwiGLU
feed-forward and an output projection untied from the embedding. No parallel code inside.

    from examples.llama import Llama, config, lm_loss
    model = Llama(config("tiny"))
    loss = model(tokens, targets)                # tokens, targets: int64[B, T]
    loss = lm_loss(model(tokens), targets)       # the same, from the logits

Named configs: `tiny` and `tiny-mha` (CPU tests), and the published shapes of Llama 3
(Dubey et al. 2024, Table 3): `llama3-8b`, `llama3-70b` and `llama3-405b` (vocabulary 128256,
8 k/v heads, rotary base 500000, sequence 8192). The large ones are built on the meta device
by autopart's command line (`autopart plan examples/llama.py:Llama --config llama3-405b ...`).

The fields follow examples/gpt.py's names (n_layer, n_head, n_embd, block_size), so
`--config llama3-70b,n_layer=8` and `autopart plan --seq N` work as they do for the GPT.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2          # grouped-query attention: n_head // n_kv_head queries per k/v
    n_embd: int = 64
    ffn_hidden: int = 192       # SwiGLU's inner width (Llama 3: about 3.5 n_embd)
    vocab_size: int = 256
    block_size: int = 64        # the sequence length the rotary tables cover
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head size n_embd/n_head={self.n_embd // self.n_head} is odd: "
                             "rotary embeddings rotate pairs of features; use an even head size")
        if self.n_head % self.n_kv_head:
            ok = [k for k in range(1, self.n_head + 1) if self.n_head % k == 0]
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head="
                             f"{self.n_kv_head}; use n_kv_head in {ok}")

    def n_params(self) -> int:
        """Parameter count: per layer q, k, v, o, three SwiGLU matrices and two norms; the
        embedding, the final norm and the untied output projection."""
        h, kv = self.n_embd, self.n_kv_head * (self.n_embd // self.n_head)
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.ffn_hidden + 2 * h
        return self.n_layer * per_layer + 2 * self.vocab_size * h + h


def _llama3(n_layer: int, n_embd: int, n_head: int, ffn_hidden: int) -> LlamaConfig:
    return LlamaConfig(n_layer=n_layer, n_head=n_head, n_kv_head=8, n_embd=n_embd,
                       ffn_hidden=ffn_hidden, vocab_size=128256, block_size=8192)


CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=96,
                        vocab_size=128, block_size=64),
    "tiny-mha": LlamaConfig(n_layer=4, n_head=4, n_kv_head=4, n_embd=32, ffn_hidden=96,
                            vocab_size=128, block_size=64),
    # Llama 3 / 3.1 (Dubey et al. 2024, Table 3): layers, model dimension, heads, FFN dimension
    "llama3-8b": _llama3(32, 4096, 32, 14336),
    "llama3-70b": _llama3(80, 8192, 64, 28672),
    "llama3-405b": _llama3(126, 16384, 128, 53248),
}


def config(spec: str = "tiny") -> LlamaConfig:
    """`"llama3-70b,n_layer=8"` -> that named config with the fields overridden."""
    name, *overrides = [p.strip() for p in spec.split(",") if p.strip()] or ["tiny"]
    if "=" in name:
        name, overrides = "tiny", [name, *overrides]
    if name not in CONFIGS:
        raise KeyError(f"unknown Llama config {name!r}; known: {', '.join(CONFIGS)}")
    cfg = CONFIGS[name]
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if not hasattr(cfg, key):
            fields = ", ".join(f.name for f in dataclasses.fields(cfg))
            raise KeyError(f"LlamaConfig has no field {key!r}; fields: {fields}")
        kind = type(getattr(cfg, key))          # every field is an int or a float
        try:
            changes[key] = kind(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a valid {kind.__name__}") from None
    return dataclasses.replace(cfg, **changes)


def rope_tables(head_dim: int, seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, float32 [seq, head_dim]: angle t * theta^(-2j/d) for feature j and its
    partner j + d/2 (the half-split layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)   # [seq, d/2]
    angles = torch.cat([angles, angles], dim=-1)                              # [seq, d]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by position: cos, sin [T, D] broadcast over batch and heads."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        kv = cfg.n_kv_head * self.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, kv, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, kv, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)     # [B, H, T, D]
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = self.n_head // self.n_kv_head       # query heads 0..groups-1 read k/v head 0
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                    # [B, H, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig | str = "tiny"):
        super().__init__()
        cfg = config(cfg) if isinstance(cfg, str) else cfg
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)   # untied
        # buffers, not parameters: the same tables on every rank; not saved in checkpoints
        cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: int64[B, T] -> logits float[B, T, V], or the mean cross-entropy if targets given."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size="
                             f"{self.config.block_size}; build the config with block_size >= {T}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)                                                  # [B, T, C]
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))                                  # [B, T, V]
        if targets is None:
            return logits
        return lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: the loss_fn to pass when the model returns logits."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def example_inputs(cfg: LlamaConfig, batch: int = 1, device: str | torch.device = "cpu"):
    """One global batch of token ids, (idx,), for compiling."""
    return (torch.zeros(batch, cfg.block_size, dtype=torch.long, device=device),)
