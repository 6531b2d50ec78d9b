"""Rank functions for tests/test_fp8.py: parallelize(..., precision="fp8") against the plain model
trained under the FP8 recipe, written out here from its definition with plain torch._scaled_mm
calls (nothing of autopart/ops/fp8.py is imported).

The recipe (docs/precision.md): precision="bf16"'s (fp32 master weights, autocast bf16 compute,
fp32 loss and gradients: tests/workers/precision.py), and each chosen nn.Linear as three FP8
GEMMs with dynamic scales, scale = max(fp8) / amax (fp32, from fp64, amax floored at 1e-12):
  tensorwise  forward x (bf16) and w (fp32) in e4m3, one scale each; backward the output
              gradient in e5m2, times the forward's e4m3 w and x
  rowwise     every operand e4m3, one scale per row along the dim its GEMM contracts, rounded
              down to a power of 2; backward recasts g, w and x along their new contracted dims
Every GEMM out in bf16 (weight gradients too, added into the fp32 .grad); bias added in bf16.
Under fp8_linears="auto" the GPT's first linear (block 0's c_attn) and last (the lm head) stay
bf16 (KEPT, the rule of passes/fp8_linears.py applied by hand to examples/gpt.py).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn

from tests.workers.common import _local_view, build, held_view
from tests.workers.precision import (BCase, Wire, _measure, _rel, reference_step,
                                     round_at_pipeline_cuts, run_each)

KEPT = ("transformer.h.0.attn.c_attn", "lm_head")
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _q(t, amax, dtype, pow2):
    """(t in `dtype`, its scale) for an amax of t's shape-compatible size."""
    s = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    top = torch.finfo(dtype).max
    return torch.clamp(t.float() * s, -top, top).to(dtype), s


def _mm(a8, b8, sa, sb, out):
    # autocast off: CPU autocast would round _scaled_mm's fp32 scales to bf16
    with torch.autocast("cpu", enabled=False):
        return torch._scaled_mm(a8, b8, scale_a=1.0 / sa, scale_b=1.0 / sb, out_dtype=out)


class RefTensorwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x = x.to(torch.bfloat16)
        x8, sx = _q(x, x.abs().max().float(), E4, False)
        w8, sw = _q(w, w.abs().max().float(), E4, False)
        ctx.save_for_backward(x8, w8, sx, sw)
        return _mm(x8, w8.t(), sx, sw, torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
        x8, w8, sx, sw = ctx.saved_tensors
        g8, sg = _q(g, g.abs().max().float(), E5, False)
        return (_mm(g8, w8, sg, sw, torch.bfloat16), _mm(g8.t(), x8, sg, sx, torch.bfloat16))


class RefRowwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x = x.to(torch.bfloat16)
        ctx.save_for_backward(x, w)
        x8, sx = _q(x, x.abs().amax(1, keepdim=True).float(), E4, True)     # [M, 1]
        w8, sw = _q(w, w.abs().amax(1, keepdim=True).float(), E4, True)     # [N, 1]
        return _mm(x8, w8.t(), sx, sw.t(), torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g8, sg = _q(g, g.abs().amax(1, keepdim=True).float(), E4, True)      # over N, [M, 1]
        w8, sw = _q(w, w.abs().amax(0, keepdim=True).float(), E4, True)      # over N, [1, K]
        grad_x = _mm(g8, w8, sg, sw, torch.bfloat16)
        gt8, sgt = _q(g.t(), g.abs().amax(0, keepdim=True).float().t(), E4, True)  # over M
        x8, sx = _q(x, x.abs().amax(0, keepdim=True).float(), E4, True)      # over M, [1, K]
        return grad_x, _mm(gt8, x8, sgt, sx, torch.bfloat16)


def fp8_recipe(model: nn.Module, scaling: str, kept=KEPT) -> list[str]:
    """Make `model`'s linear modules (nn.Linear; HF GPT-2's Conv1D, x @ W + b with W[K, N]) but
    `kept` run the recipe; returns their names."""
    fn = RefRowwise if scaling == "rowwise" else RefTensorwise
    done = []
    for name, m in model.named_modules():
        conv1d = type(m).__name__ == "Conv1D"       # transformers.pytorch_utils.Conv1D
        if (isinstance(m, nn.Linear) or conv1d) and name not in kept:
            def forward(x, m=m, conv1d=conv1d):
                w = m.weight.t() if conv1d else m.weight
                y = fn.apply(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1)
                return y if m.bias is None else y + m.bias.to(y.dtype)
            m.forward = forward
            done.append(name)
    return done


# fp8_linears="auto"'s rule applied by hand to the test models: the first linear (no linear
# upstream) and the last (the head), by family; and every weight with a side under 32 or not a
# multiple of 16 ("small", from the weight's shape)
FIRST_LAST = {"gpt": KEPT, "hf-gpt2": KEPT,
              "hf-mixtral": ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                             "model.layers.0.self_attn.v_proj", "lm_head")}


def kept_by_rule(model: nn.Module, family: str) -> tuple[str, ...]:
    small = [name for name, m in model.named_modules()
             if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
             and (min(m.weight.shape) < 32 or any(d % 16 for d in m.weight.shape))]
    return tuple(FIRST_LAST[family]) + tuple(small)


def _family(model_name: str) -> str:
    """tests/workers/common's model name (gpt4, c-hf-gpt2-tied, ...) -> FIRST_LAST's family."""
    for family in ("hf-mixtral", "hf-gpt2"):
        if family in model_name:
            return family
    return "gpt"


@dataclass(frozen=True)
class FCase(BCase):
    scaling: str = "tensorwise"
    layers: str = "auto"                # fp8_linears
    precision: str = "fp8"
    recompute: str = "none"


# Bounds: relative errors over the whole model, as tests/workers/precision.py measures them.
# One process: the recipe's very roundings, every error 0.0. Pipeline (1F1B, zb-v) and data
# parallel with ZeRO-1: only fp32 sums reorder, "grad" <= 1.4e-8, "step1" and "update" <=
# 5.9e-8 (DualPipeV and ZeRO-2 pass the same bound, their values not recorded): "none" 1e-6. Tensor parallel: each rank rounds its partial row-parallel product (and its share
# of a column-parallel input gradient) to bf16 before the all-reduce adds them, and a bf16
# rounding that differs flips e4m3 roundings of the next linear's input (3 mantissa bits):
# measured "grad" 2.8e-2 tensorwise (2.8e-2 with fp8_linears="all"), 1.4e-2 rowwise, "update"
# <= 3.4e-2, loss <= 6.8e-5. "tp" cannot tell FP8 from bf16 (the bf16 recipe is 2.5e-2 to
# 4.4e-2 away): the global amaxes under tp are held bitwise by tp_linear_problems below, and
# BF16_APART checks FP8 ran (every case measured >= 2.5e-2 from the bf16 recipe).
# The composition matrix's gpt-tied-dualpipe-v-tp2+sp-dp2-zero1-fp8 (1 row a microbatch) measured
# "grad" 0.044 on the ranks holding the middle chunks' first replica slice, 0.025-0.030 on the
# others, "update" <= 0.048; the same case in bf16 shows the same pattern against its recipe
# (0.0079 there, 0.0034-0.0057 elsewhere): noise, as large as the bf16 recipe's distance, hence
# "tp" 5e-2 (and BF16_APART, the bitwise tp_linear_problems as above).
# HF Mixtral (routed, the composition matrix's hf-mixtral-tied-interleaved-1f1b-tp1-dp1-fp8, pp=2,
# no tp): "grad" 1.3e-2 and 9.4e-3 on the two ranks, "update" <= 1.7e-2, loss 2.7e-5, against
# 4.5e-2 from the bf16 recipe; in bf16 the same model is 2.3e-3-3.9e-3 from its recipe (its fp32
# router's top-2 choices flip on one rounding: tests/workers/precision.py), which FP8's coarser
# roundings widen. "moe" 2e-2 still tells FP8 from bf16 (BF16_APART below checks FP8 ran).
BOUNDS = {"none": 1e-6, "tp": 5e-2, "moe": 2e-2}
UPDATE_BOUND, LOSS_BOUND = 5e-2, 2e-4
BF16_APART = 1e-2      # "grad": the run is this far from the bf16 recipe at least (FP8 ran)


def fp8_equivalence(case: FCase, rank: int, watch=None) -> dict:
    """case.steps SGD steps of parallelize(precision="fp8") and of the plain model under the
    written-out recipe (and under the bf16 recipe, to show FP8 changed something). `watch(pm,
    converted)`, called before the first step, returns a function called after the last that
    returns more problems (tests/workers/fp8_zero3.py: what the all-gathers carried)."""
    import autopart
    from tests.workers.equivalence import held_grads, zero_replica

    start = time.perf_counter()
    model, loss_fn, inputs, target = build(case)
    ref, ref16 = copy.deepcopy(model), copy.deepcopy(model)
    scaling, layers = getattr(case, "scaling", "tensorwise"), getattr(case, "layers", "auto")
    kept = kept_by_rule(ref, _family(case.model)) if layers == "auto" else ()
    converted = fp8_recipe(ref, scaling, kept)
    mesh = autopart.Mesh(pp=case.pp, dp=case.dp, tp=case.tp)
    cfg = autopart.Config(microbatches=case.microbatches, schedule=case.schedule,
                          virtual_stages=case.virtual_stages, zero=case.zero, precision="fp8",
                          fp8_scaling=scaling, fp8_linears=layers,
                          sequence_parallel=case.sequence_parallel, recompute=case.recompute)
    pm = autopart.parallelize(model, mesh, inputs, loss_fn=loss_fn, target=target, config=cfg,
                              timeout=timedelta(seconds=120))
    opts = [pm.optimizer(torch.optim.SGD, lr=0.1)] + \
        [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ref16)]
    mbs = case.batch // (case.dp * case.microbatches)
    for m in (ref, ref16):
        round_at_pipeline_cuts(m, pm.compiled.plan)
    mine, local = held_view(pm, rank), _local_view(pm, rank)
    ours = dict(pm.named_parameters())
    theirs, theirs16 = dict(ref.named_parameters()), dict(ref16.named_parameters())
    first = {n: p.detach().clone() for n, p in ours.items()}
    watched = watch(pm, converted) if watch is not None else None

    def moved(params):
        return {n: (p if params is ours else mine(n, params[n])).detach() - first[n]
                for n, p in ours.items()}
    found: dict = {"errors": {}, "gap": {}, "apart": {}, "by_param": {}}
    problems, wire, losses = [], Wire(), []
    for step in range(1, case.steps + 1):
        with wire:
            wire.attach(pm)
            loss = pm.train_step(*inputs, target=target)
        ref_loss = reference_step(ref, inputs, target, loss_fn, mbs, "cpu")
        reference_step(ref16, inputs, target, loss_fn, mbs, "cpu")
        losses.append((float(loss), float(ref_loss)))
        found["errors"]["loss"] = max(found["errors"].get("loss", 0.0), _rel([loss], [ref_loss]))
        if step == 1:
            replica = zero_replica(pm, rank)
            got, want = held_grads(pm, local, theirs, replica)
            _measure("grad", got, want, held_grads(pm, local, theirs16, replica)[1], found)
        for o in opts:
            o.step(), o.zero_grad()
        if step == 1:
            _measure("step1", moved(ours), moved(theirs), moved(theirs16), found)
    _measure("update", moved(ours), moved(theirs), moved(theirs16), found)
    bounds = {"grad": BOUNDS[case.noise], "step1": BOUNDS[case.noise], "update": UPDATE_BOUND,
              "loss": LOSS_BOUND}
    problems += [f"{what}: relative error {e:.3g} > {bounds[what]} (vs the bf16 recipe: "
                 f"{found['apart'].get(what, float('nan')):.3g})"
                 for what, e in found["errors"].items() if not e <= bounds[what]]
    if not found["apart"]["grad"] > BF16_APART:
        problems.append(f"the step-1 gradients are {found['apart']['grad']:.3g} from the bf16 "
                        f"recipe's, not > {BF16_APART}: the run did not compute in FP8")
    not_fp32 = [n for n, p in ours.items() if p.dtype != torch.float32 or
                (p.grad is not None and p.grad.dtype != torch.float32)]
    if not_fp32:
        problems.append(f"parameters or gradients not fp32 (master weights): {not_fp32}")
    problems += watched() if watched is not None else []
    report = pm.compiled.passes
    fp8 = next((r.report for r in report if r.name == "fp8_linears"), {})
    return {"case": case.name, "rank": rank, "problems": problems, **found, "losses": losses,
            "wire": wire.report(), "seconds": time.perf_counter() - start,
            "converted": converted, "fp8": fp8, "explain": pm.compiled.explain()}


def run_fp8_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: every case in turn; a case that raises is recorded, later ones skipped."""
    return run_each(fp8_equivalence, rank, cases)


# -- one linear over 2 tensor-parallel ranks, against the recipe's pieces ----------------------

def _pieces(scaling: str, x, w, g):
    """The recipe on the whole linear: (x8, sx, w8, sw) of the forward GEMM and, for the two
    backward GEMMs, (g8, sg, w8, sw) of g @ w and the weight gradient, each operand with the
    scales of the whole tensor, from which a rank's share of each GEMM is cut."""
    x = x.to(torch.bfloat16)
    rowwise = scaling == "rowwise"
    fwd_dims = {"x": 1, "w": 1} if rowwise else {"x": None, "w": None}

    def q(t, dim, dtype):
        a = t.abs().max() if dim is None else t.abs().amax(dim, keepdim=True)
        return _q(t, a.float(), dtype, rowwise)
    x8, sx = q(x, fwd_dims["x"], E4)
    w8, sw = q(w, fwd_dims["w"], E4)
    g8, sg = q(g, 1 if rowwise else None, E4 if rowwise else E5)
    bw8, bsw = q(w, 0, E4) if rowwise else (w8, sw)
    if rowwise:     # g.T @ x contracts the tokens: g's columns and x's columns over them
        (gt8, sgt), (xm8, sxm) = q(g.t(), 1, E4), q(x, 0, E4)
        grad_w = _mm(gt8, xm8, sgt, sxm, torch.bfloat16)
    else:
        grad_w = _mm(g8.t(), x8, sg, sx, torch.bfloat16)
    return dict(x8=x8, sx=sx, w8=w8, sw=sw, g8=g8, sg=sg, bw8=bw8, bsw=bsw, grad_w=grad_w)


def _cut(s, dim, part, tp=2):
    """Rank `part`'s share of a scale: a scalar or a size-1 dim is everyone's."""
    return s if s.dim() == 0 or s.shape[dim] == 1 else s.chunk(tp, dim)[part]


def _halves(n: int, first: float, second: float) -> torch.Tensor:
    return torch.cat([torch.full((n // 2,), float(first)), torch.full((n // 2,), float(second))])


def tp_linear_problems(rank: int, world: int, scaling: str) -> list[str]:
    """fp8_linear_tp on rank `rank`'s shard of a 64x96x80 linear, column- then row-parallel:
    every output and gradient the rank computes bitwise equal to its share of the recipe's
    GEMMs with the whole tensors' scales (which only the max all-reduce gives it), with the
    weight's amax reduced by the linear and batched at a chunk's start (_shard_problems)."""
    import torch.distributed as dist
    from autopart.ops.tp import TPComm

    comm = TPComm(world).bind(dist.group.WORLD, rank)
    g_ = torch.Generator().manual_seed(0)
    M, K, N = 64, 80, 96
    # one half of every tensor 50x the other: a rank's local amax is not the global one
    x = torch.randn(M, K, generator=g_) * _halves(K, 1, 50)
    w = torch.randn(N, K, generator=g_) * _halves(N, 1, 50)[:, None]
    g = (torch.randn(M, N, generator=g_) * _halves(N, 50, 1)).bfloat16()
    p = _pieces(scaling, x, w, g)
    problems = []
    for batched in (False, True):
        problems += _shard_problems(rank, scaling, batched, comm, x, w, g, p)
        if scaling == "tensorwise":
            problems += _sequence_parallel_problems(rank, batched, comm, x, w, g, p)
    return problems


def _sequence_parallel_problems(rank, batched, comm, x, w, g, p) -> list[str]:
    """fp8_gather_linear_sp: the column-parallel shard with x's tokens split over the 2 ranks
    (the op gathers them in FP8): the output and the weight gradient bitwise the recipe's share,
    the input gradient this rank's tokens of the sum of both ranks' bf16 GEMMs over their
    output features (what the reduce-scatter adds)."""
    from autopart.ops import fp8 as fp8_ops
    problems, how = [], "batched" if batched else "per linear"
    (M, K), N = x.shape, w.shape[0]
    rows, tokens = slice(rank * N // 2, (rank + 1) * N // 2), slice(rank * M // 2, (rank + 1) * M // 2)
    xs, ws = x[tokens].clone().requires_grad_(), w[rows].clone().requires_grad_()
    w_amax = fp8_ops.fp8_weight_amaxes_tp([ws], [0], [None], comm)[0] if batched else None
    y = fp8_ops.fp8_gather_linear_sp(xs, ws, None, "tensorwise", 0, False, True, comm, w_amax,
                                     seq_dim=0)
    y.backward(g[:, rows])
    halves = [slice(r * N // 2, (r + 1) * N // 2) for r in range(2)]
    partial = [_mm(p["g8"][:, h], p["bw8"][h], p["sg"], p["bsw"], torch.bfloat16) for h in halves]
    for what, got, want in (
            ("forward", y, _mm(p["x8"], p["w8"][rows].t(), p["sx"], p["sw"], torch.bfloat16)),
            ("weight gradient", ws.grad, p["grad_w"][rows]),
            ("input gradient", xs.grad, (partial[0] + partial[1])[tokens])):
        if not torch.equal(got.float(), want.float()):
            problems.append(f"sequence-parallel {what} ({how}): max difference "
                            f"{(got.float() - want.float()).abs().max():.3g}")
    return problems


def _shard_problems(rank, scaling, batched, comm, x, w, g, p) -> list[str]:
    """The column- then row-parallel shard of tp_linear_problems; `batched`: the weight's amax
    over tp from fp8_weight_amaxes_tp (a chunk's one all-reduce at its start, passed as w_amax),
    else reduced by the linear itself."""
    from autopart.ops import fp8 as fp8_ops
    rowwise, problems = scaling == "rowwise", []
    N, K = w.shape
    how = "batched" if batched else "per linear"

    def check(what, got, want):
        if not torch.equal(got.float(), want.float()):
            problems.append(f"{scaling} {what} ({how}): max difference "
                            f"{(got.float() - want.float()).abs().max():.3g}")

    def linear(xs, ws, k_split, n_split):
        w_amax = None
        if batched:     # the weight's amax over the dim its split lies on (rowwise) or whole
            dim = (1 if k_split else 0) if rowwise else None
            (w_amax,) = fp8_ops.fp8_weight_amaxes_tp([ws], [0], [dim], comm)
        return fp8_ops.fp8_linear_tp(xs, ws, None, scaling, 0, k_split, n_split, comm, w_amax)

    # column-parallel: w's rows (output features) split; x whole
    rows = slice(rank * N // 2, (rank + 1) * N // 2)
    xs, ws = x.clone().requires_grad_(), w[rows].clone().requires_grad_()
    y = linear(xs, ws, False, True)
    y.backward(g[:, rows])
    check("column forward", y, _mm(p["x8"], p["w8"][rows].t(), p["sx"],
                                   _cut(p["sw"], 0, rank).t(), torch.bfloat16))
    check("column input-gradient share", xs.grad,
          _mm(p["g8"][:, rows], p["bw8"][rows], p["sg"], p["bsw"], torch.bfloat16))
    check("column weight gradient", ws.grad, p["grad_w"][rows])
    # row-parallel: the contracted dim split, x's and w's columns
    cols = slice(rank * K // 2, (rank + 1) * K // 2)
    xs, ws = x[:, cols].clone().requires_grad_(), w[:, cols].clone().requires_grad_()
    y = linear(xs, ws, True, False)
    y.backward(g)
    check("row forward share", y, _mm(p["x8"][:, cols], p["w8"][:, cols].t(), p["sx"],
                                      p["sw"].t(), torch.bfloat16))
    check("row input gradient", xs.grad,
          _mm(p["g8"], p["bw8"][:, cols], p["sg"], _cut(p["bsw"], 1, rank), torch.bfloat16))
    check("row weight gradient", ws.grad, p["grad_w"][:, cols])
    return problems
