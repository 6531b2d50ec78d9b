"""autopart's ZeRO levels against FSDP2 (torch.distributed.fsdp.fully_shard), on the same GPT.

    python bench/zero_vs_fsdp.py                          # step time, table
    python bench/zero_vs_fsdp.py --steps 30 --json
    python bench/zero_vs_fsdp.py --steps 30 --sides autopart_zero3,fsdp2_reshard
    python bench/zero_vs_fsdp.py --memory --config tiny,n_layer=4 --levels 0,1,2   # peak RSS
    python bench/zero_vs_fsdp.py --memory --levels 3 --fsdp2      # zero=3 and FSDP2, dp=4, 355M

Step mode: two rank processes (Gloo, one thread each), dp=2, the example GPT, AdamW. Six sides
are built from the same weights and step back to back in every round (their order reversed
every other round), each step (forward + backward + optimizer step + zero_grad) from a barrier
and lasting as long as its slowest rank:
  autopart_zero3/2/1/0  parallelize(..., Mesh(dp=2), microbatches=M, zero=k), pm.optimizer(AdamW)
  autopart_zero3_noprefetch  zero=3 with the runtime's one-group-ahead all-gather off (each
                      group gathered where the program needs it): the A/B of the prefetch
  autopart_zero3_chunk_reduce  (only when named in --sides) zero=3 with its gradient
                      reduce-scatters cut per pipeline chunk as before issue 52 (one, posted
                      once the chunk's whole backward is done) instead of per layer group
                      (each posted as that layer's backward ends): the A/B of the grouping
  fsdp2_reshard       fully_shard as below but reshard_after_forward=True and resharded after
                      every microbatch's backward: parameters gathered for each layer's forward
                      and again for its backward, ZeRO-3's work, the peer of autopart_zero3
  fsdp2               fully_shard on every transformer block and the root of a 1-D cpu mesh,
                      reshard_after_forward=False (parameters stay gathered from forward to
                      backward, as ZeRO-2 keeps them); the rank's rows of the global batch in M
                      microbatches, each backward reduce-scattering its gradient into the shard
                      (ZeRO-2's per-microbatch reduce-scatter), parameters kept gathered between
                      microbatches (set_reshard_after_backward(False) but on the last)
Before timing, every side's first-step loss must equal the plain model's on the global batch
(rtol 1e-5) and the second step's losses (after one AdamW step) must agree with each other: a
benchmark of unequal work is worthless. The ratios are medians of per-round ratios: zero3 (and
zero3_noprefetch) / fsdp2_reshard, zero2, zero1, zero0 / fsdp2, and zero3 / zero3_noprefetch.

Memory mode (`--memory`): per rank, the peak RSS (VmHWM) net of a torch-only process's, at
dp=`--dp` (4) for each of `--levels`, against one plain process training the same model 2 AdamW
steps on the global batch (as bench/memory_scale.py measures). Its default model is
memory_scale's ~355M GPT; zero=0 replicates everything (4 x ~5.7 GB with AdamW), hence the
default levels 1,2,3. `--fsdp2` adds FSDP2 (reshard_after_forward=True) at the same dp, built on
the meta device and initialized shard by shard.
"""
from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.gpt`, `bench`

from bench.memory_scale import CONFIG as BIG_CONFIG, hwm, torch_only  # noqa: E402
from bench.run_all import _per_round  # noqa: E402
from examples.gpt import GPT, config, lm_loss  # noqa: E402

STEP_CONFIG = "tiny,n_layer=4,n_embd=256,n_head=4,vocab_size=8192,block_size=128"
SIDES = ("autopart_zero3", "autopart_zero3_noprefetch", "autopart_zero2", "autopart_zero1",
         "autopart_zero0", "fsdp2", "fsdp2_reshard")
# named in --sides only: not in the default run (bench/run_all.py reads the default sides)
OPTIONAL = ("autopart_zero3_chunk_reduce",)
PEER = {"autopart_zero3": "fsdp2_reshard", "autopart_zero3_noprefetch": "fsdp2_reshard",
        "autopart_zero3_chunk_reduce": "fsdp2_reshard",
        "autopart_zero2": "fsdp2", "autopart_zero1": "fsdp2", "autopart_zero0": "fsdp2"}
LR = 1e-3


def global_batch(cfg, batch: int, seed: int) -> torch.Tensor:
    """The same token ids on every rank (train_step checks); the targets are the tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)


# -- the sides -----------------------------------------------------------------------------------
def autopart_side(plain, mesh, x, m: int, level: int, **kw):
    """(ParallelModel, its optimizer) for one zero level."""
    import autopart
    pm = autopart.parallelize(plain, mesh, (x,), loss_fn=lm_loss, target=x,
                              microbatches=m, zero=level, **kw)
    return pm, pm.optimizer(torch.optim.AdamW, lr=LR)


def autopart_step(pm, opt, x) -> float:
    loss = pm.train_step(x, target=x)
    opt.step()
    opt.zero_grad()
    return float(loss)


def without_prefetch(pm):
    """`pm` (zero=3) gathering each parameter group when it is needed, never one ahead: the
    program's gathers keep their places (passes/gather_parameters.py), the runtime posts no
    next group's all-gather (runtime/param_shards.py ShardedParameters.gather's next_group).
    The A/B of the prefetch, on the same program."""
    sharded = pm._sharded
    gather = type(sharded).gather
    sharded.gather = lambda params, next_group=None: gather(sharded, params)
    return pm


def chunk_reduce(pm):
    """`pm` (zero=3) reduce-scattering its gradients in the optimizer's buckets (a pipeline
    chunk's parameters, cut by zero_bucket_size), the layout before the per-layer groups
    (runtime/gradients.py reduce_groups): the A/B of the grouping, on the same program."""
    for lay in pm._grads.zero_layouts:
        lay.reduce_ranges = lay.ranges
    pm._grads._layout = None     # laid out again from the ranges at the next step
    return pm


def fsdp2_side(plain, world: int, reshard: bool = False):
    """FSDP2 over every block and the root; `reshard`: reshard_after_forward (ZeRO-3's gather
    for the forward and again for the backward), else the parameters stay gathered (ZeRO-2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = copy.deepcopy(plain)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def fsdp2_step(model, opt, x, m: int, reshard: bool = False) -> float:
    """This rank's rows of the global batch in m microbatches; the global mean loss (all-reduced,
    as autopart's train_step reports it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = x.shape[0] // world
    total = torch.zeros(())
    for i, mb in enumerate(x[rank * rows:(rank + 1) * rows].chunk(m)):
        # ZeRO-2's peer keeps the parameters gathered until the last microbatch: autopart's
        # ZeRO-2 never shards them, so regathering per microbatch would be work the other side
        # does not do. ZeRO-3's peer reshards after every backward, as autopart's zero=3 does.
        model.set_reshard_after_backward(reshard or i == m - 1)
        loss = lm_loss(model(mb), mb) / m
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    opt.step()
    opt.zero_grad()
    return float(total) / world


# -- equal work ----------------------------------------------------------------------------------
def check_losses(losses: dict, ref: float, rtol: float, what: str) -> None:
    bad = {k: v for k, v in losses.items() if abs(v - ref) > rtol * abs(ref)}
    if bad:
        raise AssertionError(f"{what}: not the same work: {bad} against {ref} (rtol {rtol}); "
                             f"all: {losses}")


def equal_work(steps: dict, x, plain, rtol: float) -> dict:
    """Two steps of every side: step 1's losses against the plain model's on the global batch,
    step 2's (after one AdamW step) against each other."""
    with torch.no_grad():
        ref = float(lm_loss(plain(x), x))
    first = {k: fn() for k, fn in steps.items()}
    check_losses(first, ref, rtol, "first-step loss vs the plain model")
    second = {k: fn() for k, fn in steps.items()}
    peer = "fsdp2" if "fsdp2" in second else "fsdp2_reshard"
    check_losses(second, second[peer], 10 * rtol, f"second-step loss vs {peer}")
    return {"plain": ref, "first": first, "second": second}


# -- step mode -----------------------------------------------------------------------------------
def step_rank(rank: int, world: int, opts: dict) -> dict:
    import autopart
    torch.manual_seed(opts["seed"])
    cfg = config(opts["config"])
    plain = GPT(cfg)
    x = global_batch(cfg, opts["batch"], opts["seed"] + 1)
    m = opts["microbatches"]
    sides = opts["sides"]
    steps = {}
    for level in (3, 2, 1, 0):
        if f"autopart_zero{level}" in sides:
            pm, opt = autopart_side(copy.deepcopy(plain), autopart.Mesh(dp=world), x, m, level)
            steps[f"autopart_zero{level}"] = lambda pm=pm, opt=opt: autopart_step(pm, opt, x)
    if "autopart_zero3_noprefetch" in sides:
        pm, opt = autopart_side(copy.deepcopy(plain), autopart.Mesh(dp=world), x, m, 3)
        without_prefetch(pm)
        steps["autopart_zero3_noprefetch"] = lambda pm=pm, opt=opt: autopart_step(pm, opt, x)
    if "autopart_zero3_chunk_reduce" in sides:
        pm, opt = autopart_side(copy.deepcopy(plain), autopart.Mesh(dp=world), x, m, 3)
        chunk_reduce(pm)
        steps["autopart_zero3_chunk_reduce"] = lambda pm=pm, opt=opt: autopart_step(pm, opt, x)
    for name, reshard in (("fsdp2", False), ("fsdp2_reshard", True)):
        if name in sides:
            fsdp, fsdp_opt = fsdp2_side(plain, world, reshard)
            steps[name] = lambda f=fsdp, o=fsdp_opt, r=reshard: fsdp2_step(f, o, x, m, r)
    check = equal_work(steps, x, plain, opts["rtol"])
    wall = {k: [] for k in sides}
    for it in range(opts["warmup"] + opts["steps"]):
        # reversed every other round: no side always follows the same one (caches, drift)
        for side in sides if it % 2 == 0 else sides[::-1]:
            dist.barrier()
            start = time.perf_counter()
            steps[side]()
            if it >= opts["warmup"]:
                wall[side].append(time.perf_counter() - start)
    return {"check": check, "step_seconds": {k: slowest(v) for k, v in wall.items()},
            "params": sum(p.numel() for p in plain.parameters())}


def slowest(times: list[float]) -> list[float]:
    """A step lasts as long as its slowest rank."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def step_mode(a) -> int:
    from autopart.runtime.launch import spawn
    opts = dict(config=a.config, batch=a.batch, microbatches=a.microbatches, steps=a.steps,
                warmup=a.warmup, seed=a.seed, rtol=a.rtol, sides=a.sides)
    load = os.getloadavg()[0]
    out = spawn(step_rank, 2, opts, timeout=a.timeout)[0]
    times = out["step_seconds"]
    ratios = {k: statistics.median(_per_round(times[k], times[peer])) for k, peer in PEER.items()
              if k in times and peer in times}
    if "autopart_zero3_noprefetch" in times and "autopart_zero3" in times:
        ratios["prefetch"] = statistics.median(_per_round(times["autopart_zero3"],
                                                          times["autopart_zero3_noprefetch"]))
    if "autopart_zero3_chunk_reduce" in times and "autopart_zero3" in times:
        ratios["layer_groups"] = statistics.median(_per_round(
            times["autopart_zero3"], times["autopart_zero3_chunk_reduce"]))
    result = {"bench": "zero_vs_fsdp", "dp": 2, "config": a.config, "params": out["params"],
              "batch": a.batch, "microbatches": a.microbatches, "steps": a.steps,
              "warmup": a.warmup, "equal_work": out["check"], "step_seconds": times,
              "median_ratio_to_fsdp2": ratios, "load_before": load,
              "load_after": os.getloadavg()[0]}
    print(step_table(result), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result))
    return 0


def step_table(r: dict) -> str:
    c = r["equal_work"]
    lines = [f"ZeRO vs FSDP2, dp=2, Gloo, 1 thread/rank: GPT {r['config']} "
             f"({r['params'] / 1e6:.1f}M params), global batch {r['batch']}, {r['microbatches']} microbatches, AdamW; "
             f"{r['steps']} rounds after {r['warmup']} warm-up",
             f"equal work: plain first-step loss {c['plain']:.6f}; " + ", ".join(
                 f"{k} {v:.6f}" for k, v in c["first"].items()) + " (match)", "",
             f"{'side':<26}{'median s':>10}{'/ peer':>10}  peer"]
    for side in [s for s in SIDES + OPTIONAL if s in r["step_seconds"]]:
        ratio = r["median_ratio_to_fsdp2"].get(side)
        lines.append(f"{side:<26}{statistics.median(r['step_seconds'][side]):>10.3f}"
                     f"{'' if ratio is None else f'{ratio:.3f}':>10}  {PEER.get(side, '')}")
    if "prefetch" in r["median_ratio_to_fsdp2"]:
        lines.append(f"{'zero3 prefetch / no prefetch':<26}{r['median_ratio_to_fsdp2']['prefetch']:.3f}")
    if "layer_groups" in r["median_ratio_to_fsdp2"]:
        lines.append(f"{'zero3 per-layer / per-chunk reduce-scatters':<44}"
                     f"{r['median_ratio_to_fsdp2']['layer_groups']:.3f}")
    lines += ["", "/ peer: median of the per-round ratios (lower: autopart faster)",
              f"load average {r['load_before']:.1f} before, {r['load_after']:.1f} after, on "
              f"{os.cpu_count()} cpus"]
    return "\n".join(lines)


# -- memory mode ---------------------------------------------------------------------------------
def memory_rank(rank: int, world: int, opts: dict, level: int) -> dict:
    """Built on the meta device and initialized shard by shard (seed), so no rank ever holds the
    plain model besides its own copy; 2 AdamW steps."""
    import autopart
    with torch.device("meta"):
        model = GPT(config(opts["config"]))
    x = global_batch(config(opts["config"]), opts["batch"], opts["seed"] + 1)
    pm, opt = autopart_side(model, autopart.Mesh(dp=world), x, opts["microbatches"], level,
                            seed=opts["seed"])
    for _ in range(2):
        autopart_step(pm, opt, x)
    state = {k: pm.compiled.memory[rank][k]
             for k in ("params", "grads", "master", "optimizer", "activations")}
    return {"hwm": hwm(), "predicted": state}


def memory_fsdp2(rank: int, world: int, opts: dict) -> dict:
    """FSDP2 at the same dp, ZeRO-3's work (reshard_after_forward=True): built on the meta
    device, `fully_shard` per block and the root, `to_empty` on the CPU (each rank allocates
    its shards only), initialized shard by shard by the model's own init (its nn.init calls on
    the DTensor shards); the rank's rows of the global batch, 2 AdamW steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    cfg = config(opts["config"])
    with torch.device("meta"):
        model = GPT(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    model.to_empty(device="cpu")
    torch.manual_seed(opts["seed"])
    with torch.no_grad():
        model.apply(model._init_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = global_batch(cfg, opts["batch"], opts["seed"] + 1)
    rows = x.shape[0] // world
    mine = x[rank * rows:(rank + 1) * rows]
    for _ in range(2):
        lm_loss(model(mine), mine).backward()
        opt.step()
        opt.zero_grad()
    return {"hwm": hwm(), "predicted": {}}


def memory_plain(opts: dict) -> int:
    torch.manual_seed(opts["seed"])
    cfg = config(opts["config"])
    model = GPT(cfg)
    x = global_batch(cfg, opts["batch"], opts["seed"] + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(2):
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    return hwm()


def memory_mode(a) -> int:
    from autopart.runtime.launch import spawn
    opts = dict(config=a.config, batch=a.batch, microbatches=a.microbatches, seed=a.seed)
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        base = pool.apply(torch_only)
    with ctx.Pool(1) as pool:
        plain = pool.apply(memory_plain, (opts,))
    levels = {}
    for level in a.levels + (["fsdp2"] if a.fsdp2 else []):
        out = (spawn(memory_fsdp2, a.dp, opts, timeout=a.timeout, pg_timeout=1800)
               if level == "fsdp2" else
               spawn(memory_rank, a.dp, opts, level, timeout=a.timeout, pg_timeout=1800))
        levels[level] = [{"net": o["hwm"] - base, "ratio": (o["hwm"] - base) / (plain - base),
                          "predicted": o["predicted"]} for o in out]
    result = {"bench": "zero_vs_fsdp", "mode": "memory", "dp": a.dp, "config": a.config,
              "batch": a.batch, "microbatches": a.microbatches, "torch_only": base,
              "plain_net": plain - base, "levels": levels}
    print(memory_table(result), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result))
    return 0


def memory_table(r: dict) -> str:
    mib = 2 ** 20
    lines = [f"peak RSS per rank, dp={r['dp']}, GPT {r['config']}, global batch {r['batch']}, "
             f"{r['microbatches']} microbatch(es), 2 AdamW steps; net of a torch-only process "
             f"({r['torch_only'] / mib:.0f} MiB)",
             f"plain single process: net {r['plain_net'] / mib:.0f} MiB", "",
             f"{'level':<8}{'rank':>5}{'net MiB':>10}{'/ plain':>9}   explain's prediction (MiB)"]
    for level, ranks in r["levels"].items():
        for rank, o in enumerate(ranks):
            pred = ", ".join(f"{k} {v / mib:.0f}" for k, v in o["predicted"].items())
            name = f"zero={level}" if level != "fsdp2" else "fsdp2"
            lines.append(f"{name:<8}{rank:>5}{o['net'] / mib:>10.0f}{o['ratio']:>9.2f}"
                         f"   {pred}")
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", action="store_true", help="peak RSS per level instead of step time")
    ap.add_argument("--config", help=f"examples.gpt config spec (default: step mode "
                                     f"{STEP_CONFIG}; memory mode {BIG_CONFIG})")
    ap.add_argument("--batch", type=int, help="global batch, sequences (default 8; memory 4)")
    ap.add_argument("--microbatches", type=int, help="per step (default 2; memory 1)")
    ap.add_argument("--steps", type=int, default=15, help="measured rounds (step mode)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rtol", type=float, default=1e-5, help="first-step loss tolerance")
    ap.add_argument("--levels", default="1,2,3", help="memory mode: zero levels (default 1,2,3)")
    ap.add_argument("--dp", type=int, default=4, help="memory mode: ranks (default 4)")
    ap.add_argument("--fsdp2", action="store_true",
                    help="memory mode: also FSDP2 with reshard_after_forward=True (ZeRO-3's peer)")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help="step mode: which of " + ", ".join(SIDES + OPTIONAL) + " (default: "
                    "all but " + ", ".join(OPTIONAL) + "; a ratio needs the side and its peer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true",
                    help="print one JSON line on stdout (the table goes to stderr)")
    a = ap.parse_args(argv)
    a.config = a.config or (BIG_CONFIG if a.memory else STEP_CONFIG)
    a.batch = a.batch or (4 if a.memory else 8)
    a.microbatches = a.microbatches or (1 if a.memory else 2)
    a.levels = sorted({int(v) for v in a.levels.split(",")})
    a.sides = tuple(s for s in SIDES + OPTIONAL if s in a.sides.split(","))
    if not a.sides or not set(a.sides) & {"fsdp2", "fsdp2_reshard"}:
        ap.error(f"--sides: name at least one FSDP2 side and others of {', '.join(SIDES)}")
    if not set(a.levels) <= {0, 1, 2, 3}:
        ap.error(f"--levels {a.levels}: zero levels are 0, 1, 2, 3")
    return memory_mode(a) if a.memory else step_mode(a)


if __name__ == "__main__":
    sys.exit(main())
