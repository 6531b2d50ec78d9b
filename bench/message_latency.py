"""How long a pipeline message takes inside a step, against its idle round trip.

    python bench/message_latency.py                   # overhead-bound 1F1B and interleaved 1F1B
    python bench/message_latency.py --steps 5 --json

Two rank processes (Gloo, one thread each), the GPT of bench/pipeline_vs_torch.py (8 layers,
n_embd=64, 32 microbatches of 1). Per schedule, `--steps` traced autopart steps; for each, the
schedule simulator (Gloo's semantics, the lists the runtime runs: bench/zero_bubble.py
predicted_ms) is fed that step's own mean action times, once with free messages and once with the
per-message latency that makes it reach the step's measured time (bisection). Then the idle round
trip of one such message (an activation, 1 x 32 x 64 floats) between the two ranks, ping-pong,
when nothing else runs. A fitted latency far above half the round trip is time a message waits
for a core (or anything else the simulator does not model), not the wire.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_vs_torch as pvt  # noqa: E402
import zero_bubble as zb  # noqa: E402
from examples.gpt import GPT, config, lm_loss  # noqa: E402


def fitted_latency(schedule, traced: dict) -> float:
    """The per-message latency (ms) with which the simulator reaches the traced step's time."""
    lo, hi = 0.0, 50.0
    if zb.simulated_ms(schedule, traced["costs"], hi) < traced["wall_ms"]:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if zb.simulated_ms(schedule, traced["costs"], mid) < traced["wall_ms"] \
            else (lo, mid)
    return lo


def round_trip_us(shape, rounds: int = 300) -> float:
    t, peer, times = torch.zeros(shape), 1 - dist.get_rank(), []
    for _ in range(rounds):
        start = time.perf_counter()
        for op in ((dist.isend, dist.irecv) if dist.get_rank() == 0 else (dist.irecv, dist.isend)):
            for w in dist.batch_isend_irecv([dist.P2POp(op, t, peer)]):
                w.wait()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times[rounds // 5:])


def rank_main(rank: int, world: int, opts: dict) -> dict:
    import autopart
    torch.manual_seed(0)
    cfg = config(opts["config"])
    plain, m = GPT(cfg), opts["microbatches"]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (m, cfg.block_size), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (m, cfg.block_size), generator=g)
    out = {}
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        pm = autopart.parallelize(copy.deepcopy(plain), autopart.Mesh(pp=2), (tokens,),
                                  loss_fn=lm_loss, target=targets, microbatches=m,
                                  schedule=name, virtual_stages=v)
        pm._bench_batch = (tokens, targets)
        for _ in range(3):
            pvt._zero(pm.parameters())
            pm.train_step(tokens, target=targets)
        with tempfile.TemporaryDirectory() as tmp:
            traced = zb.measured_costs(pm, str(Path(tmp) / "t.json"), steps=opts["steps"])
        out[name] = [{"step_ms": t["wall_ms"],
                      "free_messages_ms": zb.simulated_ms(pm.compiled.schedule, t["costs"], 0.0),
                      "fitted_latency_ms": fitted_latency(pm.compiled.schedule, t)}
                     for t in traced]
    dist.barrier()
    return {"steps": out, "idle_round_trip_us": round_trip_us((1, cfg.block_size, cfg.n_embd))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="traced steps per schedule")
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--config", default="tiny,n_layer=8,n_embd=64,block_size=32")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    opts = dict(steps=a.steps, microbatches=a.microbatches, config=a.config)
    from autopart.runtime.launch import spawn
    r = spawn(rank_main, 2, opts, timeout=a.timeout)[0]
    lines = [f"GPT {a.config}, pp=2, {a.microbatches} microbatches of 1, Gloo; per traced step: "
             "measured / simulated with free messages, and the fitted latency per message"]
    for name, rows in r["steps"].items():
        lines.append(f"{name:<18}" + "  ".join(f"{x['step_ms']:.0f}/{x['free_messages_ms']:.0f} ms "
                                               f"{x['fitted_latency_ms']:.2f}" for x in rows))
    lines.append(f"idle round trip of one message: {r['idle_round_trip_us']:.0f} us")
    print("\n".join(lines), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps({"bench": "message_latency", "options": opts, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
