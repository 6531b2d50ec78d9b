"""A mixture-of-experts GPT (Switch Transformer / GShard routing), written like examples/gpt.py.

Every `moe_every`-th feed-forward block is a mixture-of-experts layer: a float32 router picks the
top-1 (Switch) or top-2 (GShard) experts of each token; each expert takes at most `capacity`
tokens of each routing group, first choices of all tokens before any second choice, then in token
order; tokens past an expert's capacity are dropped (they pass through the residual). Nothing here
knows about ranks: autopart's shard_experts pass finds the layers from the graph and shards them.

    from examples.switch import SwitchGPT, config
    model = SwitchGPT(config("tiny"))
    loss = model(tokens, targets)                  # LM loss + load-balancing loss + router z-loss
    loss, stats = model(tokens, targets, True)     # plus routing counts for the training log

Routing groups: the B*T tokens of a batch are cut, in order, into groups of `group_size`; capacity
and dropping are decided per group and the auxiliary losses are means over groups, so the loss of
a batch equals the mean of the losses of any split of it into whole groups (a data-parallel or
microbatch shard routes exactly as the whole batch does when it holds whole groups).

    capacity = max(1, floor(capacity_factor * top_k * group_size / num_experts))
    capacity_factor=None: dropless (capacity = group_size)

The dispatch and combine tensors are dense one-hot [groups, group_size, experts, capacity] and the
experts are stacked weights with a leading expert dimension ([E, C, F] and [E, F, C]) run as one
batched matmul over experts: every shape is static, so torch.export captures the layer.

Named configs: `tiny` (CPU tests), `switch-base` (Switch-Base-like, decoder only), `switch-c`
(1.57e12 parameters: Switch-C's 2048 experts of d_model 2080, d_ff 6144 in every one of 30 layers).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class SwitchConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    vocab_size: int = 256
    block_size: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    d_ff: int = 256                        # hidden width of the dense MLPs and of every expert
    num_experts: int = 4
    moe_every: int = 2                     # 1: every block is MoE; 2: blocks 1, 3, 5, ... (Switch)
    top_k: int = 1                         # 1: Switch; 2: GShard (second expert by gate weight)
    capacity_factor: float | None = 1.25   # None: dropless
    group_size: int = 16                   # routing group, in tokens
    aux_loss_coef: float = 0.01            # Switch's load-balancing loss
    z_loss_coef: float = 1e-3              # ST-MoE's router z-loss

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts}: a mixture-of-experts layer needs at "
                             "least 1 expert")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} with num_experts={self.num_experts}: each token "
                             "picks top_k distinct experts, so use 1 <= top_k <= "
                             f"{self.num_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 (1.0-1.25 is "
                             "usual), or None for dropless routing")
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be a positive number of tokens")
        if self.moe_every < 1:
            raise ValueError(f"moe_every={self.moe_every} must be >= 1 (1: every block is MoE)")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def capacity(self) -> int:
        """Tokens each expert takes from each routing group."""
        if self.capacity_factor is None:
            return self.group_size
        slots = self.capacity_factor * self.top_k * self.group_size / self.num_experts
        return max(1, math.floor(slots))

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layer))

    def n_params(self) -> int:
        """Parameter count: attention, norms, dense MLPs, routers and experts, embeddings."""
        h, f, E, V = self.n_embd, self.d_ff, self.num_experts, self.vocab_size
        b = 1 if self.bias else 0
        attn = 4 * h * h + 4 * h * b
        norms = 2 * (2 * h if self.bias else h)
        dense = 2 * h * f + (f + h) * b
        moe = E * h + 2 * E * h * f
        moe_layers = self.n_moe_layers
        blocks = (self.n_layer * (attn + norms) + moe_layers * moe
                  + (self.n_layer - moe_layers) * dense)
        head = 0 if self.tie_weights else V * h
        return blocks + V * h + self.block_size * h + (2 * h if self.bias else h) + head


CONFIGS: dict[str, SwitchConfig] = {
    "tiny": SwitchConfig(),
    # Switch-Base's sizes (d_model 768, d_ff 3072, 12 heads, 128 experts every other layer) in a
    # 12-layer decoder; T5's 32128-token vocabulary; one 512-token sequence per routing group.
    "switch-base": SwitchConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=32128,
                                block_size=512, bias=False, d_ff=3072, num_experts=128,
                                moe_every=2, capacity_factor=1.25, group_size=512),
    # Switch-C (Fedus et al. 2022, Table 9: 1571B parameters): d_model 2080, d_ff 6144, 32 heads,
    # 2048 experts in every layer. Its "15 layers" are T5's per-stack count (15 encoder + 15
    # decoder blocks, all with expert layers), so the decoder-only model with the same expert
    # parameters has 30 layers: 30 * 2048 * 2 * 2080 * 6144 = 1.570e12 expert parameters.
    # One 2048-token sequence per routing group: capacity 1 token per expert per group at
    # capacity_factor 1.0 (with 512-token groups a quarter of the slots could never fill).
    "switch-c": SwitchConfig(n_layer=30, n_head=32, n_embd=2080, vocab_size=32128,
                             block_size=2048, bias=False, d_ff=6144, num_experts=2048,
                             moe_every=1, capacity_factor=1.0, group_size=2048),
}


def config(spec: str = "tiny") -> SwitchConfig:
    """`"switch-base,num_experts=8,top_k=2"` -> that named config with the fields overridden.

    `capacity_factor=none` means dropless."""
    name, *overrides = [p.strip() for p in spec.split(",") if p.strip()] or ["tiny"]
    if "=" in name:
        name, overrides = "tiny", [name, *overrides]
    if name not in CONFIGS:
        raise KeyError(f"unknown Switch config {name!r}; known: {', '.join(CONFIGS)}")
    types = {f.name: f.type for f in dataclasses.fields(SwitchConfig)}
    kinds = {"int": int, "float": float, "bool": _bool,
             "float | None": lambda v: None if v.lower() in ("none", "dropless") else float(v)}
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in types:
            raise KeyError(f"SwitchConfig has no field {key!r}; fields: {', '.join(types)}")
        try:
            changes[key] = kinds[types[key]](value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a valid {types[key]}") from None
    return dataclasses.replace(CONFIGS[name], **changes)


def _bool(text: str) -> bool:
    """'true'/'1'/'yes' or 'false'/'0'/'no'; anything else is an error, not False."""
    if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ValueError(f"{text!r} is not a boolean")
    return text.lower() in ("1", "true", "yes")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: SwitchConfig):
        super().__init__()
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
    def __init__(self, cfg: SwitchConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.d_ff, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_ff, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))), None, None


class MoE(nn.Module):
    """Router + E experts stored as stacked weights c_fc [E, C, F] and c_proj [E, F, C]."""

    def __init__(self, cfg: SwitchConfig):
        super().__init__()
        E, C, Fd = cfg.num_experts, cfg.n_embd, cfg.d_ff
        self.cfg = cfg
        self.router = nn.Linear(C, E, bias=False)
        self.c_fc = nn.Parameter(torch.empty(E, C, Fd))
        self.c_proj = nn.Parameter(torch.empty(E, Fd, C))
        self.dropout = nn.Dropout(cfg.dropout)

    def reset_parameters(self) -> None:
        """The experts' own initialisation (as SwitchGPT's constructor gives them), so a model
        built on the meta device can be initialised module by module (autopart.materialize)."""
        torch.nn.init.normal_(self.c_fc, mean=0.0, std=0.02)
        torch.nn.init.normal_(self.c_proj, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def route(self, logits: torch.Tensor):
        """Router logits (G, S, E) -> dispatch, combine (G, S, E, capacity), per-choice masks.

        Returns (router probabilities, dispatch 0/1, combine gate weights, the one-hot of each
        choice, and of each choice within capacity). Positions in an expert's buffer: all first
        choices in token order, then all second choices; a position >= capacity is dropped."""
        cfg = self.cfg
        E, cap = cfg.num_experts, cfg.capacity
        probs = logits.softmax(dim=-1)                                   # (G, S, E) float32
        remaining, masks, gates = probs, [], []
        for _ in range(cfg.top_k):
            choice = remaining.argmax(dim=-1)                            # (G, S)
            mask = F.one_hot(choice, E)                                  # (G, S, E) int64
            masks.append(mask)
            gates.append((probs * mask).sum(dim=-1))                     # (G, S)
            remaining = remaining.masked_fill(mask.bool(), -1.0)         # next: second best
        if cfg.top_k > 1:    # GShard: the chosen gates renormalised to sum to 1
            total = sum(gates)
            gates = [g / total for g in gates]
        dispatch = combine = 0
        taken = torch.zeros_like(masks[0][:, :1])                        # (G, 1, E) filled so far
        kept = []
        for mask, gate in zip(masks, gates):
            position = torch.cumsum(mask, dim=1) - 1 + taken             # (G, S, E)
            keep = mask * (position < cap)                               # (G, S, E) 0/1
            taken = taken + mask.sum(dim=1, keepdim=True)
            slot = F.one_hot((position * keep).sum(dim=-1), cap)         # (G, S, cap)
            chosen = keep.unsqueeze(-1) * slot.unsqueeze(2)              # (G, S, E, cap) 0/1
            dispatch = dispatch + chosen
            combine = combine + gate[..., None, None] * chosen
            kept.append(keep)
        return probs, dispatch, combine, masks, kept

    def forward(self, x: torch.Tensor):
        """x (B, T, C) -> (y (B, T, C), auxiliary loss, routing counts)."""
        B, T, C = x.shape
        cfg = self.cfg
        S, E = cfg.group_size, cfg.num_experts
        if (B * T) % S:
            raise ValueError(f"{B}x{T} tokens do not divide into routing groups of "
                             f"group_size={S}; use a batch*sequence that is a multiple of {S}")
        xg = x.reshape(-1, S, C)                                         # (G, S, C)
        logits = F.linear(xg.float(), self.router.weight.float())        # (G, S, E) float32
        probs, dispatch, combine, masks, kept = self.route(logits)
        # tokens to experts: (E, G, cap, C), then the experts as batched matmuls over E
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch.to(x.dtype), xg)
        G, cap = expert_in.shape[1], expert_in.shape[2]
        h = expert_in.reshape(E, G * cap, C)                             # (E, G*cap, C)
        h = F.gelu(torch.bmm(h, self.c_fc), approximate="tanh")          # (E, G*cap, F)
        h = self.dropout(torch.bmm(h, self.c_proj))                      # (E, G*cap, C)
        expert_out = h.reshape(E, G, cap, C)
        y = torch.einsum("gsec,egcm->gsm", combine.to(x.dtype), expert_out)   # (G, S, C)
        aux = cfg.aux_loss_coef * balance_loss(probs, masks[0]) \
            + cfg.z_loss_coef * z_loss(logits)
        stats = {"routed": sum(m.sum(dim=(0, 1)) for m in masks),     # (E,) choices made
                 "processed": sum(k.sum(dim=(0, 1)) for k in kept),    # (E,) choices kept
                 "dropped_tokens": (sum(k.sum(dim=-1) for k in kept) == 0).sum()}  # no expert
        return y.reshape(B, T, C), aux, stats


def balance_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """Switch's E * sum_i f_i * P_i per routing group, averaged over groups.

    probs (G, S, E) router probabilities; first_choice (G, S, E) one-hot of each token's top-1."""
    E = probs.shape[-1]
    f = first_choice.float().mean(dim=1)                                 # (G, E)
    P = probs.mean(dim=1)                                                # (G, E)
    return (E * (f * P).sum(dim=-1)).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class Block(nn.Module):
    def __init__(self, cfg: SwitchConfig, moe: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor):
        x = x + self.attn(self.ln_1(x))
        y, aux, stats = self.mlp(self.ln_2(x))
        return x + y, aux, stats


class SwitchGPT(nn.Module):
    def __init__(self, cfg: SwitchConfig | str = "tiny"):
        super().__init__()
        cfg = config(cfg) if isinstance(cfg, str) else cfg
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, cfg.is_moe(i)) for i in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp.c_proj"):
                torch.nn.init.normal_(p, mean=0.0, std=residual_std)
            elif name.endswith("mlp.c_fc"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                return_stats: bool = False):
        """idx int64[B, T] -> logits [B, T, V]; with targets, the training loss: mean
        cross-entropy + the MoE layers' load-balancing and z-losses. With return_stats, also a
        dict of int64 routing counts summed over the batch, one row per MoE layer:
        routed[L, E] (choices made), processed[L, E] (choices within capacity),
        dropped_tokens[L] (tokens no expert took), tokens[L]."""
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)           # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        aux_total, layer_stats = 0.0, []
        for block in self.transformer.h:
            x, aux, stats = block(x)                                             # (B, T, C)
            if aux is not None:
                aux_total = aux_total + aux
                layer_stats.append(stats)
        logits = self.lm_head(self.transformer.ln_f(x))                          # (B, T, V)
        out = logits
        if targets is not None:
            out = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) + aux_total
        if not return_stats:
            return out
        stats = {k: torch.stack([s[k] for s in layer_stats]) for k in
                 ("routed", "processed", "dropped_tokens")} if layer_stats else {}
        if layer_stats:
            stats["tokens"] = torch.full((len(layer_stats),), B * T, dtype=torch.long,
                                         device=idx.device)
        return out, stats


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy alone (no auxiliary losses: train with model(idx, targets)).

    Not named lm_loss: `autopart compile` applies a module's lm_loss to the model's output, and
    this model computes its own training loss from (idx, targets) (see example_inputs)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def example_inputs(cfg: SwitchConfig, batch: int = 1, device: str | torch.device = "cpu"):
    """One global batch (idx, targets) for compiling: the model returns its own training loss."""
    idx = torch.zeros(batch, cfg.block_size, dtype=torch.long, device=device)
    return idx, idx.clone()


def summarize(stats: dict, top_k: int = 1) -> dict:
    """Routing counts (summed over ranks and microbatches) -> per-layer fractions for a log:
    dropped (share of tokens no expert took), overflow (share of choices past capacity) and
    load (share of each expert in the processed choices)."""
    tokens = stats["tokens"].double()
    processed = stats["processed"].double()
    return {
        "dropped": (stats["dropped_tokens"].double() / tokens).tolist(),
        "overflow": (1 - processed.sum(-1) / (tokens * top_k)).tolist(),
        "load": (processed / processed.sum(-1, keepdim=True).clamp(min=1)).tolist(),
    }
