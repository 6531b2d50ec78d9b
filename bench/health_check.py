"""What the health check costs: `parallelize(..., nonfinite="raise")` (the default: each rank's
verdict on its losses and gradients rides in the step's all-reduce of the loss) against
`nonfinite="ignore"` (no check), on steps small enough to be overhead-bound.

    python bench/health_check.py                      # pp=2 and tp=2, table
    python bench/health_check.py --mesh pp=2 --steps 30 --json

Two rank processes (Gloo, one thread each). Per mesh, both ParallelModels are built from the same
weights and step back to back in every round (their order alternating round by round), each step
from a barrier and lasting as long as its slowest rank; the ratio is the median of the per-round
ratios raise / ignore (1.00: the check costs nothing measurable). The first steps' losses must be
equal.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.gpt`

from examples.gpt import GPT, config, lm_loss  # noqa: E402

MODES = ("raise", "ignore")


def rank_main(rank: int, world: int, opts: dict) -> dict:
    import autopart
    torch.manual_seed(opts["seed"])
    cfg = config(opts["config"])
    plain = GPT(cfg)
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    tokens = torch.randint(0, cfg.vocab_size, (opts["batch"], cfg.block_size), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (opts["batch"], cfg.block_size), generator=g)
    results = []
    for spec in opts["meshes"]:
        mesh = autopart.Mesh.parse(spec)
        kw = {"microbatches": opts["microbatches"]} if mesh.pp > 1 else {}
        pms = {mode: autopart.parallelize(copy.deepcopy(plain), mesh, (tokens,), loss_fn=lm_loss,
                                          target=targets, nonfinite=mode, **kw) for mode in MODES}
        first = {mode: float(pm.train_step(tokens, target=targets)) for mode, pm in pms.items()}
        if first["raise"] != first["ignore"]:
            raise AssertionError(f"{spec}: first-step losses differ: {first}")
        wall: dict = {mode: [] for mode in MODES}
        cpu: dict = {mode: [] for mode in MODES}
        for it in range(opts["warmup"] + opts["steps"]):
            for mode in MODES if it % 2 == 0 else MODES[::-1]:
                pm = pms[mode]
                for p in pm.parameters():
                    p.grad = None
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.thread_time()
                pm.train_step(tokens, target=targets)
                if it >= opts["warmup"]:
                    wall[mode].append(time.perf_counter() - start)
                    cpu[mode].append(time.thread_time() - start_cpu)
        for d in (wall, cpu):           # a step lasts as long as its slowest rank
            for mode in MODES:
                t = torch.tensor(d[mode], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                d[mode] = [1e3 * x for x in t.tolist()]
        ratios = [a / b for a, b in zip(wall["raise"], wall["ignore"])]
        cpu_ratios = [a / b for a, b in zip(cpu["raise"], cpu["ignore"])]
        results.append({"mesh": spec, "first_loss": first["raise"],
                        "raise_ms": statistics.median(wall["raise"]),
                        "ignore_ms": statistics.median(wall["ignore"]),
                        "ratio": statistics.median(ratios), "round_ratios": ratios,
                        "cpu_ratio": statistics.median(cpu_ratios), "cpu_round_ratios": cpu_ratios,
                        "raise_ms_all": wall["raise"], "ignore_ms_all": wall["ignore"],
                        "raise_cpu_ms_all": cpu["raise"], "ignore_cpu_ms_all": cpu["ignore"]})
        del pms
    return {"results": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", action="append", help="a 2-rank mesh; repeat it (default pp=2 and tp=2)")
    ap.add_argument("--config", default="tiny,n_layer=2,n_embd=32,n_head=2,block_size=16",
                    help="examples.gpt config spec (default: small enough to be overhead-bound)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4, help="for a mesh with pp")
    ap.add_argument("--steps", type=int, default=30, help="measured rounds (default 30)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true",
                    help="print one JSON line on stdout (the table goes to stderr)")
    a = ap.parse_args(argv)
    opts = dict(meshes=a.mesh or ["pp=2", "tp=2"], config=a.config, batch=a.batch,
                microbatches=a.microbatches, steps=a.steps, warmup=a.warmup, seed=a.seed)
    from autopart.runtime.launch import spawn
    results = spawn(rank_main, 2, opts, timeout=a.timeout)[0]["results"]
    lines = [f"health check: nonfinite='raise' against 'ignore', GPT {a.config}, batch {a.batch}; "
             f"Gloo, 1 thread/rank; medians of {a.steps} rounds after {a.warmup} warm-up", "",
             f"{'mesh':<10}{'raise ms':>10}{'ignore ms':>11}{'ratio':>8}{'cpu ratio':>11}"]
    lines += [f"{r['mesh']:<10}{r['raise_ms']:>10.2f}{r['ignore_ms']:>11.2f}{r['ratio']:>8.3f}"
              f"{r['cpu_ratio']:>11.3f}" for r in results]
    lines += ["", "ratio: median of the per-round ratios raise / ignore; cpu ratio: the same for "
              "the main thread's CPU time (the slowest rank's), which the other rank's scheduling "
              "and waits disturb far less than the wall time",
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus"]
    print("\n".join(lines), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps({"bench": "health_check", "options": opts, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
