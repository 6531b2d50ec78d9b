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
import importlib.util
import inspect
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autopart.errors import AutopartError
from autopart.gc_paused import gc_paused
from autopart.materialize import meta_device
from autopart.mesh import Mesh
from autopart.schedule import SCHEDULES, ScheduleError

META_THRESHOLD = 1e9     # parameters; above it the model is built on the meta device


class _UsageError(Exception):
    """Bad command-line input (file, name, config): printed without a traceback, exit 2."""


def add_compile_command(subparsers) -> argparse.ArgumentParser:
    """Register `compile` on an argparse subparsers object; `args.run(args)` carries it out."""
    p = subparsers.add_parser(
        "compile", help="compile a plain model into per-rank pipeline programs and explain them",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "\n".join(
            line for line in __doc__.splitlines() if line.startswith("    autopart compile")))
    add_layout_arguments(p)
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd", "sgd-momentum"),
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
    --sequence-parallel, --recompute, --memory-budget, --precision, --zero, --loss-fn."""
    p.add_argument("target", metavar="FILE.py:NAME",
                   help="a model class or a function returning the model [, inputs [, target]]")
    p.add_argument("--config", default=None,
                   help="config name and/or overrides, e.g. gpt3-175b,n_layer=30")
    p.add_argument("--mesh", default="pp=1", help="parallel sizes, e.g. dp=2,pp=4 (default pp=1)")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch (default: one sequence per microbatch per replica, "
                        "dp * microbatches)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per replica per step (default: pp, which fills the pipeline)")
    p.add_argument("--schedule", default=None, choices=SCHEDULES,
                   help="pipeline schedule (default: 1f1b; interleaved-1f1b when --virtual-stages > 1)")
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="run norms and residuals on sequence shards over the tp axis")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full", "auto"),
                   help="activation recomputation per layer (auto: cheapest that fits "
                        "--memory-budget)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="bytes per rank, e.g. 20GB or 512MiB (checked; auto chooses under it)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: compute, pipeline transfers and tp collectives in bf16, fp32 master "
                        "weights and gradients (default fp32)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1),
                   help="1: ZeRO-1, optimizer state and fp32 master slice sharded over dp, as "
                        "the memory lines count it (default 0)")
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
                                target=built.target, microbatches=microbatches,
                                schedule=schedule, virtual_stages=args.virtual_stages,
                                sequence_parallel=args.sequence_parallel,
                                recompute=args.recompute, memory_budget=args.memory_budget,
                                optimizer=args.optimizer, precision=args.precision,
                                zero=args.zero)
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


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _load(target: str):
    """FILE.py:NAME -> (module loaded by path, NAME)."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise _UsageError(f"{target!r}: write FILE.py:NAME, e.g. examples/gpt.py:GPT")
    file = Path(path)
    if not file.is_file():
        raise _UsageError(f"no such file: {file}")
    mod_name = f"_autopart_user_{file.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module     # dataclasses and pickling look the module up here
    sys.path.insert(0, str(file.resolve().parent))   # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001  (the user's file does not run: where, in one line)
        raise _UsageError(f"{file} does not load: {type(e).__name__}: {e}{_where(e, file)}") from e
    finally:
        sys.path.remove(str(file.resolve().parent))
    if not hasattr(module, name):
        found = [k for k, v in vars(module).items() if not k.startswith("_") and callable(v)
                 and getattr(v, "__module__", None) == mod_name]
        raise _UsageError(f"{file} has no {name!r}; it defines {', '.join(found) or 'nothing callable'}")
    return module, name


class _Built:
    def __init__(self, model, inputs, target, loss_fn, meta, n_params):
        self.model, self.inputs, self.target = model, inputs, target
        self.loss_fn, self.meta, self.n_params = loss_fn, meta, n_params


def _where(e: Exception, file: Path) -> str:
    """' (FILE:LINE)' of the deepest frame in the user's file, if the traceback has one."""
    import traceback
    if isinstance(e, SyntaxError):
        return ""            # its message already says the file and line
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if Path(f.filename).resolve() == file.resolve()]
    return f" ({file}:{frames[-1].lineno})" if frames else ""


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


def _build(module, name: str, spec: str | None, batch: int, meta: bool,
           loss_name: str | None = None, adjust=None) -> _Built:
    """Build the model (on meta when asked or when too large), its inputs, target and loss.
    `adjust(config) -> config` (autopart verify's --shrink) changes the config first."""
    with meta_device():               # counting parameters allocates and initializes nothing
        model, cfg, extra = _make(module, name, spec, batch, "meta", adjust)
    n_params = sum(p.numel() for p in _unique_params(model))
    meta = meta or n_params > META_THRESHOLD
    if not meta:
        model, cfg, extra = _make(module, name, spec, batch, "cpu", adjust)
    device = "meta" if meta else "cpu"
    inputs, target = extra if extra is not None else (None, None)
    if inputs is None:
        inputs = _example_inputs(module, model, cfg, batch, device)
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    loss_fn = _loss_fn(module, loss_name)
    if loss_fn is None and target is not None:
        inputs, target = inputs + (target,), None     # model(*inputs, target) returns the loss
    elif loss_fn is not None and target is None and isinstance(inputs[0], torch.Tensor):
        target = torch.zeros_like(inputs[0])        # a target like the input (token ids)
    if target is not None:
        target = target.to(device)
    return _Built(model, inputs, target, loss_fn, meta, n_params)


def _make(module, name: str, spec: str | None, batch: int, device: str, adjust=None):
    """(model, config, (inputs, target) or None) from NAME in `module`; `adjust(config)`, when
    given, changes the config before the model is built (a function's model is rebuilt from
    its adjusted `.config`, as `type(model)(config)`, and its returned inputs are dropped)."""
    obj = getattr(module, name)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        cfg = _config(module, spec)
        if adjust is not None:
            cfg = adjust(cfg)
        try:
            model = obj(cfg) if cfg is not None else obj()
        except Exception as e:   # noqa: BLE001  (a bad config: say which, without a traceback)
            raise _UsageError(f"building {name}({spec or ''}) failed: {type(e).__name__}: {e}") from e
        return model, cfg, None
    if not callable(obj):
        raise _UsageError(f"{name} is a {type(obj).__name__}, not a model class or a function")
    params = inspect.signature(obj).parameters
    kwargs: dict[str, Any] = {}
    if "config" in params and spec is not None:
        kwargs["config"] = spec
    elif spec is not None:
        models = [k for k, v in vars(module).items() if isinstance(v, type)
                  and issubclass(v, nn.Module) and v.__module__ == module.__name__]
        raise _UsageError(f"{name} is a function taking no 'config' argument, so it cannot take "
                          f"--config; NAME must be a model class (nn.Module) or a function "
                          f"returning a model. Model classes in the file: "
                          f"{', '.join(models) or 'none'}")
    if "batch" in params:
        kwargs["batch"] = batch
    if adjust is not None and device != "meta":
        # the function builds the full-size model: look at its config on the meta device (the
        # full model may not fit in memory), and build for real only what the adjusted config says
        with meta_device():
            probe, _, _ = _make(module, name, spec, batch, "meta")
        cfg = getattr(probe, "config", None)
        new = adjust(cfg)
        if new is not cfg:
            return _rebuild(probe, new, device), new, None
        adjust = None
    if "device" in params:
        kwargs["device"] = torch.device(device)
    try:
        out = obj(**kwargs)
    except Exception as e:   # noqa: BLE001
        raise _UsageError(f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed: "
                          f"{type(e).__name__}: {e}") from e
    parts = out if isinstance(out, tuple) else (out,)
    if not parts or not isinstance(parts[0], nn.Module):
        raise _UsageError(f"{name}() must return a model, or (model, inputs[, target]); "
                          f"it returned {type(out).__name__}")
    model = parts[0]
    extra = None
    if len(parts) > 1:
        extra = (parts[1], parts[2] if len(parts) > 2 else None)
    if adjust is not None:           # on meta: the model to count
        cfg = getattr(model, "config", None)
        new = adjust(cfg)
        if new is not cfg:
            model, extra = _rebuild(model, new, device), None
    return model, getattr(model, "config", None), extra


def _rebuild(model: nn.Module, config, device: str) -> nn.Module:
    """`type(model)(config)` on `device`: a function's model built again from an adjusted
    config (its returned inputs, made for the old config, are not used)."""
    try:
        with torch.device(device):
            return type(model)(config)
    except Exception as e:  # noqa: BLE001
        raise _UsageError(f"rebuilding {type(model).__name__} from its changed config failed "
                          f"({type(e).__name__}: {e}); make NAME a model class built from "
                          f"--config") from e


def _config(module, spec: str | None):
    make = getattr(module, "config", None)
    if not callable(make):
        return spec
    try:
        return make(spec) if spec is not None else make()
    except TypeError:
        if spec is None:
            return None          # config() needs an argument: build the class with its defaults
        raise
    except (KeyError, ValueError) as e:
        raise _UsageError(f"--config {spec!r}: {e.args[0] if e.args else e}") from e


def _loss_fn(module, name: str | None):
    """--loss-fn NAME from the file, else the file's lm_loss, else None (the model's output is
    the loss)."""
    if name is None:
        return getattr(module, "lm_loss", None)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise _UsageError(f"--loss-fn {name}: the file has no function {name!r}")
    return fn


def _unique_params(model: nn.Module):
    return list(model.parameters())      # nn.Module.parameters() yields tied weights once


def _example_inputs(module, model, cfg, batch: int, device: str):
    make = getattr(module, "example_inputs", None)
    if callable(make):
        return make(cfg if cfg is not None else getattr(model, "config", None), batch, device)
    seq = _seq_len(getattr(model, "config", cfg))
    if seq is None:
        raise _UsageError(
            "no example inputs: give the module an example_inputs(cfg, batch, device) function, "
            "or make NAME a function returning (model, inputs)")
    return (torch.zeros(batch, seq, dtype=torch.long, device=device),)   # token ids


def _seq_len(cfg) -> int | None:
    for attr in ("block_size", "n_positions", "max_position_embeddings", "seq_len"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int):
            return value
    return None


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
                + f"\n# schedule={plan.schedule} microbatches={plan.microbatches} "
                f"virtual_stages={plan.virtual_stages} microbatch size={plan.microbatch_size}\n\n")
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
    """Standalone entry (`python -m autopart.compile_cli ...`) until `autopart` wires it in."""
    parser = argparse.ArgumentParser(prog="autopart")
    add_compile_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
