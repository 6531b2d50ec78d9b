"""The headline benchmarks in one go, each run twice, recorded in bench/RESULTS.md.

    python -m bench                          # every benchmark, 30 rounds, twice; appends to RESULTS.md
    python -m bench --quick --no-record      # plumbing check: 3 rounds, once each, never recorded
    python -m bench --only pipeline,tp --rounds 40 --json

Each benchmark script runs as its own process, twice. A run's figure is the median of its
per-round values: for a ratio, the per-round ratios of the two sides that stepped back to back in
that round (so the machine's drift cancels); for a time in seconds (compile, plan), the median of
its processes. When a benchmark's two figures differ by more than 3% (the larger over the smaller)
the pair is printed and recorded as "noisy", not as a result. See bench/README.md "run_all".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "RESULTS.md"
NOISE = 0.03          # two runs further apart than this (relative) are noisy
MIN_ROUNDS = 30       # fewer rounds are a trial, never recorded
QUICK_ROUNDS = 3


@dataclass
class Bench:
    name: str                                        # for --only
    script: str                                      # in bench/
    args: Callable[[int], list[str]]                 # rounds -> the script's options
    rows: dict[str, str]                             # row -> what its figure is
    values: Callable[[dict], dict[str, list[float]]]  # the script's JSON -> row -> per-round values
    unit: str = "ratio"                              # or "s"
    rounds: Callable[[int], int] = lambda r: r       # rounds -> the rounds (or processes) it takes
    timeout: float = 900
    optional: dict[str, str] = field(default_factory=dict)  # rows only when a run gave them


def _per_round(a: list[float], b: list[float]) -> list[float]:
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} rounds: not paired")
    return [x / y for x, y in zip(a, b)]


# the floor rows: how low any runtime of eager chunks can go against torch's step
FLOOR = ("the compute floor (each rank's chunks run eagerly microbatch by microbatch, forward "
         "then backward, no communication, no schedule) / torch.distributed.pipelining's step, "
         "paired rounds, ")


def _pipeline(out: dict) -> dict:
    rows = {f"pp {r['schedule']}": _per_round(r["autopart_ms_all"], r["torch_ms_all"])
            for r in out["results"]}
    for r in out["results"]:        # runs before 2026-11-29 had no NCCL-lowered side
        if "nccl_lowered_ms_all" in r:
            rows[f"pp {r['schedule']} / nccl-lowered"] = _per_round(
                r["autopart_ms_all"], r["nccl_lowered_ms_all"])
        if "floor_ms_all" in r:     # from 2026-11-29
            rows[f"pp {r['schedule']} floor / torch"] = _per_round(r["floor_ms_all"],
                                                                  r["torch_ms_all"])
        if "own_floor_ms_all" in r:     # from 2026-12-02: autopart's own chunks, no comm
            rows[f"pp {r['schedule']} / own floor"] = _per_round(r["autopart_ms_all"],
                                                                r["own_floor_ms_all"])
    return rows


def _traced(out: dict) -> dict:
    """pipeline_vs_torch.py --traced: autopart against torch's tracer-built stages, and how far
    autopart's step is above its own floor, each per round."""
    rows = {}
    for r in out["results"]:
        s, t = r["schedule"], r["torch_traced_ms_all"]
        a, f = r["autopart_ms_all"], r["own_floor_ms_all"]
        rows[f"pp {s} / torch traced"] = _per_round(a, t)
        rows[f"pp {s} own floor / torch traced"] = _per_round(f, t)
        rows[f"pp {s} / torch traced above own floor"] = [
            x - y for x, y in zip(_per_round(a, t), _per_round(f, t))]
    return rows


TRACED = ("8 layers n_embd=128, seq 16, 8 microbatches of 2 (issue 52's setup)")


def _tp(t: dict) -> dict:
    rows = {"tp=2": _per_round(t["autopart"], t["dtensor"])}
    if "autopart_no_overlap" in t:      # from 2026-12-02: the step without overlap_collectives
        rows["tp=2 overlap=False"] = _per_round(t["autopart_no_overlap"], t["dtensor"])
        rows["tp=2 overlap / overlap=False"] = _per_round(t["autopart"], t["autopart_no_overlap"])
    if "autopart_floor" in t:           # from 2026-12-03: no tp collectives at all
        rows["tp=2 own floor"] = _per_round(t["autopart_floor"], t["dtensor"])
        rows["tp=2 above own floor"] = [x - y for x, y in zip(rows["tp=2"],
                                                               rows["tp=2 own floor"])]
    return rows


def _zero_bubble(out: dict) -> dict:
    base = out["paired_ms"]["1f1b"]
    rows = {f"{k} / 1f1b": _per_round(v, base) for k, v in out["paired_ms"].items() if k != "1f1b"}
    for k, ratio in out.get("sim_over_measured", {}).items():   # one figure a run
        rows[f"sim / measured {k}"] = [ratio]
    return rows


def _health(out: dict) -> dict:
    rows = {}
    for r in out["results"]:
        rows[f"health {r['mesh']}"] = _per_round(r["raise_ms_all"], r["ignore_ms_all"])
        if "raise_cpu_ms_all" in r:
            rows[f"health {r['mesh']} cpu"] = _per_round(r["raise_cpu_ms_all"], r["ignore_cpu_ms_all"])
    return rows


def _zero(out: dict) -> dict:
    t = out["step_seconds"]
    rows = {f"zero{k} / fsdp2": _per_round(t[f"autopart_zero{k}"], t["fsdp2"]) for k in (2, 1, 0)}
    if "autopart_zero3" in t:       # runs before zero=3 had no such side
        rows["zero3 / fsdp2 reshard"] = _per_round(t["autopart_zero3"], t["fsdp2_reshard"])
    if "autopart_zero3_noprefetch" in t:    # from 2026-12-02: the prefetch's A/B (issue 52)
        rows["zero3 no prefetch / fsdp2 reshard"] = _per_round(t["autopart_zero3_noprefetch"],
                                                              t["fsdp2_reshard"])
        rows["zero3 prefetch / no prefetch"] = _per_round(t["autopart_zero3"],
                                                         t["autopart_zero3_noprefetch"])
    return rows


def _moe_overlap(out: dict) -> dict:
    t = out["step_seconds"]
    rows = {"ep overlap / no overlap": _per_round(t["overlap"], t["no_overlap"])}
    if "serial" in t:
        rows["ep overlap / serial pairs"] = _per_round(t["overlap"], t["serial"])
    if "combined" in t:
        rows["ep combined F&B / overlap off (interleaved)"] = _per_round(t["combined"],
                                                                         t["combined_off"])
        rows["ep combined F&B / serial"] = _per_round(t["combined"], t["combined_serial"])
    return rows


def _cp(out: dict) -> dict:
    t = out["step_seconds"]
    rows = {"cp ring / allgather": _per_round(t["ring"], t["allgather"])}
    if "torch" in t:            # torch's context_parallel ran (it does not on CPU, torch 2.13)
        rows["cp ring / torch context_parallel"] = _per_round(t["ring"], t["torch"])
    return rows


BENCHMARKS = [
    Bench("pipeline", "pipeline_vs_torch.py", lambda r: ["--steps", str(r)],
          {"pp 1f1b": "autopart / torch.distributed.pipelining step (Schedule1F1B), pp=2, GPT 8 "
                      "layers n_embd=64, 32 microbatches of 1",
           "pp interleaved-1f1b": "the same, interleaved 1F1B v=2 (ScheduleInterleaved1F1B)"},
          _pipeline,
          optional={**{f"pp {s} / nccl-lowered": "autopart's step with the action lists "
                       "lowered for Gloo (receives posted early) / the same model lowered for NCCL "
                       "(receives hoisted where the validator proves it), paired rounds, " + what
                       for s, what in (("1f1b", "the pp 1f1b model"),
                                       ("interleaved-1f1b", "the pp interleaved model"))},
                    **{f"pp {s} floor / torch": FLOOR + what
                       for s, what in (("1f1b", "the pp 1f1b model"),
                                       ("interleaved-1f1b", "the pp interleaved model"))},
                    **{f"pp {s} / own floor": "autopart's step / its own chunk programs run "
                       "forward+backward per microbatch with no communication and no schedule "
                       "(the bound on autopart's own step), paired rounds, " + what
                       for s, what in (("1f1b", "the pp 1f1b model"),
                                       ("interleaved-1f1b", "the pp interleaved model"))}}),
    Bench("pipeline-compute", "pipeline_vs_torch.py",
          lambda r: ["--steps", str(r), "--schedule", "1f1b", "--microbatches", "8",
                     "--microbatch-size", "8", "--config",
                     "tiny,n_layer=8,n_embd=256,n_head=8,block_size=32,vocab_size=512"],
          {"pp 1f1b compute-bound": "autopart / torch.distributed.pipelining step (Schedule1F1B), "
                                    "pp=2, GPT 8 layers n_embd=256, 8 microbatches of 8 (issue "
                                    "34's compute-bound row; recorded from 2026-11-29)"},
          # the script steps its NCCL-lowered side here too: its row is kept, not dropped
          lambda out: {k.replace("pp 1f1b", "pp 1f1b compute-bound", 1): v
                       for k, v in _pipeline(out).items()},
          optional={"pp 1f1b compute-bound / nccl-lowered": "autopart's step lowered for Gloo / "
                    "lowered for NCCL, the compute-bound model, paired rounds",
                    "pp 1f1b compute-bound floor / torch": FLOOR + "the compute-bound model"}),
    Bench("pipeline-traced", "pipeline_vs_torch.py",
          lambda r: ["--steps", str(r), "--traced", "--microbatches", "8", "--microbatch-size",
                     "2", "--config", "tiny,n_layer=8,n_embd=128,block_size=16"],
          {**{f"pp {s} / torch traced": f"autopart / torch.distributed.pipelining step over "
              f"torch's tracer-built stages (pipeline() + build_stage, split where autopart's "
              f"chunks begin; {cls}), pp=2, GPT " + TRACED
              for s, cls in (("1f1b", "Schedule1F1B"),
                             ("interleaved-1f1b", "ScheduleInterleaved1F1B, v=2"))},
           **{f"pp {s} own floor / torch traced": "autopart's own floor (its chunk programs, "
              "forward+backward per microbatch, no communication, no schedule) / the same "
              "torch traced step, paired rounds: the lowest the row above can read, " + what
              for s, what in (("1f1b", "1F1B"), ("interleaved-1f1b", "interleaved"))},
           **{f"pp {s} / torch traced above own floor": "(autopart - own floor) / torch traced, "
              "per round: the distance of the ratio from autopart's own floor, " + what
              for s, what in (("1f1b", "1F1B"), ("interleaved-1f1b", "interleaved"))}},
          _traced),
    Bench("tp", "tp_vs_dtensor.py", lambda r: ["--steps", str(r)],
          {"tp=2": "autopart / DTensor parallelize_module step (fwd+bwd+SGD), HF Llama 4 layers "
                   "h=256, batch 8x128"},
          lambda out: _tp(out["step_seconds"]),
          optional={"tp=2 overlap=False": "autopart overlap=False / DTensor, the same (the "
                                          "backward's all-reduces in series)",
                    "tp=2 overlap / overlap=False": "autopart / autopart overlap=False, the "
                                                    "same, paired rounds (issue 52)",
                    "tp=2 own floor": "autopart's own floor (the same rank programs with every "
                                      "tp collective skipped: shape_only, no data moved) / "
                                      "DTensor, paired rounds: the lowest the tp=2 row can read "
                                      "by hiding communication",
                    "tp=2 above own floor": "(autopart - own floor) / DTensor, per round: the "
                                            "tp communication autopart's step does not hide"}),
    Bench("zero-bubble", "zero_bubble.py",
          lambda r: ["--microbatches", "8", "--paired", "zb-h1,zb-v:2,interleaved-1f1b:2,zb-h1:2",
                     "--steps", str(r)],
          {"zb-h1 / 1f1b": "autopart ZB-H1 / autopart 1F1B step, pp=2, GPT 8 layers n_embd=256, "
                           "8 microbatches of 8 (4 before 2026-11-28 04:00)",
           "zb-v v=2 / 1f1b": "autopart ZB-V (v=2) / autopart 1F1B step, the same",
           "interleaved-1f1b v=2 / 1f1b": "autopart interleaved 1F1B (v=2) / autopart 1F1B, the same",
           "zb-h1 v=2 / 1f1b": "autopart interleaved ZB-H1 (v=2) / autopart 1F1B, the same",
           **{f"sim / measured {k}": f"the C++ simulator's step (Gloo's semantics, the lists the "
                                     f"runtime runs) from each of {k}'s 5 traced steps' mean action "
                                     "times / that step, median (from 2026-11-29; before: NCCL's "
                                     "semantics, median costs / the untraced median step)"
              for k in ("1f1b", "zb-h1", "zb-v v=2", "interleaved-1f1b v=2", "zb-h1 v=2")}},
          _zero_bubble, timeout=1800),
    Bench("split-cost", "split_cost.py", lambda r: ["--rounds", str(r)],
          {f"(I+W)/B chunk {c}": f"one process, zb-h1 pp=2 chunk {c} of the same GPT, microbatch "
                                 "of 8: its I and W programs / autograd's fused backward B "
                                 "(issue 34's bound 1.05)" for c in (0, 1)},
          lambda out: {f"(I+W)/B chunk {r['chunk']}": r["i_plus_w_over_b"] for r in out["chunks"]}),
    Bench("zero", "zero_vs_fsdp.py", lambda r: ["--steps", str(r)],
          {"zero2 / fsdp2": "autopart zero=2 / FSDP2 fully_shard (reshard_after_forward=False) "
                            "step (fwd+bwd+AdamW), dp=2, GPT 4 layers n_embd=256 vocab 8192, "
                            "batch 8x128, 2 microbatches",
           "zero1 / fsdp2": "the same, autopart zero=1",
           "zero0 / fsdp2": "the same, autopart zero=0 (plain data-parallel all-reduce)",
           "zero3 / fsdp2 reshard": "autopart zero=3 / FSDP2 with reshard_after_forward=True, "
                                    "resharded after every microbatch's backward (both gather "
                                    "each layer for its forward and again for its backward)"},
          _zero,
          optional={"zero3 no prefetch / fsdp2 reshard": "autopart zero=3 with its one-group-"
                    "ahead all-gather off (each group gathered where the program needs it) / "
                    "the same FSDP2, paired rounds",
                    "zero3 prefetch / no prefetch": "autopart zero=3 / the same program without "
                    "the prefetch, paired rounds (issue 52)"}),
    Bench("health", "health_check.py", lambda r: ["--steps", str(3 * r)],
          {"health pp=2": "nonfinite='raise' / 'ignore' step, pp=2, tiny GPT (overhead-bound), "
                          "3x the rounds",
           "health tp=2": "the same, tp=2",
           "health pp=2 cpu": "the same, pp=2, the main thread's CPU time (slowest rank)",
           "health tp=2 cpu": "the same, tp=2, CPU time"},
          _health,
          rounds=lambda r: 3 * r),
    Bench("checkpoint", "checkpoint_vs_torch.py",
          lambda r: ["--paired", "--config", "tiny,n_layer=4,n_embd=256,vocab_size=8192", "--repeat", str(r)],
          {"checkpoint save": "autopart save (4 ranks, pp=2 x dp=2, DCP) / torch.save, GPT 4 layers "
                              "n_embd=256 vocab 8192 with Adam state, 64 MB (not gpt2-124m's "
                              "1.4 GB: 30 rounds of it take long)",
           "checkpoint load": "autopart load (CRC-32 verified) / torch.load + load_state_dict",
           "checkpoint load (sizes only)": "autopart load(verify=False) / torch.load"},
          lambda out: {"checkpoint save": out["round_ratios"]["save"],
                       "checkpoint load": out["round_ratios"]["load"],
                       "checkpoint load (sizes only)": out["round_ratios"]["load_noverify"]}),
    Bench("moe-overlap", "moe_overlap.py", lambda r: ["--steps", str(r)],
          {"ep overlap / no overlap": "autopart overlap=True (pairs) / overlap=False "
                                      "step (fwd+bwd+SGD), "
                                      "pp=2 x dp=2 with ep=2, HF Mixtral h=64 4 layers 4 experts "
                                      "top-2, batch 16x64, 4 microbatches, the slowest rank per "
                                      "round, paired rounds (issue 52's target <= 0.85)"},
          _moe_overlap, timeout=1800,
          optional={"ep overlap / serial pairs": "autopart overlap=True / the same paired "
                    "schedule and programs with each microbatch's ops in order (every wait "
                    "right after its post): the overlap's own share, paired rounds",
                    "ep combined F&B / overlap off (interleaved)": "the same layout under "
                    "interleaved-1f1b v=2: overlap=True (each forward run beside the backward "
                    "next to it) / overlap=False, paired rounds",
                    "ep combined F&B / serial": "interleaved-1f1b v=2: combined / each combined "
                    "pair run as the backward then the whole forward, paired rounds"}),
    Bench("cp", "cp_attention.py", lambda r: ["--rounds", str(r)],
          {"cp ring / allgather": "autopart cp=2 ring attention / all-gather attention step "
                                  "(fwd+bwd+AdamW), GPT 2 layers n_embd=128 vocab 1024, "
                                  "1 x 4096 tokens"},
          _cp, timeout=1800,
          optional={"cp ring / torch context_parallel":
                    "autopart cp=2 ring / torch context_parallel step, the same (only where "
                    "torch's runs: not on CPU in torch 2.13)"}),
    Bench("compile-1t", "compile_time.py",
          lambda r: ["--model", "megatron-1t", "--pp", "64", "--tp", "8", "--dp", "6",
                     "--repeat", str(max(1, r // 10))],
          {"compile 1T s": "seconds, whole process: autopart.compile of megatron-1t on pp=64 tp=8 "
                           "dp=6 (3072 ranks), meta device; a process per round, rounds/10 of them"},
          lambda out: {"compile 1T s": [x["process_wall"] for x in out["runs"]]},
          unit="s", rounds=lambda r: max(1, r // 10)),
    Bench("plan", "plan_time.py", lambda r: ["--repeat", str(max(1, r // 15))],
          {"plan cold s": "seconds, whole `autopart plan` process, megatron-1t on 3072 GPUs, "
                          "layer-profile cache empty; rounds/15 processes",
           "plan warm s": "the same with the profile cached"},
          lambda out: {"plan cold s": [x["cold_s"] for x in out["runs"]],
                       "plan warm s": [x["warm_s"] for x in out["runs"]]},
          unit="s", rounds=lambda r: max(1, r // 15)),
]


# -- one benchmark -------------------------------------------------------------------------------
def invoke(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """Runs one benchmark process: (exit status, stdout, stderr). Tests replace it."""
    try:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, "", f"timed out after {timeout:.0f} s\n{e.stderr or ''}"
    return p.returncode, p.stdout, p.stderr


def run_once(bench: Bench, rounds: int) -> tuple[dict[str, float] | None, float, str]:
    """One run: (row -> the median of its per-round values, or None on failure; seconds; error)."""
    argv = [sys.executable, str(BENCH / bench.script), *bench.args(rounds), "--json"]
    start = time.perf_counter()
    code, out, err = invoke(argv, bench.timeout)
    seconds = time.perf_counter() - start
    try:
        if code != 0:
            raise RuntimeError(f"exit status {code}")
        values = bench.values(json.loads(out.strip().splitlines()[-1]))
        return {row: statistics.median(v) for row, v in values.items()}, seconds, ""
    except Exception as e:   # noqa: BLE001 - a failed benchmark is reported, the others still run
        tail = " | ".join(err.strip().splitlines()[-3:])
        return None, seconds, f"{e}: {tail}"[:400]


def verdict(first: float | None, second: float | None) -> str:
    """'result' when the two runs agree within NOISE (the larger over the smaller), else 'noisy'."""
    if first is None or second is None:
        return "failed"
    lo, hi = sorted((first, second))
    return "result" if lo > 0 and hi / lo - 1 <= NOISE + 1e-12 else "noisy"


def measure(bench: Bench, rounds: int, runs: int, log=sys.stderr) -> list[dict]:
    """The benchmark run `runs` times: one dict per row (figures, verdict, rounds, seconds)."""
    figures, seconds, errors = [], 0.0, []
    for i in range(runs):
        got, s, error = run_once(bench, rounds)
        seconds += s
        figures.append(got or {})
        if error:
            errors.append(f"run {i + 1}: {error}")
        print(f"  {bench.name} run {i + 1}/{runs}: {s:.0f} s: " + (
            ", ".join(f"{k} {v:.3f}" for k, v in got.items()) if got else f"FAILED {error}"),
              file=log, flush=True)
    rows = []
    optional = {k: v for k, v in bench.optional.items() if any(k in f for f in figures)}
    for row, what in {**bench.rows, **optional}.items():
        got = [f.get(row) for f in figures]
        v = verdict(got[0], got[1]) if runs == 2 else ("failed" if None in got else "quick")
        rows.append({"benchmark": row, "what": what, "unit": bench.unit, "runs": got,
                     "verdict": v, "rounds": bench.rounds(rounds), "seconds": seconds,
                     "errors": errors})
    return rows


# -- the record ----------------------------------------------------------------------------------
def _fmt(x: float | None, unit: str) -> str:
    return "-" if x is None else f"{x:.2f} s" if unit == "s" else f"{x:.3f}"


def _spread(row: dict) -> str:
    a, b = (row["runs"] + [None, None])[:2]
    return f"{100 * (max(a, b) / min(a, b) - 1):.1f}%" if a and b else "-"


def table(rows: list[dict]) -> str:
    w = max([30] + [len(r["benchmark"]) + 2 for r in rows])
    head = f"{'benchmark':<{w}}{'run 1':>10}{'run 2':>10}{'apart':>8}  {'verdict':<8}{'rounds':>7}{'seconds':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        a, b = (r["runs"] + [None, None])[:2]
        lines.append(f"{r['benchmark']:<{w}}{_fmt(a, r['unit']):>10}{_fmt(b, r['unit']):>10}"
                     f"{_spread(r):>8}  {r['verdict']:<8}{r['rounds']:>7}{r['seconds']:>9.0f}")
    return "\n".join(lines)


def git_state() -> tuple[str, bool]:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") or "?", bool(git("status", "--porcelain",
                                                               "--untracked-files=no"))


def section(rows: list[dict], *, when: datetime.datetime, commit: str, dirty: bool,
            load_before, load_after, command: str, rounds: int) -> str:
    """The Markdown section appended to RESULTS.md for one invocation."""
    la = ", ".join(f"{x:.2f}" for x in load_before)
    lb = ", ".join(f"{x:.2f}" for x in load_after)
    out = [f"## {when:%Y-%m-%d %H:%M}: `{command}`", "",
           f"Commit {commit}{' (working tree dirty)' if dirty else ''}; {os.cpu_count()} cpus; load "
           f"average (1, 5, 15 min) {la} before, {lb} after; {rounds} rounds. A run's figure is the "
           f"median of its per-round values (ratios: lower is faster for autopart; `s`: seconds); "
           f"two runs more than {100 * NOISE:.0f}% apart are noisy, not a result.", "",
           "| benchmark | what | run 1 | run 2 | apart | verdict | rounds | seconds |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        a, b = (r["runs"] + [None, None])[:2]
        out.append(f"| {r['benchmark']} | {r['what']} | {_fmt(a, r['unit'])} | {_fmt(b, r['unit'])} "
                   f"| {_spread(r)} | {r['verdict']} | {r['rounds']} | {r['seconds']:.0f} |")
    errors = [f"- {r['benchmark']}: {e}" for r in rows for e in r["errors"]]
    return "\n".join(out + ([""] + sorted(set(errors)) if errors else [])) + "\n"


def record(text: str, path: Path | None = None) -> None:
    with open(path or RESULTS, "a") as f:
        f.write("\n" + text)


# -- command line --------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_ROUNDS} rounds, each benchmark once: a plumbing check, never recorded")
    ap.add_argument("--only", help="NAME[,NAME]: of " + ", ".join(b.name for b in BENCHMARKS))
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS,
                    help=f"rounds per run (default {MIN_ROUNDS}; fewer are not recorded)")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    ap.add_argument("--json", action="store_true",
                    help="one JSON line with every row on stdout (the table goes to stderr)")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.only.split(",")] if a.only else [b.name for b in BENCHMARKS]
    unknown = sorted(set(names) - {b.name for b in BENCHMARKS})
    if unknown:
        ap.error(f"unknown benchmark {', '.join(unknown)}; known: "
                 f"{', '.join(b.name for b in BENCHMARKS)}")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    rounds, runs = (QUICK_ROUNDS, 1) if a.quick else (a.rounds, 2)
    recording = not (a.no_record or a.quick or rounds < MIN_ROUNDS)
    command = " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])])
    log = sys.stderr
    load_before, when = os.getloadavg(), datetime.datetime.now()
    print(f"{command}: {', '.join(names)}; {rounds} rounds, {runs} run(s) each; load average "
          f"{load_before[0]:.2f}", file=log, flush=True)
    rows = []
    for bench in BENCHMARKS:
        if bench.name in names:
            rows += measure(bench, rounds, runs, log)
    load_after = os.getloadavg()
    text = table(rows)
    print(text, file=log if a.json else sys.stdout)
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {runs} run(s); "
          f"noisy: the two runs more than {100 * NOISE:.0f}% apart", file=log)
    if recording:
        commit, dirty = git_state()
        record(section(rows, when=when, commit=commit, dirty=dirty, load_before=load_before,
                       load_after=load_after, command=command, rounds=rounds))
        print(f"recorded in {RESULTS}", file=log)
    else:
        print("not recorded" + (" (--quick)" if a.quick else " (--no-record)" if a.no_record else
                                f" (fewer than {MIN_ROUNDS} rounds)"), file=log)
    if a.json:
        print(json.dumps({"rounds": rounds, "runs": runs, "load_before": load_before,
                          "load_after": load_after, "rows": rows}))
    return 1 if any(r["verdict"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
