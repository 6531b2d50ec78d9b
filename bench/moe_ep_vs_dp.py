"""Expert parallelism (ep=2) against plain data parallelism with every expert replicated (dp=2),
on the tiny Switch model, 2 ranks.

    python bench/moe_ep_vs_dp.py
    python bench/moe_ep_vs_dp.py --steps 20 --json

Two rank processes (Gloo, one thread each) build both layouts from the same weights and alternate
training steps (forward + backward + SGD) in one run. The table gives median step times, the ratio
ep/dp, and the share of the ep step spent in all-to-all: the time inside
torch.distributed.all_to_all_single, counted by a timer wrapped around it in this benchmark's
processes only. Before timing, both layouts' first-step losses are checked against the plain model.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.switch import SwitchGPT, config  # noqa: E402


class _A2ATimer:
    """Wraps dist.all_to_all_single to add up the seconds spent in it."""

    def __init__(self):
        self.seconds, self._inner = 0.0, dist.all_to_all_single

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def run(rank: int, world: int, args) -> dict:
    import autopart
    timer = _A2ATimer()
    dist.all_to_all_single = timer      # the ep ops look the function up at call time
    cfg = config(args.config)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size), generator=g)

    def build():
        torch.manual_seed(0)
        return SwitchGPT(cfg)

    with torch.no_grad():
        plain = build()(x, y).item()
    sides = {}
    for name, mesh in (("ep", autopart.Mesh(dp=world, ep=world)), ("dp", autopart.Mesh(dp=world))):
        pm = autopart.parallelize(build(), mesh, (x, y), microbatches=args.microbatches)
        sides[name] = (pm, torch.optim.SGD(pm.parameters(), lr=1e-2))

    def step(name):
        pm, opt = sides[name]
        loss = pm.train_step(x, y)
        opt.step()
        opt.zero_grad()
        return loss.item()

    first = {"plain": plain, "ep": step("ep"), "dp": step("dp")}
    for _ in range(args.warmup):
        step("ep"), step("dp")
    times, a2a = {"ep": [], "dp": []}, []
    for _ in range(args.steps):
        for name in ("ep", "dp"):
            dist.barrier()
            timer.seconds = 0.0
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
            if name == "ep":
                a2a.append(timer.seconds)
    params = {k: sum(p.numel() for p in pm.parameters()) for k, (pm, _) in sides.items()}
    return {"first_loss": first, "times": times, "a2a": a2a, "params": params}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    from autopart.runtime.launch import spawn
    out = spawn(run, 2, args, timeout=args.timeout)[0]
    first = out["first_loss"]
    ok = all(abs(first[k] - first["plain"]) < 1e-4 for k in ("ep", "dp"))
    med = {k: statistics.median(v) for k, v in out["times"].items()}
    a2a_share = statistics.median(a / t for a, t in zip(out["a2a"], out["times"]["ep"]))
    result = {"config": args.config, "batch": args.batch, "microbatches": args.microbatches,
              "first_step_loss": first, "losses_match": ok, "median_step_seconds": med,
              "ratio_ep_over_dp": med["ep"] / med["dp"], "all_to_all_share_of_ep_step": a2a_share,
              "params_per_rank": out["params"]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"Switch {args.config}, 2 ranks, Gloo, 1 thread per rank, global batch {args.batch}, "
              f"{args.microbatches} microbatches")
        print(f"first-step loss: plain {first['plain']:.6f}  ep=2 {first['ep']:.6f}  "
              f"dp=2 {first['dp']:.6f}  ({'match' if ok else 'MISMATCH'})")
        print(f"parameters per rank: ep=2 {out['params']['ep']}, dp=2 (experts replicated) "
              f"{out['params']['dp']}")
        print(f"median step (fwd+bwd+SGD): ep=2 {med['ep'] * 1e3:.1f} ms   dp=2 {med['dp'] * 1e3:.1f} ms"
              f"   ratio ep/dp {result['ratio_ep_over_dp']:.3f}")
        print(f"share of the ep=2 step spent in all-to-all: {a2a_share:.1%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
