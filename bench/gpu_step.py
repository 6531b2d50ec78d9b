"""One GPU: autopart's training step against the plain model's, the same work, side by side.

    python bench/gpu_step.py                       # GPT-2 124M, batch 8 x 1024, bf16, table
    python bench/gpu_step.py --steps 30 --json     # the rows as JSON
    python bench/gpu_step.py --precision fp32 --config tiny --batch 4
    python bench/gpu_step.py --nonfinite ignore      # without the health check
    python bench/gpu_step.py --microbatches 4        # the plain side accumulates over the same 4
    python bench/gpu_step.py --precision fp8         # autopart's FP8 step against the plain bf16 one

One rank on cuda:0, its process group NCCL (world 1). Two sides built from the same weights
step back to back in every round (their order alternating round by round), each timed from a
`torch.cuda.synchronize()` to one after `opt.step()`:

  plain     the unmodified model: forward under `torch.autocast(bf16)` (the recipe autopart's
            `precision="bf16"` is held to), backward, AdamW; also under `--precision fp8`,
            so that the figure is autopart's FP8 step against bf16 (docs/precision.md)
  autopart  `parallelize(model, Mesh(pp=1), precision=..., microbatches=M)`: `pm.train_step`
            then AdamW over `pm.parameters()` (zero=0) or `pm.optimizer` (zero>=1)

The figure is the median of the per-round ratios autopart / plain (below 1: autopart faster).
With M > 1 the plain side accumulates over the same M microbatches, so both do the same work.
Peak memory is the CUDA caching allocator's own count (`torch.cuda.max_memory_allocated`) over
each side's timed steps, reset between the sides. The first step's losses must agree (bf16
within 2e-2, fp32 within 1e-4) or the run fails: unequal work is no benchmark.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.gpt`

from autopart.config import choices  # noqa: E402
from examples.gpt import GPT, config, lm_loss  # noqa: E402

SIDES = ("autopart", "plain")


def _plain_step(model, opt, chunks, autocast: bool) -> float:
    total = 0.0
    for x, y in chunks:
        with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(x), y) / len(chunks)
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _autopart_step(pm, opt, x, y):
    loss = pm.train_step(x, target=y)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def rank_main(rank: int, world: int, opts: dict) -> dict:
    import autopart
    from autopart.runtime.launch import rank_device
    device = rank_device()
    torch.manual_seed(opts["seed"])
    cfg = config(opts["config"])
    plain = GPT(cfg).to(device)
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    x, y = (torch.randint(0, cfg.vocab_size, (opts["batch"], cfg.block_size), generator=g).to(device)
            for _ in range(2))
    m, bf16 = opts["microbatches"], opts["precision"] in ("bf16", "fp8")   # the plain side's
    start = time.perf_counter()
    pm = autopart.parallelize(copy.deepcopy(plain), autopart.Mesh(pp=1), (x,), loss_fn=lm_loss,
                              target=y, microbatches=m, precision=opts["precision"],
                              zero=opts["zero"], nonfinite=opts["nonfinite"],
                              compile=opts["compile"])
    compile_s = time.perf_counter() - start
    opt = (pm.optimizer(torch.optim.AdamW, lr=1e-4) if opts["zero"]
           else torch.optim.AdamW(pm.parameters(), lr=1e-4))
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    chunks = list(zip(x.chunk(m), y.chunk(m)))
    step = {"autopart": lambda: _autopart_step(pm, opt, x, y),
            "plain": lambda: _plain_step(plain, ref_opt, chunks, bf16)}
    first = {side: float(step[side]()) for side in SIDES}
    tol = 2e-2 if bf16 else 1e-4
    if abs(first["autopart"] - first["plain"]) > tol:
        raise AssertionError(f"first-step losses differ by more than {tol}: {first}")
    wall: dict = {side: [] for side in SIDES}
    peak: dict = {side: 0 for side in SIDES}
    for it in range(opts["warmup"] + opts["steps"]):
        for side in SIDES if it % 2 == 0 else SIDES[::-1]:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            step[side]()
            torch.cuda.synchronize(device)
            if it >= opts["warmup"]:
                wall[side].append(1e3 * (time.perf_counter() - t0))
                peak[side] = max(peak[side], torch.cuda.max_memory_allocated(device))
    ratios = [a / b for a, b in zip(wall["autopart"], wall["plain"])]
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "config": opts["config"], "batch": opts["batch"], "seq": cfg.block_size,
            "microbatches": m, "precision": opts["precision"], "zero": opts["zero"],
            "nonfinite": opts["nonfinite"], "compile": opts["compile"],
            "first_loss": first, "parallelize_s": round(compile_s, 2),
            "ms": {s: statistics.median(wall[s]) for s in SIDES}, "ms_all": wall,
            "ratio": statistics.median(ratios), "round_ratios": ratios,
            "peak_mib": {s: round(peak[s] / 2**20, 1) for s in SIDES},
            "tokens_per_s": {s: opts["batch"] * cfg.block_size / (statistics.median(wall[s]) / 1e3)
                             for s in SIDES}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--precision", default="bf16", choices=choices("precision"))
    ap.add_argument("--zero", type=int, default=0, choices=(0, 1))
    ap.add_argument("--nonfinite", default="raise", choices=("raise", "ignore"),
                    help="autopart's health check (the default, raise) or none")
    ap.add_argument("--compile", action="store_true",
                    help="autopart with compile=True (Inductor); the plain side stays eager")
    ap.add_argument("--steps", type=int, default=20, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_step.py needs a CUDA device; this machine has none", file=sys.stderr)
        return 2
    from autopart.runtime.launch import spawn
    out = spawn(rank_main, 1, vars(args), device="cuda", timeout=1200)[0]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['device']}, torch {out['torch']}, GPT {out['config']}, batch {out['batch']} x "
          f"{out['seq']}, {out['microbatches']} microbatch(es), {out['precision']}, zero={out['zero']}, "
          f"nonfinite={out['nonfinite']}, compile={out['compile']}")
    for s in SIDES:
        print(f"  {s:9s} {out['ms'][s]:8.2f} ms/step  {out['tokens_per_s'][s]:10.0f} tokens/s  "
              f"peak {out['peak_mib'][s]:8.1f} MiB")
    print(f"  autopart / plain: {out['ratio']:.3f} (median of {len(out['round_ratios'])} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
