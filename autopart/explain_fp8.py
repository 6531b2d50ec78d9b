"""What precision="fp8" adds to each rank's program (explain's FP8 lines and JSON).

Per FP8 linear and microbatch: the casts to FP8 (forward x and w; backward the output gradient,
and under rowwise the recasts of g, w and x along the backward GEMMs' contracted dims) and, on a
tensor-parallel shard, the max all-reduces of the amaxes over a split dim (autopart/ops/fp8.py):
the weights' amaxes of a whole chunk in one all-reduce at its start (fp8_weight_amaxes_tp), and
per linear its activation's: x's in forward when its contracted dim is split (row-parallel) or
its tokens are (sequence parallelism), the output gradient's in backward when its output features
are (column-parallel). Under zero=3 (tensorwise) the weights read only by FP8 linears are cast to
e4m3 before their all-gather, their amaxes max-all-reduced first (one per gathered group, over
dp, and over tp for tp shards): `zero3_fp8_lines`.
"""
from __future__ import annotations

from autopart.errors import module_path
from autopart.ops.fp8 import _target, fp8_weight_amaxes_tp, gathered_in_fp8
from autopart.ops.tp import gather_linear_sp

CASTS = {"tensorwise": (2, 1), "rowwise": (2, 4)}      # scaling -> (forward, backward) casts


def fp8_rows(compiled) -> list[dict]:
    """One row per linear the fp8_linears pass saw: module, fp8 or why bf16, and per
    microbatch its casts, its own amax all-reduces over tp (activations'), the fp32 elements
    it reduces (its weight's, in its chunk's batch, included), whether its weight's amax
    went in that batch, and whether zero=3 all-gathers its weight in FP8 (gathered_fp8)."""
    plan = compiled.program.fp8
    if plan is None:
        return []
    nodes = {n.name: n for n in compiled.program.gm.graph.nodes}
    gathered = {name for weights in zero3_fp8(compiled).values() for name in weights}
    batched = weight_batches(compiled) > 0
    tokens = compiled.plan.microbatch_size * (compiled.program.seq_len or 1)
    rows = []
    for name in sorted(set(plan.converted) | set(plan.kept), key=list(nodes).index):
        node, row = nodes[name], {"node": name, "module": module_path(nodes[name])}
        if name in plan.kept:
            rows.append({**row, "fp8": False, "why": plan.kept[name]})
            continue
        k_split, n_split = plan.converted[name]
        fwd, bwd, weight = _reduced_elements(plan.scaling, k_split, n_split, tokens, node)
        if node.target is gather_linear_sp:     # x a sequence shard: its amax reduced too
            fwd = 1                             # (tensorwise only: compile refuses rowwise)
        in_fp8 = _weight(node, compiled.program.params) in gathered
        # zero=3 batches no weight amax: the FP8 gather reduces it, else the linear's forward
        own_weight = bool(weight) and not batched and not in_fp8
        rows.append({**row, "fp8": True, "casts_fwd": CASTS[plan.scaling][0],
                     "casts_bwd": CASTS[plan.scaling][1],
                     "amax_all_reduces": int(bool(fwd) or own_weight) + int(bool(bwd)),
                     "amax_elements": fwd + bwd + weight,
                     "weight_amax_batched": bool(weight) and batched, "gathered_fp8": in_fp8})
    return rows


def _weight(node, params) -> str | None:
    """The get_attr target of a converted linear's weight (fp8_linears' operands)."""
    from autopart.passes.fp8_linears import operands
    found = operands(node, params)
    return found[1].target if found is not None else None


def zero3_fp8(compiled) -> dict[str, dict]:
    """zero=3: per chunk (its label), the weights gathered in FP8 -> {numel (this rank's, under
    tp), group (index in its param_shards), tp (its amax reduced over tp too)}."""
    if compiled.plan.config.zero != 3:
        return {}
    out = {}
    for chunk in compiled.program.chunks:
        found, _ = gathered_in_fp8(chunk.gm)
        shards = getattr(chunk.gm, "param_shards", None)
        group = {n: g for g, names in enumerate(getattr(shards, "groups", ())) for n in names}
        out[f"chunk {chunk.chunk}"] = {
            name: {"numel": _target(chunk.gm, name).numel(), "group": group.get(name),
                   "tp": comm is not None} for name, comm in found.items()}
    return out


def zero3_fp8_lines(compiled) -> list[str]:
    """What the zero=3 FP8 gathers move and reduce, per chunk."""
    lines = []
    for chunk, weights in zero3_fp8(compiled).items():
        if not weights:
            continue
        n = sum(w["numel"] for w in weights.values())
        groups = {w["group"] for w in weights.values()}
        tp = sum(w["tp"] for w in weights.values())
        lines.append(
            f"  zero=3 {chunk}: {len(weights)} FP8 weights cast to e4m3 before their all-gather: "
            f"{n} B per gather of them all (1 B an element; fp32's {4 * n} B); before each "
            f"cast one max all-reduce of the slices' amaxes per gathered group over dp "
            f"({len(groups)} groups)" + (f", then one over tp ({tp} tensor-parallel shards)"
                                         if tp else "")
            + "; the linears read the gathered e4m3 weight and its scale (no cast of w)")
    return lines


def _reduced_elements(scaling, k_split, n_split, tokens, node) -> tuple[int, int, int]:
    """(forward activation, backward gradient, weight) amax elements max-all-reduced over tp
    per microbatch; the weight's in its chunk's batch."""
    if not (k_split or n_split):
        return 0, 0, 0
    n_out = int(node.meta["val"].shape[-1])          # whole shapes: the graph's metadata
    x = node.args[1] if "addmm" in str(node.target) else node.args[0]
    k_in = int(x.meta["val"].shape[-1])
    if scaling == "tensorwise":
        return int(k_split), int(n_split), 1
    # rowwise: forward x's rows (over K), backward g's rows (over N); the weight's rows over K
    # (row-parallel) or columns over N (column-parallel)
    return (tokens if k_split else 0), (tokens if n_split else 0), (n_out if k_split else k_in)


def weight_batches(compiled) -> int:
    """The chunks whose weights' amaxes are max-all-reduced in one batch (one per microbatch)."""
    return sum(n.target is fp8_weight_amaxes_tp for c in compiled.program.chunks
               for n in c.gm.graph.nodes)


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
    own, batches = sum(r["amax_all_reduces"] for r in fp8), weight_batches(compiled)
    if own or batches:
        elements = sum(r["amax_elements"] for r in fp8)
        weights = sum(r["weight_amax_batched"] for r in fp8)
        batch = f"{batches} of the weights' {weights} amaxes, one per chunk at its start; " \
            if batches else ""          # zero=3: none (its gathers reduce the weights' amaxes)
        lines.append(f"  amax max-all-reduces over tp per microbatch: {own + batches} ({batch}"
                     f"{own} of activations; {elements} fp32 elements, {4 * elements} B)")
    lines += zero3_fp8_lines(compiled)
    lines += [f"  bf16: {r['module'] or r['node']} ({r['why']})" for r in kept]
    return lines
