"""The planner against published H100 runs: per row, the measured TFLOP/s per GPU, the prediction
for the row's own layout, the error; then the honest half-fit (constants fitted on half the rows,
the other half predicted) and the A100 Table 1 check.

    python -m bench.published              # the three tables (a few seconds with the layer cache)
    python -m bench.published --fit        # refit h100-sxm on all rows and on the fit half (minutes)
    python -m bench.published --fit-fp8    # refit fp8_gemm_efficiency on the FP8 fit half

Rows: autopart/planner/data/published_h100_runs_given.json (a copy of the given file). The
prediction and its units are autopart/planner/published.py's: the row's FLOPs by Megatron-LM's
count over the predicted step time, with Megatron-LM's overlaps (cost.RUNTIMES).
Last, the FP8 runs (autopart/planner/data/published_h100_fp8_runs.json, NeMo 24.07 on DGX-H100): the
fit half and the held-out half, in tokens a second per GPU, predicted / published.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import warnings


def predictions(cluster, rows) -> list[tuple]:
    """(row, estimate or None, predicted TFLOP/s per GPU, relative error) per row."""
    from autopart.planner import published as P
    out = []
    for r in rows:
        e = P.predict(r, cluster)
        tf = P.predicted_tflops(r, e)
        out.append((r, e, tf, tf / r["tflops_per_gpu"] - 1))
    return out


def table(cluster, rows, title: str) -> tuple[str, list[float]]:
    lines = [title, "| published run (H100, BF16) | GPUs | tp | pp | dp | measured TFLOP/s/GPU | predicted | error "
                    "| layout the prediction took |", "|---|---|---|---|---|---|---|---|---|"]
    errors = []
    for r, e, tf, err in predictions(cluster, rows):
        errors.append(err)
        lay = e.layout if e is not None else None
        how = (f"b={lay.microbatch_size}, v={lay.virtual_stages}, {lay.recompute} recompute, zero={lay.zero}"
               if lay else "does not fit")
        lines.append(f"| {r['model'].split(' (')[0]}, seq {r['seq']} | {r['gpus']} | {r['tp']} | {r['pp']} | "
                     f"{r['dp']} | {r['tflops_per_gpu']:g} | {tf:.1f} | {err:+.1%} | {how} |")
    lines.append(f"largest error {max(abs(x) for x in errors):.1%}")
    return "\n".join(lines), errors


def table1() -> tuple[str, float]:
    from autopart.planner.cluster import PRESETS
    from autopart.planner.fit import predict_row, reference_rows
    lines = ["A100 Table 1 (Narayanan et al. 2021, a100-80gb-selene, the 2021 runtime):",
             "| model | GPUs | measured | predicted | error |", "|---|---|---|---|---|"]
    worst = 0.0
    for r in reference_rows():
        e = predict_row(r, PRESETS["a100-80gb-selene"])
        err = e.tflops_per_device / r["tflops_per_gpu"] - 1
        worst = max(worst, abs(err))
        lines.append(f"| {r['params_billion']}B | {r['num_gpus']} | {r['tflops_per_gpu']} | "
                     f"{e.tflops_per_device:.1f} | {err:+.1%} |")
    lines.append(f"largest error {worst:.1%}")
    return "\n".join(lines), worst


def fp8_table(cluster, rows, title: str) -> tuple[str, list[float]]:
    """The FP8 rows: published tokens/s/GPU against predicted (precision="fp8"), their ratio, and
    the bf16 prediction of the same layout beside (what FP8 is predicted to gain)."""
    from autopart.planner import published as P
    lines = [title, "| published run (H100, FP8) | GPUs | tp | pp | cp | vp | mbs | measured tokens/s/GPU "
                    "(TFLOP/s) | predicted fp8 | predicted / published | predicted bf16 | recompute, zero |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        e = P.predict(r, cluster, precision="fp8")
        tok, bf16 = P.predicted_tokens(r, e), P.predicted_tokens(r, P.predict(r, cluster, precision="bf16"))
        ratios.append(tok / r["tokens_per_s_per_gpu"])
        how = f"{e.layout.recompute}, zero={e.layout.zero}" if e is not None else "does not fit"
        lines.append(f"| {r['model'].split(' (')[0]}, seq {r['seq']} | {r['gpus']} | {r['tp']} | {r['pp']} | {r['cp']} | "
                     f"{r['vp']} | {r['mbs']} | {r['tokens_per_s_per_gpu']:g} ({r['tflops_per_gpu']:g}) | {tok:.0f} | "
                     f"{ratios[-1]:.3f} | {bf16:.0f} | {how} |")
    lines.append(f"largest error {max(abs(x - 1) for x in ratios):.1%}")
    return "\n".join(lines), ratios


def main() -> None:
    from autopart.planner import published as P
    from autopart.planner.cluster import H100_HALF_FIT, PRESETS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the constants (prints them; paste into cluster.py)")
    ap.add_argument("--fit-fp8", action="store_true",
                    help="refit fp8_gemm_efficiency on the FP8 fit half (prints it; cluster.py's FP8_FITTED)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")          # tp=16 replication warnings of the analysed shapes
    rows = P.rows()
    fit_half, held = P.half_split(rows)
    h100 = PRESETS["h100-sxm"]
    half = dataclasses.replace(h100, **H100_HALF_FIT)
    if args.fit:
        for name, some in (("all rows", rows), ("fit half", fit_half)):
            c = P.fit(h100, some)
            print(name, json.dumps({k: round(getattr(c, k), 4) for k in P.FREE}))
        return
    fp8_fit, fp8_held = P.half_split(P.fp8_rows())
    if args.fit_fp8:
        print("fp8_gemm_efficiency", P.fit_fp8(h100, fp8_fit))
        return
    print(table(h100, rows, "h100-sxm (fitted on all ten rows), each row's own layout:")[0], "\n")
    print(f"half-fit: constants fitted on {', '.join(r['model'].split(' (')[0] for r in fit_half)} "
          "(sorted by GPUs, every other row from the first)")
    print(table(half, fit_half, "the fitted half:")[0], "\n")
    print(table(half, held, "the held-out half, predicted:")[0], "\n")
    print(table1()[0])
    names = ", ".join(f"{r['model'].split(' (')[0]} ({r['gpus']})" for r in fp8_fit)
    print(f"\nFP8 (h100-sxm, fp8_gemm_efficiency {h100.fp8_gemm_efficiency:g} fitted on {names}; "
          "Megatron-LM's runtime and FP8 recipe):")
    print(fp8_table(h100, fp8_fit, "the fitted half:")[0], "\n")
    print(fp8_table(h100, fp8_held, "the held-out half, predicted:")[0])
    skipped = [r["model"].split(" (")[0] for r in P.fp8_rows(all_rows=True) if r["layers"] is None]
    print(f"recorded, not predicted (model shape not in the source): {', '.join(skipped)}")


if __name__ == "__main__":
    main()
