"""Step time and peak activation memory with recompute none / selective / full, the example GPT
(`tiny`: 4 layers, h=64, s=64) at pp=2, 1F1B, 4 microbatches, in the same run; printed as ratios
to none. Peak activations are measured by the ranks themselves (saved-tensor hooks counting the
unique storages autograd keeps, plus a recomputed region's own saved tensors while it reruns: see
tests/workers/memory.py), beside the memory model's prediction.

    python bench/recompute.py [--steps 8] [--config tiny]
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("none", "selective", "full")


def rank_main(rank: int, world: int, config: str, steps: int) -> dict:
    import torch
    import autopart
    from examples.gpt import GPT, config as gpt_config, lm_loss
    from tests.workers.memory import _instrument_reruns, _Live, _Saved

    torch.set_num_threads(1)
    cfg = gpt_config(config)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size), generator=g)
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        pm = autopart.parallelize(GPT(cfg), autopart.Mesh(pp=world), (x,), loss_fn=lm_loss,
                                  target=x, microbatches=4, recompute=mode,
                                  timeout=timedelta(seconds=300))
        opt = torch.optim.SGD(pm.parameters(), lr=0.01)
        pm.train_step(x, target=x), opt.step(), opt.zero_grad()        # warm up
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            pm.train_step(x, target=x)
            times.append(time.perf_counter() - start)
            opt.step(), opt.zero_grad()
        live = _Live({p.untyped_storage().data_ptr() for p in pm.parameters()})
        _instrument_reruns(pm, live)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, live), lambda s: s.t):
            pm.train_step(x, target=x)
        out[mode] = {"step_s": sorted(times)[len(times) // 2], "peak_acts": live.peak,
                     "predicted_acts": pm.compiled.memory[rank]["activations"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--config", default="tiny")
    args = ap.parse_args()
    from autopart.runtime.launch import spawn
    ranks = spawn(rank_main, 2, args.config, args.steps, timeout=1200)
    print(f"example GPT {args.config}, pp=2, 1f1b, 4 microbatches of 2; median of {args.steps} "
          "steps; activations: peak bytes autograd keeps (measured) per rank")
    print(f"{'recompute':<10} {'step time':>10} {'/none':>6}   "
          + "   ".join(f"rank {r} acts   /none  predicted" for r in range(len(ranks))))
    base = ranks[0]["none"]["step_s"]
    for mode in MODES:
        step = max(r[mode]["step_s"] for r in ranks)
        base = max(r["none"]["step_s"] for r in ranks)
        cells = [f"{r[mode]['peak_acts']:>10} {r[mode]['peak_acts'] / r['none']['peak_acts']:>6.2f}"
                 f" {r[mode]['predicted_acts']:>10}" for r in ranks]
        print(f"{mode:<10} {step * 1e3:>8.1f}ms {step / base:>6.2f}   " + "   ".join(cells))


if __name__ == "__main__":
    main()
