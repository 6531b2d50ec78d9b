"""Search over layouts: tp, pp, dp, virtual stages, microbatch size, schedule, recomputation, the
ZeRO level (0, 1, 2 with dp > 1).

Every candidate is first priced with the bubble formula (microseconds each), then the best
`simulate_top` (fitting or not) are priced again with the C++ simulator and re-ranked; the table
says which rows were simulated. Layouts that do not fit the memory model stay in the table, with
their prediction and why they were rejected. ep is searched for mixture-of-experts models (powers
of two dividing the expert count and dp); dense models have ep = 1.

>>> from autopart.planner.search import divisors
>>> divisors(12)
[1, 2, 3, 4, 6, 12]
"""
from __future__ import annotations

import dataclasses

from autopart.errors import AutopartError
from autopart.memory.units import ZERO_LEVELS
from autopart.planner.cost import SCHEDULE_NAMES, CostModel, Estimate, Layout

MICROBATCH_SIZES = (1, 2, 4, 8, 16)
MAX_VIRTUAL_STAGES = 8


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(model: CostModel, gpus: int, tp=None, pp=None, dp=None, ep=None) -> list[tuple[int, int, int, int]]:
    """(tp, pp, dp, ep) with tp * pp * dp = gpus: tp inside a node and analysed, pp at most the
    layers, ep (expert shards, over dp ranks) dividing dp."""
    c, p = model.cluster, model.profile
    out = []
    for t, e in sorted(p.parts):
        if t > c.gpus_per_node or gpus % t or (tp and t != tp) or (ep and e != ep):
            continue
        for q in divisors(gpus // t):
            d = gpus // (t * q)
            if q > p.layers or (pp and q != pp) or (dp and d != dp) or model.batch % d or d % e:
                continue
            out.append((t, q, d, e))
    return out


# Megatron-LM's choices: full (keep layer inputs), selective (rerun attention cores), none
RECOMPUTE = ("full", "selective", "none")


def candidates(model: CostModel, gpus: int, *, tp=None, pp=None, dp=None, microbatch_size=None,
               virtual_stages=None, schedule=None, recompute=None, ep=None,
               zero=None) -> list[Layout]:
    """Every layout the knobs allow; a knob given is fixed, the others are searched."""
    layers = model.profile.layers
    out = []
    for t, q, d, e in meshes(model, gpus, tp, pp, dp, ep):
        levels = [zero] if zero is not None else ZERO_LEVELS if d > 1 else (0,)
        for b in ([microbatch_size] if microbatch_size else MICROBATCH_SIZES):
            for name, v in _schedules(q, layers, virtual_stages, schedule):
                for r in ([recompute] if recompute else RECOMPUTE):
                    for z in levels:
                        lay = Layout(t, q, d, b, v, name, r, e, z)
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
            # Megatron's interleaving gives every chunk the same number of layers
            if pp > 1 and v > 1 and layers % (pp * v) == 0:
                yield name, v


def search(model: CostModel, gpus: int, *, simulate_top: int = 24, **knobs) -> list[Estimate]:
    """Ranked estimates, best first: fitting layouts by step time, then the rejected ones."""
    if gpus < 1:
        raise AutopartError(f"--gpus {gpus} must be at least 1")
    layouts = candidates(model, gpus, **knobs)
    if not layouts:
        raise AutopartError(_nothing(model, gpus, knobs))
    rough = sorted((model.estimate(lay, simulate=False) for lay in layouts), key=_rank)
    fitting = [e for e in rough if e.fits][:simulate_top]
    rejected = [e for e in rough if not e.fits][: max(4, simulate_top // 4)]
    exact = {e.layout: model.estimate(e.layout) for e in fitting + rejected}
    return sorted((exact.get(e.layout, e) for e in rough), key=_rank)


def zero_choice(model: CostModel, best: Estimate) -> str:
    """Why `best` has its ZeRO level: the same layout at the other levels, as predicted."""
    lay = best.layout
    if lay.dp == 1:
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


def _rank(e: Estimate):
    return (not e.fits, not e.simulated, e.step_time)


def _nothing(model: CostModel, gpus: int, knobs: dict) -> str:
    p, c = model.profile, model.cluster
    given = ", ".join(f"{k}={v}" for k, v in knobs.items() if v) or "no fixed knobs"
    return (f"no layout of {gpus} devices runs this model ({p.layers} layers, global batch {model.batch}) "
            f"with {given}: tp must divide {gpus} and be at most {c.gpus_per_node} (analysed (tp, ep): "
            f"{sorted(p.parts)}; refused: {p.invalid_tp or 'none'}), pp at most {p.layers}, and the "
            f"batch a multiple of dp * microbatch size")


__all__ = ["search", "candidates", "RECOMPUTE", "meshes", "divisors", "MICROBATCH_SIZES",
           "ZERO_LEVELS", "zero_choice"]
