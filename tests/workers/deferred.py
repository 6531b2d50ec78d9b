"""Rank functions for tests/test_deferred_init.py: models built on the meta device as users build
them (`with torch.device("meta")`, no init_fn, no seed), parallelized with their weights left
unfilled, then filled one way (load_pretrained of the plain model's checkpoint, or
pm.init_weights) and trained 3 steps beside the plain model.

The plain reference is the real model seeded like the checkpoint the test process wrote, or
autopart.materialize of a meta copy with the seed given to init_weights. Allocation is counted
by the dispatcher (tests/workers/meta.LargestAlloc), not by autopart.
"""
from __future__ import annotations

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


def _optimizer(case: DCase):
    if case.optim == "adamw":     # lr 1e-4: Adam's round-off moves (see meta.py) stay < atol
        return torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.1)
    return torch.optim.SGD, dict(lr=0.1, momentum=0.9)


def run(rank: int, world: int, case: DCase) -> dict:
    import autopart
    from autopart.errors import AutopartError
    from tests.workers.common import _local_view, held_view
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
        with torch.device("meta"):
            ref = construct(case)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autopart.materialize(ref, seed=3)
    mine = _local_view(pm, rank)
    if case.zero == 3:    # a sharded parameter holds this rank's 1-D slice of its local view
        holds, sliced = held_view(pm, rank), {n for lay in pm._grads.zero_layouts
                                              for n in lay.names}
        mine = (lambda n, t, local=mine: holds(n, t) if n in sliced else local(n, t))
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
    atol = 2e-4 if case.optim == "adamw" else ATOL
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
