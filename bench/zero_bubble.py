"""Zero-bubble schedules: autopart's 1F1B, interleaved 1F1B, ZB-H1 and ZB-V against
torch.distributed.pipelining's Schedule1F1B, ScheduleInterleavedZeroBubble and
ScheduleZBVZeroBubble, on the same GPT, the same cuts and the same batch.

    python bench/zero_bubble.py                       # the table
    python bench/zero_bubble.py --steps 10 --json

Two rank processes (Gloo, one thread each: with more ranks than cores an idle rank lends its core
to another and a bubble stops costing time, so this machine measures bubbles at pp=2 only).
Compute-bound microbatches: the example GPT with n_embd=256, microbatches of 8 sequences, m=4.
Per schedule, in turn, step after step in one run (the machine's noise hits all alike):
  autopart   ParallelModel.train_step
  torch      the torch.distributed.pipelining schedule on stage modules cut where autopart cut
  floor      each rank's chunks run eagerly microbatch by microbatch, no communication
and the table gives median step times, autopart / torch, autopart / autopart's own 1F1B, and
each one's share of the floor: floor * (1 + the schedule's bubble with unit F = I = W costs) /
step time. One traced autopart step per schedule gives each chunk's measured F, I, W (or B)
times; the schedule simulator's step time from them is printed beside the measured one.
Helpers (stage modules, checks against the plain model, timing) come from
bench/pipeline_vs_torch.py. Results: bench/README.md and README "Zero-bubble schedules".
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_vs_torch as pvt  # noqa: E402
from examples.gpt import GPT, config, lm_loss  # noqa: E402

# (autopart schedule, virtual stages, torch schedule class or None)
ROWS = [
    ("1f1b", 1, "Schedule1F1B"),
    ("interleaved-1f1b", 2, None),
    ("zb-h1", 1, None),                          # torch has no one-chunk ZB-H1 of its own
    ("zb-h1", 2, "ScheduleInterleavedZeroBubble"),
    ("zb-v", 2, "ScheduleZBVZeroBubble"),
]
PP = pvt.PP
for _name, _v, _cls in ROWS:     # torch_pipeline looks its class up in this table by key
    if _cls:
        pvt.SCHEDULES.setdefault(f"torch:{_cls}", (_v, _cls))


def measured_costs(pm, trace_path: str, steps: int = 1) -> list[dict]:
    """`steps` traced steps of `pm`, on every rank: per step, its wall time (ms, from a barrier to
    the slowest rank's return) and its per (chunk, kind) mean action time in ms ((-1, "SEND"):
    posting a batch with sends). Means, not medians: a step's makespan is made of the sums of its
    action times, which a median of a skewed spread under-states."""
    from autopart.runtime.trace import Recorder
    rec = Recorder(trace_path, dist.get_rank(), dist.get_world_size())
    walls = []
    for _ in range(steps):
        pvt._zero(pm.parameters())
        pm._step.trace = rec      # these steps only: tracing costs a gather per step
        walls.append(pvt._timed(lambda: pm.train_step(pm._bench_batch[0],
                                                      target=pm._bench_batch[1]))[0])
        pm._step.trace = None
        rec.end_step()
    t = torch.tensor(walls, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    rows = [None]
    if dist.get_rank() == 0:
        per: list = [{} for _ in range(steps)]
        for e in json.loads(Path(trace_path).read_text())["traceEvents"]:
            if e["ph"] != "X" or e["tid"] != 0:
                continue
            kind = e["args"]["kind"]
            key = (e["args"]["chunk"], kind) if kind in ("F", "B", "I", "W") else \
                (-1, "SEND") if kind in ("SEND_F", "SEND_B") else None
            if key is not None:
                per[e["args"]["step"]].setdefault(key, []).append(e["dur"] / 1e3)
        rows = [[[(c, k, statistics.mean(v)) for (c, k), v in step.items()] for step in per]]
    dist.broadcast_object_list(rows, src=0)
    return [{"wall_ms": 1e3 * w, "costs": {(c, k): ms for c, k, ms in step}}
            for w, step in zip(t.tolist(), rows[0])]


def predicted_ms(schedule, costs: dict) -> tuple[float, float]:
    """(simulated step time from measured per-action costs, unit-cost bubble); a message costs
    what posting one took (Gloo: the sending rank's own time), when measured."""
    from autopart import schedule as sched
    unit = sched.simulate(schedule, forward_cost=1.0, input_grad_cost=1.0, weight_grad_cost=1.0)
    return simulated_ms(schedule, costs, costs.get((-1, "SEND"), 0.0)), unit.bubble


def simulated_ms(schedule, costs: dict, latency: float) -> float:
    """The simulator's step from per (chunk, kind) action times and a per-message latency. It
    runs what the runtime runs here: the lists lowered for Gloo, under Gloo's semantics (a post
    never waits, a compute waits for the receive it reads: sends_wait=False); NCCL's semantics
    over-predicted ZB-V's step by 8-11% from the very action times of that step."""
    from autopart import schedule as sched
    from autopart.schedule_lowering import hoist_receives
    n = schedule.num_chunks
    if (0, "I") in costs:
        halves = dict(input_grad_cost=[costs[(c, "I")] for c in range(n)],
                      weight_grad_cost=[costs[(c, "W")] for c in range(n)])
    else:
        halves = dict(backward_cost=[costs[(c, "B")] for c in range(n)])
    return sched.simulate(hoist_receives(schedule, independent_posts=True),
                          forward_cost=[costs[(c, "F")] for c in range(n)], latency=latency,
                          sends_wait=False, **halves).makespan


def sim_over_measured(schedule, traced: list[dict]) -> tuple[float, dict]:
    """(median over the traced steps of simulated / measured step, each step simulated from its
    own mean action times; the mean action times over all of them, for the table)."""
    ratios = [simulated_ms(schedule, t["costs"], t["costs"].get((-1, "SEND"), 0.0)) / t["wall_ms"]
              for t in traced]
    keys = traced[0]["costs"]
    mean = {k: statistics.mean(t["costs"][k] for t in traced) for k in keys}
    return statistics.median(ratios), mean


def model_and_batch(opts: dict):
    """(plain GPT, its config, tokens, targets, the generator that drew them): the same on every rank."""
    torch.manual_seed(opts["seed"])
    cfg = config(opts["config"])
    plain = GPT(cfg)
    n = opts["microbatches"] * opts["microbatch_size"]
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    tokens = torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g)
    return plain, cfg, tokens, targets, g


def rank_main(rank: int, world: int, opts: dict) -> dict:
    import autopart
    plain, cfg, tokens, targets, g = model_and_batch(opts)
    m, mbs = opts["microbatches"], opts["microbatch_size"]
    hidden = 0.02 * torch.randn(mbs, cfg.block_size, cfg.n_embd, generator=g)
    results = []
    for name, v, torch_cls in ROWS:
        pm = autopart.parallelize(copy.deepcopy(plain), autopart.Mesh(pp=PP), (tokens,),
                                  loss_fn=lm_loss, target=targets, microbatches=m, schedule=name,
                                  virtual_stages=v)
        pm._bench_batch = (tokens, targets)
        key = f"torch:{torch_cls}" if torch_cls else {1: "1f1b", 2: "interleaved-1f1b"}[v]
        pipe = pvt.torch_pipeline(copy.deepcopy(plain), pm.compiled, pm.coords["pp"], m, key)
        # autopart must match the plain model; torch's result is reported, not required (its
        # ScheduleInterleavedZeroBubble gets the tied embedding's gradient wrong here)
        check = pvt.check_equal_work(plain, pm, pipe, tokens, targets, float("inf"))
        if not (check["autopart_grad_rel_err"] <= opts["tol"]
                and abs(check["autopart_loss"] - check["plain_loss"]) <= opts["tol"] * 10):
            raise AssertionError(f"{name} v={v}: autopart differs from the plain model: {check}")
        runners = {"autopart": (lambda: pm.train_step(tokens, target=targets), list(pm.parameters())),
                   "floor": (lambda: pvt.floor_step(pipe, tokens, targets, m, hidden), pipe.params)}
        if torch_cls:
            runners["torch"] = (lambda: pvt.torch_step(pipe, tokens, targets), pipe.params)
        wall: dict = {k: [] for k in runners}
        for it in range(opts["warmup"] + opts["steps"]):
            for k, (fn, params) in runners.items():
                pvt._zero(params)
                dt, _ = pvt._timed(fn)
                if it >= opts["warmup"]:
                    wall[k].append(dt)
        med = {}
        for k, xs in wall.items():
            t = torch.tensor(xs, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)      # a step lasts as long as its slowest rank
            med[k] = 1e3 * statistics.median(t.tolist())
        pvt._zero(pm.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            keep = opts.get("trace_dir")
            traced = measured_costs(pm, str(Path(keep or tmp) / f"{name}-v{v}.json"), steps=3)
        sim_ratio, costs = sim_over_measured(pm.compiled.schedule, traced)
        predicted, bubble = predicted_ms(pm.compiled.schedule, costs)
        results.append({"schedule": name, "virtual_stages": v, "torch": torch_cls,
                        "autopart_ms": med["autopart"], "torch_ms": med.get("torch"),
                        "floor_ms": med["floor"], "bubble": bubble,
                        "floor_share": med["floor"] * (1 + bubble) / med["autopart"],
                        "torch_floor_share": (med["floor"] * (1 + bubble) / med["torch"]
                                              if torch_cls else None),
                        "predicted_ms": predicted, "sim_over_measured": sim_ratio, "check": check,
                        "costs_ms": {f"{c}{k}": round(x, 2) for (c, k), x in sorted(costs.items())}})
        del pm, pipe
    return {"results": results}


def paired_main(rank: int, world: int, opts: dict) -> dict:
    """--paired: autopart's 1F1B and each named schedule, built side by side from the same weights
    and stepped back to back in every round (1F1B first, each step from a barrier, the slowest
    rank's time), so that each schedule's ratio to 1F1B is a median of per-round ratios. Each
    one's first step must match the plain model, as in rank_main."""
    import autopart
    plain, _, tokens, targets, _ = model_and_batch(opts)
    m = opts["microbatches"]
    ref_loss = float(pvt.plain_step(plain, tokens, targets))
    ref = dict(plain.named_parameters())
    pms = {}
    for name, v in [("1f1b", 1), *opts["paired"]]:
        pm = autopart.parallelize(copy.deepcopy(plain), autopart.Mesh(pp=PP), (tokens,),
                                  loss_fn=lm_loss, target=targets, microbatches=m, schedule=name,
                                  virtual_stages=v)
        loss = float(pm.train_step(tokens, target=targets))
        errs = torch.tensor([abs(loss - ref_loss), pvt._grad_error(
            [(p.grad, ref[n].grad) for n, p in pm.named_parameters()])])
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        if not (float(errs[1]) <= opts["tol"] and float(errs[0]) <= opts["tol"] * 10):
            raise AssertionError(f"{name} v={v}: autopart differs from the plain model: {errs.tolist()}")
        pm._bench_batch = (tokens, targets)
        pms[name + (f" v={v}" if v > 1 else "")] = pm
    wall: dict = {k: [] for k in pms}
    for it in range(opts["warmup"] + opts["steps"]):
        for k, pm in pms.items():
            pvt._zero(pm.parameters())
            dt, _ = pvt._timed(lambda: pm.train_step(tokens, target=targets))
            if it >= opts["warmup"]:
                wall[k].append(dt)
    for k, xs in wall.items():
        t = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)          # a step lasts as long as its slowest rank
        wall[k] = [1e3 * x for x in t.tolist()]
    # the simulator fed each schedule's measured action costs (5 traced steps after the rounds),
    # to set beside its measured step
    sim, measured = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, pm in pms.items():
            sim[k], costs = sim_over_measured(
                pm.compiled.schedule, measured_costs(pm, str(Path(tmp) / "trace.json"), steps=5))
            measured[k] = {f"{c}{kind}": x for (c, kind), x in sorted(costs.items())}
    return {"paired": wall, "sim_over_measured": sim, "costs": measured}


def table(opts: dict, results: list[dict]) -> str:
    cfg = config(opts["config"])
    base = next(r["autopart_ms"] for r in results if r["schedule"] == "1f1b")
    lines = [f"GPT {opts['config']} (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, block_size="
             f"{cfg.block_size}); pp={PP}, Gloo, 1 thread/rank; {opts['microbatches']} microbatches "
             f"x {opts['microbatch_size']} sequences; medians of {opts['steps']} steps after "
             f"{opts['warmup']} warm-up", "",
             f"{'schedule':<22}{'autopart':>9}{'predicted':>10}{'sim/meas':>9}{'vs 1f1b':>8}"
             f"{'torch':>8}{'ratio':>7}{'bubble':>8}{'floor':>8}{'autopart':>9}{'torch':>7}",
             f"{'':<22}{'ms':>9}{'ms':>10}{'':>9}{'':>8}{'ms':>8}{'':>7}{'':>8}{'ms':>8}"
             f"{'share':>9}{'share':>7}"]
    for r in results:
        name = r["schedule"] + (f" v={r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        t = f"{r['torch_ms']:>8.0f}{r['autopart_ms'] / r['torch_ms']:>7.2f}" if r["torch"] else \
            f"{'-':>8}{'-':>7}"
        ts = f"{100 * r['torch_floor_share']:>6.0f}%" if r["torch"] else f"{'-':>7}"
        lines.append(f"{name:<22}{r['autopart_ms']:>9.0f}{r['predicted_ms']:>10.0f}"
                     f"{r['sim_over_measured']:>9.3f}{r['autopart_ms'] / base:>8.3f}{t}{r['bubble']:>8.3f}{r['floor_ms']:>8.0f}"
                     f"{100 * r['floor_share']:>8.0f}%{ts}")
    lines += ["", "torch: " + ", ".join(f"{r['schedule']} v={r['virtual_stages']} vs {r['torch']}"
                                        for r in results if r["torch"]),
              "vs 1f1b    autopart step time / autopart's own 1F1B; ratio = autopart / torch",
              "predicted  the C++ simulator's makespan (Gloo's semantics) from this run's mean "
              "per-action times; sim/meas: per traced step, simulated from that step's own "
              "action times / its measured step, median of 3",
              "bubble     the schedule's bubble with unit F = I = W costs (one synchronous step)",
              "share      floor * (1 + bubble) / step time; floor = each rank's chunks eagerly, "
              "no communication"]
    for r in results:
        c = r["check"]
        lines.append(f"{r['schedule']} v={r['virtual_stages']}: first-step grad rel err autopart "
                     f"{c['autopart_grad_rel_err']:.1e} torch {c['torch_grad_rel_err']:.1e}; "
                     f"per-action ms {r['costs_ms']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--config", default="tiny,n_layer=8,n_embd=256,n_head=8,block_size=32,vocab_size=512")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace-dir", help="keep each schedule's traced step there (<name>-v<v>.json)")
    ap.add_argument("--paired", metavar="SCHEDULE[:V],...",
                    help="instead of the table: autopart's 1F1B and these schedules (e.g. "
                         "zb-h1,zb-v:2) stepped back to back in every round; prints the median "
                         "per-round ratio of each to 1F1B (--json: every step time)")
    a = ap.parse_args(argv)
    opts = dict(microbatches=a.microbatches, microbatch_size=a.microbatch_size, steps=a.steps,
                warmup=a.warmup, config=a.config, seed=a.seed, tol=a.tol,
                trace_dir=str(Path(a.trace_dir).resolve()) if a.trace_dir else None)
    from autopart.runtime.launch import spawn
    if a.paired:
        opts["paired"] = [(n, int(v or 1)) for n, _, v in (x.partition(":") for x in a.paired.split(","))]
        out = spawn(paired_main, PP, opts, timeout=a.timeout, pg_timeout=600)[0]
        wall, sim = out["paired"], out["sim_over_measured"]
        ratios = {k: statistics.median(x / y for x, y in zip(xs, wall["1f1b"]))
                  for k, xs in wall.items() if k != "1f1b"}
        lines = [f"{k}: median step {statistics.median(wall[k]):.0f} ms, vs 1f1b "
                 f"({statistics.median(wall['1f1b']):.0f} ms) {r:.3f} (median of {a.steps} "
                 f"per-round ratios)" for k, r in ratios.items()]
        lines += [f"{k}: simulated / measured step {sim[k]:.3f} (median over 5 traced steps, each "
                  "simulated from its own mean action times)" for k in wall]
        print("\n".join(lines), file=sys.stderr if a.json else sys.stdout)
        if a.json:
            print(json.dumps({"bench": "zero_bubble", "options": opts, "paired_ms": wall,
                              "ratio_to_1f1b": ratios, "sim_over_measured": sim,
                              "costs_ms": out["costs"]}))
        return 0
    out = spawn(rank_main, PP, opts, timeout=a.timeout, pg_timeout=600)[0]
    text = table(opts, out["results"])
    print(text, file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps({"bench": "zero_bubble", "options": opts, "results": out["results"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
