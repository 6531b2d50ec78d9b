"""The explain table and JSON: stages, layers, parameters, FLOPs, memory, transfers, bubble."""
from __future__ import annotations

import dataclasses

import sympy

from autopart.analysis import evaluate
from autopart.errors import module_path
from autopart.explain_fp8 import fp8_lines, fp8_rows
from autopart.explain_zero import reduce_scatter_lines, reduce_scatter_rows
from autopart.ir import sym_shape
from autopart.ops import aten_groups as G
from autopart.ops import is_autopart_op, op_info


def _fmt(n: float, unit: str = "") -> str:
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def chunk_rows(compiled) -> list[dict]:
    """One dict per chunk: the numbers the table and the JSON show."""
    plan, program = compiled.plan, compiled.program
    b, s = plan.microbatch_size, program.seq_len
    rows = []
    stages = program.stages
    for c in program.chunks:
        names = [n for n, k in stages.chunk_of.items() if k == c.chunk]
        flops = sum(evaluate(compiled.costs[n].fwd_bwd_flops, b, s) for n in names)
        act = sum(evaluate(compiled.costs[n].out_bytes, b, s) for n in names)
        nparams = sum(_local_numel(program, plan, p) for p in c.params)
        recv = sum(_bytes(x, b, s, plan.config.precision) for x in c.recvs)
        send = sum(_bytes(x, b, s, plan.config.precision) for x in c.sends)
        rows.append({"chunk": c.chunk, "pp_rank": c.rank,
                     "layers": _layer_span(c.layers), "params": nparams,
                     "flops_per_microbatch": flops, "activation_bytes_per_microbatch": act,
                     "recv_bytes_per_microbatch": recv, "send_bytes_per_microbatch": send})
    return rows


def _local_numel(program, plan, name: str) -> int:
    n = program.params[name].numel
    if name in plan.ep_shards:
        n //= plan.mesh.ep
    return n // plan.mesh.tp if name in plan.tp_shards else n


def ep_rows(compiled) -> list[dict]:
    """One row per MoE layer sharded over ep: experts per rank, capacity, all-to-all bytes one
    rank sends per microbatch (forward; backward sends the same again)."""
    plan, program = compiled.plan, compiled.program
    ep_plan = program.ep
    if plan.mesh.ep == 1 or ep_plan is None:
        return []
    b, s = plan.microbatch_size, program.seq_len
    return [{"name": layer.name, "num_experts": layer.num_experts,
             "experts_per_rank": layer.experts_per_rank, "capacity": layer.capacity,
             "group_size": layer.group_size, "layout": layer.layout,
             "params": list(layer.params), "router": layer.router,
             "tokens_per_expert": layer.tokens_per_expert,
             "a2a_bytes_formula": layer.a2a_bytes,
             "a2a_bytes_per_microbatch": _at(layer.a2a_bytes, b, s),
             "source": layer.source}
            for layer in ep_plan.layers]


def _at(formula: str, b: int, s) -> float:
    """A printed size formula in b and s (the plan keeps it as text) at b and s."""
    expr = sympy.sympify(formula)
    values = {"b": b, "s": s or 1}
    return float(expr.subs({x: values[x.name] for x in expr.free_symbols if x.name in values}))


def _ep_lines(compiled) -> list[str]:
    rows = ep_rows(compiled)
    if not rows:
        return []
    ep, replicas = compiled.plan.mesh.ep, compiled.plan.mesh.dp // compiled.plan.mesh.ep
    reduce = (f"expert gradients summed over the {replicas} ranks holding the same experts"
              if replicas > 1 else "dp = ep: no rank shares its experts, no expert all-reduce")
    lines = [f"expert parallelism over ep={ep} (groups of {ep} consecutive dp ranks; {reduce}); "
             "all-to-all bytes each rank sends per microbatch (b = microbatch size, "
             "s = sequence), forward, and the same again in backward:"]
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        cap = (f"capacity {r['capacity']} per group of {r['group_size']} tokens"
               if r["capacity"] is not None else
               "dropless, rows sorted by expert" if r["layout"] == "sorted-rows" else "dropless")
        lines.append(f"  {r['name']:<{width}}  {r['experts_per_rank']} of {r['num_experts']} "
                     f"experts per rank  {cap}  all-to-all {_fmt(r['a2a_bytes_per_microbatch'], 'B')}"
                     f" = {r['a2a_bytes_formula']}")
    total = sum(r["a2a_bytes_per_microbatch"] for r in rows)
    lines.append(f"  {len(rows)} MoE layers: {_fmt(total, 'B')} forward + {_fmt(total, 'B')} "
                 f"backward all-to-all per rank per microbatch")
    return lines + _ep_overlap_lines(compiled)


def _ep_overlap_lines(compiled) -> list[str]:
    """Where each all-to-all's wait sits in the paired programs (passes/overlap_experts.py)."""
    report = next((p.report for p in compiled.passes if p.name == "overlap_experts"), None)
    paired = compiled.schedule.ranks[0]
    if report is not None and report.get("segmented_chunks"):
        return _combined_lines(compiled, report)
    if report is None or not report["paired_chunks"]:
        why = ("overlap=False" if not compiled.config.overlap else
               "needs an even number of microbatches and a 1f1b, gpipe or interleaved-1f1b "
               "schedule")
        return [f"  all-to-alls not overlapped ({why}): each waited on where it is posted"]
    lines = [f"  all-to-alls overlapped across microbatch pairs (overlap_experts): the schedule "
             f"runs microbatches two at a time ({' '.join(map(str, paired[:4]))} ...); in each "
             "chunk's paired program each wait sits after the other microbatch's ops:"]
    for chunk, waits in report["waits"].items():
        lines += [f"    chunk {chunk}  {w}" for w in waits]
    lines += [f"    kept: {k} ({v})" for k, v in report["kept"].items()]
    return lines


def _combined_lines(compiled, report: dict) -> list[str]:
    """Where the forwards are cut, and the schedule's first forward next to another
    microbatch's backward (compiler.combines_forward_backward)."""
    example = next((f"{a} {b}" for r in compiled.schedule.ranks
                    for a, b in zip([x for x in r if x.kind.is_compute],
                                    [x for x in r if x.kind.is_compute][1:])
                    if {str(a.kind), str(b.kind)} == {"F", "B"} and a.microbatch != b.microbatch),
                   "none")
    lines = ["  all-to-alls overlapped across a forward and another microbatch's backward "
             "(overlap_experts, combined 1F1B): where the interleaved 1F1B runs a forward next "
             f"to a backward of another microbatch (first: {example}) and both chunks hold "
             "all-to-alls, the runtime runs the forward's next segment each time the backward "
             "has posted a gradient's all-to-all, so each side's all-to-all moves while the "
             "other computes. Each forward, cut after its posts:"]
    for chunk, waits in report["waits"].items():
        lines += [f"    chunk {chunk}  {w}" for w in waits]
    lines += [f"    kept: {k} ({v})" for k, v in report["kept"].items()]
    return lines


# Per-rank bytes moved by ring collectives, as a multiple of the tensor's size, for tp ranks:
# all-reduce 2(t-1)/t, all-gather and reduce-scatter (t-1)/t each.
_COLLECTIVES = {   # op -> (forward, backward) collectives and their ring factors in units of (t-1)/t
    "copy_to_tp": ("-", "all-reduce", 2),
    "reduce_from_tp": ("all-reduce", "-", 2),
    "gather_linear_sp": ("all-gather", "all-gather + reduce-scatter", 3),
    "reduce_scatter_tp": ("reduce-scatter", "all-gather", 2),
    "gather_from_tp": ("all-gather", "-", 1),
    "scatter_to_tp": ("-", "all-gather", 1),
}


def tp_rows(compiled) -> list[dict]:
    """One row per tensor-parallel collective: the linear it serves, its split, bytes per rank."""
    plan, program = compiled.plan, compiled.program
    tp = plan.mesh.tp
    tp_plan = program.tp
    if tp == 1 or tp_plan is None:
        return []
    b, s = plan.microbatch_size, program.seq_len
    rows = []
    for node in program.gm.graph.nodes:
        op = getattr(node.target, "__name__", "")
        if not is_autopart_op(node.target, axis="tp") or op not in _COLLECTIVES:
            continue
        fwd, bwd, factor = _COLLECTIVES[op]
        if node.name in (program.overlap or {}) or op == "gather_linear_sp":
            bwd += ", behind the weight gradients"      # passes/overlap_collectives.py, ops/tp.py
        tensor = node.args[0]
        shape = sym_shape(tensor.meta["val"], program.symbols)
        size = 1.0
        for d in shape:
            size *= evaluate(d, b, s)
        size *= _wire_itemsize(tensor, node.target, plan.config.precision)
        linear = next(iter(node.users)) if op == "copy_to_tp" else node if op == "gather_linear_sp" \
            else tensor
        split = "column" if linear.name in tp_plan.column else "row" if linear.name in tp_plan.row \
            else "vocab" if op == "reduce_from_tp" else "redistribute"
        rows.append({"node": linear.name, "module": module_path(linear), "split": split,
                     "forward": fwd, "backward": bwd,
                     "bytes_per_microbatch": factor * (tp - 1) / tp * size})
    return rows


def _tp_lines(compiled) -> list[str]:
    rows = tp_rows(compiled)
    if not rows:
        return []
    plan = compiled.plan
    layers = [l for l in compiled.plan.chunk_layers for l in l]
    first = layers[0] if layers else None
    shown = [r for r in rows if first and (r["module"] == first or r["module"].startswith(first + "."))]
    lines = [f"tensor parallelism over tp={plan.mesh.tp}"
             + (" with sequence parallelism" if plan.config.sequence_parallel else "")
             + (" (bf16 where autocast computes in bf16)"
                if plan.config.precision != "fp32" else "")
             + (f"; collectives of one layer ({first}), bytes per rank per microbatch:" if shown else ":")]
    for r in shown:
        lines.append(f"  {r['module']:<28} {r['split']:<7} fwd {r['forward']:<15} "
                     f"bwd {r['backward']:<45} {_fmt(r['bytes_per_microbatch'], 'B')}")
    per_layer = sum(r["bytes_per_microbatch"] for r in shown)
    total = sum(r["bytes_per_microbatch"] for r in rows)
    if shown:
        lines.append(f"  per layer {_fmt(per_layer, 'B')}; whole model {_fmt(total, 'B')} per microbatch")
    sharded = len(plan.tp_shards)
    lines.append(f"  {sharded} weights split over tp, the rest replicated")
    return lines


def _bytes(boundary, b, s, precision: str = "fp32") -> float:
    n = 1
    for d in boundary.concrete_shape(b, s):
        n *= d
    bf16 = precision != "fp32" and boundary.dtype.is_floating_point   # the runtime sends bf16
    return float(n * (2 if bf16 else boundary.dtype.itemsize))


# Under precision="bf16" (autocast), what a tensor-parallel collective carries is bf16 when its
# tensor comes out of an op autocast runs in bf16, or when the runtime casts its input first (the
# ops that feed a linear: the registry's `before_linear`, runtime/executable.py); collectives on
# the fp32 residual stream (the vocabulary-parallel embedding's reduce, the sequence-parallel
# scatter of the embedding) stay fp32.
def _wire_itemsize(tensor, collective, precision: str) -> int:
    val = tensor.meta["val"]
    if precision == "fp32" or not val.dtype.is_floating_point:
        return val.element_size()
    if op_info(collective).before_linear:
        return 2
    node = tensor
    while getattr(node, "target", None) in G.RESHAPES:
        node = node.args[0]
    return 2 if getattr(node, "target", None) in G.AUTOCAST_REDUCED else val.element_size()


def _layer_span(layers) -> str:
    if not layers:
        return "-"
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"


def explain_table(compiled) -> str:
    plan, sim = compiled.plan, compiled.simulation
    rows = chunk_rows(compiled)
    head = (f"{plan.mesh}  schedule={plan.config.schedule} microbatches={plan.config.microbatches} "
            f"virtual_stages={plan.config.virtual_stages}  global batch={plan.global_batch} "
            f"microbatch size={plan.microbatch_size}"
            + (f"  precision={plan.config.precision} (transfers in bf16)"
               if plan.config.precision != "fp32" else ""))
    cols = ["chunk", "pp rank", "layers", "params", "fwd+bwd FLOPs/mb", "activations/mb",
            "recv/mb", "send/mb"]
    table = [[str(r["chunk"]), str(r["pp_rank"]), r["layers"], _fmt(r["params"]),
              _fmt(r["flops_per_microbatch"]), _fmt(r["activation_bytes_per_microbatch"], "B"),
              _fmt(r["recv_bytes_per_microbatch"], "B"), _fmt(r["send_bytes_per_microbatch"], "B")]
             for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    total = sum(r["params"] for r in rows)
    per_rank = _params_per_pp_rank(rows, plan.mesh.pp)
    lines.append(f"parameters: {_fmt(total)} in all (shared ones counted per chunk); "
                 f"largest pipeline rank holds {max(per_rank) / max(total, 1):.1%}")
    lines += _tp_lines(compiled)
    lines += _ep_lines(compiled)
    lines += _cp_lines(compiled)
    lines += fp8_lines(compiled)
    if plan.shared_params:
        shared = ", ".join(f"{n} (chunks {list(c)})" for n, c in plan.shared_params.items())
        lines.append(f"shared parameters, gradients summed between their chunks: {shared}")
    if plan.loss_rule:     # passes/weigh_loss_by_tokens.py
        lines.append(f"loss: {plan.loss_rule}")
    lines.append(f"simulated bubble: {sim.bubble:.3f} of the ideal time; peak microbatches in "
                 f"flight per rank: {list(sim.peak_in_flight)}")
    lines += _memory_lines(compiled)
    lines += _gather_lines(compiled)
    lines += reduce_scatter_lines(compiled)
    lines.append(f"options: {compiled.config} (autopart.Config; the rest at their defaults)")
    lines.append("passes: " + ", ".join(f"{p.name} {p.seconds:.2f}s" for p in compiled.passes)
                 + f"; compile {compiled.seconds:.2f}s")
    return "\n".join(lines)


def memory_rows(compiled) -> list[dict]:
    """One row per pipeline rank (its dp/tp ranks hold the same sizes): compiled.memory[rank]."""
    mesh = compiled.plan.mesh
    return [{"rank": r, "pp_rank": p, **compiled.memory[r]}
            for p in range(mesh.pp) for r in [mesh.rank(pp=p, dp=0, tp=0)]]


def recompute_summary(compiled) -> dict:
    plan = compiled.program.recompute
    if plan is None:
        return {}
    chosen = {}
    for (chunk, layer), kind in plan.choices.items():
        chosen.setdefault(kind, []).append(layer)
    return {"mode": plan.mode, "optimizer": plan.optimizer, "budget": plan.budget,
            "layers": {k: sorted(v) for k, v in chosen.items()},
            "skipped": [list(x) for x in plan.skipped]}


def gather_rows(compiled) -> list[dict]:
    """zero=3: per chunk, its parameter groups in the forward's order and when each is freed
    (passes/gather_parameters.py: "forward", "backward" or "step")."""
    groups = getattr(compiled.program, "param_groups", None) or {}
    return [{"chunk": c, "groups": [{"group": label, "freed_after": after}
                                    for label, after in rows]}
            for c, rows in sorted(groups.items())]


_FREED = {"forward": "freed after the forward (gathered again for the backward)",
          "backward": "kept to the backward", "step": "kept for the step"}


def _gather_lines(compiled) -> list[str]:
    rows = gather_rows(compiled)
    if not rows:
        return []
    lines = ["zero=3 parameter groups (all-gathered before their first reader, each gather "
             "prefetching the next group):"]
    for row in rows:
        by = {}
        for g in row["groups"]:
            by.setdefault(g["freed_after"], []).append(g["group"])
        parts = [f"{len(v)} {_FREED[k]}" + (f": {_names(v)}" if k != "forward" else "")
                 for k, v in by.items()]
        lines.append(f"  chunk {row['chunk']}: {len(row['groups'])} groups; " + "; ".join(parts))
    return lines


def _names(labels: list[str]) -> str:
    """Group labels, a group of several names in parentheses, a long list cut in the middle."""
    shown = [f"({x})" if ", " in x else x for x in labels]
    if len(shown) > 6:
        shown = shown[:3] + [f"... {len(shown) - 5} more ..."] + shown[-2:]
    return ", ".join(shown)


def _memory_lines(compiled) -> list[str]:
    from autopart.memory import fmt_bytes
    summary = recompute_summary(compiled)
    counts = ", ".join(f"{k} {len(v)}" for k, v in summary.get("layers", {}).items())
    lines = [f"recompute={summary.get('mode')} ({counts or 'no layers'}); memory per rank "
             f"(optimizer={summary.get('optimizer') or compiled.config.optimizer}, "
             f"precision={compiled.config.precision}, "
             f"zero={compiled.config.zero}"
             + (f", budget {fmt_bytes(summary['budget'])}" if summary.get("budget") else "")
             + "; every dp/tp rank of a pipeline rank the same):"]
    keys = ("params", "grads", "master", "optimizer", "activations", "buffers", "total")
    lines.append("  pp rank  " + "  ".join(f"{k:>11}" for k in keys))
    for row in memory_rows(compiled):
        lines.append(f"  {row['pp_rank']:>7}  " + "  ".join(f"{fmt_bytes(row[k]):>11}" for k in keys))
    return lines


def _params_per_pp_rank(rows, pp) -> list[int]:
    out = [0] * pp
    for r in rows:
        out[r["pp_rank"]] += r["params"]
    return out


def cp_rows(compiled) -> dict | None:
    """Context parallelism as JSON (None without a cp axis): the attention kernel, each
    replaced core with its mask, the rewritten position sources, the sequence per rank, and the
    position-mixing ops of the regions proved per-token by running them (token islands)."""
    cp = compiled.program.cp
    if cp is None or cp.cp == 1:
        return None
    return {"cp": cp.cp, "attention": cp.attention, "seq_len": cp.seq_len,
            "local_seq_len": cp.local_seq_len,
            "cores": [{"node": n, "mask": m} for n, m in cp.cores], "positions": list(cp.positions),
            "islands": list(cp.islands), "documents": list(cp.documents)}


def _cp_lines(compiled) -> list[str]:
    row = cp_rows(compiled)
    if row is None:
        return []
    masks = sorted({c["mask"] for c in row["cores"]})
    return [f"context parallelism over cp={row['cp']}: {row['attention']} attention replaces "
            f"{len(row['cores'])} attention core(s) ({'/'.join(masks)}); each rank holds "
            f"{row['local_seq_len']} of {row['seq_len']} positions (chunks i and "
            f"{2 * row['cp'] - 1}-i); positions from {len(row['positions'])} source(s) "
            f"({', '.join(row['positions'][:4])}) are the rank's own; gradients reduced over "
            f"dp x cp = {compiled.plan.mesh.replicas} replicas"] + \
        ([f"  proved per-token by running them on each rank's chunks: {len(row['islands'])} "
          f"position-mixing op(s) outside attention ({', '.join(row['islands'][:6])}"
          f"{', ...' if len(row['islands']) > 6 else ''})"] if row["islands"] else []) + \
        ([f"  packed documents: attention masked per block by the document ids of "
          f"{', '.join(row['documents'])} (blocks of disjoint documents skipped)"]
         if row["documents"] else [])


def explain_json(compiled) -> dict:
    plan, sim = compiled.plan, compiled.simulation
    return {
        "mesh": {"dp": plan.mesh.dp, "pp": plan.mesh.pp, "tp": plan.mesh.tp, "ep": plan.mesh.ep,
                 "cp": plan.mesh.cp, "world_size": plan.mesh.world_size},
        "schedule": plan.config.schedule, "microbatches": plan.config.microbatches,
        "virtual_stages": plan.config.virtual_stages, "global_batch": plan.global_batch,
        "microbatch_size": plan.microbatch_size, "precision": plan.config.precision,
        "loss_rule": plan.loss_rule,
        "chunks": chunk_rows(compiled),
        "shared_params": {k: list(v) for k, v in plan.shared_params.items()},
        "tensor_parallel": tp_rows(compiled),
        "sequence_parallel": plan.config.sequence_parallel,
        "expert_parallel": ep_rows(compiled),
        "context_parallel": cp_rows(compiled),
        "fp8": fp8_rows(compiled),
        "bubble": sim.bubble, "peak_in_flight": list(sim.peak_in_flight),
        "recompute": recompute_summary(compiled),
        "memory": memory_rows(compiled),
        "zero": compiled.config.zero,
        "param_groups": gather_rows(compiled),
        "reduce_scatters": reduce_scatter_rows(compiled),
        "passes": [{"name": p.name, "seconds": p.seconds} for p in compiled.passes],
        "compile_seconds": compiled.seconds,
        # every option of the run, defaults included (autopart/config.py)
        "options": dataclasses.asdict(compiled.config),
    }


__all__ = ["explain_table", "explain_json", "chunk_rows"]
