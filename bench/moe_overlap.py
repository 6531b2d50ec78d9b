"""Expert parallelism's all-to-alls overlapped across microbatch pairs (passes/overlap_experts.py)
against the same layout without the overlap: pp=2 x dp=2 with ep=2, an unmodified Hugging Face
Mixtral built from a config (random weights), 4 microbatches, 4 ranks (issue 52).

    python bench/moe_overlap.py
    python bench/moe_overlap.py --steps 30 --json

Four rank processes (Gloo, one thread each) build both layouts from the same weights and step
them back to back in each round (forward + backward + SGD), so that the machine's drift cancels
in the per-round ratio; the figure is the median of those ratios. With the overlap the schedule
runs the microbatches two at a time (1F1B over 2 pairs: a larger bubble) and each pair's
all-to-alls wait behind the other microbatch's compute; without it, 1F1B over 4 microbatches.
A third side, "serial", isolates the overlap from the pairing: the same paired schedule and
paired programs with each microbatch's ops in order (a's whole forward, then b's: every wait
right after its post), made by replacing passes/overlap_experts.py `interleave` in this
benchmark's processes only. Three more sides time the interleaved 1F1B (virtual_stages=2), where
each forward next to another microbatch's backward runs beside it (runtime/compute.py
forward_backward: combined F&B): "combined" (the overlap on), "combined_off" (overlap=False, the
same schedule) and "combined_serial" (the same segmented forwards, each combined pair run as the
backward then the whole forward: every wait right after its post, by replacing
`forward_backward` during that side's steps only). Before timing, every side's first-step loss is checked against the
plain model's.
On CPU the all-to-alls run on Gloo's threads, which share the cores with the ranks' compute:
what hides there is the transfer's latency, not its bandwidth.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _mixtral(args):
    import transformers
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=args.seq))


def _loss(out, target):
    return F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), target.reshape(-1))


def run(rank: int, world: int, args) -> dict:
    import warnings

    import autopart
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    with torch.no_grad():
        plain = _loss(_mixtral(args)(input_ids=x), x).item()
    from autopart.passes import overlap_experts as oe
    interleave, sides = oe.interleave, {}
    for name, overlap in (("overlap", True), ("no_overlap", False), ("serial", True),
                          ("combined", True), ("combined_off", False),
                          ("combined_serial", True)):
        if name == "serial":        # a's items, then b's: each wait right after its post
            oe.interleave = lambda items: [(mb, it) for mb in (0, 1) for it in items]
        vpp = dict(schedule="interleaved-1f1b", virtual_stages=2) \
            if name.startswith("combined") else {}
        pm = autopart.parallelize(_mixtral(args), autopart.Mesh(pp=2, dp=2, ep=2), (x,),
                                  loss_fn=_loss, target=x, microbatches=args.microbatches,
                                  overlap=overlap, **vpp)
        oe.interleave = interleave
        sides[name] = (pm, torch.optim.SGD(pm.parameters(), lr=1e-2))

    from autopart.runtime import compute
    combined = compute.forward_backward

    def serial(f, b, ctx):          # the backward, then the whole forward
        compute.backward(b, ctx)
        compute.Segments(f, ctx).finish()

    def step(name):
        pm, opt = sides[name]
        compute.forward_backward = serial if name == "combined_serial" else combined
        try:
            loss = pm.train_step(x, target=x)
        finally:
            compute.forward_backward = combined
        opt.step()
        opt.zero_grad()
        return loss.item()

    first = {"plain": plain, **{name: step(name) for name in sides}}
    for _ in range(args.warmup):
        for name in sides:
            step(name)
    times = {name: [] for name in sides}
    for r in range(args.steps):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):   # alternate the order
            dist.barrier()
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    return {"first_loss": first, "times": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=1500.0)
    args = p.parse_args(argv)
    from autopart.runtime.launch import spawn
    outs = spawn(run, 4, args, timeout=args.timeout)
    first = outs[-1]["first_loss"]          # the last pipeline stage's ranks hold the loss
    sides = ("overlap", "no_overlap", "serial", "combined", "combined_off", "combined_serial")
    ok = all(abs(first[k] - first["plain"]) < 1e-4 for k in sides)
    # a step ends when its slowest rank's does: per round, the slowest rank's time
    steps = {k: [max(o["times"][k][i] for o in outs) for i in range(args.steps)] for k in sides}

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(steps[a], steps[b]))
    result = {"bench": "moe_overlap", "mesh": "pp=2,dp=2,ep=2", "microbatches": args.microbatches,
              "model": f"HF Mixtral h={args.hidden} layers={args.layers} 4 experts top-2",
              "batch": [args.batch, args.seq], "first_step_loss": first, "losses_match": ok,
              "step_seconds": steps, "ratio_overlap_over_no_overlap": ratio("overlap", "no_overlap"),
              "ratio_overlap_over_serial": ratio("overlap", "serial"),
              "ratio_combined_over_combined_off": ratio("combined", "combined_off"),
              "ratio_combined_over_combined_serial": ratio("combined", "combined_serial")}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"HF Mixtral h={args.hidden}, {args.layers} layers, 4 experts top-2; pp=2 x dp=2, "
              f"ep=2, {args.microbatches} microbatches, batch {args.batch}x{args.seq}, 4 ranks, "
              "Gloo, 1 thread per rank")
        print(f"first-step loss: plain {first['plain']:.6f}  " + "  ".join(
            f"{k} {first[k]:.6f}" for k in sides) + f"  ({'match' if ok else 'MISMATCH'})")
        med = {k: statistics.median(v) for k, v in steps.items()}
        print("median step: " + "  ".join(f"{k} {med[k] * 1e3:.1f} ms" for k in sides))
        print(f"median per-round ratio overlap / no overlap "
              f"{result['ratio_overlap_over_no_overlap']:.3f}, overlap / serial pairs "
              f"{result['ratio_overlap_over_serial']:.3f}")
        print(f"interleaved 1F1B (v=2), combined F&B: combined / overlap off "
              f"{result['ratio_combined_over_combined_off']:.3f}, combined / serial "
              f"{result['ratio_combined_over_combined_serial']:.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
