"""The planner against published H100 runs (data/published_h100_runs_given.json): each row's
measured TFLOP/s per GPU next to the prediction for its own layout, and the fit of the h100-sxm
constants on them (all rows, or half of them to predict the other half).

    python -m bench.published            # the table; --fit refits the constants

A row is predicted with its published tp, pp, dp (cp=1) and ZeRO level fixed (`zero_levels`),
and what the source does not state searched: microbatch size, virtual stages, schedule,
recomputation (none, selective, full on every layer or on the first N of each chunk). The runtime is Megatron-LM's (cost.RUNTIMES: tp collectives behind GEMMs,
sequence parallelism, parameter gathers behind the forward). Predicted TFLOP/s is the row's
FLOPs a step by Megatron-LM's count (`megatron_flops`, from the row's shape, not from the
planner) over the predicted step time and the GPUs, the unit the sources report.

FP8 (data/published_h100_fp8_runs.json, NeMo 24.07 on DGX-H100): each row with its tp, pp, dp, cp,
microbatch size and virtual stages fixed, precision="fp8" under Megatron-LM's runtime (Transformer
Engine's recipe: cost.CostModel.fp8_mask), compared in tokens a second per GPU (the source's unit;
`predicted_tokens`); the one FP8 constant, fp8_gemm_efficiency, is fitted on half the rows
(`half_split`, `fit_fp8`) and the other half predicted.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data" / "published_h100_runs_given.json"
# measured FP8 runs (NeMo's H100 performance summary), for the FP8 GEMM efficiency
FP8_DATA = Path(__file__).resolve().parent / "data" / "published_h100_fp8_runs.json"
GPT = str(ROOT / "examples" / "gpt.py") + ":GPT"
# a Llama-3-shaped model: GQA, SwiGLU, RMSNorm, RoPE, SDPA, an untied head
LLAMA = str(ROOT / "examples" / "llama.py") + ":Llama"
# the constants fitted; the rest of a cluster's constants (latency_s, attention_score_bytes) are fixed
FREE = ("gemm_efficiency", "gemm_half_dim", "fused_attention_efficiency", "intra_efficiency",
        "inter_efficiency", "memory_efficiency", "op_overhead_s")


def rows(path: Path = DATA) -> list[dict]:
    return json.loads(Path(path).read_text())["rows"]


def half_split(all_rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(fit half, held-out half): the rows sorted by GPU count (which orders them by size), every
    other one from the first fitted, the others held out."""
    ordered = sorted(all_rows, key=lambda r: (r["gpus"], r["layers"] * r["hidden"] ** 2))
    return ordered[0::2], ordered[1::2]


def megatron_flops(r: dict) -> float:
    """FLOPs a step as Megatron-LM's num_floating_point_operations counts them (training.py):
    12 B s l h^2 ((1 + g/a + s/h) + (f/h) * (3/2 if gated) + V / (2 l h)), g kv heads, a heads,
    f the feed-forward width; the Llama rows' SwiGLU is gated. Causal masking is not subtracted."""
    B, s, l, h, V = r["gbs"], r["seq"], r["layers"], r["hidden"], r["vocab"]
    gated = 1.5 if r["kv_heads"] != r["heads"] else 1.0       # the given Llama rows: GQA and SwiGLU
    return 12 * B * s * l * h * h * ((1 + r["kv_heads"] / r["heads"] + s / h) + r["ffn_hidden"] / h * gated
                                     + V / (2 * l * h))


def target(r: dict) -> tuple[str, str]:
    """(FILE.py:NAME, config spec) of the row's model shape."""
    if r["kv_heads"] == r["heads"] and r["ffn_hidden"] == 4 * r["hidden"]:
        return GPT, (f"tiny,n_embd={r['hidden']},n_layer={r['layers']},n_head={r['heads']},"
                     f"vocab_size={r['vocab']},block_size={r['seq']},tie_weights=false")
    return LLAMA, (f"llama3-405b,n_layer={r['layers']},n_embd={r['hidden']},n_head={r['heads']},"
                   f"n_kv_head={r['kv_heads']},ffn_hidden={r['ffn_hidden']},vocab_size={r['vocab']},"
                   f"block_size={r['seq']}")


def zero_levels(r: dict) -> tuple:
    """The Megatron-LM rows: the distributed optimizer (zero=1). Llama 3's FSDP shards optimizer
    state and gradients, keeping parameters whole after the forward; whether its pipeline
    reduce-scatters gradients every microbatch (zero=2) or once a step (zero=1) the paper does not
    say, so both are searched."""
    return (1, 2) if r["zero_or_fsdp"].startswith("FSDP") else (1,)


def model_for(r: dict, cluster, runtime: str = "megatron", precision: str = "bf16"):
    from autopart.planner.cost import CostModel
    from autopart.planner.profile import load_profile
    return CostModel(load_profile(*target(r)), cluster, r["gbs"], precision=precision, optimizer="adam",
                     runtime=runtime)


def predict(r: dict, cluster, *, simulate_top: int = 8, runtime: str = "megatron", precision: str = "bf16"):
    """The fastest fitting estimate of the row's own layout, or None. What the row gives is fixed
    (tp, pp, dp, cp, and where given the microbatch size and virtual stages), the rest searched."""
    from autopart.planner.search import search
    model = model_for(r, cluster, runtime, precision)
    fixed = {}
    if r.get("mbs"):
        fixed["microbatch_size"] = r["mbs"]
    if r.get("vp"):
        fixed.update(virtual_stages=r["vp"], schedule="interleaved-1f1b" if r["vp"] > 1 else "1f1b")
    best = None
    for z in zero_levels(r):
        ranked = search(model, r["gpus"], tp=r["tp"], pp=r["pp"], dp=r["dp"], cp=r.get("cp") or 1, zero=z,
                        simulate_top=simulate_top, **fixed)
        e = next((e for e in ranked if e.fits), None)
        if e is not None and (best is None or e.step_time < best.step_time):
            best = e
    return best


def predicted_tflops(r: dict, e) -> float:
    return megatron_flops(r) / (e.step_time * r["gpus"]) / 1e12 if e is not None else 0.0


def errors(cluster, some: list[dict], simulate_top: int = 8) -> list[float]:
    return [predicted_tflops(r, predict(r, cluster, simulate_top=simulate_top)) / r["tflops_per_gpu"] - 1
            for r in some]


def fit(base, some: list[dict], *, iterations: int = 60):
    """Nelder-Mead (fit._nelder_mead) over FREE in log space on `some` rows: the 8-norm of the
    relative errors (close to the largest, which the 10% bound is on)."""
    from autopart.planner.fit import _nelder_mead

    def make(x):
        return dataclasses.replace(base, **{k: math.exp(v) for k, v in zip(FREE, x)})

    def loss(x):
        values = {k: math.exp(v) for k, v in zip(FREE, x)}
        if any(v > 1 for k, v in values.items() if k not in ("gemm_half_dim", "op_overhead_s")):
            return 1e9
        return sum(e ** 8 for e in errors(make(x), some, simulate_top=2)) ** (1 / 8)

    return make(_nelder_mead(loss, [math.log(getattr(base, k)) for k in FREE], iterations))


# -- FP8 (precision="fp8") -----------------------------------------------------------------------

def fp8_rows(path: Path = FP8_DATA, *, all_rows: bool = False) -> list[dict]:
    """The FP8 runs whose model shape is known (all_rows: every recorded run)."""
    got = rows(path)
    return got if all_rows else [r for r in got if r["layers"] is not None]


def predicted_tokens(r: dict, e) -> float:
    """Tokens a second per GPU of estimate `e` for row `r`: the source's own unit, no FLOPs count
    between them (NeMo's Model TFLOP/s counts by its own formula)."""
    return r["gbs"] * r["seq"] / (e.step_time * r["gpus"]) if e is not None else 0.0


def fp8_errors(cluster, some: list[dict], simulate_top: int = 8, precision: str = "fp8") -> list[float]:
    """Per row, predicted / published tokens per second per GPU, minus 1."""
    return [predicted_tokens(r, predict(r, cluster, simulate_top=simulate_top, precision=precision))
            / r["tokens_per_s_per_gpu"] - 1 for r in some]


def fit_fp8(base, some: list[dict], *, lo: float = 0.2, hi: float = 1.0, iterations: int = 24) -> float:
    """fp8_gemm_efficiency minimizing the 8-norm of `some` rows' relative errors (the rest of
    `base` held): golden-section search on [lo, hi], the one free constant."""
    def loss(x):
        c = dataclasses.replace(base, fp8_gemm_efficiency=x)
        return sum(e ** 8 for e in fp8_errors(c, some, simulate_top=2)) ** (1 / 8)

    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    x1, x2 = b - g * (b - a), a + g * (b - a)
    f1, f2 = loss(x1), loss(x2)
    for _ in range(iterations):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - g * (b - a)
            f1 = loss(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (b - a)
            f2 = loss(x2)
    return round((a + b) / 2, 4)


__all__ = ["rows", "half_split", "megatron_flops", "target", "predict", "predicted_tflops", "errors",
           "fit", "FREE", "DATA", "FP8_DATA", "fp8_rows", "predicted_tokens", "fp8_errors", "fit_fp8"]
