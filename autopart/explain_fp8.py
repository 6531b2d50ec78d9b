"""What precision="fp8" adds to each rank's program (explain's FP8 lines and JSON).

Per FP8 linear and microbatch: the casts to FP8 (forward x and w; backward the output gradient,
and under rowwise the recasts of g, w and x along the backward GEMMs' contracted dims) and, on a
tensor-parallel shard, the max all-reduces of the amaxes over a split dim (autopart/ops/fp8.py):
one per linear in forward when its contracted dim is split (row-parallel), one in backward when
its output features are (column-parallel), each of every amax it needs at once.
"""
from __future__ import annotations

from autopart.errors import module_path

CASTS = {"tensorwise": (2, 1), "rowwise": (2, 4)}      # scaling -> (forward, backward) casts


def fp8_rows(compiled) -> list[dict]:
    """One row per linear the fp8_linears pass saw: module, fp8 or why bf16, and per
    microbatch its casts and the amax all-reduces (count and fp32 elements) over tp."""
    plan = compiled.program.fp8
    if plan is None:
        return []
    nodes = {n.name: n for n in compiled.program.gm.graph.nodes}
    tokens = compiled.plan.microbatch_size * (compiled.program.seq_len or 1)
    rows = []
    for name in sorted(set(plan.converted) | set(plan.kept), key=list(nodes).index):
        node, row = nodes[name], {"node": name, "module": module_path(nodes[name])}
        if name in plan.kept:
            rows.append({**row, "fp8": False, "why": plan.kept[name]})
            continue
        k_split, n_split = plan.converted[name]
        fwd, bwd = _reduced_elements(plan.scaling, k_split, n_split, tokens, node,
                                     compiled.plan.mesh.tp)
        rows.append({**row, "fp8": True, "casts_fwd": CASTS[plan.scaling][0],
                     "casts_bwd": CASTS[plan.scaling][1],
                     "amax_all_reduces": int(bool(fwd)) + int(bool(bwd)),
                     "amax_elements": fwd + bwd})
    return rows


def _reduced_elements(scaling, k_split, n_split, tokens, node, tp) -> tuple[int, int]:
    """(forward, backward) amax elements max-all-reduced over tp per microbatch."""
    if not (k_split or n_split):
        return 0, 0
    n_out = int(node.meta["val"].shape[-1])          # whole shapes: the graph's metadata
    x = node.args[1] if "addmm" in str(node.target) else node.args[0]
    k_in = int(x.meta["val"].shape[-1])
    if scaling == "tensorwise":
        return (2 if k_split else 1 if n_split else 0), (1 if n_split else 0)
    # rowwise: forward x's rows and w's rows (over K), backward g's rows and w's columns (over N)
    return (tokens + n_out if k_split else 0), (tokens + k_in if n_split else 0)


def fp8_lines(compiled) -> list[str]:
    rows = fp8_rows(compiled)
    if not rows:
        return []
    plan = compiled.program.fp8
    fp8 = [r for r in rows if r["fp8"]]
    kept = [r for r in rows if not r["fp8"]]
    fwd, bwd = CASTS[plan.scaling]
    lines = [f"fp8 ({plan.scaling} scaling, fp8_linears={plan.layers}): {len(fp8)} of "
             f"{len(rows)} linears as FP8 GEMMs (forward, input and weight gradient); per "
             f"linear and microbatch {fwd} casts to FP8 in forward, {bwd} in backward"]
    reduces = sum(r["amax_all_reduces"] for r in fp8)
    if reduces:
        elements = sum(r["amax_elements"] for r in fp8)
        lines.append(f"  amax max-all-reduces over tp per microbatch: {reduces} "
                     f"({elements} fp32 elements, {4 * elements} B)")
    lines += [f"  bf16: {r['module'] or r['node']} ({r['why']})" for r in kept]
    return lines
