"""`autopart plan FILE.py:NAME --gpus N --batch B --cluster NAME`: choose a layout with the cost model.

    autopart plan examples/gpt.py:GPT --config megatron-1t --gpus 3072 --batch 3072 --cluster a100-80gb-selene
    autopart plan examples/gpt.py:GPT --config megatron-1t --gpus 3072 --batch 3072 --cluster a100-80gb-selene --mesh tp=8,pp=64,dp=6 --json
    autopart plan examples/gpt.py:GPT --config gpt3-175b --gpus 96 --batch 96 --cluster a100-80gb-selene --explain-cost --png plan.png
    autopart plan examples/gpt.py:GPT --config gpt3-175b,n_layer=80,n_embd=8192,n_head=64 --seq 131072 --gpus 1024 --batch 64
    autopart calibrate                      # measure this machine: the `local` cluster

Without --mesh (or with some axes of it) the planner searches tp, pp, dp, microbatch size, virtual
stages, schedule, recomputation and the ZeRO level, and context parallelism (cp: each sequence
split over cp ranks) for sequences of 8192 tokens or more (or when nothing fits without it);
knobs given are fixed. `--seq N` plans at N tokens a sequence (the config's sequence-length
field, e.g. block_size or max_seq_len, set to N). The ranked table lists the layouts that fit
first (fastest first), then the rejected ones with why, and lines say why the chosen layout has
its ZeRO level and its cp degree; `--json` prints {"layouts": [...], "best": {...},
"zero_choice": "...", "cp_choice": "..."} alone on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from autopart.config import Config, choices
from autopart.errors import AutopartError
from autopart.gc_paused import gc_paused
from autopart.planner.cost import PRECISIONS, RUNTIMES     # what the cost model prices (fp16 too)
from autopart.planner.search import RECOMPUTE, SCHEDULE_NAMES, ZERO_LEVELS
from autopart.cli.parsers import documented_parser


def add_plan_command(subparsers) -> argparse.ArgumentParser:
    p = documented_parser(subparsers, "plan", "choose a parallel layout with the cost model",
                          __doc__, examples="    autopart")
    p.add_argument("target", metavar="FILE.py:NAME", help="a model class or a function returning the model")
    p.add_argument("--config", default=None, help="config name and/or overrides, e.g. megatron-1t,n_layer=64")
    p.add_argument("--gpus", type=int, required=True, help="devices in total")
    p.add_argument("--batch", type=int, required=True, help="global batch (sequences per step)")
    p.add_argument("--cluster", default="a100-80gb-selene",
                   help="a100-80gb-selene (default), h100-sxm, h200, local, or a cluster .json file")
    p.add_argument("--mesh", default=None,
                   help="fix some axes, e.g. tp=8,pp=64,dp=6, dp=8,ep=8 or cp=4 (the rest searched)")
    p.add_argument("--seq", type=int, default=None, metavar="TOKENS",
                   help="sequence length to plan for (default: the config's); sets the config's "
                        "block_size / max_seq_len / ... field; cp is searched from 8192 tokens")
    p.add_argument("--microbatch-size", type=int, default=None)
    p.add_argument("--virtual-stages", type=int, default=None)
    p.add_argument("--schedule", default=None, choices=SCHEDULE_NAMES)
    p.add_argument("--recompute", default=None, choices=RECOMPUTE,
                   help="fix activation recomputation (default: search full, selective, none; "
                        "selective reruns only each layer's attention core)")
    p.add_argument("--zero", type=int, default=None, choices=ZERO_LEVELS,
                   help="fix the ZeRO level (default: search 0, 1 and 2 where dp > 1)")
    p.add_argument("--precision", default=None, choices=tuple(PRECISIONS),
                   help="default bf16 mixed precision (fp32 on the local cluster)")
    p.add_argument("--optimizer", default=Config().optimizer, choices=choices("optimizer"))
    p.add_argument("--runtime", default="autopart", choices=RUNTIMES[:2],
                   help="whose overlaps the prediction assumes: autopart's runtime (default) or "
                        "Megatron-LM's (tp collectives behind GEMMs, sequence parallelism, parameter "
                        "gathers behind the forward); --explain-cost prints the other's figure too")
    p.add_argument("--versus", metavar="MESH", default=None,
                   help="with --explain-cost: compare the chosen layout term by term with the fastest "
                        "fitting layout of this mesh (e.g. a published one, tp=8,pp=16,dp=128)")
    p.add_argument("--top", type=int, default=12, help="rows of the printed table (default 12)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--explain-cost", action="store_true",
                   help="print the cluster's calibration constants and the chosen layout's time breakdown")
    p.add_argument("--png", metavar="FILE", default=None,
                   help="draw the chosen layout's predicted timeline to FILE and the ranked layouts "
                        "to FILE-layouts.png")
    p.set_defaults(run=run_plan)
    return p


def add_calibrate_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this machine into the `local` cluster profile",
                              description="Time matmuls of a few shapes, a memory-bound op, and a Gloo "
                                          "all-reduce and p2p between two local processes; save the profile.")
    p.add_argument("--out", default=None, help="where to save (default ~/.cache/autopart/local-cluster.json)")
    p.set_defaults(run=run_calibrate)
    return p


def parse_mesh(text: str | None, gpus: int) -> dict:
    """'tp=8,pp=64,dp=6' -> {'tp': 8, 'pp': 64, 'dp': 6}, checked against --gpus (cp adds ranks:
    tp * pp * dp * cp devices; ep does not)."""
    if not text:
        return {}
    axes = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in ("tp", "pp", "dp", "ep", "cp"):
            raise AutopartError(f"--mesh {text!r}: write axis=size with axes tp, pp, dp, cp, ep "
                                "(e.g. tp=8,pp=64,dp=6)")
        if key in axes:
            raise AutopartError(f"--mesh {text!r}: {key} given twice")
        try:
            axes[key] = int(value)
        except ValueError:
            raise AutopartError(f"--mesh {text!r}: {key}={value!r} is not an integer") from None
        if axes[key] < 1:
            raise AutopartError(f"--mesh {text!r}: {key} must be at least 1")
    size = 1
    for k, v in axes.items():
        size *= v if k != "ep" else 1          # ep shards experts over dp ranks: no ranks of its own
    full = {"tp", "pp", "dp"} <= set(axes)
    if gpus % size or (full and size != gpus):
        raise AutopartError(f"--mesh {text!r} uses {size} devices, which does not "
                            f"{'equal' if full else 'divide'} --gpus {gpus}")
    return axes


@gc_paused
def run_plan(args: argparse.Namespace) -> int:
    try:
        return _plan(args)
    except AutopartError as e:
        print(f"autopart plan: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:   # the compile CLI's usage errors (file, name, config), a model file's
        if type(e).__name__ in ("_UsageError", "ModelFileError"):
            print(f"autopart plan: error: {e}", file=sys.stderr)
            return 2
        raise


def _plan(args: argparse.Namespace) -> int:
    from autopart.planner import CostModel, default_precision
    from autopart.planner.cluster import cluster
    from autopart.planner.profile import load_profile
    from autopart.planner.search import cp_choice, search, zero_choice
    start = time.perf_counter()
    if args.gpus < 1 or args.batch < 1:
        raise AutopartError(f"--gpus {args.gpus} and --batch {args.batch} must be positive")
    if args.seq is not None and args.seq < 1:
        raise AutopartError(f"--seq {args.seq} must be positive")
    c = cluster(args.cluster)                       # before the slow capture
    axes = parse_mesh(args.mesh, args.gpus)
    profile = load_profile(args.target, args.config, args.seq)
    model = CostModel(profile, c, args.batch, precision=args.precision or default_precision(c),
                      optimizer=args.optimizer, runtime=args.runtime)
    ranked = search(model, args.gpus, tp=axes.get("tp"), pp=axes.get("pp"), dp=axes.get("dp"), ep=axes.get("ep"),
                    microbatch_size=args.microbatch_size, virtual_stages=args.virtual_stages,
                    schedule=args.schedule, recompute=args.recompute, zero=args.zero, cp=axes.get("cp"))
    best = next((e for e in ranked if e.fits), None)
    why_zero = zero_choice(model, best) if best is not None else None
    why_cp = cp_choice(model, best, ranked) if best is not None else None
    seconds = time.perf_counter() - start
    if args.png and best is not None:
        for path in draw(model, best, ranked, args.png):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps({"layouts": [e.row() for e in ranked], "best": best.row() if best else None,
                          "zero_choice": why_zero, "cp_choice": why_cp, "runtime": args.runtime,
                          "best_other_runtime": other_runtime(model, best)}))
    else:
        print(report(model, ranked, best, args.top, seconds))
        if why_zero:
            print(f"ZeRO: {why_zero}")
        if why_cp:
            print(f"CP: {why_cp}")
    if args.explain_cost:
        rival = _versus(model, args, axes) if args.versus and best is not None else None
        print(explain(model, best, rival), file=sys.stderr if args.json else sys.stdout)
    return 0 if best is not None else 1


def report(model, ranked, best, top: int, seconds: float) -> str:
    p, c = model.profile, model.cluster
    lines = [f"{p.layers} layers, hidden {p.hidden}, vocab {p.vocab}, sequence {p.seq}; global batch "
             f"{model.batch}; {c.name}, {model.precision} + {model.optimizer}",
             f"{len(ranked)} layouts, {sum(e.fits for e in ranked)} fit; searched in {seconds:.1f} s "
             + (f"(one layer captured in {p.seconds:.1f} s)" if not p.cached else "(layer profile cached)"), ""]
    head = ("mesh", "cp", "mbs", "v", "schedule", "recompute", "zero", "step s", "model TFLOP/s/dev",
            "GB/rank", "")
    rows = [_cells(model, e) for e in ranked if e.fits][:top]
    rejected = [e for e in ranked if not e.fits]
    rows += [_cells(model, e) for e in rejected[: max(3, top // 4)]]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines.append("  ".join(str(h).ljust(w) for h, w in zip(head, widths)).rstrip())
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    if rejected:
        lines.append(f"({len(rejected)} rejected in all)")
    if best is not None:
        r = best.row()
        lines += ["", f"best: {r['mesh']}, microbatch size {r['microbatch_size']}, {r['schedule']} "
                      f"(v={r['virtual_stages']}), recompute {r['recompute']}, zero={r['zero']}: "
                      f"{r['step_time_s']:.3f} s a step, {model_tflops(model, best):.1f} model "
                      f"TFLOP/s per device, {r['memory_per_rank_gb']:.1f} GB per rank",
                  "(model TFLOP/s: the model's FLOPs, recomputation not counted, as Megatron-LM "
                  "reports them)"]
    else:
        lines += ["", "no layout fits in memory"]
    return "\n".join(lines)


def model_tflops(model, e) -> float:
    """`e`'s TFLOP/s per device counting the model's FLOPs only, as Megatron-LM's
    num_floating_point_operations does (CostModel.counted_flops: three times the forward's
    matmuls read from the graph, 72 B s l h^2 (1 + s/6h + V/12lh) for a GPT): a layout that
    recomputes activations does more work for the same training step, so the recomputed FLOPs
    (which Estimate.tflops_per_device, the paper's Table 1 count that the A100 constants were
    fitted on, includes) earn it nothing here."""
    return model.counted_flops() / (e.step_time * e.layout.devices) / 1e12


def _cells(model, e) -> tuple:
    r = e.row()
    note = "" if e.fits else f"rejected: {e.rejected_because}"
    if not e.simulated:
        note = (note + " " if note else "") + "(bubble formula)"
    return (r["mesh"], r["cp"], r["microbatch_size"], r["virtual_stages"], r["schedule"], r["recompute"],
            r["zero"], f"{r['step_time_s']:.3f}", f"{model_tflops(model, e):.1f}",
            f"{r['memory_per_rank_gb']:.1f}", note)


def other_runtime(model, best) -> dict | None:
    """The chosen layout's step time under the other runtime's overlaps (cost.RUNTIMES)."""
    if best is None:
        return None
    from autopart.planner import CostModel
    name = "megatron" if model.runtime == "autopart" else "autopart"
    other = CostModel(model.profile, model.cluster, model.batch, precision=model.precision,
                      optimizer=model.optimizer, runtime=name).estimate(best.layout)
    return {"runtime": name, "step_time_s": round(other.step_time, 4), "fits": other.fits}


def _versus(model, args, axes):
    """The fastest fitting layout of --versus's mesh (the other knobs as given), or None."""
    from autopart.planner.search import search
    v = parse_mesh(args.versus, args.gpus)
    ranked = search(model, args.gpus, tp=v.get("tp"), pp=v.get("pp"), dp=v.get("dp"), ep=v.get("ep"),
                    cp=v.get("cp", 1), microbatch_size=args.microbatch_size, virtual_stages=args.virtual_stages,
                    schedule=args.schedule, recompute=args.recompute, zero=args.zero)
    return next((e for e in ranked if e.fits), None) or (ranked[0] if ranked else None)


def versus_lines(best, rival) -> list[str]:
    """The chosen layout and `rival` term by term: seconds a step and the difference."""
    def name(e):
        lay = e.layout
        return (f"{lay.mesh} b={lay.microbatch_size} v={lay.virtual_stages} {lay.recompute}"
                + (f"({lay.recompute_layers})" if lay.recompute_layers else "") + f" zero={lay.zero}")
    lines = [f"  versus {name(rival)}" + ("" if rival.fits else f" (does not fit: {rival.rejected_because})")
             + f": {rival.step_time:.4f} s a step against {best.step_time:.4f} s ({name(best)})",
             "    term: chosen, versus, difference (s)"]
    for k in dict.fromkeys([*best.breakdown, *rival.breakdown]):
        a, b = best.breakdown.get(k, 0.0), rival.breakdown.get(k, 0.0)
        lines.append(f"    {k}: {a:.4f}, {b:.4f}, {b - a:+.4f}")
    lines.append(f"    memory per rank: {best.memory['total'] / 1e9:.1f} GB, {rival.memory['total'] / 1e9:.1f} GB")
    return lines


def explain(model, best, rival=None) -> str:
    lines = [model.cluster.explain()]
    if best is not None:
        lay = best.layout
        f, b, _ = model.part_times(model.parts(lay)["layer"], lay.tp, lay.microbatch_size, lay.ep, lay.cp)
        lines.append(f"chosen layout {lay.mesh}: one layer, one microbatch of {lay.microbatch_size}: forward "
                     f"{f * 1e3:.2f} ms, backward {b * 1e3:.2f} ms (+ forward again with full recompute)")
        notes = model.assumptions(lay)
        lines.append(f"  step time as {model.runtime}'s runtime overlaps (the figure plan reports; "
                     f"--runtime chooses); each term and the overlap it assumes:")
        lines += [f"  {k}: {v:.4f} s" + (f"  [{notes[k]}]" if k in notes else "") for k, v in best.breakdown.items()]
        lines += [f"  {k}: {v}" for k, v in notes.items() if k not in best.breakdown]
        o = other_runtime(model, best)
        lines.append(f"  the same layout as {o['runtime']}'s runtime overlaps: {o['step_time_s']:.4f} s a step"
                     + ("" if o["fits"] else " (does not fit there)"))
        if rival is not None:
            lines += versus_lines(best, rival)
        m = best.memory
        lines.append("  memory per rank (GB): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in m.items()))
    return "\n".join(lines)


def draw(model, best, ranked, path: str) -> list[str]:
    """The chosen layout's simulated timeline (at most 2pp microbatches drawn) and a bar chart."""
    from pathlib import Path
    from autopart.schedule import make_schedule, simulate
    from autopart.cli.timeline import draw_simulated
    lay = best.layout
    fwd, bwd, _ = model.chunk_costs(lay)
    m = model.microbatches(lay)
    shown = m if m <= 2 * lay.pp else 2 * lay.pp
    schedule = make_schedule(lay.schedule, lay.pp, shown, lay.virtual_stages)
    sim = simulate(schedule, fwd, bwd, latency=model.message_time(lay))
    title = (f"predicted: {lay.mesh}, {lay.schedule} v={lay.virtual_stages}, microbatch {lay.microbatch_size}, "
             f"{shown} of {m} microbatches shown: {sim.makespan:.3g} s")
    # the cost model's chunk costs are seconds, so the simulated times are too
    out = [str(draw_simulated(schedule, sim, path, title=title, xlabel="time (s)"))]
    out.append(str(_bars(model, ranked, Path(path).with_name(Path(path).stem + "-layouts.png"))))
    return out


def _bars(model, ranked, path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [e for e in ranked if e.fits][:15] + [e for e in ranked if not e.fits][:5]
    labels = [f"{e.layout.mesh} b={e.layout.microbatch_size} v={e.layout.virtual_stages} {e.layout.recompute}"
              for e in shown]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(shown) + 1.2))
    ax.barh(range(len(shown)), [model_tflops(model, e) for e in shown],
            color=["tab:blue" if e.fits else "tab:gray" for e in shown])
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("predicted model TFLOP/s per device (recomputation not counted); "
                  "gray: does not fit in memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def run_calibrate(args: argparse.Namespace) -> int:
    from autopart.planner.calibrate import calibrate
    from autopart.planner.cluster import LOCAL_PATH
    c = calibrate()
    path = c.save(args.out or LOCAL_PATH)
    print(c.explain())
    print(f"saved {path}")
    return 0


__all__ = ["add_plan_command", "add_calibrate_command", "model_tflops", "parse_mesh", "run_plan"]
