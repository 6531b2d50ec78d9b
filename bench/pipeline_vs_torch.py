"""autopart's pipeline runtime against torch.distributed.pipelining, on the same GPT, cuts and schedule.

    python bench/pipeline_vs_torch.py                          # both schedules, table
    python bench/pipeline_vs_torch.py --schedule 1f1b --microbatches 16 --steps 10 --json
    python bench/pipeline_vs_torch.py --traced --microbatches 8 --microbatch-size 2 \
        --config tiny,n_layer=8,n_embd=128,block_size=16      # issue 52's tracer-built baseline

Two rank processes (Gloo, one thread each) run, per schedule, four things in turn, step after
step in one run so that the machine's noise hits all of them alike:
  autopart   ParallelModel.train_step on the global batch
  nccl-lowered  the same model, its action list lowered as for NCCL (receives hoisted only where
             the validator proves it, autopart/schedule_lowering.py hoist_receives) instead of Gloo's
             early posts: what the Gloo lowering gains, paired round by round ("lowering" column)
  torch      torch.distributed.pipelining: one PipelineStage per autopart chunk, built by splitting
             the GPT at the layer boundaries autopart chose, driven by Schedule1F1B /
             ScheduleInterleaved1F1B with the same loss function
  torch-traced  (--traced) the same schedules over torch's tracer-built stages: pipeline()
             (torch.export) split at the same blocks, build_stage per chunk; the table gives
             autopart / torch traced, own floor / torch traced and their distance
  floor      each rank's chunks run eagerly microbatch by microbatch, no communication
             (torch's stage modules: a bound on torch's step, not autopart's)
  own-floor  autopart's own chunk programs the same way: the bound on autopart's step
  plain      the unsplit model, forward+backward on the whole global batch, on rank 0 alone
and the table gives median step times, autopart/torch (wall and main-thread CPU time), and each
one's share of the ideal pipeline:
  ideal = plain / pp * (1 + (pp - 1) / (v * microbatches))     share = ideal / step time
Before timing, both pipelines' first-step loss and gradients are checked against the plain model.
See bench/README.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.gpt`

from examples.gpt import GPT, config, lm_loss  # noqa: E402

SCHEDULES = {   # autopart name -> (virtual stages, torch schedule class name)
    "1f1b": (1, "Schedule1F1B"),
    "interleaved-1f1b": (2, "ScheduleInterleaved1F1B"),
}
PP = 2


# -- torch's side: stage modules cut where autopart cut ------------------------------------------
class GPTStage(nn.Module):
    """Blocks `layers` of `model`, plus the embeddings on the first stage and ln_f + lm_head on the
    last: the piece of the plain GPT that one autopart chunk computes (weights shared with `model`)."""

    def __init__(self, model: GPT, layers: list[int], first: bool, last: bool):
        super().__init__()
        t = model.transformer
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
        self.h = nn.ModuleList(t.h[i] for i in layers)
        if last:
            self.ln_f, self.lm_head = t.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:                                   # x: int64[B, T] token ids
            pos = torch.arange(0, x.shape[1], dtype=torch.long, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h:                             # x: float[B, T, C]
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))               # float[B, T, V]
        return x


def layer_cuts(chunk_layers, n_layer: int) -> list[list[int]]:
    """autopart's `plan.chunk_layers` -> block indices per chunk; fails if a block is split."""
    out, seen = [], []
    for paths in chunk_layers:
        idx = [int(re.fullmatch(r"transformer\.h\.(\d+)", p).group(1)) for p in paths]
        out.append(idx)
        seen += idx
    if seen != list(range(n_layer)):
        raise RuntimeError(f"autopart's chunks {chunk_layers} do not cut at whole-block boundaries "
                           f"in order; this benchmark needs block boundaries to mirror them")
    return out


@dataclass
class TorchPipe:
    """This rank's torch.distributed.pipelining schedule and what a step needs around it."""
    schedule: object
    has_first: bool
    has_last: bool
    tied: list            # parameters whose grads are summed between ranks (the tied embedding)
    params: list          # this rank's parameters, each once
    names: dict           # id(param) -> name in the plain model
    stages: list          # this rank's PipelineStages, in chunk order


def torch_pipeline(model: GPT, compiled, rank: int, microbatches: int, schedule: str) -> TorchPipe:
    """torch.distributed.pipelining stages for this rank's chunks, checked against autopart's."""
    from torch.distributed import pipelining as tp
    plan = compiled.plan
    cuts = layer_cuts(plan.chunk_layers, model.config.n_layer)
    k = len(cuts)
    mine = [c for c in range(k) if plan.chunk_ranks[c] == rank]
    names_of: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), set()).add(name)
    by_chunk = {c.chunk: c for c in compiled.programs[rank].chunks}
    stages = []
    for c in mine:
        module = GPTStage(model, cuts[c], first=c == 0, last=c == k - 1)
        ours = {id(p) for p in module.parameters()}
        theirs = set(by_chunk[c].params)
        names = set().union(*(names_of[i] for i in ours))
        if len(ours) != len(theirs) or not theirs <= names:
            raise RuntimeError(f"chunk {c}: torch stage holds {sorted(names)} but autopart's chunk "
                               f"holds {sorted(theirs)}")
        stages.append(tp.PipelineStage(module, c, k, torch.device("cpu")))
    sched = _schedule(schedule, stages, microbatches)
    # Tied embedding / output projection: both ranks hold it; sum its grads as autopart does.
    tied = []
    first_rank, last_rank = plan.chunk_ranks[0], plan.chunk_ranks[-1]
    if model.config.tie_weights and first_rank != last_rank:
        tied = [model.transformer.wte.weight]
    params = list({id(p): p for s in stages for p in s.submod.parameters()}.values())
    return TorchPipe(sched, 0 in mine, k - 1 in mine, tied, params,
                     {id(p): n for n, p in model.named_parameters()}, stages)


def traced_pipeline(model: GPT, compiled, rank: int, microbatches: int, schedule: str,
                    example: torch.Tensor) -> TorchPipe:
    """torch's tracer front end: `pipeline()` traces the plain GPT (torch.export) on one
    microbatch `example` and splits it where autopart's chunks begin (SplitPoint.BEGINNING on
    each chunk's first block); `build_stage` makes this rank's stages. The tied embedding /
    output projection is replicated on the first and last stage (torch's default), its
    gradients summed between the ranks in torch_step as for the hand-built stages."""
    from torch.distributed import pipelining as tp
    plan = compiled.plan
    cuts = layer_cuts(plan.chunk_layers, model.config.n_layer)
    k = len(cuts)
    spec = {f"transformer.h.{c[0]}": tp.SplitPoint.BEGINNING for c in cuts[1:]}
    named = list(model.named_parameters(remove_duplicate=False))
    uses = Counter(id(p) for _, p in named)
    shared = {n for n, p in named if uses[id(p)] > 1}       # the tied embedding's two names
    pipe = tp.pipeline(model, mb_args=(example,), split_spec=spec)
    if pipe.num_stages != k:
        raise RuntimeError(f"pipeline() made {pipe.num_stages} stages of split points {spec}, "
                           f"autopart {k} chunks")
    mine = [c for c in range(k) if plan.chunk_ranks[c] == rank]
    by_chunk = {c.chunk: c for c in compiled.programs[rank].chunks}
    stages, names, read = [], {}, {}
    for c in mine:
        stage = pipe.build_stage(c, torch.device("cpu"))
        held = read_parameters(stage.submod)
        if len(held) != len(by_chunk[c].params) or \
                not set(by_chunk[c].params) <= _aliases(model, held):
            raise RuntimeError(f"chunk {c}: torch's traced stage holds {sorted(held)} but "
                               f"autopart's chunk holds {sorted(by_chunk[c].params)}")
        names.update({id(p): n for n, p in held.items()})
        read.update({id(p): p for p in held.values()})
        stages.append(stage)
    sched = _schedule(schedule, stages, microbatches)
    params = list(read.values())
    tied = [p for p in params if names[id(p)] in shared] \
        if plan.chunk_ranks[0] != plan.chunk_ranks[-1] else []
    return TorchPipe(sched, 0 in mine, k - 1 in mine, tied, params, names, stages)


def read_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a traced stage's graphs read (get_attr), by qualified name, through its
    call_module nodes: pipeline() also attaches the tied embedding's other name to a stage
    that never reads it (the original tensor, its .grad None), which is no part of its work."""
    out: dict[str, nn.Parameter] = {}

    def walk(mod: nn.Module, prefix: str) -> None:
        own = dict(mod.named_parameters())
        for n in getattr(mod, "graph", None).nodes if hasattr(mod, "graph") else ():
            if n.op == "get_attr" and n.target in own:
                out[prefix + n.target] = own[n.target]
            elif n.op == "call_module":
                walk(mod.get_submodule(n.target), prefix + n.target + ".")
    walk(module, "")
    return out


def _aliases(model: GPT, held: dict) -> set[str]:
    """Every plain-model name of the tensors `held` names (a tied tensor has two)."""
    plain = model.named_parameters(remove_duplicate=False)
    by_name = dict(plain)
    ids = {id(by_name[n]) for n in held if n in by_name}
    return {n for n, p in by_name.items() if id(p) in ids} | set(held)


def _schedule(schedule: str, stages: list, microbatches: int):
    from torch.distributed import pipelining as tp
    cls = getattr(tp, SCHEDULES[schedule][1])
    if len(stages) == 1:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=lm_loss)
    return cls(stages, n_microbatches=microbatches, loss_fn=lm_loss)


def torch_step(pipe: TorchPipe, tokens, targets) -> torch.Tensor:
    """One torch pipelining training step, with the same extra work autopart's train_step does:
    the tied-weight gradient all-reduce and the global mean loss on every rank."""
    losses: list = []
    has_last = pipe.has_last
    args = (tokens,) if pipe.has_first else ()
    pipe.schedule.step(*args, target=targets if has_last else None,
                       losses=losses if has_last else None)
    for p in pipe.tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    total = torch.stack(losses).detach().sum() / len(losses) if has_last else torch.zeros(())
    dist.all_reduce(total)
    return total


def plain_step(model: GPT, tokens, targets) -> torch.Tensor:
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    return loss.detach()


# -- checks ----------------------------------------------------------------------------------------
def _zero(params) -> None:
    for p in params:
        p.grad = None


def _grad_error(pairs) -> float:
    """Largest |g - g_plain| over all pairs, relative to the largest |g_plain|."""
    worst, scale = 0.0, 1e-12
    for g, ref in pairs:
        g = torch.zeros_like(ref) if g is None else g
        worst = max(worst, float((g - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
    return worst / scale


def check_equal_work(plain, pm, pipes: dict, tokens, targets, tol: float) -> dict:
    """First step of each on the same weights and batch: loss and grads must match the plain
    model. `pipes`: side name (torch, torch_traced) -> its TorchPipe."""
    plain_params = dict(plain.named_parameters(remove_duplicate=False))
    _zero(plain_params.values())
    ref_loss = float(plain_step(plain, tokens, targets))
    losses = {"autopart": float(pm.train_step(tokens, target=targets))}
    errors = {"autopart": _grad_error([(p.grad, plain_params[n].grad)
                                       for n, p in pm.named_parameters()])}
    for side, pipe in pipes.items():
        losses[side] = float(torch_step(pipe, tokens, targets))
        errors[side] = _grad_error([(p.grad, plain_params[pipe.names[id(p)]].grad)
                                    for p in pipe.params])
    sides = list(losses)
    errs = torch.tensor([abs(losses[k] - ref_loss) for k in sides] + [errors[k] for k in sides])
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    out = {"plain_loss": ref_loss, **{f"{k}_loss": v for k, v in losses.items()},
           **{f"{k}_grad_rel_err": float(e) for k, e in zip(sides, errs[len(sides):])}}
    scale = max(1.0, abs(ref_loss))
    bad = [f"{k} loss" for k, e in zip(sides, errs) if not float(e) <= tol * scale] + \
        [f"{k} grads" for k, e in zip(sides, errs[len(sides):]) if not float(e) <= tol]
    if bad:
        raise AssertionError(f"not the same work as the plain model: {', '.join(bad)} differ: {out}")
    return out


# -- compute floor: the same chunks, eager, microbatch by microbatch, no communication ------------------
def floor_step(pipe: TorchPipe, tokens, targets, m: int, hidden: torch.Tensor) -> None:
    """Forward+backward of this rank's chunks on every microbatch with no pipeline at all: the
    compute any runtime must do at this microbatch size (inputs from other ranks are stand-ins)."""
    mbs = tokens.shape[0] // m
    for stage in pipe.stages:
        mod = stage.submod
        for i in range(m):
            rows = slice(i * mbs, (i + 1) * mbs)
            x = tokens[rows] if mod.first else hidden.detach().requires_grad_(True)
            out = mod(x)
            if mod.last:
                (lm_loss(out, targets[rows]) / m).backward()
            else:
                out.backward(hidden)


def own_floor_step(pm, tokens, targets, m: int) -> None:
    """autopart's own floor: this rank's chunk programs, as its executor runs them
    (runtime/executable.py), forward and backward on every microbatch, with no communication
    and no schedule (received tensors and gradients are stand-ins of their boundary shapes). The
    limit autopart's step is measured against: what is left above it is the runtime's."""
    from autopart.runtime.executable import executable
    mbs = tokens.shape[0] // m
    seq = tokens.shape[1]
    for chunk in pm._step.chunks.values():
        run = executable(chunk.gm)
        names = list(pm.compiled.program.inputs)
        for i in range(m):
            rows = slice(i * mbs, (i + 1) * mbs)
            given = dict(zip(names, (tokens[rows], targets[rows])))
            recvs = [torch.full(b.concrete_shape(mbs, seq), 0.02, dtype=b.dtype,
                                requires_grad=b.differentiable) for b in chunk.recvs]
            out = run(*recvs, *(given[n] for n in chunk.inputs))
            if chunk.is_last:
                (out[0] / m).backward()
            else:
                sends = [(o, torch.full_like(o, 0.02)) for b, o in zip(chunk.sends, out)
                         if b.differentiable and o.requires_grad]
                torch.autograd.backward([o for o, _ in sends], [g for _, g in sends])


def nccl_lowering(pm):
    """`pm` running the action list lowered as for NCCL, whatever its device (the bench's A/B
    of the lowering; the runtime picks the lowering by the tensors' device)."""
    from autopart.schedule_lowering import hoist_receives
    pm._step.actions = hoist_receives(pm.compiled.schedule).ranks[pm.coords["pp"]]
    return pm


# -- one rank ----------------------------------------------------------------------------------------
def _timed(fn, *args, sync: bool = True) -> tuple[float, float]:
    """(wall, cpu) seconds of fn(*args); cpu is the calling thread's CPU time: the runtime's own
    work (Python, compute, posting messages) without waiting, so other load on the machine
    disturbs it far less than the wall time."""
    if sync:
        dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    fn(*args)
    return time.perf_counter() - wall, time.thread_time() - cpu


def rank_main(rank: int, world: int, opts: dict) -> dict:
    import autopart
    torch.manual_seed(opts["seed"])
    cfg = config(opts["config"])
    plain = GPT(cfg)
    m, mbs = opts["microbatches"], opts["microbatch_size"]
    batch = m * mbs
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    hidden = 0.02 * torch.randn(mbs, cfg.block_size, cfg.n_embd, generator=g)
    results = []
    for name in opts["schedules"]:
        v = SCHEDULES[name][0]
        ap_model, t_model = copy.deepcopy(plain), copy.deepcopy(plain)
        t0 = time.perf_counter()
        pm = autopart.parallelize(ap_model, autopart.Mesh(pp=PP), (tokens,), loss_fn=lm_loss,
                                  target=targets, microbatches=m, schedule=name, virtual_stages=v)
        compile_s = time.perf_counter() - t0
        pipe = torch_pipeline(t_model, pm.compiled, pm.coords["pp"], m, name)
        pipes = {"torch": pipe}
        if opts.get("traced"):      # torch's tracer front end on its own copy of the weights
            pipes["torch_traced"] = traced_pipeline(copy.deepcopy(plain), pm.compiled,
                                                    pm.coords["pp"], m, name, tokens[:mbs])
        nccl_lowered = nccl_lowering(autopart.parallelize(
            copy.deepcopy(plain), autopart.Mesh(pp=PP), (tokens,), loss_fn=lm_loss,
            target=targets, microbatches=m, schedule=name, virtual_stages=v))
        check = check_equal_work(plain, pm, pipes, tokens, targets, opts["tol"])

        ap_params, t_params, p_params = list(pm.parameters()), pipe.params, list(plain.parameters())
        runners = {   # every rank runs these together, each step starting at a barrier
            "autopart": (lambda: pm.train_step(tokens, target=targets), ap_params),
            "nccl-lowered": (lambda: nccl_lowered.train_step(tokens, target=targets),
                             list(nccl_lowered.parameters())),
            "torch": (lambda: torch_step(pipe, tokens, targets), t_params),
            **({"torch-traced": (lambda: torch_step(pipes["torch_traced"], tokens, targets),
                                 pipes["torch_traced"].params)} if "torch_traced" in pipes else {}),
            "floor": (lambda: floor_step(pipe, tokens, targets, m, hidden), t_params),
            "own-floor": (lambda: own_floor_step(pm, tokens, targets, m), ap_params),
        }
        wall = {k: [] for k in (*runners, "plain")}
        cpu = {k: [] for k in (*runners, "plain")}
        load = os.getloadavg()[0]
        for it in range(opts["warmup"] + opts["steps"]):
            for key, (fn, params) in runners.items():      # A, B, A, B, ...
                _zero(params)
                dt, dc = _timed(fn)
                if it >= opts["warmup"]:
                    wall[key].append(dt)
                    cpu[key].append(dc)
            _zero(p_params)   # plain: rank 0 alone, the other rank waits at the barrier
            dist.barrier()
            dt, dc = _timed(plain_step, plain, tokens, targets, sync=False) if rank == 0 else (0, 0)
            dist.barrier()
            if it >= opts["warmup"]:
                wall["plain"].append(dt)
                cpu["plain"].append(dc)
        # a step lasts as long as its slowest rank
        for d in (wall, cpu):
            for key in d:
                t = torch.tensor(d[key], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                d[key] = t.tolist()
        med = {k: statistics.median(x) for k, x in wall.items()}
        cmed = {k: statistics.median(x) for k, x in cpu.items()}
        bubble = (PP - 1) / (v * m)
        ideal = med["plain"] / PP * (1 + bubble)
        results.append({
            "schedule": name, "pp": PP, "virtual_stages": v, "microbatches": m,
            "microbatch_size": mbs, "chunk_layers": [list(c) for c in pm.compiled.plan.chunk_layers],
            "autopart_ms": 1e3 * med["autopart"], "torch_ms": 1e3 * med["torch"],
            "plain_ms": 1e3 * med["plain"], "ideal_ms": 1e3 * ideal, "floor_ms": 1e3 * med["floor"],
            "ratio": med["autopart"] / med["torch"],
            "autopart_share": ideal / med["autopart"], "torch_share": ideal / med["torch"],
            "floor_share": ideal / (med["floor"] * (1 + bubble)),
            "autopart_cpu_ms": 1e3 * cmed["autopart"], "torch_cpu_ms": 1e3 * cmed["torch"],
            "cpu_ratio": cmed["autopart"] / cmed["torch"],
            "quartiles_ms": {k: [1e3 * q for q in statistics.quantiles(x, n=4)] if len(x) > 1
                             else [1e3 * x[0]] * 3 for k, x in wall.items()},
            "autopart_ms_all": [1e3 * t for t in wall["autopart"]],
            "torch_ms_all": [1e3 * t for t in wall["torch"]],
            "nccl_lowered_ms_all": [1e3 * t for t in wall["nccl-lowered"]],
            "floor_ms_all": [1e3 * t for t in wall["floor"]],
            "own_floor_ms": 1e3 * med["own-floor"],
            "own_floor_ms_all": [1e3 * t for t in wall["own-floor"]],
            # autopart's step over its own chunks' compute: 1 would be a runtime that costs
            # nothing (the median of per-round ratios)
            "autopart_over_own_floor": statistics.median(
                a / b for a, b in zip(wall["autopart"], wall["own-floor"])),
            "lowering": statistics.median(a / b for a, b in zip(wall["autopart"],
                                                                 wall["nccl-lowered"])),
            "load_before": load, "load_after": os.getloadavg()[0],
            "compile_s": compile_s, "check": check, **traced_figures(wall)})
        del pm, pipe, pipes, nccl_lowered
    return {"results": results}


def traced_figures(wall: dict) -> dict:
    """The torch-traced side's figures (none when it did not run): autopart / torch traced and
    autopart's own floor / torch traced, each the median of per-round ratios, and the distance
    between them, the median of per-round (autopart - own floor) / torch traced: how far
    autopart's step is above the limit of its own programs, in torch traced steps."""
    if "torch-traced" not in wall:
        return {}
    t, a, f = wall["torch-traced"], wall["autopart"], wall["own-floor"]
    return {"torch_traced_ms": 1e3 * statistics.median(t),
            "torch_traced_ms_all": [1e3 * x for x in t],
            "ratio_traced": statistics.median(x / y for x, y in zip(a, t)),
            "own_floor_over_traced": statistics.median(x / y for x, y in zip(f, t)),
            "traced_distance": statistics.median((x - z) / y for x, z, y in zip(a, f, t))}


# -- driver ------------------------------------------------------------------------------------------
def table(opts: dict, results: list[dict]) -> str:
    cfg = config(opts["config"])
    lines = [f"GPT {opts['config']} (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
             f"block_size={cfg.block_size}, vocab={cfg.vocab_size}); pp={PP}, Gloo, 1 thread/rank; "
             f"{opts['microbatches']} microbatches x {opts['microbatch_size']}; medians of "
             f"{opts['steps']} steps after {opts['warmup']} warm-up, autopart/torch/floor/plain in turn",
             "",
             f"{'schedule':<20}{'autopart':>9}{'torch':>8}{'ratio':>7}{'cpu ratio':>10}"
             f"{'plain':>8}{'ideal':>8}{'floor':>8}{'autopart':>10}{'torch':>8}{'floor':>8}"
             f"{'lowering':>10}{'own floor':>10}{'/ own':>7}",
             f"{'':<20}{'ms':>9}{'ms':>8}{'':>7}{'':>10}{'ms':>8}{'ms':>8}{'ms':>8}"
             f"{'share':>10}{'share':>8}{'share':>8}{'':>10}{'ms':>10}{'':>7}"]
    for r in results:
        name = r["schedule"] + (f" v={r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        lines.append(f"{name:<20}{r['autopart_ms']:>9.1f}{r['torch_ms']:>8.1f}{r['ratio']:>7.2f}"
                     f"{r['cpu_ratio']:>10.2f}{r['plain_ms']:>8.1f}{r['ideal_ms']:>8.1f}"
                     f"{r['floor_ms']:>8.1f}{100 * r['autopart_share']:>9.1f}%"
                     f"{100 * r['torch_share']:>7.1f}%{100 * r['floor_share']:>7.1f}%"
                     f"{r['lowering']:>10.3f}{r['own_floor_ms']:>10.1f}"
                     f"{r['autopart_over_own_floor']:>7.2f}")
    lines += [
        "",
        "ratio      autopart / torch step time (wall, slowest rank); cpu ratio: the same for the",
        "           main thread's CPU time (what the runtime itself costs, waiting excluded)",
        "ideal      plain / pp * (1 + (pp-1)/(v*m)), plain = the unsplit model's forward+backward on",
        "           the whole global batch on one rank; share = ideal / step time",
        "lowering   median of the per-round ratios autopart / the same model with NCCL's lowering",
        "           of its action lists (Gloo's early receive posts against validated hoisting)",
        "floor      the rank's chunks run eagerly microbatch by microbatch, no communication: the",
        "           compute any runtime must do at this microbatch size; floor share = ideal /",
        "           (floor * (1 + bubble)), the best share a pipeline of eager chunks can reach",
        "own floor  autopart's own chunk programs, as its executor runs them, forward+backward on",
        "           every microbatch with no communication and no schedule: the limit of autopart's",
        "           step; / own = autopart step / own floor (median of per-round ratios), what the",
        "           runtime, the bubble and the transfers add"]
    for r in results:
        c = r["check"]
        cuts = " | ".join(f"{p[0].split('.')[-1]}-{p[-1].split('.')[-1]}" for p in r["chunk_layers"])
        lines.append(f"{r['schedule']}: blocks per chunk [{cuts}]; first-step loss plain "
                     f"{c['plain_loss']:.6f} autopart {c['autopart_loss']:.6f} torch "
                     f"{c['torch_loss']:.6f}; grad rel err autopart {c['autopart_grad_rel_err']:.1e} "
                     f"torch {c['torch_grad_rel_err']:.1e}; load avg {r['load_before']:.1f} -> "
                     f"{r['load_after']:.1f} on {os.cpu_count()} cpus")
        if "ratio_traced" in r:
            lines.append(f"    torch traced (pipeline() + build_stage): {r['torch_traced_ms']:.1f} ms; "
                         f"autopart / torch traced {r['ratio_traced']:.3f}; own floor / torch "
                         f"traced {r['own_floor_over_traced']:.3f}; distance (autopart - own "
                         f"floor) / torch traced {r['traced_distance']:.3f}; first-step loss "
                         f"{c['torch_traced_loss']:.6f}, grad rel err "
                         f"{c['torch_traced_grad_rel_err']:.1e}")
        q = r["quartiles_ms"]
        lines.append("    step time quartiles (ms): " + "; ".join(
            f"{k} {v[0]:.1f} / {v[1]:.1f} / {v[2]:.1f}" for k, v in q.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", choices=[*SCHEDULES, "all"], default="all")
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="measured steps of each (default 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--config", default="tiny,n_layer=8,n_embd=64,block_size=32",
                    help="GPT config spec for examples.gpt.config")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="allowed loss / relative gradient difference from the plain model")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before the ranks are killed")
    ap.add_argument("--traced", action="store_true",
                    help="also step torch's tracer-built stages (pipeline() + build_stage), "
                         "paired with the others round by round")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON line on stdout (the table goes to stderr)")
    a = ap.parse_args(argv)
    opts = dict(schedules=list(SCHEDULES) if a.schedule == "all" else [a.schedule],
                microbatches=a.microbatches, microbatch_size=a.microbatch_size, steps=a.steps,
                warmup=a.warmup, config=a.config, seed=a.seed, tol=a.tol, traced=a.traced)
    from autopart.runtime.launch import spawn
    out = spawn(rank_main, PP, opts, timeout=a.timeout)[0]
    text = table(opts, out["results"])
    if a.json:
        print(text, file=sys.stderr)
        print(json.dumps({"bench": "pipeline_vs_torch", "options": opts, "results": out["results"]}))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
