"""`autopart compile FILE.py:NAME --mesh dp=2,pp=4`: compile a plain model and show what each rank runs.

    autopart compile examples/gpt.py:GPT --config tiny --mesh pp=2,dp=2 --microbatches 4
    autopart compile examples/gpt.py:GPT --config gpt3-175b --mesh pp=16 --emit out/
    autopart compile examples/gpt.py:GPT --config tiny,n_layer=6 --mesh pp=2 --rank 1

NAME is a model class or a function in FILE.py. A class is built from `--config`: through the
module's `config(spec)` function when it has one (so `gpt3-175b,n_layer=30` names a config and
overrides fields), else from the string itself. A function is called with whichever of `config`,
`batch` and `device` it names, and returns the model, or `(model, inputs)`, or
`(model, inputs, target)`. Without returned inputs, the module's `example_inputs(cfg, batch, device)`
makes them; the module's `lm_loss`, when present, is the loss, with a target shaped like the input.

Models over ~1e9 parameters (or any model with `--meta`) are built on the meta device: nothing is
allocated, and the compile still gives every rank's program, the table and the plan.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from autopart.errors import AutopartError
from autopart.gc_paused import gc_paused
from autopart.mesh import Mesh
from autopart.config import Config, choices
# Loading FILE.py:NAME and building the model, its inputs and loss is library code, shared with
# the planner and `autopart verify` (autopart/model_files.py); the command keeps its short names.
from autopart.model_files import META_THRESHOLD  # noqa: F401  (autopart verify imports it here)
from autopart.model_files import ModelFileError as _UsageError
from autopart.model_files import build as _build
from autopart.model_files import load_target as _load
from autopart.schedule import SCHEDULES, ScheduleError
from autopart.cli.parsers import documented_parser


_DEFAULT = Config()     # the flags' defaults are the API's


def add_compile_command(subparsers) -> argparse.ArgumentParser:
    """Register `compile` on an argparse subparsers object; `args.run(args)` carries it out."""
    p = documented_parser(subparsers, "compile", "compile a plain model into per-rank pipeline "
                          "programs and explain them", __doc__)
    add_layout_arguments(p)
    p.add_argument("--optimizer", default=_DEFAULT.optimizer, choices=choices("optimizer"),
                   help="the optimizer whose state the memory model counts (default adam)")
    p.add_argument("--emit", metavar="DIR", default=None,
                   help="write each distinct rank program to DIR/rank{pp_rank}.py")
    p.add_argument("--rank", type=int, default=None, help="print this global rank's program code")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device (automatic above ~1e9 parameters)")
    p.add_argument("--compile", action="store_true",
                   help="report what parallelize(compile=True) would compile with Inductor: "
                        "each rank's segments and the distinct artifacts its layers share")
    p.set_defaults(run=run_compile)
    return p


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """The model and layout flags `autopart compile` and `autopart verify` share: FILE.py:NAME,
    --config, --mesh, --batch, --microbatches, --schedule, --virtual-stages,
    --sequence-parallel, --recompute, --memory-budget, --precision, --zero, --loss-fn,
    --cp-attention."""
    p.add_argument("target", metavar="FILE.py:NAME",
                   help="a model class or a function returning the model [, inputs [, target]]")
    p.add_argument("--config", default=None,
                   help="config name and/or overrides, e.g. gpt3-175b,n_layer=30")
    p.add_argument("--mesh", default="pp=1", help="parallel sizes, e.g. dp=2,pp=4 or cp=2,tp=2 "
                   "(axes pp, dp, cp, tp, ep; default pp=1)")
    p.add_argument("--cp-attention", default=_DEFAULT.cp_attention, choices=choices("cp_attention"),
                   help="context parallelism's attention (cp > 1): ring (K/V passed peer to "
                        "peer) or allgather (K/V all-gathered); default ring")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch (default: one sequence per microbatch per replica, "
                        "dp * microbatches)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per replica per step (default: pp, which fills the pipeline)")
    p.add_argument("--schedule", default=None, choices=SCHEDULES,
                   help="pipeline schedule (default: 1f1b; interleaved-1f1b when --virtual-stages > 1)")
    p.add_argument("--virtual-stages", type=int, default=_DEFAULT.virtual_stages, help="model chunks per pipeline rank")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="run norms and residuals on sequence shards over the tp axis")
    p.add_argument("--recompute", default=_DEFAULT.recompute, choices=choices("recompute"),
                   help="activation recomputation per layer (auto: cheapest that fits "
                        "--memory-budget)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="bytes per rank, e.g. 20GB or 512MiB (checked; auto chooses under it)")
    p.add_argument("--precision", default=_DEFAULT.precision, choices=choices("precision"),
                   help="bf16: compute, pipeline transfers and tp collectives in bf16, fp32 master "
                        "weights and gradients (default fp32)")
    p.add_argument("--zero", type=int, default=_DEFAULT.zero, choices=choices("zero"),
                   help="1: ZeRO-1, optimizer state and fp32 master slice sharded over dp; 2: "
                        "ZeRO-2, the gradients too; as the memory lines count it (default 0)")
    p.add_argument("--loss-fn", default=None, metavar="NAME",
                   help="a function in FILE.py turning (output, target) into the loss (default: "
                        "the file's lm_loss when it has one; else the model returns its loss)")


@gc_paused
def run_compile(args: argparse.Namespace) -> int:
    """Run `autopart compile` for parsed `args`; returns the exit code (2 on a compile error)."""
    try:
        return _run(args)
    except (AutopartError, ScheduleError, _UsageError) as e:
        hint = ""
        if "pass loss_fn=" in str(e) and args.loss_fn is None:   # the API's remedy, for the CLI
            hint = ("\n  on the command line: --loss-fn NAME, a function in FILE.py taking "
                    "(output, target) (a function named lm_loss is used without the flag)")
        print(f"autopart compile: error: {e}{hint}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from autopart.compiler import compile as autopart_compile

    start = time.perf_counter()
    mesh, microbatches, schedule, batch = layout(args)
    if args.rank is not None:
        mesh.coords(args.rank)        # a rank outside the mesh fails before the slow part
    if args.emit:
        _check_writable(Path(args.emit))    # before the slow part, not after it
    module, name = _load(args.target)
    built = _build(module, name, args.config, batch, args.meta, args.loss_fn)
    compiled = autopart_compile(built.model, mesh, built.inputs, loss_fn=built.loss_fn,
                                target=built.target,
                                config=options(args, microbatches, schedule))
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    files = _emit(compiled, Path(args.emit)) if args.emit else []
    if args.json:
        out = compiled.to_json()
        out.update({"model": args.target, "config": args.config, "parameters": built.n_params,
                    "meta_device": built.meta, "total_seconds": seconds, "peak_rss_bytes": peak})
        if files:
            out["emitted"] = [str(f) for f in files]
        if args.rank is not None:
            out["rank_program"] = {"rank": args.rank, "code": compiled.programs[args.rank].code}
        if args.compile:     # runtime/compiled.py: nothing is compiled here, only counted
            from autopart.runtime.compiled import describe
            out["inductor"] = describe(compiled)
        print(json.dumps(out, indent=1))
        return 0
    if built.meta:
        why = "--meta" if args.meta else f"{built.n_params / 1e9:.1f}B parameters > ~1e9"
        print(f"model built on the meta device ({why}): no weights allocated")
    print(compiled.explain())
    if args.compile:
        from autopart.runtime.compiled import describe_lines
        print("\n".join(describe_lines(compiled)))
    print(f"compile time: {seconds:.2f} s (whole command, model build included); "
          f"peak memory (ru_maxrss): {peak / 2**20:.0f} MiB")
    for f in files:
        print(f"wrote {f}")
    if args.rank is not None:
        c = compiled.programs[args.rank].coords
        print(f"\n# global rank {args.rank} (pp={c['pp']}, dp={c['dp']}, tp={c['tp']})")
        print(compiled.programs[args.rank].code, end="")
    return 0


def layout(args: argparse.Namespace) -> tuple[Mesh, int, str, int]:
    """(mesh, microbatches, schedule, global batch) from the layout flags, defaults filled in."""
    mesh = Mesh.parse(args.mesh)
    if args.microbatches is not None and args.microbatches < 1:
        raise _UsageError(f"--microbatches {args.microbatches} must be at least 1")
    microbatches = args.microbatches if args.microbatches is not None else mesh.pp
    schedule = args.schedule or ("interleaved-1f1b" if args.virtual_stages > 1 else "1f1b")
    batch = args.batch if args.batch is not None else mesh.dp * microbatches
    if batch < 1:
        raise _UsageError(f"--batch {batch} must be positive")
    return mesh, microbatches, schedule, batch


def options(args: argparse.Namespace, microbatches: int, schedule: str) -> Config:
    """The Config the layout flags name (autopart/config.py checks every value)."""
    return Config(microbatches=microbatches, schedule=schedule,
                  virtual_stages=args.virtual_stages, sequence_parallel=args.sequence_parallel,
                  recompute=args.recompute, memory_budget=args.memory_budget,
                  optimizer=getattr(args, "optimizer", _DEFAULT.optimizer),
                  precision=args.precision, zero=args.zero, cp_attention=args.cp_attention)


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _check_writable(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise _UsageError(f"--emit {folder}: exists and is not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".autopart-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise _UsageError(f"--emit {folder}: cannot write there ({e.strerror})") from e


def _emit(compiled, folder: Path) -> list[Path]:
    """One file per distinct program, naming the global ranks that run it. Programs differ only
    by pipeline rank and tensor-parallel rank (data-parallel replicas run the same one), and
    tensor-parallel ranks share their code (they differ in weight shards), so there is one file
    per pipeline rank."""
    folder.mkdir(parents=True, exist_ok=True)
    mesh, plan = compiled.plan.mesh, compiled.plan
    files = []
    for pp in range(mesh.pp):
        prog = compiled.programs[mesh.rank(pp=pp)]
        ranks = [r for r in range(mesh.world_size) if mesh.coords(r)["pp"] == pp]
        head = (f"# autopart: pipeline rank {pp} of {mesh}\n"
                f"# run by global ranks {_ranges(ranks)}"
                + (f" (each tp rank with its own 1/{mesh.tp} weight shards)" if mesh.tp > 1 else "")
                + f"\n# schedule={plan.config.schedule} microbatches={plan.config.microbatches} "
                f"virtual_stages={plan.config.virtual_stages} "
                f"microbatch size={plan.microbatch_size}\n\n")
        (folder / f"rank{pp}.py").write_text(head + prog.code)
        files.append(folder / f"rank{pp}.py")
    return files


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m autopart.cli.compile ...`) until `autopart` wires it in."""
    parser = argparse.ArgumentParser(prog="autopart")
    add_compile_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
