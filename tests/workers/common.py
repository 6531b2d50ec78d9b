"""The models, batches and cases the multi-process tests share (`Case`, `build`), the tolerances
(`RTOL`, `ATOL`) and the comparison every equivalence, checkpoint and meta test goes through
(`_compare`), with the views of what a rank holds of a plain tensor. The equivalence harness
that uses them is tests/workers/equivalence.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# fp32 throughout. The parallel run sums the same products in a different order (per microbatch,
# then across microbatches, stages and replicas), so results agree to fp32 round-off, not bits:
# losses, gradients and SGD parameters all within rtol 1e-5 / atol 1e-6 (measured max abs errors
# ~5e-7 on values up to ~1). A missing microbatch, replica or tied-weight share is a >= 12% error.
RTOL, ATOL = 1e-5, 1e-6


# -- models ---------------------------------------------------------------------------------------

def gpt_config(n_layer: int = 8):
    from examples.gpt import GPTConfig
    return GPTConfig(n_layer=n_layer, n_head=4, n_embd=32, vocab_size=128, block_size=16)


def hf_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on a Hugging Face CausalLMOutput's `.logits` (the model's own loss shifts)."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class ToyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.table = nn.Embedding(width, width)

    def forward(self, h, route, keep, mask):
        h = h + torch.tanh(self.lin(h)) * mask[..., None] + self.table(route) * 0.1
        return torch.where(keep[..., None], h, h * 0.5)


class Toy(nn.Module):
    """A model that exercises what GPT does not: a second user input (`mask`, float, read by every
    block, so by every pipeline chunk), an int64 and a bool activation computed from the first
    activations and read by every block (so they cross every pipeline cut as non-float boundary
    tensors, with no gradient to send back), and a forward that takes the target and returns its
    own loss (loss_fn=None)."""

    def __init__(self, n_layer: int = 4, width: int = 32, vocab: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(ToyBlock(width) for _ in range(n_layer))
        self.head = nn.Linear(width, vocab)
        self.route_bias = nn.Embedding(width, vocab)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)                                  # (B, T, W)
        route = h.argmax(-1)                             # int64 (B, T), from activations
        keep = h.sum(-1) > 0                             # bool (B, T), from activations
        for block in self.blocks:
            h = block(h, route, keep, mask)
        logits = self.head(h) + self.route_bias(route)   # route stays live to the end
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class Extras(nn.Module):
    """State beyond trainable weights: a frozen layer, a persistent and a non-persistent buffer
    read in forward, and a parameter forward never uses (no gradient, still in the state dict)."""

    def __init__(self, n_layer: int = 4, width: int = 16, vocab: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width).requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n_layer))
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("shift", torch.full((width,), 0.1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.emb(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * self.scale + self.shift
        return self.head(h)


# examples/switch.py's tiny config, made smaller: one 16-token sequence per routing group, 4
# experts in blocks 1 and 3 (capacity floor(1.25 * 16 / 4) = 5 tokens per expert per group)
SWITCH = "tiny,n_layer=4,n_embd=32,d_ff=64,vocab_size=128,block_size=16,group_size=16"
SWITCH_SPECS = {"switch": SWITCH,                                        # top-1 with capacity
                "switch-top2": SWITCH + ",top_k=2,capacity_factor=none",  # top-2 dropless
                "switch-stats": SWITCH}     # returns (loss, routing counts): pm.last_stats


class WithStats(nn.Module):
    """model(idx, targets, True): (loss, {routed, processed, dropped_tokens, tokens})."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return self.model(idx, targets, True)


@dataclass(frozen=True)
class Case:
    """One equivalence configuration; `world` ranks run it."""
    name: str
    model: str = "gpt"               # gpt (8 layers) | gpt4 (4 layers) | hf | toy | extras
                                     # | switch | switch-top2 | mixtral | mixtral4 (4
                                     # layers) (mixture of experts)
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1                      # experts sharded over ep of the dp ranks
    cp: int = 1                      # the sequence sharded over cp ranks (context parallelism)
    cp_attention: str = "ring"       # ring | allgather
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    batch: int = 8                   # global batch
    seq: int = 16
    optim: str = "sgd"               # sgd | adam | adamw
    steps: int = 3
    accumulate: int = 1              # train_step calls (same batch) per optimizer step
    clip: float | None = 0.05        # clip_grad_norm_ on step 2 (small enough that it clips)
    device: str = "cpu"              # cpu | cuda (rank r on cuda:r)
    ignored: str = ""                # labels set to -100: "uneven" (the first half of the rows
                                     # lose their second half) | "empty" (uneven, and the first
                                     # quarter of the rows wholly ignored)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp * self.cp


# model name -> build function (case, seed, device) for models defined outside this file
FAMILIES: dict = {}


def build(case: Case, seed: int = 0, device: str = "cpu"):
    """(model, loss_fn, inputs, target) for a case, identical in every process."""
    model, loss_fn, inputs, target = _build(case, seed, device)
    if getattr(case, "ignored", "") and target is not None:
        target = ignore_labels(target, case.ignored)
    return model, loss_fn, inputs, target


def ignore_labels(target: torch.Tensor, how: str) -> torch.Tensor:
    """`target` with labels set to -100 (ignored by cross-entropy) unevenly over the rows:
    microbatches then count different numbers of tokens."""
    t = target.clone()
    rows, seq = t.shape[0], t.shape[-1]
    t[: rows // 2, seq // 2:] = -100
    if how == "empty":
        t[: max(rows // 4, 1)] = -100
    return t


def _build(case: Case, seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    if case.model in ("gpt", "gpt4"):
        from examples.gpt import GPT, lm_loss
        cfg = gpt_config(8 if case.model == "gpt" else 4)
        model, loss_fn, vocab = GPT(cfg), lm_loss, cfg.vocab_size
    elif case.model == "renamed":        # the example GPT with every name changed
        module = renamed_gpt_module()
        cfg = module.GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=128, block_size=16)
        model, loss_fn, vocab = module.GPT(cfg), module.lm_loss, cfg.vocab_size
    elif case.model == "hf":
        import transformers
        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model, loss_fn, vocab = transformers.GPT2LMHeadModel(cfg), hf_loss, cfg.vocab_size
    elif case.model in SWITCH_SPECS:     # the model returns its own loss (LM + auxiliary)
        from examples.switch import SwitchGPT, config
        model, loss_fn, vocab = SwitchGPT(config(SWITCH_SPECS[case.model])), None, 128
        if case.model == "switch-stats":
            model = WithStats(model)
    elif case.model in ("mixtral", "mixtral4"):
        from tests.workers.moe import hf_moe
        import transformers
        transformers.logging.set_verbosity_error()
        layers = 4 if case.model == "mixtral4" else 2
        model, loss_fn, vocab = hf_moe("hf-mixtral", layers), hf_loss, 128
    elif case.model == "toy":
        model, loss_fn, vocab = Toy(), None, 64
    elif case.model == "extras":
        from examples.gpt import lm_loss
        model, loss_fn, vocab = Extras(), lm_loss, 64
    elif case.model in FAMILIES:        # registered by tests/workers/family.py
        return FAMILIES[case.model](case, seed, device)
    else:
        raise ValueError(case.model)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
    y = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
    model = model.to(device)
    if case.model == "toy":      # the target is a model input: forward returns the loss itself
        mask = torch.rand(case.batch, case.seq, generator=g) + 0.5
        return model, loss_fn, tuple(t.to(device) for t in (x, mask, y)), None
    if case.model in SWITCH_SPECS:
        return model, loss_fn, (x.to(device), y.to(device)), None
    return model, loss_fn, (x.to(device),), y.to(device)


def _compare(what: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
             problems: list[str]) -> float:
    """Record a problem unless `actual` is close to `expected`; returns the max absolute error.

    A non-finite element (NaN, inf) in either tensor is a problem, whatever the other holds:
    `err > tol` is False for a NaN error, so without this check a NaN would pass."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    if actual.shape != expected.shape:
        problems.append(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
        return float("inf")
    finite = True
    for side, t in (("actual", actual), ("expected", expected)):
        bad = ~torch.isfinite(t)
        if bad.any():
            i = int(bad.reshape(-1).nonzero()[0])
            problems.append(f"{what}: {int(bad.sum())} of {t.numel()} elements of the {side} "
                            f"value are not finite ({int(t.isnan().sum())} NaN); first at flat "
                            f"index {i}: {float(t.reshape(-1)[i])!r}")
            finite = False
    if not finite:
        return float("inf")
    err = (actual - expected).abs()
    bad = err > atol + rtol * expected.abs()
    if bad.any():
        i = int(err.argmax())
        a, e = float(actual.reshape(-1)[i]), float(expected.reshape(-1)[i])
        problems.append(f"{what}: {int(bad.sum())} of {err.numel()} elements differ; max abs error "
                        f"{float(err.max()):.3g} at flat index {i} ({a:.8g} vs {e:.8g}); "
                        f"rtol={rtol} atol={atol}")
    return float(err.max()) if err.numel() else 0.0


def _local_view(pm, rank: int):
    """name, plain tensor -> the part of it this rank holds, cut here from the placement alone
    (the shard's dim and sections, the rank's mesh coordinates), never by autopart's own slicing
    (autopart/localize.py cuts the rank's tensors, autopart/verification.py `verify`'s plain
    side): its experts first (E / ep of dim 0, those of ep index dp % ep), then its tp shard
    (each section of the dim in tp equal parts, part tp index)."""
    plan, mesh = pm.compiled.plan, pm.mesh
    at = mesh.coords(rank)

    def view(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if mesh.ep > 1 and name in plan.ep_shards:
            tensor = torch.chunk(tensor, mesh.ep, dim=0)[at["dp"] % mesh.ep]
        if mesh.tp > 1 and name in plan.tp_shards:
            tensor = _chunk_sections(tensor, plan.tp_shards[name], mesh.tp, at["tp"])
        return tensor
    return view


def _chunk_sections(tensor: torch.Tensor, shard, parts: int, index: int) -> torch.Tensor:
    """torch.chunk's part `index` of each of the shard's sections along its dim, concatenated
    (a fused q|k|v weight: this rank's heads of q, of k and of v)."""
    bounds = [0]
    for length in shard.sections:
        assert length % parts == 0, (shard, parts)
        bounds.append(bounds[-1] + length)
    return torch.cat([torch.chunk(tensor[(slice(None),) * shard.dim + (slice(a, b),)], parts,
                                  dim=shard.dim)[index] for a, b in zip(bounds, bounds[1:])],
                     dim=shard.dim)


def held_view(pm, rank: int):
    """name, plain tensor -> what pm.named_parameters() holds of it between steps: `_local_view`,
    and under zero=3 (docs/memory.md: each trainable parameter flattened, padded to a multiple
    of its replica group's size d and cut in d; replica i owns chunk i) this rank's chunk of it.
    The replica group and index from the mesh coordinates: dense parameters over dp x cp
    (index dp * cp + cp), experts over the dp // ep ranks holding the same ones (index
    (dp // ep) * cp + cp)."""
    local = _local_view(pm, rank)
    if pm.zero != 3:
        return local
    mesh, at = pm.mesh, pm.mesh.coords(rank)
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}

    def held(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in trainable:
            return local(name, tensor)
        flat = local(name, tensor).reshape(-1)
        if mesh.ep > 1 and name in pm.compiled.plan.ep_shards:
            size, i = mesh.dp // mesh.ep * mesh.cp, at["dp"] // mesh.ep * mesh.cp + at["cp"]
        else:
            size, i = mesh.dp * mesh.cp, at["dp"] * mesh.cp + at["cp"]
        return zero_chunk(flat, size, i)
    return held


def zero_chunk(flat: torch.Tensor, size: int, index: int) -> torch.Tensor:
    """Replica `index`'s ZeRO chunk of a flattened tensor (docs/memory.md): the flat tensor padded
    with zeros to a multiple of `size`, torch.chunk'ed in `size`, the padding dropped again."""
    n = flat.numel()
    padded = torch.cat([flat, flat.new_zeros(-n % size)])
    chunk = torch.chunk(padded, size)[index]
    start = index * chunk.numel()
    return chunk[:max(0, min(chunk.numel(), n - start))]


def renamed_gpt_module():
    """examples/gpt.py with every class, module attribute and config field renamed (the passes
    must decide by ops and dataflow, never by names)."""
    import re
    import types
    from pathlib import Path
    if "renamed_gpt" in sys.modules:
        return sys.modules["renamed_gpt"]
    source = (Path(__file__).resolve().parents[2] / "examples" / "gpt.py").read_text()
    names = {"CausalSelfAttention": "Mixer", "MLP": "Widen", "Block": "Unit", "c_attn": "w0",
             "c_proj": "w1", "c_fc": "w2", "ln_1": "nA", "ln_2": "nB", "ln_f": "nZ", "attn": "mx",
             "mlp": "wd", "transformer": "trunk", "lm_head": "readout", "wte": "tok",
             "wpe": "where", "drop": "dz"}
    for old, new in names.items():
        source = re.sub(rf"\b{old}\b", new, source)
    module = types.ModuleType("renamed_gpt")
    module.__file__ = "renamed_gpt.py"
    sys.modules["renamed_gpt"] = module      # dataclasses look their module up
    exec(compile(source, "renamed_gpt.py", "exec"), module.__dict__)
    return module


# AUTOPART_TEST_NCCL_CONTRACT=1: every rank process (they all import this module) runs with
# batch_isend_irecv keeping NCCL's contract (tests/nccl_contract.py)
from tests import nccl_contract as _nccl_contract  # noqa: E402
_nccl_contract.install_from_env()


def each_case(run, rank: int, world: int, cases: list) -> list[dict]:
    """Rank function body: `run(rank, world, case)` for every case, a case that raises recorded
    with its traceback (one case's failure must not hide the others')."""
    import traceback
    out = []
    for case in cases:
        try:
            out.append({"case": case.name, **run(rank, world, case)})
        except Exception as e:  # noqa: BLE001
            out.append({"case": case.name, "problems": [f"{type(e).__name__}: {e}\n"
                                                        f"{traceback.format_exc()}"]})
    return out


__all__ = ["Case", "Extras", "Toy", "build", "each_case"]
