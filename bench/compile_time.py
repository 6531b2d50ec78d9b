"""Compile time and peak memory of a large GPT on the meta device, whole process included.

    python bench/compile_time.py                      # gpt3-175b, pp=16 (target: < 30 s)
    python bench/compile_time.py --model megatron-1t --pp 64 --virtual-stages 2
    python bench/compile_time.py --model gpt3-175b --pp 16 --dp 8 --repeat 3
    python bench/compile_time.py --model megatron-1t --pp 64 --tp 8 --dp 6   # 3072 ranks
    python bench/compile_time.py --model megatron-1t --pp 64 --tp 8 --dp 6 \
        --recompute full --memory-budget 80GB --precision bf16    # as the paper ran it, A100-80GB

Each run is a fresh `python` subprocess (imports, model build on the meta device, capture,
passes, emission), timed from outside; the child reports its own breakdown and ru_maxrss.
Nothing is allocated: the weights would need 4 bytes per parameter (700 GB for 175B).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILE_OPTIONS = ("recompute", "memory_budget", "precision")    # passed to compile as given


def child(model: str, pp: int, dp: int, tp: int, v: int, microbatches: int | None,
          options: dict) -> None:
    """Runs in the subprocess: compile once, print the breakdown as JSON."""
    t0 = time.perf_counter()
    import torch

    import autopart
    from examples.gpt import GPT, config, example_inputs, lm_loss
    t_import = time.perf_counter() - t0

    cfg = config(model)
    t1 = time.perf_counter()
    with autopart.meta_device():        # as `autopart compile` builds it: no init on meta
        gpt = GPT(cfg)
    t_build = time.perf_counter() - t1
    m = microbatches or pp * v
    x, = example_inputs(cfg, dp * m, "meta")
    compiled = autopart.compile(gpt, autopart.Mesh(pp=pp, dp=dp, tp=tp), (x,), loss_fn=lm_loss, target=x,
                                microbatches=m, virtual_stages=v,
                                schedule="interleaved-1f1b" if v > 1 else "1f1b", **options)
    passes = {p.name: p.seconds for p in compiled.passes}
    t2 = time.perf_counter()
    compiled.explain()      # what `autopart compile` prints: the memory table is most of it
    t_explain = time.perf_counter() - t2
    print(json.dumps({
        "import": t_import, "build_meta_model": t_build,
        "capture_schedule_simulate_check": compiled.seconds - sum(passes.values()),
        "passes": passes, "compile_total": compiled.seconds, "explain": t_explain,
        "params": cfg.n_params(), "ranks": len(compiled.programs),
        "chunks": len(compiled.plan.chunk_layers),
        "distinct_chunks": compiled.check["checked"],
        "max_over_mean_cost": max(compiled.program.stages.chunk_cost) / (sum(compiled.program.stages.chunk_cost) / pp / v),
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))
    from autopart.cli import exit_now
    exit_now(0)               # ends as the `autopart` command does: no interpreter teardown


def run_once(args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--pp", str(args.pp),
           "--dp", str(args.dp), "--tp", str(args.tp), "--virtual-stages", str(args.virtual_stages)]
    if args.microbatches:
        cmd += ["--microbatches", str(args.microbatches)]
    for flag in COMPILE_OPTIONS:
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"compile failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall"] = wall
    # CPU time is what a loaded machine does not inflate (the wall time is, by other processes).
    result["process_cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt3-175b", help="a config of examples/gpt.py")
    p.add_argument("--pp", type=int, default=16)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=None, help="default pp * virtual stages")
    p.add_argument("--recompute", default=None, help="compile's recompute= (default none)")
    p.add_argument("--memory-budget", default=None,
                   help="compile's memory_budget= per rank, e.g. 80GB: the cut is then "
                        "compute-optimal among the cuts that fit it")
    p.add_argument("--precision", default=None, help="compile's precision= (default fp32)")
    p.add_argument("--repeat", type=int, default=1, help="runs; the table shows the fastest")
    p.add_argument("--target", type=float, default=30.0, help="seconds, whole process")
    p.add_argument("--json", action="store_true",
                   help="print one JSON line with every run on stdout (the table goes to stderr)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        options = {k: getattr(args, k) for k in COMPILE_OPTIONS if getattr(args, k) is not None}
        child(args.model, args.pp, args.dp, args.tp, args.virtual_stages, args.microbatches, options)
        return
    runs = [run_once(args) for _ in range(args.repeat)]
    if args.json:
        with contextlib.redirect_stdout(sys.stderr):
            table(args, runs)
        print(json.dumps({"bench": "compile_time", "runs": runs, "loadavg": os.getloadavg()}))
    else:
        table(args, runs)


def table(args, runs: list[dict]) -> None:
    best = min(runs, key=lambda r: r["process_wall"])
    print(f"{args.model} ({best['params'] / 1e9:.1f}B parameters) pp={args.pp} dp={args.dp} tp={args.tp} "
          f"v={args.virtual_stages}: {best['ranks']} ranks, {best['chunks']} chunks "
          f"({best['distinct_chunks']} distinct), meta device")
    rows = [("python + torch + autopart import", best["import"]),
            ("build GPT on the meta device", best["build_meta_model"]),
            ("capture (torch.export) + schedule + simulation + checks",
             best["capture_schedule_simulate_check"]),
            *((f"  {name}", seconds) for name, seconds in best["passes"].items()),
            ("autopart.compile total", best["compile_total"]),
            ("explain() (the table `autopart compile` prints)", best["explain"]),
            ("whole process (wall, from outside)", best["process_wall"]),
            ("whole process (CPU user+sys)", best["process_cpu"])]
    width = max(len(name) for name, _ in rows)
    for name, seconds in rows:
        print(f"{name.ljust(width)}  {seconds:7.2f} s")
    print(f"{'largest chunk compute / mean'.ljust(width)}  {best['max_over_mean_cost']:7.2f}")
    rss = best["maxrss_bytes"] / 2**30
    print(f"{'peak memory (ru_maxrss)'.ljust(width)}  {rss:7.2f} GiB   "
          f"(the fp32 weights alone: {best['params'] * 4 / 2**30:,.0f} GiB)")
    if len(runs) > 1:
        print("all runs (wall s): " + ", ".join(f"{r['process_wall']:.2f}" for r in runs))
    verdict = "OK" if best["process_wall"] < args.target else "SLOWER THAN"
    load = os.getloadavg()[0]
    print(f"{verdict} target {args.target:.0f} s (load average {load:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
