"""Rank functions for the expert-parallel tests (module level, so spawned ranks can import them).

`ep_cases` runs, on each of `world` ranks (dp = world, ep | dp), an MoE model (examples/switch.py
captured with its routing counts, GatedMoE, or an unmodified Hugging Face MoE) rewritten by
shard_experts and given the rank's experts; each rank is fed its own data-parallel shard of the
global batch. Against a deep copy of the plain model (taken before capture: captured programs
share parameter objects with the model) run on the whole batch, it checks every SGD step's loss
(mean over ranks), the routing counts (summed over ranks), the first step's gradients and every
parameter after the last step. Gradients are reduced as the runtime must: dense ones summed over
the dp ranks and divided by dp; expert ones summed over the dp/ep ranks holding the same experts
and divided by dp (see reduce_grad).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

RTOL, ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@dataclass(frozen=True)
class EPCase:
    name: str
    spec: str                 # examples.switch config, "gated" (GatedMoE) or "hf-..." (hf_moe)
    skew: bool = False        # router skewed: capacity binds, the last expert gets no tokens
    ep: int = 0               # 0: ep = world (= dp)
    bug: bool = False         # reduce expert grads as dense ones over the replicas (the common
                              # bug: ep times too large); the test expects it to be caught
    batch: int = 4            # global batch (sequences of block_size tokens)
    steps: int = 3
    lr: float = 0.5


class GatedMoE(nn.Module):
    """A mixture-of-experts LM written unlike examples/switch.py: top-2 by `topk`, dropless
    dense dispatch, SwiGLU experts with separate gate/up/down stacked weights, a per-expert bias
    [E, 1, F] and a replicated scale [F] inside the experts, no attention."""

    def __init__(self, vocab: int = 64, width: int = 16, hidden: int = 32, experts: int = 4,
                 group: int = 8, shared_use: bool = False):
        super().__init__()
        E, C, Fd = experts, width, hidden
        self.group, self.shared_use = group, shared_use
        self.emb = nn.Embedding(vocab, C)
        self.gate = nn.Linear(C, E, bias=False)
        self.w_gate = nn.Parameter(torch.randn(E, C, Fd) * 0.2)
        self.w_up = nn.Parameter(torch.randn(E, C, Fd) * 0.2)
        self.b_up = nn.Parameter(torch.randn(E, 1, Fd) * 0.1)
        self.scale = nn.Parameter(torch.ones(Fd) + 0.1 * torch.randn(Fd))
        self.w_down = nn.Parameter(torch.randn(E, Fd, C) * 0.2)
        self.head = nn.Linear(C, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        h = self.emb(x)                                               # (B, T, C)
        C, S, E = h.shape[-1], self.group, self.w_up.shape[0]
        g = h.reshape(-1, S, C)                                       # (G, S, C)
        probs = self.gate(g).softmax(-1)                              # (G, S, E)
        top = probs.topk(2, dim=-1)
        mask = F.one_hot(top.indices, E).sum(2)                       # (G, S, E)
        pos = (torch.cumsum(mask, 1) - 1).clamp(min=0)
        dispatch = mask.unsqueeze(-1) * F.one_hot(pos, S)             # (G, S, E, S) dropless
        combine = (probs * mask).unsqueeze(-1) * dispatch
        xin = torch.einsum("gsec,gsm->egcm", dispatch.to(h.dtype), g).reshape(E, -1, C)
        up = torch.bmm(xin, self.w_up) + self.b_up
        a = F.silu(torch.bmm(xin, self.w_gate)) * up * self.scale
        out = torch.bmm(a, self.w_down).reshape(E, -1, S, C)          # (E, G, S, C)
        mixed = torch.einsum("gsec,egcm->gsm", combine, out).reshape(B, T, C)
        loss = F.cross_entropy(self.head(h + mixed).reshape(-1, self.head.out_features),
                               y.reshape(-1))
        if self.shared_use:            # the expert weight read whole outside the experts
            loss = loss + 1e-3 * self.w_down.square().sum()
        return loss


def hf_moe(name: str, layers: int = 2) -> nn.Module:
    """An unmodified Hugging Face mixture-of-experts LM built from a small config (4 experts,
    top-2, the default grouped_mm experts: rows sorted by expert, dropless)."""
    import transformers
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    if name == "hf-mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4))
    if name == "hf-olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common, num_experts=4))
    if name == "hf-qwen2-moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, moe_intermediate_size=64,
            shared_expert_intermediate_size=64))
    raise KeyError(name)


def hf_loss(out, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


class WithStats(nn.Module):
    """model(idx, targets, True) as a flat tuple: (loss, routed, processed, dropped_tokens)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        loss, stats = self.model(idx, targets, True)
        return loss, stats["routed"], stats["processed"], stats["dropped_tokens"]


def capture_with_stats(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor):
    """A Program whose graph returns the loss and the routing counts (capture() keeps only the
    loss; this uses its export and conversion steps directly)."""
    from autopart import capture as cap
    wrapper = WithStats(model)
    args = (idx.clone(), targets.clone())
    exported, dynamic = cap._export(wrapper, args)
    return cap._to_program(exported, model, args, dynamic, ["idx", "targets"])


def skew_router(model: nn.Module) -> None:
    """Skew every router: a norm with a tiny gain and a bias c makes each MoE input ~ c plus a
    little noise, and the router scores c as expert 0 > 1 > ... > E-2 >> E-1, with a random part
    that lets tokens differ. Expert 0 overflows its capacity and the last expert gets no tokens,
    neither as first nor as second choice."""
    with torch.no_grad():
        for block in model.transformer.h:
            if not hasattr(block.mlp, "router"):
                continue
            w = block.mlp.router.weight                           # (E, C)
            E, C = w.shape
            c = torch.linspace(-1, 1, C)
            c = c / c.norm()
            block.ln_2.bias.copy_(2 * c)
            block.ln_2.weight.fill_(0.05)
            r = torch.randn(E, C, generator=torch.Generator().manual_seed(0))
            r = r - (r @ c)[:, None] * c
            prefs = torch.linspace(1.0, 0.6, E)
            prefs[-1] = -5.0
            w.copy_(r + prefs[:, None] * c)


def batches(vocab: int, seq: int, steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),
             torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(steps)]


def ep_groups(rank: int, world: int, ep: int):
    """(this rank's ep group, its index in it, its expert-replica group) over dp = world ranks:
    ep groups are consecutive data-parallel ranks {0..ep-1}, {ep..2ep-1}, ...; the replica
    group holds the ranks with the same index in their ep group, which keep the same experts.
    Every rank creates every group, in the same order (torch.distributed requires it)."""
    mine = rank // ep, rank % ep
    ep_group = replica = None
    for g in range(world // ep):
        pg = dist.new_group(list(range(g * ep, (g + 1) * ep)))
        if g == mine[0]:
            ep_group = pg
    for i in range(ep):
        pg = dist.new_group(list(range(i, world, ep)))
        if i == mine[1]:
            replica = pg
    return ep_group, mine[1], replica


def run_case(rank: int, world: int, case: EPCase, program_cache: dict) -> dict:
    from autopart.capture import capture
    from autopart.localize import localize_module
    from autopart.passes.shard_experts import shard_experts
    from examples.switch import SwitchGPT, config

    gated = case.spec == "gated"
    hf = case.spec.startswith("hf-")
    torch.manual_seed(0)
    model = GatedMoE() if gated else hf_moe(case.spec) if hf else SwitchGPT(config(case.spec))
    vocab, seq = (64, 16) if gated else (128, 16) if hf else (model.config.vocab_size,
                                                              model.config.block_size)
    data = batches(vocab, seq, case.steps, case.batch)
    if case.spec not in program_cache:
        x0, y0 = data[0][0][:2], data[0][1][:2]
        program_cache[case.spec] = (model, capture(model, (x0, y0)) if gated else
                                    capture(model, (x0,), loss_fn=hf_loss, target=y0) if hf else
                                    capture_with_stats(model, x0, y0))
    shared, program = program_cache[case.spec]
    with torch.no_grad():   # this case's weights, into the model the program reads
        for p, q in zip(shared.parameters(), model.parameters()):
            p.copy_(q)
    if case.skew:
        skew_router(shared)
    ref = copy.deepcopy(shared)
    ep = case.ep or world
    if ("groups", ep) not in program_cache:
        program_cache[("groups", ep)] = ep_groups(rank, world, ep)
    ep_group, ep_rank, replica = program_cache[("groups", ep)]
    rewritten, report = shard_experts(program, ep=ep)
    plan = rewritten.ep
    gm = localize_module(rewritten.gm, ep_shards=plan.params, ep=(ep, ep_rank), copy=True)
    if ep > 1:
        gm.ep_comm.bind(ep_group, ep_rank)

    ref_params = dict(ref.named_parameters())
    mine = dict(gm.named_parameters())
    problems, losses, counts = [], [], []
    for step, (x, y) in enumerate(data):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]     # this rank's data-parallel shard
        out = gm(xs, ys)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        ref_out = ref(x, y) if gated else hf_loss(ref(x), y) if hf else ref(x, y, True)
        ref_loss = ref_out if gated or hf else ref_out[0]
        ref_loss.backward()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        losses.append((float(mean_loss), float(ref_loss.detach())))
        if not torch.allclose(mean_loss, ref_loss.detach(), rtol=RTOL, atol=ATOL):
            problems.append(f"step {step}: loss {float(mean_loss)} != plain {float(ref_loss)}")
        if not (gated or hf):
            ref_stats = ref_out[1]
            for key, count in zip(("routed", "processed", "dropped_tokens"), out[1:]):
                total = count.clone()
                dist.all_reduce(total)
                if not torch.equal(total, ref_stats[key]):
                    problems.append(f"step {step}: {key} {total.tolist()} != plain "
                                    f"{ref_stats[key].tolist()}")
            counts.append({k: v.tolist() for k, v in ref_stats.items()})

        for name, p in mine.items():
            grad = reduce_grad(name, p.grad, plan, world, replica)
            if case.bug and name in plan.params:
                grad = grad * ep          # averaged over the dp/ep replicas only
            want = ref_params[name].grad
            if name in plan.params:
                want = want.chunk(ep, dim=0)[ep_rank]
            if step == 0 and not torch.allclose(grad, want, rtol=GRAD_RTOL, atol=GRAD_ATOL):
                ratio = float(grad.norm() / want.norm().clamp(min=1e-30))
                problems.append(f"grad {name}: max diff {float((grad - want).abs().max()):.3g} "
                                f"(norm ratio {ratio:.3f})")
            with torch.no_grad():
                p -= case.lr * grad
            p.grad = None
        with torch.no_grad():
            for p in ref.parameters():
                if p.grad is not None:
                    p -= case.lr * p.grad
                p.grad = None
    for name, p in mine.items():
        want = ref_params[name].detach()
        if name in plan.params:
            want = want.chunk(ep, dim=0)[ep_rank]
        if not torch.allclose(p.detach(), want, rtol=RTOL, atol=ATOL):
            problems.append(f"after {case.steps} steps: {name} differs by "
                            f"{float((p.detach() - want).abs().max()):.3g}")
    return {"case": case.name, "rank": rank, "problems": problems, "losses": losses,
            "counts": counts, "layers": [layer["name"] for layer in report["layers"]],
            "expert_params": sorted(plan.params),
            "local_shapes": {n: tuple(mine[n].shape) for n in plan.params}}


def reduce_grad(name: str, grad: torch.Tensor, plan, dp: int, replica) -> torch.Tensor:
    """What the runtime must do. Dense gradients: sum over the dp ranks, divide by dp. An expert
    gradient already holds the tokens of every rank of this rank's ep group for this rank's
    experts: sum it over the expert-replica group (the dp/ep ranks holding the same experts, one
    per ep group) and divide by dp, not by dp/ep."""
    grad = grad.clone()
    dist.all_reduce(grad, group=replica if name in plan.params else None)
    return grad / dp


def ep_cases(rank: int, world: int, cases: list) -> list[dict]:
    torch.manual_seed(0)
    cache: dict = {}
    return [run_case(rank, world, case, cache) for case in cases]


# -- expert tensor parallelism (tests/test_expert_tensor_parallel.py) ---------------------------

WITHOUT_EXPERT_REDUCE = "-no-expert-all-reduce"


def etp_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: tests.workers.equivalence.run_cases with the families registered (qwen3-moe);
    a case named ...-no-expert-all-reduce compiles with the all-reduce after each row-parallel
    expert matmul left out, so each tp rank combines only its partial expert output: it must differ
    from the plain model, or the equality of the other cases would prove nothing."""
    from tests.workers import family  # noqa: F401  (registers the families)
    from tests.workers.equivalence import run_cases
    normal = [c for c in cases if not c.name.endswith(WITHOUT_EXPERT_REDUCE)]
    out = run_cases(rank, world, normal)
    broken = [c for c in cases if c.name.endswith(WITHOUT_EXPERT_REDUCE)]
    if broken:
        with _expert_reduce_left_out():
            out += run_cases(rank, world, broken)
    return out


class _expert_reduce_left_out:
    """split_tensor_parallel's rewrite, for the duration, keeps the partial sums of expert
    matmuls (a weight stacked over experts, 3-D) instead of all-reducing them over tp."""

    def __enter__(self):
        import importlib
        from autopart.placement import ndim
        rewrite = importlib.import_module("autopart.passes.split_tensor_parallel.rewrite")
        self.module, self.reduce = rewrite, rewrite._reduce

        def reduce(g, partial, comm, seq_dim, like):
            if len(like.args) > 1 and ndim(like.args[1]) == 3:
                return partial
            return self.reduce(g, partial, comm, seq_dim, like)
        rewrite._reduce = reduce
        return self

    def __exit__(self, *exc):
        self.module._reduce = self.reduce


# -- host syncs of dropless expert parallelism (tests/test_expert_parallel.py) ------------------

def expert_syncs(rank: int, world: int) -> dict:
    """HF Mixtral (dropless, rows sorted by expert) on dp=world x ep=world, 2 microbatches: the
    host syncs of its second train_step made in autopart's own files (the model's own code,
    e.g. transformers' grouped-mm fallback on the CPU, syncs in the plain model too), and the
    number of MoE layers it has."""
    from pathlib import Path
    from tests.workers.common import Case
    from tests.workers.overlap import counted_syncs
    case = Case("mixtral-syncs", model="mixtral", dp=world, ep=world, microbatches=2, batch=4)
    root = Path(__file__).resolve().parents[2]
    ours = {p.name for d in ("autopart", "runtime", "passes") for p in (root / d).rglob("*.py")}
    syncs = [s for s in counted_syncs(case, rank, {"nonfinite": "ignore"}) if s.split(" at ")[1].split(":")[0] in ours]
    return {"syncs": syncs, "moe_layers": hf_moe("hf-mixtral").config.num_hidden_layers,
            "microbatches": case.microbatches}
