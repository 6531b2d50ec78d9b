"""Rank functions for tests/test_overlap.py: the data-parallel gradient reduction overlapped
with the backward (runtime/gradients.py; ZeRO's reduce-scatter, runtime/buckets.py), with
buckets small enough to cut the test model into several, so that a bucket can go out before the
backward ends."""
from __future__ import annotations

import json
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from tests.workers.common import Case, build
from tests.workers.equivalence import equivalence

SMALL_BUCKET = 16 * 1024        # bytes: a 4-layer test GPT's rank holds ~10 such buckets
# Tensor methods that copy a value to the host (on CUDA: wait for the device)
SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def overlap_cases(rank: int, world: int, cases: list[Case], trace_dir: str) -> list[dict]:
    """Per case: the equivalence run with small buckets, then two runs counting the host syncs of
    their second train_step and clip_grad_norm_ (parallelize's defaults; nonfinite="ignore"),
    then a traced run of 2 steps (rank 0 returns the trace's events)."""
    from autopart.runtime import gradients, optimizer
    gradients.BUCKET_BYTES = SMALL_BUCKET
    optimizer.DEFAULT_BUCKET_SIZE = SMALL_BUCKET // 4    # ZeRO's buckets count fp32 elements
    out = []
    for case in cases:
        try:
            result = _equivalence(case, rank)
            result["syncs_default"] = counted_syncs(case, rank, {})
            result["syncs"] = counted_syncs(case, rank, {"nonfinite": "ignore"})
            result["events"] = traced(case, rank, Path(trace_dir) / f"{case.name}.json")
            result["buckets"] = len(_buckets[-1])
        except Exception:  # noqa: BLE001  (reported by the test process, per case)
            out.append({"case": case.name, "rank": rank,
                        "problems": [f"raised on rank {rank}:\n{traceback.format_exc()}"]})
            break
        out.append(result)
    return out


_buckets: list = []


def _equivalence(case: Case, rank: int) -> dict:
    """equivalence(case); a composition case (tests/composition.CCase) also records what its
    collectives carried (tests/workers/precision.Wire), which its claims are judged by."""
    if not hasattr(case, "precision"):
        return equivalence(case, rank)
    from tests.workers.precision import Wire
    with Wire() as wire:
        result = equivalence(case, rank, wire)
    result["wire"] = wire.report()
    return result


def _parallelize(case: Case, trace: str | None = None, nonfinite: str = "ignore"):
    import autopart
    model, loss_fn, inputs, target = build(case)
    pm = autopart.parallelize(model, autopart.Mesh(pp=case.pp, dp=case.dp, tp=case.tp, ep=case.ep),
                              inputs,
                              loss_fn=loss_fn, target=target, microbatches=case.microbatches,
                              schedule=case.schedule, virtual_stages=case.virtual_stages,
                              zero=getattr(case, "zero", 0), trace=trace,
                              timeout=timedelta(seconds=120),
                              **({} if nonfinite is None else {"nonfinite": nonfinite}))
    return pm, inputs, target


def counted_syncs(case: Case, rank: int, options: dict) -> list[str]:
    """'method at file:line (function)' for each host sync of train_step (the second: the first
    also checks every rank got the same batch) and clip_grad_norm_, parallelized with `options`
    ({}: parallelize's own defaults)."""
    pm, inputs, target = _parallelize(case, nonfinite=options.get("nonfinite"))
    pm.train_step(*inputs, target=target)
    pm.clip_grad_norm_(1.0)
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            seen.append(f"{name} at {Path(caller.filename).name}:{caller.lineno} ({caller.name})")
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counting(name, fn))
    try:
        pm.train_step(*inputs, target=target)
        pm.clip_grad_norm_(1.0)
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    _buckets.append(pm._grads._layout.buckets if pm._grads._layout else [])
    return seen


def traced(case: Case, rank: int, path: Path) -> list[dict] | None:
    """The events of a 2-step trace (rank 0 writes the file; the others return None)."""
    pm, inputs, target = _parallelize(case, trace=str(path))
    for _ in range(2):
        pm.train_step(*inputs, target=target)
    torch.distributed.barrier()
    return json.loads(path.read_text())["traceEvents"] if rank == 0 else None
