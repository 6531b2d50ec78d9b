"""Rank functions for tests/test_deferred_init.py: models built on the meta device as users build
them (`with torch.device("meta")`, no init_fn, no seed), parallelized with their weights left
unfilled, then filled one way (load_pretrained of the plain model's checkpoint, or
pm.init_weights) and trained 3 steps beside the plain model.

The plain reference is the real model seeded like the checkpoint the test process wrote, or
the real model initialized by plain torch as docs/memory.md says init_weights(seed) does
(`scratch_reference`: the model's own init under the same seeds, not autopart's code). Allocation is counted
by the dispatcher (tests/workers/meta.LargestAlloc), not by autopart.
"""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.workers.common import each_case, ATOL, RTOL, _compare, hf_loss
from tests.workers.meta import LargestAlloc, held_bytes


@dataclass(frozen=True)
class DCase:
    name: str
    model: str                 # hand-gpt | hf-llama | hf-gpt2 | hf-mixtral | titan-llama
    mesh: dict = field(default_factory=dict)
    fill: str = "load"         # load (load_pretrained of `source`) | scratch (pm.init_weights)
    kind: str = "safetensors"  # the checkpoint's format: safetensors | torch | hf | dcp
    optim: str = "sgd"         # sgd (momentum) | adamw
    zero: int = 0
    source: str = ""           # written by the test process

    @property
    def world(self) -> int:
        m = self.mesh
        return m.get("pp", 1) * m.get("dp", 1) * m.get("tp", 1)


# -- models autopart was not written for ----------------------------------------------------------

class HandBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class HandGPT(nn.Module):
    """A GPT written by hand in the minGPT style: learned positions as a raw nn.Parameter on the
    root (no module, no reset_parameters, zeros in the constructor)."""

    def __init__(self, vocab: int = 128, d: int = 32, layers: int = 4, block: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, block, d))
        self.blocks = nn.ModuleList(HandBlock(d, 4) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def logits_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def construct(case: DCase) -> tuple[nn.Module, object]:
    """(model, loss_fn) built under the current device context (meta or real)."""
    import transformers
    transformers.logging.set_verbosity_error()
    if case.model == "hand-gpt":
        return HandGPT(), logits_loss
    if case.model == "titan-llama":
        from tests.titan_llama import ModelArgs, Transformer
        return Transformer(ModelArgs()), logits_loss
    if case.model == "hf-llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=False, use_cache=False)
        return transformers.LlamaForCausalLM(cfg), hf_loss
    if case.model == "hf-gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=128,
                                      n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False)
        return transformers.GPT2LMHeadModel(cfg), hf_loss
    if case.model == "hf-mixtral":
        from tests.workers.moe import hf_moe
        return hf_moe("hf-mixtral"), hf_loss
    raise ValueError(case.model)


def plain(case: DCase, seed: int = 0) -> nn.Module:
    """The plain model whose checkpoint the test writes: real weights, seeded."""
    torch.manual_seed(seed)
    return construct(case)[0]


def batch():
    g = torch.Generator().manual_seed(7)
    return (torch.randint(0, 128, (8, 16), generator=g),
            torch.randint(0, 128, (8, 16), generator=g))


def save_checkpoint(case: DCase, path: str) -> None:
    """The plain model's state dict as case.kind: safetensors | torch | hf | dcp."""
    model = plain(case)
    if case.kind == "hf":
        model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    elif case.kind == "safetensors":
        from safetensors.torch import save_model
        save_model(model, path)
    elif case.kind == "dcp":     # torchtitan's format: dcp.save of the model's state dict
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # "assuming ... a single process": yes
            dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)
    else:
        torch.save(model.state_dict(), path)


# AdamW at lr 1e-2, compared with atol ADAMW_ATOL = 1e-4, 1% of one step: a missed, doubled or
# wrong step moves nearly every element by ~lr and fails. eps 1e-5: Adam moves an element whose
# true gradient is zero (GPT-2's key biases: softmax ignores a shift of the scores) by
# lr * g / (sqrt(v) + eps), which for the default eps 1e-8 turns the round-off g ~1e-9 of two
# summation orders into up to +-lr; with eps 1e-5 it is <= 1e-4 * lr, while a real gradient
# (|g| >= 1e-4 here) still moves by most of lr.
ADAMW = dict(lr=1e-2, eps=1e-5, weight_decay=0.1)
ADAMW_ATOL = 1e-4


def _optimizer(case: DCase):
    if case.optim == "adamw":
        return torch.optim.AdamW, ADAMW
    return torch.optim.SGD, dict(lr=0.1, momentum=0.9)


def module_seed(seed: int, path: str) -> int:
    """The global RNG's seed while the module at `path` initializes, by docs/memory.md's rule
    ("the global RNG seeded from (seed, module path)"): the first 8 bytes of
    sha256(f"{seed}:{path}"), little-endian, as a non-negative int64. A torchtitan-style root
    init_weights() runs whole under path "<init_weights>"."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def scratch_reference(case: DCase, seed: int) -> tuple[nn.Module, list[str]]:
    """The plain model as pm.init_weights(seed) must fill it (docs/memory.md, "From scratch"),
    made with plain torch on a model built for real: a root init_weights() (torchtitan) run whole;
    else each module owning parameters in named_modules() order (a tie by its first owner) under
    its own seed: its reset_parameters(), then the root's _init_weights(module) (Hugging Face),
    and a parameter neither sets gets the documented default normal(0, 0.02). Returns the model
    and the parameters given the default (the ones the warning must name)."""
    model = construct(case)[0]
    if callable(getattr(model, "init_weights", None)) and \
            not callable(getattr(model, "_init_weights", None)):
        with torch.no_grad():
            torch.manual_seed(module_seed(seed, "<init_weights>"))
            model.init_weights()
        return model, []
    per_module, seen, defaulted = getattr(model, "_init_weights", None), set(), []
    for path, module in model.named_modules():
        own = {k: p for k, p in module._parameters.items() if p is not None}
        first = [k for k, p in own.items() if id(p) not in seen]
        seen.update(id(p) for p in own.values())
        if first:
            defaulted += _init_one(module, path, first, own, per_module, seed)
    return model, defaulted


def _init_one(module, path, first, own, per_module, seed) -> list[str]:
    """`module`'s parameters `first` initialized in place as scratch_reference says; the others
    (tied, set by an earlier owner) kept. Returns those given the default."""
    kept = {k: p.detach().clone() for k, p in own.items() if k not in first}
    defaulted = []
    with torch.no_grad():
        for k in first:                # NaN: what no initializer wrote shows
            own[k].fill_(float("nan"))
        torch.manual_seed(module_seed(seed, path))
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if per_module is not None:
            per_module(module)
        for k in first:
            if own[k].isnan().all():
                own[k].normal_(0.0, 0.02)
                defaulted.append(f"{path}.{k}" if path else k)
        for k, v in kept.items():
            own[k].copy_(v)
    return defaulted


def run(rank: int, world: int, case: DCase) -> dict:
    import autopart
    from autopart.errors import AutopartError
    from tests.workers.common import held_view
    problems: list[str] = []
    with torch.device("meta"):
        meta_model, loss_fn = construct(case)
    inputs, target = batch()
    mesh = autopart.Mesh(**case.mesh)
    allocated = LargestAlloc()      # .total: every byte parallelize allocated
    with warnings.catch_warnings(record=True) as caught, allocated:
        warnings.simplefilter("always")
        pm = autopart.parallelize(meta_model, mesh, (inputs,), loss_fn=loss_fn, target=target,
                                  microbatches=2, zero=case.zero,
                                  timeout=timedelta(seconds=120))
    if any(t.device.type != "meta" for t in meta_model.state_dict().values()):
        problems.append("parallelize materialized tensors of the user's meta model")
    try:                                    # nothing filled yet: refused, naming the three ways
        pm.train_step(inputs, target=target)
        problems.append("train_step ran on weights never filled")
    except AutopartError as e:
        if not all(w in str(e) for w in ("load_pretrained", "pm.load(", "init_weights")):
            problems.append(f"the unfilled-weights error does not name the three ways: {e}")
    largest_load = LargestAlloc()
    if case.fill == "load":
        with largest_load:
            pm.load_pretrained(case.source)
        ref = plain(case)
    else:
        with warnings.catch_warnings(record=True) as caught_init:
            warnings.simplefilter("always")
            pm.init_weights(seed=3)
        caught += caught_init
        ref, _ = scratch_reference(case, seed=3)
    mine = held_view(pm, rank)       # zero=3: a trainable parameter's 1-D slice of its shard
    ref_state = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    held = {n: t for c in pm.program.chunks
            for n, t in list(c.gm.named_parameters()) + list(c.gm.named_buffers())}
    for name, t in held.items():          # filled: exactly the reference's slice
        if name in ref_state and not torch.equal(t.detach(), mine(name, ref_state[name].detach())):
            problems.append(f"after {case.fill}: {name} differs from the plain model's")
    cls, kw = _optimizer(case)
    opt, ref_opt = pm.optimizer(cls, **kw), cls(ref.parameters(), **kw)
    for step in range(1, 4):
        loss = pm.train_step(inputs, target=target)
        opt.step(), opt.zero_grad()
        ref_loss = loss_fn(ref(inputs), target)
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        _compare(f"step {step} loss", loss, ref_loss, RTOL, ATOL, problems)
    atol = ADAMW_ATOL if case.optim == "adamw" else ATOL
    ref_params = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        _compare(f"{name} after 3 steps", p, mine(name, ref_params[name]), RTOL, atol, problems)
    full = {n: t.numel() * t.element_size() for n, t in ref_state.items()}
    return {"problems": problems, "held": held_bytes(pm), "allocated": allocated.total,
            "zero": case.zero, "full_params": sum(p.numel() * p.element_size()
                                                  for p in ref.parameters()),
            "largest_full": max(full.values()),
            "buffers": sum(b.numel() * b.element_size() for b in ref.buffers()),
            "largest_load": largest_load.largest,
            "warnings": [str(w.message) for w in caught if "autopart initialized" in
                         str(w.message)]}


def run_cases(rank: int, world: int, cases: list) -> list[dict]:
    return each_case(run, rank, world, cases)
