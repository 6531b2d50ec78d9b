"""autopart with compile=True (Inductor) against autopart eager, torch.distributed.pipelining and
DTensor, with the compile seconds cold and warm.

    python bench/compiled_vs_eager.py                    # pp=2 (two microbatch sizes) and tp=2
    python bench/compiled_vs_eager.py --only pp --steps 10 --json

pp=2: two Gloo rank processes run the example GPT (8 layers) with 1F1B, step after step in one
run, alternating: autopart compiled, autopart eager, torch.distributed.pipelining (stages cut
where autopart cut: bench/pipeline_vs_torch.py), each step starting at a barrier; once with
microbatches of `--small` sequences (overhead-bound) and once of `--large` (compute-bound).
tp=2: the Llama-style model of bench/tp_vs_dtensor.py, autopart compiled, eager, and DTensor's
hand plan, alternating the same way (forward + backward + SGD step each).

Compile seconds: every measurement run first compiles in a fresh Inductor cache directory
(cold: every graph lowered and built), then a second process group on the same directory
compiles again (warm: Inductor's FX-graph and AOTAutograd caches on disk) and that one runs the
timed steps. Compile seconds = parallelize(compile=True) plus the first train_step (where the
artifacts are made), slowest rank; the CompileReport's Inductor seconds beside it.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from examples.gpt import GPT, config, lm_loss  # noqa: E402


def _slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


_CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                   ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"))


def _compile(build, example, compile: bool, caches: dict | None = None, **kw):
    """(ParallelModel, seconds to build it and run its first step, Inductor seconds); `caches`
    gets torch's own counts of Inductor FX-graph and AOTAutograd cache hits and misses during
    it, summed over the ranks (whether a warm start really came from the caches)."""
    import autopart
    from torch._dynamo.utils import counters
    before = [counters[a][b] for a, b in _CACHE_COUNTERS]
    start = time.perf_counter()
    pm = autopart.parallelize(build(), compile=compile, **example, **kw)
    pm.train_step(*example["example_inputs"], target=example["target"])
    seconds = time.perf_counter() - start
    inductor = pm.inductor.report.seconds if pm.inductor is not None else 0.0
    counts = torch.tensor([counters[a][b] - n for (a, b), n in zip(_CACHE_COUNTERS, before)])
    dist.all_reduce(counts)
    if caches is not None:
        caches.update({b: int(n) for (_, b), n in zip(_CACHE_COUNTERS, counts)})
    return pm, _slowest(seconds), _slowest(inductor)


def _alternate(runners: dict, steps: int, warmup: int) -> dict:
    """Median wall ms of each runner (slowest rank), run A, B, C, A, B, C, ... ."""
    times = {k: [] for k in runners}
    for it in range(warmup + steps):
        for name, fn in runners.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if it >= warmup:
                times[name].append(time.perf_counter() - start)
    return {k: 1e3 * _slowest(statistics.median(v)) for k, v in times.items()}


def _sgd_step(pm_or_model, loss_fn=None, x=None, y=None):
    params = list(pm_or_model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)

    def step():
        if loss_fn is None:
            pm_or_model.train_step(x, target=y)
        else:
            loss_fn(pm_or_model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def _torch_step(pipe, x, y) -> None:
    from pipeline_vs_torch import torch_step
    torch_step(pipe, x, y)
    for p in pipe.params:       # as the optimizer's zero_grad on the other sides
        p.grad = None


def pp_rank(rank: int, world: int, opts: dict) -> dict:
    import autopart
    from pipeline_vs_torch import torch_pipeline
    out = {}
    torch.manual_seed(0)
    plain = GPT(config(opts["config"]))
    cfg = plain.config
    for label, mbs in (("overhead-bound", opts["small"]), ("compute-bound", opts["large"])):
        m = opts["microbatches"]
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, cfg.vocab_size, (m * mbs, cfg.block_size), generator=g)
        y = torch.randint(0, cfg.vocab_size, (m * mbs, cfg.block_size), generator=g)
        example = dict(mesh=autopart.Mesh(pp=2), example_inputs=(x,), target=y)
        # a memory budget the compute-only cut fits: the cut is then compute-optimal, whole
        # blocks here, which torch's stages (built from whole blocks) can mirror
        kw = dict(loss_fn=lm_loss, microbatches=m, schedule="1f1b",
                  memory_budget=opts["memory_budget"])
        entry = {"microbatch_size": mbs, "microbatches": m}
        if opts["cold_only"]:
            _, entry["compile_s"], entry["inductor_s"] = _compile(
                lambda: copy.deepcopy(plain), example, True, entry.setdefault("caches", {}), **kw)
            out[label] = entry
            continue
        compiled, entry["compile_s"], entry["inductor_s"] = _compile(
            lambda: copy.deepcopy(plain), example, True, entry.setdefault("caches", {}), **kw)
        eager, entry["eager_setup_s"], _ = _compile(lambda: copy.deepcopy(plain), example, False,
                                                    **kw)
        loss_c, loss_e = float(compiled.train_step(x, target=y)), float(eager.train_step(x, target=y))
        entry["loss_compiled_minus_eager"] = abs(loss_c - loss_e)
        runners = {"compiled": _sgd_step(compiled, x=x, y=y), "eager": _sgd_step(eager, x=x, y=y)}
        try:        # torch's stages mirror autopart's cut, which must fall between blocks
            pipe = torch_pipeline(copy.deepcopy(plain), eager.compiled, eager.coords["pp"], m,
                                  "1f1b")
            runners["torch"] = lambda: _torch_step(pipe, x, y)
            if opts["torch_compile"]:
                runners["torch_compiled"], entry["torch_compile_s"] = _torch_compiled(
                    plain, eager.compiled, eager.coords["pp"], m, x, y)
        except RuntimeError as e:      # a cut inside a block: compiled vs eager only
            entry["torch_skipped"] = str(e)
        ms = _alternate(runners, opts["steps"], opts["warmup"])
        entry.update({f"{k}_ms": v for k, v in ms.items()})
        if "torch" in ms:
            entry["compiled_vs_torch"] = ms["compiled"] / ms["torch"]
        entry["compiled_vs_eager"] = ms["compiled"] / ms["eager"]
        if "torch_compiled" in ms:
            entry["compiled_vs_torch_compiled"] = ms["compiled"] / ms["torch_compiled"]
            entry["torch_compiled_vs_torch"] = ms["torch_compiled"] / ms["torch"]
        out[label] = entry
    return out


def _torch_compiled(plain, compiled, rank: int, m: int, x, y):
    """torch pipelining with each block compiled in place by torch.compile, as torchtitan
    compiles its blocks: what Inductor alone gives the peer. Returns (step, seconds of its
    first step, where Dynamo and Inductor compile)."""
    from pipeline_vs_torch import torch_pipeline
    model = copy.deepcopy(plain)
    for block in model.transformer.h:
        block.compile()
    pipe = torch_pipeline(model, compiled, rank, m, "1f1b")
    dist.barrier()
    start = time.perf_counter()
    _torch_step(pipe, x, y)
    return (lambda: _torch_step(pipe, x, y)), _slowest(time.perf_counter() - start)


def tp_rank(rank: int, world: int, opts: dict) -> dict:
    import autopart
    from tp_vs_dtensor import dtensor_model, loss_fn, make_model
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1024, (opts["tp_batch"], opts["tp_seq"]), generator=g)
    y = torch.randint(0, 1024, (opts["tp_batch"], opts["tp_seq"]), generator=g)
    build = lambda: make_model(opts["tp_layers"], opts["tp_hidden"])   # noqa: E731
    example = dict(mesh=autopart.Mesh(tp=world), example_inputs=(x,), target=y)
    entry = {}
    compiled, entry["compile_s"], entry["inductor_s"] = _compile(
        build, example, True, entry.setdefault("caches", {}), loss_fn=loss_fn)
    if opts["cold_only"]:
        return {"tp": entry}
    eager, entry["eager_setup_s"], _ = _compile(build, example, False, loss_fn=loss_fn)
    theirs = dtensor_model(build(), world)
    ms = _alternate({"compiled": _sgd_step(compiled, x=x, y=y), "eager": _sgd_step(eager, x=x, y=y),
                     "dtensor": _sgd_step(theirs, loss_fn, x, y)}, opts["steps"], opts["warmup"])
    entry.update({f"{k}_ms": v for k, v in ms.items()})
    entry["compiled_vs_dtensor"] = ms["compiled"] / ms["dtensor"]
    entry["compiled_vs_eager"] = ms["compiled"] / ms["eager"]
    return {"tp": entry}


def run(opts: dict) -> dict:
    """Cold compile in a fresh cache directory, then the warm run that also times the steps."""
    from autopart.runtime.launch import spawn
    results = {}
    for name, fn in (("pp", pp_rank), ("tp", tp_rank)):
        if opts["only"] not in ("all", name):
            continue
        with tempfile.TemporaryDirectory(prefix="autopart-inductor-") as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache    # the rank processes inherit it
            cold = spawn(fn, 2, dict(opts, cold_only=True), timeout=opts["timeout"])[0]
            warm = spawn(fn, 2, dict(opts, cold_only=False), timeout=opts["timeout"])[0]
        for label, entry in warm.items():
            entry["cold_compile_s"] = cold[label]["compile_s"]
            entry["cold_inductor_s"] = cold[label]["inductor_s"]
            entry["warm_compile_s"] = entry.pop("compile_s")
            entry["warm_inductor_s"] = entry.pop("inductor_s")
            entry["cold_caches"], entry["warm_caches"] = cold[label]["caches"], entry.pop("caches")
            results[label] = entry
    return results


def table(results: dict) -> str:
    lines = [f"{'case':<16} {'mbs':>4} {'compiled':>9} {'eager':>9} {'baseline':>9} "
             f"{'c/base':>7} {'c/eager':>8} {'cold s':>7} {'warm s':>7} {'ind s':>6} "
             f"{'eager s':>7} {'torch+c':>9} {'c/t+c':>6} {'t+c/t':>6}"]
    for label, e in results.items():
        base = e.get("torch_ms", e.get("dtensor_ms"))
        ratio = e.get("compiled_vs_torch", e.get("compiled_vs_dtensor"))
        base, ratio = (f"{base:>8.1f}m", f"{ratio:>7.2f}") if base else (f"{'-':>9}", f"{'-':>7}")
        lines.append(f"{label:<16} {e.get('microbatch_size', '-'):>4} {e['compiled_ms']:>8.1f}m "
                     f"{e['eager_ms']:>8.1f}m {base} {ratio} "
                     f"{e['compiled_vs_eager']:>8.2f} {e['cold_compile_s']:>7.1f} "
                     f"{e['warm_compile_s']:>7.1f} {e['warm_inductor_s']:>6.1f} "
                     f"{e['eager_setup_s']:>7.1f} " + _torch_compiled_cells(e))
    lines.append("baseline: torch.distributed.pipelining (pp rows), DTensor (tp row); times are "
                 "median step ms, slowest rank; cold/warm: parallelize + first step with "
                 "compile=True, empty / filled Inductor cache; ind s: of warm s, the seconds in "
                 "Inductor (imports, cache loads); eager s: parallelize + first step with "
                 "compile=False in the same process (capture, imports already warm); torch+c: "
                 "torch pipelining with every block torch.compile'd (torchtitan's way), c/t+c "
                 "compiled autopart against it, t+c/t what torch.compile gives torch's own "
                 "pipeline (the ceiling Inductor sets on this machine)")
    for label, e in results.items():
        if "torch_skipped" in e:
            lines.append(f"{label}: no torch pipelining baseline: {e['torch_skipped']}")
        w = e["warm_caches"]
        lines.append(f"{label} warm start, all ranks: FX-graph cache {w['fxgraph_cache_hit']} hits "
                     f"/ {w['fxgraph_cache_miss']} misses, AOTAutograd cache "
                     f"{w['autograd_cache_hit']} hits / {w['autograd_cache_miss']} misses")
    lines.append(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return "\n".join(lines)


def _torch_compiled_cells(e: dict) -> str:
    if "torch_compiled_ms" not in e:
        return f"{'-':>9} {'-':>6} {'-':>6}"
    return (f"{e['torch_compiled_ms']:>8.1f}m {e['compiled_vs_torch_compiled']:>6.2f} "
            f"{e['torch_compiled_vs_torch']:>6.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("all", "pp", "tp"), default="all")
    p.add_argument("--config", default="tiny,n_layer=8,n_embd=128,block_size=64",
                   help="GPT config for the pp rows (default: the 8-layer example GPT)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--small", type=int, default=1, help="sequences per microbatch, overhead-bound")
    p.add_argument("--large", type=int, default=8, help="sequences per microbatch, compute-bound")
    p.add_argument("--tp-layers", type=int, default=4)
    p.add_argument("--tp-hidden", type=int, default=256)
    p.add_argument("--tp-batch", type=int, default=8)
    p.add_argument("--tp-seq", type=int, default=128)
    p.add_argument("--memory-budget", default="16GB",
                   help="parallelize's memory_budget for the pp rows: one the compute-only cut "
                        "fits, so the cut is compute-optimal (whole blocks, as torch's stages)")
    p.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                   help="skip the torch pipelining + torch.compile'd blocks column")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", action="store_true")
    opts = vars(p.parse_args(argv))
    results = run(opts)
    print(json.dumps(results, indent=1) if opts["json"] else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
