"""`autopart.parallelize(model, "auto", ...)`: the planner chooses the layout for the world size.

Rank 0 plans (the `local` cluster by default: `autopart calibrate` measures it) and broadcasts its
choice, so every rank compiles the same layout even if their clocks disagree.
"""
from __future__ import annotations

import sys

from autopart.errors import AutopartError


def choose(model, example_inputs: tuple, loss_fn, target, world_size: int, *, cluster: str = "local",
           rank: int = 0, broadcast=None, zero: int = 0) -> dict:
    """{"mesh": Mesh, "microbatches", "schedule", "virtual_stages", "recompute", "note"}; the
    ZeRO level is the user's (`zero`), held fixed in the search."""
    choice = [None]
    if rank == 0:
        try:
            choice[0] = _plan(model, example_inputs, loss_fn, target, world_size, cluster, zero)
        except AutopartError as e:
            choice[0] = {"error": str(e)}
    if broadcast is not None:
        broadcast(choice)
    if "error" in choice[0]:
        raise AutopartError(f'mesh="auto": {choice[0]["error"]}')
    from autopart.mesh import Mesh
    out = dict(choice[0])
    out["mesh"] = Mesh(**out["mesh"])
    if rank == 0:
        print(out["note"], file=sys.stderr)
    return out


def _plan(model, example_inputs, loss_fn, target, world_size, cluster_name, zero: int) -> dict:
    from autopart.planner import CostModel, default_precision
    from autopart.planner.cluster import cluster
    from autopart.planner.profile import profile_model
    from autopart.planner.search import search
    c = cluster(cluster_name)
    batch = int(example_inputs[0].shape[0])
    model_ = CostModel(profile_model(model, example_inputs, loss_fn, target), c, batch,
                       precision=default_precision(c))
    ranked = search(model_, world_size, zero=zero)     # zero > 0: layouts with dp > 1 only
    best = next((e for e in ranked if e.fits), None)
    if best is None:
        raise AutopartError(f"no layout of {world_size} ranks fits in {c.memory_bytes / 1e9:g} GB per rank "
                            f"({ranked[0].rejected_because})")
    lay = best.layout
    note = (f'autopart: mesh="auto" chose {lay.mesh}, {model_.microbatches(lay)} microbatches of '
            f"{lay.microbatch_size}, {lay.schedule} (v={lay.virtual_stages}), recompute {lay.recompute}: "
            f"predicted {best.step_time * 1e3:.1f} ms a step on the {c.name} cluster "
            f"({len(ranked)} layouts considered)")
    return {"mesh": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "cp": lay.cp}, "microbatches": model_.microbatches(lay),
            "schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
            "recompute": lay.recompute, "note": note}


__all__ = ["choose"]
