"""The pipeline's part of the cost model (autopart/planner/cost.py): how layers split into chunks
(`chunk_layers`), a step's makespan and peak in-flight microbatches from the C++ simulator
(`pipeline`, what autopart.schedule.simulate runs, with the cost model's per-chunk costs) or, for
the search's first pass, from the bubble formula (`pipeline_formula`), and which schedules split
the backward into input and weight gradients (`splits_backward`). cost.py re-exports them.
"""
from __future__ import annotations

import functools
import math

@functools.cache
def splits_backward(schedule: str) -> bool:
    """Whether `schedule` runs I and W actions (the zero-bubble ones), from the C++ core."""
    from autopart.schedule import make_schedule
    try:
        made = make_schedule(schedule, pp=2, microbatches=4, virtual_stages=2 if schedule in (
            "interleaved-1f1b", "zb-v", "dualpipe-v") else 1)
    except Exception:        # noqa: BLE001  (a name the core refuses: none to split)
        return False
    return any(a.kind in ("I", "W") for actions in made.ranks for a in actions)


def chunk_layers(layers: int, chunks: int) -> list[int]:
    """Layers per chunk, as even as possible (the larger chunks first)."""
    base, extra = divmod(layers, chunks)
    return [base + (k < extra) for k in range(chunks)]


@functools.lru_cache(maxsize=4096)
def pipeline(name: str, pp: int, m: int, v: int, fwd: tuple, bwd: tuple, msg: float) -> tuple[float, tuple]:
    """(makespan, peak in-flight chunk-microbatches per rank) from the C++ simulator.

    Past m = 2pp a step's makespan grows linearly with m (the steady state repeats; checked
    exactly for 1F1B and interleaved with unequal chunks and messages), so long pipelines are
    simulated at pp and 2pp microbatches and extended: 512 microbatches on 64 stages cost two
    short simulations instead of one of 130k actions."""
    if m <= 2 * pp:
        return _simulate(name, pp, m, v, fwd, bwd, msg)
    t1, _ = _simulate(name, pp, pp, v, fwd, bwd, msg)
    t2, peaks = _simulate(name, pp, 2 * pp, v, fwd, bwd, msg)
    return t2 + (t2 - t1) * (m - 2 * pp) / pp, peaks


@functools.lru_cache(maxsize=4096)
def _simulate(name, pp, m, v, fwd, bwd, msg):
    # cached apart from pipeline(): layouts differing in dp alone (so in m) share both runs
    from autopart import _C
    packed = _schedule(name, pp, m, v)
    half = [b / 2 for b in bwd]
    raw = _C.simulate(pp, m, v, packed, list(fwd), list(bwd), float(msg), math.inf, 0.0, half, half, name)
    return raw.makespan, tuple(raw.peak_in_flight)


@functools.lru_cache(maxsize=256)
def _schedule(name, pp, m, v):
    """The packed action lists (the same for every chunk cost)."""
    from autopart import _C
    return _C.make_schedule(name, pp, m, v)


def pipeline_formula(pp: int, v: int, m: int, fwd, bwd, msg) -> tuple[float, tuple]:
    """The bubble formula (pp-1)/(v m) on the slowest rank, for the first pass of the search;
    in-flight counts as Megatron's warm-up gives them (v: virtual stages)."""
    per_rank = [0.0] * pp
    for k, (f, b) in enumerate(zip(fwd, bwd)):    # one pass: chunk k runs on rank k % pp
        per_rank[k % pp] += f + b
    chunk = max(f + b for f, b in zip(fwd, bwd))
    makespan = m * max(per_rank) + (pp - 1) * (chunk + 2 * msg) + 2 * m * v * msg * (pp > 1)
    if v == 1:
        flight = tuple(min(m, pp - r) for r in range(pp))
    else:
        flight = tuple(min(m * v, (pp - r - 1) * 2 + (v - 1) * pp + 1) for r in range(pp))
    return makespan, flight


__all__ = ["chunk_layers", "pipeline", "pipeline_formula", "splits_backward"]
