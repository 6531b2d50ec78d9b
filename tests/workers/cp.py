"""Models for the context-parallel tests (tests/test_context_parallel.py), registered in
tests/workers/common.FAMILIES on import, and the spawned ranks' function that imports them
first."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.workers.common import FAMILIES
from tests.workers.equivalence import run_cases


# -- models autopart was not written for ---------------------------------------------------------

class HandAttention(nn.Module):
    """Attention as older code bases write it: a tril buffer sliced to the sequence, masked_fill,
    softmax in fp32, dropout(0), a learned position table sliced to the sequence length;
    `window`: the buffer a band, each query seeing its last `window` keys (a sliding window)."""

    def __init__(self, d: int = 32, heads: int = 4, block: int = 64, window: int | None = None):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        band = torch.ones(block, block).tril()
        band = band.triu(-(window - 1)) if window is not None else band
        self.register_buffer("bias", band.view(1, 1, block, block))
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.drop(F.softmax(att.float(), dim=-1).type_as(att))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class HandLM(nn.Module):
    def __init__(self, vocab: int = 96, d: int = 32, layers: int = 2, block: int = 64,
                 window: int | None = None):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(block, d) * 0.02)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln=nn.LayerNorm(d), att=HandAttention(d, window=window), mlp=nn.Linear(d, d)))
            for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = x + blk["att"](blk["ln"](x))
            x = x + torch.tanh(blk["mlp"](x))
        return self.head(x)


def _lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def _hand(case, seed, device, window: int | None = None):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 96, (case.batch, case.seq), generator=g)
    y = torch.randint(0, 96, (case.batch, case.seq), generator=g)
    return HandLM(window=window).to(device), _lm_loss, (x.to(device),), y.to(device)


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(input_ids=idx, use_cache=False).logits


def _llama(case, seed, device, attention: str = "sdpa"):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation=attention)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 128, (case.batch, case.seq), generator=g)
    y = torch.randint(0, 128, (case.batch, case.seq), generator=g)
    return _Logits(transformers.LlamaForCausalLM(cfg)).to(device), _lm_loss, (x.to(device),), \
        y.to(device)


def _qwen2_moe(case, seed, device):
    """Hugging Face Qwen2-MoE (4 routed experts, top-2, plus a shared expert behind a sigmoid
    gate): its routed experts sort, gather and scatter tokens as Mixtral's do."""
    from tests.workers.moe import hf_moe
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 128, (case.batch, case.seq), generator=g)
    y = torch.randint(0, 128, (case.batch, case.seq), generator=g)
    return _Logits(hf_moe("hf-qwen2-moe")).to(device), _lm_loss, (x.to(device),), y.to(device)


def _sliding(family: str, **extra):
    """Unmodified Hugging Face models with a sliding window of 6 keys (shorter than the test's
    32 tokens, so it hides keys), random weights from a small config: Mistral (every layer),
    Gemma 2 and 3 (a sliding layer, then a full one)."""
    def build(case, seed, device):
        import transformers
        transformers.logging.set_verbosity_error()
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randint(0, 128, (case.batch, case.seq), generator=g)
        y = torch.randint(0, 128, (case.batch, case.seq), generator=g)
        return _Logits(sliding_model(family, **extra)).to(device), _lm_loss, (x.to(device),), \
            y.to(device)
    return build


def sliding_model(family: str, **extra):
    """The `family`'s causal LM from a small config with sliding_window=6 (`extra` overrides)."""
    import transformers
    # Gemma 2 (score soft-capping) and GPT-OSS (sinks) have no SDPA path: their eager one
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, sliding_window=6,
                  attn_implementation="eager" if family in ("gemma2", "gpt-oss") else "sdpa")
    common.update(extra)
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    if family == "gemma3":
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            layer_types=["sliding_attention", "full_attention"], **common))
    if family == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            layer_types=["sliding_attention", "full_attention"], **common))
    if family == "gpt-oss":
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
            num_experts_per_tok=2, **common))
    raise ValueError(family)


FAMILIES.setdefault("cp-hand", _hand)
FAMILIES.setdefault("cp-mistral", _sliding("mistral"))
FAMILIES.setdefault("cp-gemma3", _sliding("gemma3"))
# Gemma 2 without its score soft-capping (a tanh the cp kernels do not compute; refused)
FAMILIES.setdefault("cp-gemma2", _sliding("gemma2", attn_logit_softcapping=None))
# a sliding window of 5 keys, shorter than a chunk at seq 32, cp=2 (chunks of 8): some blocks
# are hidden by it entirely, the rest masked in part
FAMILIES.setdefault("cp-window-hand", lambda case, seed, device: _hand(case, seed, device, 5))
FAMILIES.setdefault("cp-qwen2-moe", _qwen2_moe)
FAMILIES.setdefault("cp-llama", _llama)
# attention written out (matmul, HF's additive causal mask, softmax, matmul): its mask is causal
FAMILIES.setdefault("cp-llama-eager", lambda case, seed, device: _llama(case, seed, device, "eager"))


def run_cp_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: run_cases with this file's models registered (spawned processes import
    it, not the test module)."""
    return run_cases(rank, world, cases)


def saved_activation_bytes(rank: int, world: int, seq: int) -> dict:
    """Rank function: bytes of the distinct tensors autograd saves for backward in one
    train_step of the example GPT at Mesh(cp=world), parameters excluded (measured by
    torch.autograd.graph.saved_tensors_hooks, not by the memory model)."""
    from datetime import timedelta

    import autopart
    from examples.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=seq)
    x = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    pm = autopart.parallelize(GPT(cfg), autopart.Mesh(cp=world), (x,), loss_fn=lm_loss,
                              target=x, timeout=timedelta(seconds=120))
    params = {p.untyped_storage().data_ptr() for p in pm.parameters()}
    saved: dict = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.train_step(x, target=x)
    return {"rank": rank, "bytes": sum(saved.values())}


class PaddedLM(nn.Module):
    """Right-padded batches: the model takes (ids, keep) with keep 0 on padding, and its
    attention hides the padded keys, causally: SDPA with a boolean mask (`hand=False`) or a
    hand-written core with masked_fill (`hand=True`). Padding labels are -100."""

    def __init__(self, hand: bool, vocab: int = 96, d: int = 32, block: int = 64):
        super().__init__()
        self.hand, self.tok = hand, nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, keep):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        q, k, v = (z.view(b, t, 4, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        mask = causal[None, None] & keep.bool()[:, None, None, :]
        if self.hand:
            att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, -1)))


def _padded(hand: bool):
    def build(case, seed, device):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randint(1, 96, (case.batch, case.seq), generator=g)
        lengths = [case.seq, case.seq - 5, case.seq // 2 + 1, 3][: case.batch]
        keep = torch.stack([(torch.arange(case.seq) < n).long() for n in lengths])
        y = torch.randint(0, 96, (case.batch, case.seq), generator=g).masked_fill(keep == 0, -100)
        return PaddedLM(hand).to(device), _lm_loss, (x.to(device), keep.to(device)), y.to(device)
    return build


FAMILIES.setdefault("cp-pad-sdpa", _padded(False))
FAMILIES.setdefault("cp-pad-hand", _padded(True))


class PackedLM(nn.Module):
    """Documents packed into rows: the model takes (ids, doc, pos): each token's document id
    (padding a document of its own, id -1) and its position within its document (restarting
    at 0 per document, as a packing collator gives them); attention is causal within each
    document (SDPA with a boolean mask from `doc`). Padding labels are -100."""

    def __init__(self, vocab: int = 96, d: int = 32, block: int = 64, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, doc, pos):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(pos)
        causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        mask = (doc[:, :, None] == doc[:, None, :])[:, None] & causal
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (z.view(b, t, 4, -1).transpose(1, 2) for z in qkv(x).chunk(3, -1))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + proj(y.transpose(1, 2).reshape(b, t, -1))
        return self.head(x)


def packed_batch(batch: int, seq: int, g: torch.Generator):
    """(doc, pos) of rows packed with documents of random lengths (one row a single document
    across the whole sequence, the last row ending in padding), ids increasing along a row."""
    docs = []
    for r in range(batch):
        cuts = torch.rand(seq, generator=g) < (0.0 if r == 0 else 0.2)
        doc = torch.cumsum(cuts.long(), 0) + 10 * r
        if r == batch - 1:
            doc[seq - seq // 4:] = -1
        docs.append(doc)
    doc = torch.stack(docs)
    idx = torch.arange(seq).expand(batch, seq)
    start = torch.ones_like(doc, dtype=torch.bool)
    start[:, 1:] = doc[:, 1:] != doc[:, :-1]
    pos = idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(1).values
    return doc, pos


def _packed(case, seed, device):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 96, (case.batch, case.seq), generator=g)
    doc, pos = packed_batch(case.batch, case.seq, g)
    y = torch.randint(0, 96, (case.batch, case.seq), generator=g).masked_fill(doc < 0, -100)
    return PackedLM().to(device), _token_loss, (x.to(device), doc.to(device), pos.to(device)), \
        y.to(device)


def _token_loss(logits, target):
    """The mean over the tokens not labelled -100, with classes on dim 1 (no flatten)."""
    return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100)


FAMILIES.setdefault("cp-packed", _packed)


def reused_document_id(rank: int, world: int) -> dict:
    """Rank function: PackedLM at Mesh(cp=world) given a row whose ids come back to an earlier
    document (0, 0, 1, 1, 0): train_step's refusal, then the loss of the batch repaired."""
    from datetime import timedelta

    import autopart
    from autopart.errors import AutopartError
    from tests.workers.common import Case
    c = Case("bad", model="cp-packed", batch=2, seq=16)
    model, loss_fn, (x, doc, pos), y = _packed(c, 0, "cpu")
    pm = autopart.parallelize(model, autopart.Mesh(cp=world), (x, doc, pos), loss_fn=loss_fn,
                              target=y, timeout=timedelta(seconds=60))
    bad = doc.clone()
    bad[1] = torch.tensor([5] * 4 + [6] * 6 + [5] * 6)     # document 5 again after 6
    try:
        pm.train_step(x, bad, pos, target=y)
        refused = None
    except AutopartError as e:
        refused = str(e)
    return {"rank": rank, "refused": refused, "loss": float(pm.train_step(x, doc, pos, target=y))}


class PackedWindowLM(nn.Module):
    """A sliding window, packed documents and padding in one attention core: each query sees
    the last `window` keys of its own document, padding aside. `hand=False`: (ids, doc, pos),
    SDPA with one boolean mask of the documents and the window, the padded tail a document of
    its own (id -1). `hand=True`: (ids, doc, pos, keep), a hand-written core masked three
    times (masked_fill of the banded buffer, of other documents' keys, of the keys `keep`
    marks as padding), so that the pass proves a window, a document mask and a key padding
    mask in one core. Padding labels are -100."""

    def __init__(self, hand: bool, window: int = 5, vocab: int = 96, d: int = 32,
                 block: int = 64):
        super().__init__()
        self.hand, self.tok, self.pos = hand, nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.register_buffer("band", torch.ones(block, block).tril().triu(-(window - 1)))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(2))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, doc, pos, keep=None):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(pos)
        band = self.band[:t, :t] != 0
        other = (doc[:, :, None] != doc[:, None, :])[:, None]
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (z.view(b, t, 4, -1).transpose(1, 2) for z in qkv(x).chunk(3, -1))
            if self.hand:
                att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
                att = att.masked_fill(~band, float("-inf")).masked_fill(other, float("-inf"))
                att = att.masked_fill(keep[:, None, None, :] == 0, float("-inf"))
                y = att.softmax(-1) @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=band & ~other)
            x = x + proj(y.transpose(1, 2).reshape(b, t, -1))
        return self.head(x)


def _packed_window(hand: bool):
    """Rows packed as cp-packed's (packed_batch: row 0 one document, the last row's tail
    padding, id -1, labels -100); a window of 5 keys over chunks of 8 at cp=2 (blocks hidden
    by it). `hand`: `keep` also marks a padded run of 3 keys right after the first token of
    row 0 (labels -100): the later queries of that document must not see them, and each padded
    query still sees the document's first token (no row of the softmax empty: NaN)."""
    def build(case, seed, device):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randint(0, 96, (case.batch, case.seq), generator=g)
        doc, pos = packed_batch(case.batch, case.seq, g)
        keep = torch.ones_like(doc)
        keep[0, 1:4] = 0
        y = torch.randint(0, 96, (case.batch, case.seq), generator=g)
        y = y.masked_fill((doc < 0) | (keep == 0), -100)
        inputs = (x, doc, pos, keep) if hand else (x, doc, pos)
        return PackedWindowLM(hand).to(device), _token_loss, \
            tuple(t.to(device) for t in inputs), y.to(device)
    return build


FAMILIES.setdefault("cp-packed-window", _packed_window(False))
FAMILIES.setdefault("cp-packed-window-hand", _packed_window(True))


def reused_document_id_on(rank: int, world: int, runs: list) -> list[dict]:
    """Rank function: for each (model family, mesh keywords) of `runs` (packed models whose
    inputs are (ids, doc, pos, ...)), train_step given a row whose ids come back to an earlier
    document: its refusal, then the loss of the batch repaired (the ranks go on together)."""
    from datetime import timedelta

    import autopart
    from autopart.errors import AutopartError
    from tests.workers.common import Case, build
    import tests.workers.packed_experts  # noqa: F401  (registers packed-mixtral)
    out = []
    for family, mesh in runs:
        model, loss_fn, inputs, y = build(Case("bad", model=family, batch=4, seq=16))
        pm = autopart.parallelize(model, autopart.Mesh(**mesh), inputs, loss_fn=loss_fn,
                                  target=y, microbatches=2 if mesh.get("pp", 1) > 1 else 1,
                                  timeout=timedelta(seconds=60))
        bad = inputs[1].clone()
        bad[1] = torch.tensor([5] * 4 + [6] * 6 + [5] * 6)     # document 5 again after 6
        try:
            pm.train_step(inputs[0], bad, *inputs[2:], target=y)
            refused = None
        except AutopartError as e:
            refused = str(e)
        out.append({"rank": rank, "mesh": mesh, "refused": refused,
                    "documents": pm.compiled.program.cp.documents,
                    "loss": float(pm.train_step(*inputs, target=y))})
    return out
