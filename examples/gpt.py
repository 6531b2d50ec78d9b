"""A GPT written like nanoGPT: one file, a config dataclass, no parallel code inside.

autopart parallelizes this model as it stands; nothing here knows about ranks or meshes.

    from examples.gpt import GPT, GPTConfig, CONFIGS
    model = GPT(CONFIGS["tiny"])
    loss = model(tokens, targets)        # tokens, targets: int64[B, T]

Named configs: `tiny` (CPU tests), `gpt2-124m`, `gpt3-175b`, and the ten rows of Table 1 of
Narayanan et al. 2021 (`megatron-1.7b` ... `megatron-1t`; vocabulary 51200, sequence 2048).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    vocab_size: int = 256
    block_size: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True   # GPT-2 ties the input embedding and the output projection

    def n_params(self) -> int:
        """Parameter count, the Megatron-LM paper's formula plus biases and norms exactly."""
        h, l, V, s = self.n_embd, self.n_layer, self.vocab_size, self.block_size
        per_layer = 12 * h * h + (13 * h if self.bias else 4 * h)
        head = 0 if self.tie_weights else V * h
        return l * per_layer + V * h + s * h + (2 * h if self.bias else h) + head


def _megatron(h: int, l: int, a: int) -> GPTConfig:
    return GPTConfig(n_layer=l, n_head=a, n_embd=h, vocab_size=51200, block_size=2048)


CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=64),
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    # GPT-3's 50257-token vocabulary padded to a multiple of 64 (as nanoGPT does), so it splits
    # over tensor-parallel ranks.
    "gpt3-175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, vocab_size=50304, block_size=2048),
    # Table 1 of Narayanan et al. 2021 (h, l, a).
    "megatron-1.7b": _megatron(2304, 24, 24),
    "megatron-3.6b": _megatron(3072, 30, 32),
    "megatron-7.5b": _megatron(4096, 36, 32),
    "megatron-18.4b": _megatron(6144, 40, 48),
    "megatron-39.1b": _megatron(8192, 48, 64),
    "megatron-76.1b": _megatron(10240, 60, 80),
    "megatron-145.6b": _megatron(12288, 80, 96),
    "megatron-310.1b": _megatron(16384, 96, 128),
    "megatron-529.6b": _megatron(20480, 105, 128),
    "megatron-1t": _megatron(25600, 128, 160),
}


def config(spec: str = "tiny") -> GPTConfig:
    """`"gpt3-175b,n_layer=30"` -> that named config with the fields overridden."""
    name, *overrides = [p.strip() for p in spec.split(",") if p.strip()] or ["tiny"]
    if "=" in name:
        name, overrides = "tiny", [name, *overrides]
    if name not in CONFIGS:
        raise KeyError(f"unknown GPT config {name!r}; known: {', '.join(CONFIGS)}")
    cfg = CONFIGS[name]
    types = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in types:
            raise KeyError(f"GPTConfig has no field {key!r}; fields: {', '.join(types)}")
        kind = {"int": int, "float": float, "bool": _bool}
        try:
            changes[key] = kind[types[key]](value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a valid {types[key]}") from None
    cfg = dataclasses.replace(cfg, **changes)
    if cfg.n_embd % cfg.n_head:
        ok = [h for h in range(1, cfg.n_embd + 1) if cfg.n_embd % h == 0 and h <= 128]
        raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}; "
                         f"use n_head in {ok}")
    return cfg


def _bool(text: str) -> bool:
    """'true'/'1'/'yes' or 'false'/'0'/'no'; anything else is an error, not False."""
    words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
    if text.lower() not in words:
        raise ValueError(f"{text!r} is not a boolean")
    return words[text.lower()]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v fused
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                         # (B, T, C) each
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                 # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | str = "tiny"):
        super().__init__()
        cfg = config(cfg) if isinstance(cfg, str) else cfg
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: int64[B, T] -> logits float[B, T, V], or the mean cross-entropy if targets given."""
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)           # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)                                                         # (B, T, C)
        logits = self.lm_head(self.transformer.ln_f(x))                          # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: the loss_fn to pass when the model returns logits."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def example_inputs(cfg: GPTConfig, batch: int = 1, device: str | torch.device = "cpu"):
    """One global batch of token ids, (idx,), for compiling."""
    return (torch.zeros(batch, cfg.block_size, dtype=torch.long, device=device),)
