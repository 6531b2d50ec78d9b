"""FP8 against bf16 over a training run: the example GPT (`tiny`: 4 layers, n_embd 64, 64 tokens,
byte vocabulary) on examples/data/corpus.txt, 200 AdamW steps, one rank, each precision from the
same weights on the same batches; the loss every step and the band between them.

    python -m bench.fp8_curve                      # 200 steps, tensorwise and rowwise vs bf16
    python -m bench.fp8_curve --steps 50 --json out.json

docs/precision.md quotes its output. A single rank (Mesh()): what is measured is the recipe's
numerics, which tests/test_fp8.py holds equal to the written-out recipe on every mesh it runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.gpt import GPT, config, lm_loss  # noqa: E402
from examples.train_gpt import batches  # noqa: E402

RUNS = (("bf16", {"precision": "bf16"}), ("fp8-tensorwise", {"precision": "fp8"}),
        ("fp8-rowwise", {"precision": "fp8", "fp8_scaling": "rowwise"}))


def train(options: dict, steps: int, batch: int, seed: int = 0) -> list[float]:
    import autopart
    torch.manual_seed(seed)
    model = GPT(config("tiny"))
    data = list(batches(steps, batch, model.config.block_size, seed))
    pm = autopart.parallelize(model, autopart.Mesh(), (data[0][0],), loss_fn=lm_loss,
                              target=data[0][1], config=autopart.Config(**options),
                              timeout=timedelta(seconds=300))
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.0)
    losses = []
    for x, y in data:
        losses.append(float(pm.train_step(x, target=y)))
        opt.step()
        opt.zero_grad()
    return losses


def band(run: list[float], ref: list[float], last: int) -> dict:
    """Relative loss difference |run - ref| / ref: max over all steps and mean over the last."""
    rel = [abs(a - b) / b for a, b in zip(run, ref)]
    return {"max": max(rel), f"mean_last_{last}": sum(rel[-last:]) / last,
            "final": run[-1], "final_ref": ref[-1]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--runs", default=",".join(n for n, _ in RUNS),
                    help="which of " + ", ".join(n for n, _ in RUNS) + " (bf16 always)")
    args = ap.parse_args(argv)
    store = dist.FileStore(tempfile.mktemp(prefix="fp8_curve_"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        curves, seconds = {}, {}
        wanted = {"bf16", *args.runs.split(",")}
        for name, options in [r for r in RUNS if r[0] in wanted]:
            start = time.perf_counter()
            curves[name] = train(options, args.steps, args.batch)
            seconds[name] = time.perf_counter() - start
            print(f"{name}: first {curves[name][0]:.4f} last {curves[name][-1]:.4f} "
                  f"({seconds[name]:.0f} s)", flush=True)
    finally:
        dist.destroy_process_group()
    last = min(50, args.steps)
    result = {"steps": args.steps, "batch": args.batch, "seconds": seconds, "curves": curves,
              "band": {n: band(curves[n], curves["bf16"], last) for n in curves if n != "bf16"}}
    for name, b in result["band"].items():
        print(f"{name} vs bf16: max relative loss difference {b['max']:.4f}, mean over the "
              f"last {last} steps {b[f'mean_last_{last}']:.4f}; final loss {b['final']:.4f} "
              f"vs {b['final_ref']:.4f}")
    for step in sorted({0, 9, 49, 99, 149, args.steps - 1} & set(range(args.steps))):
        print(f"  step {step + 1:>4}: " + "  ".join(f"{n} {curves[n][step]:.4f}" for n in curves))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
