"""`autopart.parallelize(model, "auto", ...)`: the planner chooses the layout for the world size.

Rank 0 plans (the `local` cluster by default: `autopart calibrate` measures it) and broadcasts its
choice, so every rank compiles the same layout even if their clocks disagree.
"""
from __future__ import annotations

import sys

from autopart.config import PLANNED, Config
from autopart.errors import AutopartError
from autopart.mesh import Mesh


def choose(model, example_inputs: tuple, loss_fn, target, world_size: int, config: Config,
           *, fixed: dict | None = None, cluster: str = "local", rank: int = 0,
           broadcast=None) -> tuple[Mesh, Config]:
    """(mesh, config): the planner's mesh, and `config` with the options of PLANNED (microbatches,
    schedule, virtual_stages, recompute) it chose, except those in `fixed` (the user's: kept, and
    the search holds them). The ZeRO level is always the user's."""
    fixed = {k: v for k, v in (fixed or {}).items() if k in PLANNED}
    choice = [None]
    if rank == 0:
        try:
            choice[0] = _plan(model, example_inputs, loss_fn, target, world_size, cluster,
                              config.zero, fixed)
        except AutopartError as e:
            choice[0] = {"error": str(e)}
    if broadcast is not None:
        broadcast(choice)
    if "error" in choice[0]:
        raise AutopartError(f'mesh="auto": {choice[0]["error"]}')
    out = choice[0]
    if rank == 0:
        print(out["note"], file=sys.stderr)
    return Mesh(**out["mesh"]), config.replace(**out["chosen"])


def _plan(model, example_inputs, loss_fn, target, world_size, cluster_name, zero: int,
          fixed: dict) -> dict:
    from autopart.planner import CostModel, default_precision
    from autopart.planner.cluster import cluster
    from autopart.planner.profile import profile_model
    from autopart.planner.search import search
    c = cluster(cluster_name)
    batch = int(example_inputs[0].shape[0])
    model_ = CostModel(profile_model(model, example_inputs, loss_fn, target), c, batch,
                       precision=default_precision(c))
    knobs = {k: fixed[k] for k in ("schedule", "virtual_stages", "recompute") if k in fixed}
    ranked = search(model_, world_size, zero=zero, **knobs)   # zero > 0: layouts with dp > 1 only
    if "microbatches" in fixed:
        ranked = [e for e in ranked if model_.microbatches(e.layout) == fixed["microbatches"]]
    best = next((e for e in ranked if e.fits), None)
    if best is None:
        why = ranked[0].rejected_because if ranked else \
            f"none with microbatches={fixed.get('microbatches')}"
        raise AutopartError(f"no layout of {world_size} ranks fits in {c.memory_bytes / 1e9:g} GB "
                            f"per rank ({why})")
    lay = best.layout
    planned = {"microbatches": model_.microbatches(lay), "schedule": lay.schedule,
               "virtual_stages": lay.virtual_stages, "recompute": lay.recompute}
    chosen = {k: v for k, v in planned.items() if k not in fixed}
    kept = "".join(f", {k}={v!r} kept (yours)" for k, v in fixed.items())
    note = (f'autopart: mesh="auto" chose {lay.mesh}, '
            + ", ".join(f"{k}={v!r}" for k, v in chosen.items())
            + f" (microbatches of {lay.microbatch_size}){kept}: predicted "
            f"{best.step_time * 1e3:.1f} ms a step on the {c.name} cluster "
            f"({len(ranked)} layouts considered)")
    return {"mesh": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "cp": lay.cp},
            "chosen": chosen, "note": note}


__all__ = ["choose"]
