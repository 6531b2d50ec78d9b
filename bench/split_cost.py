"""A zero-bubble chunk's split backward against its fused backward: per chunk, I + W against B.

    python bench/split_cost.py                   # the table, 30 rounds
    python bench/split_cost.py --rounds 40 --json

One process, one thread, no communication: the compute-bound GPT of bench/zero_bubble.py (8 layers,
n_embd=256, microbatches of 8 x 32 tokens) compiled for zb-h1 on pp=2; each chunk runs, in every
round and back to back, the two paths the executor has for one microbatch:
  fused   F: the chunk's program under autograd; B: autograd's backward
  split   F: split_backward's forward program; I: the input-gradient program; W: the weight-gradient
          program (the executor's own functions, so what a zero-bubble step runs)
Each path starts with the parameters' .grad set (as from an earlier microbatch), so both add into
it. The figures are medians of the per-round ratios (I + W) / B and F(split) / F(fused), and the
minor page faults each action took (getrusage): an action that makes the allocator fetch fresh
pages from the OS pays for each one. Issue 34's target: (I + W) / B <= 1.05 per chunk.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.gpt import GPT, config, lm_loss  # noqa: E402

CONFIG = "tiny,n_layer=8,n_embd=256,n_head=8,block_size=32,vocab_size=512"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def chunk_paths(chunk, tokens, targets, mbs: int, seq: int, m: int) -> dict:
    """{"fused": [(kind, fn)], "split": [...]}, and a fresh StepContext per run."""
    from autopart.runtime import compute
    g = torch.Generator().manual_seed(chunk.chunk)

    def shape(spec):
        return compute.concrete_shape(spec, mbs, seq)
    recvs = [torch.randn(shape(s), generator=g) if s.dtype.is_floating_point
             else torch.zeros(shape(s), dtype=s.dtype) for s in chunk.recvs]
    grads = [] if chunk.is_last else [torch.randn(shape(s), generator=g)
                                      for s in chunk.sends if s.differentiable]
    feed = {name: (tokens if i == 0 else targets)[:mbs] for i, name in enumerate(chunk.inputs)}

    def context():
        ctx = compute.StepContext(chunks={chunk.chunk: chunk}, peer=None, microbatch=lambda i: feed,
                             batch=mbs, seq=seq, device=torch.device("cpu"), loss_scale=1 / m)
        ctx.acts[(chunk.chunk, 0)] = [r.clone() for r in recvs]
        if grads:
            ctx.grads_in[(chunk.chunk, 0)] = list(grads)
        return ctx
    paths = {"fused": [("F", compute.forward), ("B", compute.backward)],
             "split": [("F", compute.forward_split), ("I", compute.input_grad_split),
                       ("W", compute.weight_grad_split)]}
    return paths, context


def run_path(steps, context, chunk) -> dict:
    ctx, out = context(), {}
    for kind, fn in steps:
        action = SimpleNamespace(chunk=chunk, microbatch=0, kind=kind)
        f0, t0 = _faults(), time.perf_counter()
        fn(action, ctx)
        out[kind] = (time.perf_counter() - t0, _faults() - f0)
    return out


def measure(rounds: int, warmup: int, config_text: str, microbatches: int, mbs: int) -> list[dict]:
    import autopart
    torch.manual_seed(0)
    cfg = config(config_text)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (microbatches * mbs, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (microbatches * mbs, cfg.block_size))
    compiled = autopart.compile(model, autopart.Mesh(pp=2), (tokens,), loss_fn=lm_loss,
                                target=targets, microbatches=microbatches, schedule="zb-h1")
    rows = []
    for rank in (0, 1):
        for chunk in compiled.programs.instantiate(rank).chunks:
            if chunk.backward.fallback is not None:
                raise SystemExit(f"chunk {chunk.chunk} has no split programs: "
                                 f"{chunk.backward.fallback}")
            for p in chunk.gm.parameters():      # as after an earlier microbatch
                p.grad = torch.zeros_like(p)
            paths, context = chunk_paths(chunk, tokens, targets, mbs, cfg.block_size,
                                         microbatches)
            runs = {"fused": [], "split": []}
            for r in range(warmup + rounds):
                for name in ("fused", "split"):
                    got = run_path(paths[name], context, chunk.chunk)
                    if r >= warmup:
                        runs[name].append(got)
            fused, split = runs["fused"], runs["split"]
            rows.append({
                "chunk": chunk.chunk, "rank": rank, "is_last": chunk.is_last,
                "ms": {f"{path} {k}": 1e3 * statistics.median(x[k][0] for x in runs[path])
                       for path in runs for k in runs[path][0]},
                "faults": {f"{path} {k}": statistics.median(x[k][1] for x in runs[path])
                           for path in runs for k in runs[path][0]},
                "i_plus_w_over_b": [(s["I"][0] + s["W"][0]) / f["B"][0] for f, s in zip(fused, split)],
                "f_split_over_f": [s["F"][0] / f["F"][0] for f, s in zip(fused, split)]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(a.rounds, a.warmup, a.config, a.microbatches, a.microbatch_size)
    lines = [f"GPT {a.config}, zb-h1 pp=2, microbatch {a.microbatch_size} x 32; one thread; "
             f"medians of {a.rounds} rounds", ""]
    for r in rows:
        ms, fl = r["ms"], r["faults"]
        lines.append(
            f"chunk {r['chunk']}: (I+W)/B {statistics.median(r['i_plus_w_over_b']):.3f}  "
            f"F split/fused {statistics.median(r['f_split_over_f']):.3f}  |  fused F "
            f"{ms['fused F']:.1f} B {ms['fused B']:.1f} ms  split F {ms['split F']:.1f} "
            f"I {ms['split I']:.1f} W {ms['split W']:.1f} ms  |  page faults B "
            f"{fl['fused B']:.0f}, I {fl['split I']:.0f}, W {fl['split W']:.0f}")
    print("\n".join(lines), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps({"bench": "split_cost", "options": vars(a), "chunks": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
