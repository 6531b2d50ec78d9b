"""Search over layouts: tp, pp, dp, virtual stages, microbatch size, schedule, recomputation, the
ZeRO level (0, 1, 2 with dp > 1).

Every candidate is first priced with the bubble formula (microseconds each), then the best
`simulate_top` (fitting or not) are priced again with the C++ simulator and re-ranked; the table
says which rows were simulated. Layouts that do not fit the memory model stay in the table, with
their prediction and why they were rejected. ep is searched for mixture-of-experts models (powers
of two dividing the expert count and dp); dense models have ep = 1. cp (context parallelism: each
sequence split over cp ranks) is searched for long sequences, from CP_MIN_SEQ tokens, or when no
layout without it fits: powers of two with 2*cp dividing the sequence (causal load balancing cuts
it in 2*cp chunks), for models whose layers have attention cores.

>>> from autopart.planner.search import divisors
>>> divisors(12)
[1, 2, 3, 4, 6, 12]
"""
from __future__ import annotations

import dataclasses

from autopart.config import choices
from autopart.errors import AutopartError
from autopart.memory.units import ZERO_LEVELS
from autopart.planner.cost import (SCHEDULE_NAMES, CostModel, Estimate, Layout, chunk_layers,
                                   fp8_refused)

MICROBATCH_SIZES = (1, 2, 4, 8, 16)
MAX_VIRTUAL_STAGES = 8
CP_MIN_SEQ = 8192       # tokens: from here on context parallelism is searched
MAX_CP = 64


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_degrees(model: CostModel, gpus: int) -> list[int]:
    """The context-parallel degrees > 1 worth pricing: powers of two dividing `gpus`, with 2*cp
    dividing the sequence, for a model whose layer has attention cores (the ring passes K/V)."""
    p = model.profile
    if p.parts[(1, 1)]["layer"].kv_bytes(1) <= 0:
        return []
    return [k for k in (2 ** i for i in range(1, MAX_CP.bit_length()))
            if gpus % k == 0 and p.seq % (2 * k) == 0]


def long_sequence(model: CostModel) -> bool:
    return model.profile.seq >= CP_MIN_SEQ


def meshes(model: CostModel, gpus: int, tp=None, pp=None, dp=None, ep=None,
           cp=None) -> list[tuple[int, int, int, int, int]]:
    """(tp, pp, dp, ep, cp) with tp * cp * pp * dp = gpus: tp inside a node and analysed, cp in
    `cp` (an int, or a list of degrees; None: 1), pp at most the layers, ep (expert shards, over
    dp ranks) dividing dp."""
    c, p = model.cluster, model.profile
    cps = [1] if cp is None else [cp] if isinstance(cp, int) else list(cp)
    out = []
    for t, e in sorted(p.parts):
        if t > c.gpus_per_node or gpus % t or (tp and t != tp) or (ep and e != ep):
            continue
        for k in cps:
            if gpus % (t * k):
                continue
            for q in divisors(gpus // (t * k)):
                d = gpus // (t * k * q)
                if q > p.layers or (pp and q != pp) or (dp and d != dp) or model.batch % d or d % e:
                    continue
                out.append((t, q, d, e, k))
    return out


# Megatron-LM's choices, most memory saved first: full (keep layer inputs), selective (rerun
# attention cores), none; the values are Config's (auto is the compiler's choice under a budget)
RECOMPUTE = tuple(reversed([r for r in choices("recompute") if r != "auto"]))


def candidates(model: CostModel, gpus: int, *, tp=None, pp=None, dp=None, microbatch_size=None,
               virtual_stages=None, schedule=None, recompute=None, ep=None,
               zero=None, cp=None) -> list[Layout]:
    """Every layout the knobs allow; a knob given is fixed, the others are searched (cp: an int
    fixes it, a list gives the degrees to search, None is 1)."""
    layers = model.profile.layers
    out = []
    for t, q, d, e, k in meshes(model, gpus, tp, pp, dp, ep, cp):
        levels = [zero] if zero is not None else ZERO_LEVELS if d * k > 1 else (0,)
        for b in ([microbatch_size] if microbatch_size else MICROBATCH_SIZES):
            for name, v in _schedules(q, layers, virtual_stages, schedule):
                for r in ([recompute] if recompute else RECOMPUTE):
                    for z in levels:
                        lay = Layout(t, q, d, b, v, name, r, e, z, k)
                        if model.check(lay) is None:
                            out.append(lay)
    return out


def _schedules(pp: int, layers: int, virtual_stages, schedule):
    names = [schedule] if schedule else SCHEDULE_NAMES
    for name in names:
        if name == "1f1b":
            if virtual_stages in (None, 1):
                yield name, 1
            continue
        vs = [virtual_stages] if virtual_stages else range(2, MAX_VIRTUAL_STAGES + 1)
        for v in vs:
            # interleaving: v chunks a rank, as even as possible (chunk_layers: Megatron-LM's
            # uneven first and last stages, as Llama 3's 126 layers over pp=16 had)
            if pp > 1 and v > 1 and layers >= pp * v:
                yield name, v


def search(model: CostModel, gpus: int, *, simulate_top: int = 24, **knobs) -> list[Estimate]:
    """Ranked estimates, best first: fitting layouts by step time, then the rejected ones. cp
    (a knob: fixed) is searched from CP_MIN_SEQ tokens, or when no layout without it fits."""
    if gpus < 1:
        raise AutopartError(f"--gpus {gpus} must be at least 1")
    cp = knobs.pop("cp", None)
    degrees = cp_degrees(model, gpus) if cp is None else []
    searched = [1, *degrees] if cp is None and long_sequence(model) else cp
    layouts = candidates(model, gpus, cp=searched, **knobs)
    rough = [model.estimate(lay, simulate=False) for lay in layouts]
    if cp is None and degrees and not long_sequence(model) and not any(e.fits for e in rough):
        more = candidates(model, gpus, cp=degrees, **knobs)     # nothing fits: try splitting sequences
        rough += [model.estimate(lay, simulate=False) for lay in more]
    if not rough:
        raise AutopartError(_nothing(model, gpus, {**knobs, "cp": cp}))
    if knobs.get("recompute") in (None, "full"):
        rough += partial_recompute(model, rough, simulate_top)
    rough.sort(key=_rank)
    fitting = [e for e in rough if e.fits][:simulate_top]
    rejected = [e for e in rough if not e.fits][: max(4, simulate_top // 4)]
    exact = {e.layout: model.estimate(e.layout) for e in fitting + rejected}
    return sorted((exact.get(e.layout, e) for e in rough), key=_rank)


def partial_recompute(model: CostModel, rough: list[Estimate], top: int) -> list[Estimate]:
    """For the `top` fastest layouts without recomputation that do not fit: the same layout
    recomputing the fewest layers of each chunk that fits (Megatron-LM's block method), found by
    bisection (memory falls as more layers rerun)."""
    tried = sorted((e for e in rough if e.layout.recompute == "none" and not e.fits), key=lambda e: e.step_time)
    out = []
    for e in tried[:4 * top]:
        lay = e.layout
        counts = chunk_layers(model.profile.layers, lay.pp * lay.virtual_stages)
        lo, hi = 1, max(counts) - 1          # all of a chunk's layers is recompute="full" itself
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            est = model.estimate(dataclasses.replace(lay, recompute="full", recompute_layers=mid), simulate=False)
            if est.fits:
                best, hi = est, mid - 1
            else:
                lo = mid + 1
        if best is not None:
            out.append(best)
    return out


def zero_choice(model: CostModel, best: Estimate) -> str:
    """Why `best` has its ZeRO level: the same layout at the other levels, as predicted."""
    lay = best.layout
    if lay.replicas == 1:
        return "zero=0: dp=1, no replicas to shard over"
    others = []
    for z in (z for z in ZERO_LEVELS if z != lay.zero):
        e = model.estimate(dataclasses.replace(lay, zero=z))
        gb = f"{e.memory['total'] / 1e9:.1f} GB per rank"
        others.append(f"zero={z} needs {gb}, more than the cluster's "
                      f"{model.cluster.memory_bytes / 1e9:g} GB" if not e.fits else
                      f"zero={z}: {e.step_time / best.step_time - 1:+.1%} step time, {gb}")
    return (f"zero={lay.zero} ({best.memory['total'] / 1e9:.1f} GB per rank, the fastest level "
            f"that fits): " + "; ".join(others))


def cp_choice(model: CostModel, best: Estimate, ranked: list[Estimate]) -> str:
    """Why `best` has its cp degree: activations with and without it, the best layout of the
    other choice, the ring's share of the step."""
    lay, p = best.layout, model.profile
    gib = 2 ** 30
    fitting = [e for e in ranked if e.fits]
    if lay.cp == 1:
        others = [e for e in fitting if e.layout.cp > 1]
        if not any(e.layout.cp > 1 for e in ranked):
            why = (f"at {p.seq} tokens (< {CP_MIN_SEQ}) context parallelism is not searched while a "
                   "layout without it fits" if not long_sequence(model) else
                   "no cp degree applies (2*cp must divide the sequence and the GPUs, and the layer "
                   "needs attention cores)")
            return f"cp=1: {why}"
        if not others:
            return f"cp=1: at {p.seq} tokens no layout with cp > 1 fits"
        o = others[0]
        return (f"cp=1: at {p.seq} tokens the sequence fits a rank whole; the fastest layout with cp, "
                f"{o.layout.mesh}, is {o.step_time / best.step_time - 1:+.1%} in step time")
    whole = model.estimate(dataclasses.replace(lay, cp=1), simulate=False)
    layer_cp, _ = model.kept_per_layer(lay)
    layer_1, _ = model.kept_per_layer(dataclasses.replace(lay, cp=1))
    no_cp = [e for e in fitting if e.layout.cp == 1]
    if no_cp:
        rival = (f"the fastest without cp, {no_cp[0].layout.mesh}, takes "
                 f"{no_cp[0].step_time / best.step_time - 1:+.1%} step time")
    else:
        rival = "no layout without cp fits"
    ring = best.breakdown.get("cp_ring_exposed", 0.0)
    layer = model.parts(lay)["layer"]
    moved = layer.kv_bytes(lay.microbatch_size) * model._act_scale / lay.cp
    # transfer time a step on the first pipeline rank: K/V forward (again when recomputed), and
    # K/V with dK/dV backward, cp - 1 steps per attention layer and microbatch
    counts = chunk_layers(p.layers, lay.pp * lay.virtual_stages)
    layers = sum(n for k, n in enumerate(counts) if k % lay.pp == 0)
    sends = 3 + (lay.recompute == "full")
    transfer = (model.microbatches(lay) * layers * (lay.cp - 1) * sends
                * model.ring_transfer(layer, lay.tp, lay.microbatch_size, lay.cp))
    return (f"cp={lay.cp}: at {p.seq} tokens a layer keeps {layer_1 / gib:.2f} GiB of activations per "
            f"microbatch on a rank with cp=1 ({whole.memory['activations'] / gib:.1f} GiB in all, "
            f"{whole.memory['total'] / 1e9:.1f} GB per rank with this layout: "
            f"{'fits in' if whole.fits else 'more than'} {model.cluster.memory_bytes / 1e9:g} GB); "
            f"cp={lay.cp} brings them to {layer_cp / gib:.2f} GiB ({best.memory['activations'] / gib:.1f} "
            f"GiB in all, {best.memory['total'] / 1e9:.1f} GB per rank), the fastest layout that fits; "
            f"{rival}; the ring's K/V exchange ({moved / 2 ** 20:.0f} MiB a message, {lay.cp - 1} per "
            f"attention layer and pass, {transfer:.1f} s of transfer a step) costs "
            f"{ring / best.step_time:.1%} of the step beyond what the attention blocks hide")


def _rank(e: Estimate):
    return (not e.fits, not e.simulated, e.step_time)


def _nothing(model: CostModel, gpus: int, knobs: dict) -> str:
    p, c = model.profile, model.cluster
    given = ", ".join(f"{k}={v}" for k, v in knobs.items() if v) or "no fixed knobs"
    if model.precision == "fp8" and model.runtime == "autopart":
        # the knobs themselves may be what FP8 refuses (cp, ep, zero=3): say that, not the sizes
        why = fp8_refused(knobs.get("zero") or 0, knobs.get("cp") or 1, knobs.get("ep") or 1)
        if why:
            return (f"no layout of {gpus} devices runs this model with {given} and "
                    f"precision='fp8': {why}")
    return (f"no layout of {gpus} devices runs this model ({p.layers} layers, global batch {model.batch}) "
            f"with {given}: tp must divide {gpus} and be at most {c.gpus_per_node} (analysed (tp, ep): "
            f"{sorted(p.parts)}; refused: {p.invalid_tp or 'none'}), pp at most {p.layers}, and the "
            f"batch a multiple of dp * microbatch size")


__all__ = ["search", "candidates", "RECOMPUTE", "meshes", "divisors", "MICROBATCH_SIZES",
           "ZERO_LEVELS", "zero_choice", "cp_choice", "cp_degrees", "CP_MIN_SEQ"]
