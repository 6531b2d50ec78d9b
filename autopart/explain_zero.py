"""explain()'s ZeRO gradient lines: where each reduce-scatter is posted and waited.

The groups are runtime/gradients.py reduce_groups over the schedule's action list of each
pipeline rank and its chunks' graphs: what the runtime lays out (GradientReducer.shard), one
reduce-scatter per layer group (a group larger than zero_bucket_size in several).
"""
from __future__ import annotations

from autopart.runtime.buckets import IN_FLIGHT
from autopart.runtime.gradients import reduce_groups


def reduce_scatter_rows(compiled) -> list[dict]:
    """ZeRO with replicas: per pipeline rank, its gradient reduce-scatters in the
    order they are posted (reduce_groups over the schedule's action list and the chunks'
    graphs, as the runtime lays them out): each group's label, parameter count and the backward
    action inside which (fused B: as its last gradient lands) or after which (W) it is posted;
    zero=1 once per step (the last microbatch), zero=2 and 3 after every microbatch's backward;
    and the parameters reduced at the step's end instead (summed over tp or pp first). Every
    reduce-scatter is waited on before the step returns, the oldest first whenever IN_FLIGHT
    are posted."""
    plan, mesh, zero = compiled.plan, compiled.plan.mesh, compiled.config.zero
    replicated = {False: len(mesh.groups("dp")[0]) > 1,
                  True: mesh.ep > 1 and len(mesh.ep_replica_groups()[0]) > 1}
    if not zero or not any(replicated.values()):
        return []
    rows = []
    for pp in range(mesh.pp):
        actions = compiled.schedule.ranks[pp]
        chunks = {c.chunk: c for c in compiled.program.chunks if c.rank == pp}
        tied = {n for n, cs in plan.shared_params.items()
                if len({plan.chunk_ranks[c] for c in cs}) > 1}

        def early(name):
            return replicated[name in plan.ep_shards] and name not in tied and \
                not (name in plan.sp_grad_reduce and mesh.tp > 1)
        groups = reduce_groups(actions, chunks, early)
        params = {n for c in chunks.values() for n in c.params}
        rows.append({"pp_rank": pp, "groups": [
            {"group": label if label in chunks[actions[i].chunk].layers else ", ".join(names),
             "params": len(names), "chunk": actions[i].chunk,
             "posted_in": _action(actions[i], zero)} for i, label, names in groups],
            "at_step_end": sorted(params - {n for _, _, ns in groups for n in ns})})
    return rows


def _action(action, zero: int) -> str:
    """The backward a group is posted in: the last microbatch's (zero=1) or every one's."""
    kind = getattr(action.kind, "name", str(action.kind))
    return f"{kind}{action.microbatch}" if zero < 2 else f"each {kind}"


def reduce_scatter_lines(compiled) -> list[str]:
    rows = reduce_scatter_rows(compiled)
    if not rows:
        return []
    zero = compiled.config.zero
    when = "after every microbatch's backward" if zero >= 2 else \
        "once per step, by the last microbatch's backward"
    lines = [f"zero={zero} gradient reduce-scatters (one per layer group, posted {when} as "
             f"soon as the group's gradients are final; at most {IN_FLIGHT} in flight, the "
             "oldest waited first; all waited before the step returns, before the optimizer):"]
    for row in rows:
        posts = [f"{g['group']} ({g['params']} params) in {g['posted_in']}"
                 for g in row["groups"]]
        shown = posts if len(posts) <= 8 else posts[:4] + [f"... {len(posts) - 6} more ..."] \
            + posts[-2:]
        lines.append(f"  pp rank {row['pp_rank']}: {len(posts)} posted in this order: "
                     + ", ".join(shown))
        if row["at_step_end"]:
            late = row["at_step_end"]
            lines.append(f"    at the step's end (summed over tp or pp first): {len(late)} "
                         f"parameters ({', '.join(late[:3])}{', ...' if len(late) > 3 else ''})")
    return lines


__all__ = ["reduce_scatter_lines", "reduce_scatter_rows"]
