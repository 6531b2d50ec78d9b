"""`autopart verify FILE.py:NAME --mesh tp=2,pp=2`: rehearse a layout before a cluster run.

    autopart verify examples/gpt.py:GPT --config tiny --mesh tp=2,pp=2 --schedule zb-v
    autopart verify examples/switch.py:SwitchGPT --config tiny --mesh dp=2,ep=2 --optimizer adam
    autopart verify examples/gpt.py:GPT --config gpt3-175b --mesh tp=2,pp=2 --shrink --json

Starts the mesh as local Gloo processes (at most 8), and on every rank trains --steps steps of
the compiled layout and of the plain model (a copy taken before parallelize) on the same random
batch of token ids (with --local-batches each rank's layout is given only its share of it,
pm.local_batch; the plain model the whole batch), then prints each step's loss (parallel,
plain) and, per parameter group, the largest difference, PASS/FAIL against the tolerance and
the first parameter that differs. Exit 0: everything matches; 1: something differs; 2: bad
input. The model, config and layout flags are `autopart compile`'s (autopart/cli/compile.py);
autopart/verification.py does the comparing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn as nn

from autopart.cli.compile import (META_THRESHOLD, _build, _load, _UsageError, add_layout_arguments,
                                  layout)
from autopart.errors import AutopartError
from autopart.schedule import ScheduleError
from autopart import rehearsal_config as RC
from autopart import verification as V
from autopart.cli.parsers import documented_parser

BATCH_SEED = 1234
# bytes per parameter in one rank process, at most: the plain copy's weights and gradients (8) and
# the layout's share of them (8, all of it on one rank at worst), plus Adam's two moments for each
BYTES_PER_PARAM = {"sgd": 16, "adam": 32}
PERTURB_ENV = "AUTOPART_VERIFY_PERTURB"   # tests only: a plain parameter to nudge (must FAIL)
WRONG_SHARE_ENV = "AUTOPART_VERIFY_WRONG_SHARE"   # tests only: a rank fed another replica's rows


def add_verify_command(subparsers) -> argparse.ArgumentParser:
    """Register `verify` on an argparse subparsers object; `args.run(args)` carries it out."""
    p = documented_parser(subparsers, "verify", "train a layout and the plain model side by "
                          "side on local processes and compare them (a rehearsal before a "
                          "cluster run)", __doc__, more="\n\n" + __doc__.split("\n\n")[2])
    add_layout_arguments(p)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to train (default 3)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"),
                   help="sgd (lr 0.1) or adam (lr 1e-3) on both sides (default sgd)")
    p.add_argument("--tolerance", default=None, metavar="RTOL,ATOL",
                   help="pass when |parallel - plain| <= ATOL + RTOL * |plain| (one number: both); "
                        "default 1e-5,1e-6 for sgd and 1e-5,1e-5 for adam (fp32 round-off of "
                        "another summation order); non-finite values always fail")
    p.add_argument("--shrink", action="store_true",
                   help="scale width and depth down to fit this machine, keeping the layout's "
                        "structure (heads and k/v heads divisible by tp, layers >= pp * "
                        "virtual stages, experts divisible by ep, vocabulary divisible by tp)")
    p.add_argument("--local-batches", action="store_true",
                   help="give each rank's train_step only its share of the batch (pm.local_batch: "
                        "its rows, its cp chunks, None for what it does not read), as a data "
                        "loader feeding each rank would; the plain model trains on the whole batch")
    p.add_argument("--timeout", type=float, default=V.SPAWN_TIMEOUT, metavar="SECONDS",
                   help=f"the whole run's limit; ranks still running are killed "
                        f"(default {V.SPAWN_TIMEOUT:.0f})")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(run=run_verify)
    return p


def run_verify(args: argparse.Namespace) -> int:
    """Run `autopart verify`; 0 when the layout matches the plain model, 1 when it differs, 2 on
    bad input (one line on stderr). Under --json stdout carries the JSON alone."""
    if not args.json:
        return _run(args)[0]
    with _stdout_to_stderr():       # the user's model may print while it is built or captured
        code, report = _run(args)
    if report is not None:
        print(json.dumps(report, indent=1))
    return code


@contextmanager
def _stdout_to_stderr():
    """Send whatever is written to stdout meanwhile, by this process (Python or C), or by the
    rank processes it starts (they inherit file descriptor 1), to stderr; restore it after."""
    sys.stdout.flush()
    saved, python = os.dup(1), sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout = python


def _run(args: argparse.Namespace) -> tuple[int, dict | None]:
    """run_verify's work: (exit code, the JSON report under --json when there is one)."""
    try:
        job = _job(args)
        mesh = job["mesh"]
        prepared = _prepare(job)        # in this process first: user errors before any spawn
        _compile(prepared, job)
    except (AutopartError, ScheduleError, _UsageError) as e:
        print(f"autopart verify: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2, None
    notes = prepared["notes"]
    if not args.json:
        print(f"autopart verify {args.target}" + (f" --config {args.config}" if args.config else "")
              + f": {mesh}, as local processes; schedule "
              f"{job['parallel']['schedule']}, microbatches {job['parallel']['microbatches']}, "
              f"batch {job['batch']}")
        print(f"model: {prepared['n_params']:,} parameters; {args.steps} steps of "
              f"{args.optimizer} (lr {V.LEARNING_RATE[args.optimizer]:g}) on one random batch "
              f"(seed {BATCH_SEED}), layout and plain model on every rank"
              + (", each rank's layout given only its share of it (--local-batches)"
                 if args.local_batches else ""))
        for note in notes:
            print(note)
        sys.stdout.flush()
    from autopart.runtime.launch import spawn
    start = time.perf_counter()
    try:
        per_rank = spawn(_rank, mesh.world_size, job, timeout=args.timeout,
                         pg_timeout=V.PG_TIMEOUT)
    except RuntimeError as e:
        text = str(e)
        user = _user_error_in(text)
        if user is not None:            # a compile-time error every rank raised: bad input
            print(f"autopart verify: error: {user}", file=sys.stderr)
            return 2, None
        print(f"autopart verify: the run failed:\n{text}", file=sys.stderr)
        return 1, None
    report = V.merge(per_rank, mesh=mesh, steps=args.steps, optimizer=args.optimizer,
                     tolerance=job["tolerance"], notes=notes,
                     seconds=time.perf_counter() - start)
    if args.json:
        out = report.to_dict()
        out.update({"model": args.target, "config": args.config, "parameters":
                    prepared["n_params"], "shrunk": prepared["shrunk"], "batch": job["batch"],
                    "schedule": job["parallel"]["schedule"],
                    "microbatches": job["parallel"]["microbatches"]})
        return (0 if report.ok else 1), out
    print("\n".join([n for n in report.notes if n not in notes] + report.lines(notes=False)))
    return (0 if report.ok else 1), None


def _compile(prepared: dict, job: dict) -> None:
    """Compile the layout once here (one process, no group), so that a layout the model cannot
    take (heads not divisible by tp, a schedule needing virtual stages, ...) is a one-line
    error before any rank starts."""
    import warnings
    from autopart.compiler import compile as autopart_compile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the ranks compile again; warnings are theirs to give
        autopart_compile(prepared["model"], job["mesh"], prepared["inputs"],
                         loss_fn=prepared["loss_fn"], target=prepared["target"],
                         optimizer=job["optimizer"], **job["parallel"])


def _user_error_in(text: str) -> str | None:
    """The AutopartError a rank raised at compile time (the same on every rank), if that is
    what failed the run."""
    import re
    found = re.search(r"\b(?:AutopartError|ScheduleError): (.*)", text)
    return found.group(1) if found else None


def _tolerance(text: str | None, optimizer: str):
    if text is None:
        return None
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise _UsageError(f"--tolerance {text!r}: write RTOL,ATOL (e.g. 1e-5,1e-6) or one "
                          f"number for both") from None
    if len(parts) not in (1, 2) or any(not (x >= 0) for x in parts):
        raise _UsageError(f"--tolerance {text!r}: write RTOL,ATOL, two numbers >= 0 "
                          f"(e.g. 1e-5,1e-6), or one number for both")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def _wrong_share(args: argparse.Namespace) -> int | None:
    """The rank AUTOPART_VERIFY_WRONG_SHARE names (tests only): with --local-batches it is fed
    another data-parallel replica's rows, so the run must FAIL."""
    rank = os.environ.get(WRONG_SHARE_ENV)
    if not rank:
        return None
    if not args.local_batches:
        raise _UsageError(f"{WRONG_SHARE_ENV} feeds a rank a wrong share: add --local-batches")
    return int(rank)


def _job(args: argparse.Namespace) -> dict:
    """Everything a rank needs to rebuild the same model and batch (picklable: the model file is
    loaded again in each rank process)."""
    mesh, microbatches, schedule, batch = layout(args)
    if args.steps < 1:
        raise _UsageError(f"--steps {args.steps} must be at least 1")
    if args.precision != "fp32":
        raise _UsageError("--precision bf16: verify compares with the fp32 plain model "
                          "elementwise, and bf16 differs from it by ~4e-3 by design; the layout "
                          "is the same in fp32: rehearse it with --precision fp32")
    if not args.timeout > 0:
        raise _UsageError(f"--timeout {args.timeout} must be positive")
    V.check_mesh(mesh)
    tolerance = _tolerance(args.tolerance, args.optimizer)
    return {"target": args.target, "config": args.config, "shrink": args.shrink,
            "batch": batch, "loss_fn": args.loss_fn, "mesh": mesh, "steps": args.steps,
            "optimizer": args.optimizer, "tolerance": tolerance,
            "virtual_stages": args.virtual_stages,
            "perturb": os.environ.get(PERTURB_ENV) or None,
            "local_batches": args.local_batches, "wrong_share": _wrong_share(args),
            "parallel": dict(microbatches=microbatches, schedule=schedule,
                             virtual_stages=args.virtual_stages,
                             sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                             memory_budget=args.memory_budget, zero=args.zero)}


def _prepare(job: dict, check_memory: bool = True) -> dict:
    """The model (seeded: the same in every process), the random batch, the loss, and notes on
    what was changed for the rehearsal. `check_memory`: refuse a model too large for the ranks
    (done once, by the calling process, before the ranks start)."""
    module, name = _load(job["target"])
    cfg = None
    changes: dict = {}

    def adjust(config):
        nonlocal cfg, changes
        if config is None or isinstance(config, str):
            if job["shrink"]:
                raise _UsageError(f"--shrink: {name} is built from {config!r}, not a config "
                                  f"object with fields to scale; give the file a config(spec) "
                                  f"function returning a dataclass or Hugging Face config")
            return config
        changes = RC.config_changes(config, job["mesh"], job["virtual_stages"], job["shrink"])
        cfg = RC.apply_changes(config, changes) if changes else config
        return cfg

    # count on the meta device first: a model too large for this machine is refused before
    # anything is allocated
    counted = _build(module, name, job["config"], job["batch"], True, job["loss_fn"],
                     adjust=adjust) if check_memory else None
    world = job["mesh"].world_size
    need = counted.n_params * (BYTES_PER_PARAM[job["optimizer"]] * world + 4) if counted else 0
    available = _available_memory() if counted else None
    # at most half of what is available: the machine is shared, and estimates are estimates
    if counted and (counted.n_params > META_THRESHOLD
                    or (available is not None and need > available / 2)):
        raise _UsageError(
            f"{counted.n_params / 1e6:,.0f}M parameters need about {need / 2**30:.1f} GiB in "
            f"{world} rank processes (the plain model and the layout in each), more than this "
            f"machine can spare" + (f" (half its {available / 2**30:.1f} GiB available)"
                                   if available else "")
            + ": add --shrink")
    torch.manual_seed(0)
    built = _build(module, name, job["config"], job["batch"], False, job["loss_fn"],
                   adjust=adjust)
    model = built.model
    vocab = _vocab(cfg if cfg is not None else getattr(model, "config", None), model)
    g = torch.Generator().manual_seed(BATCH_SEED)
    inputs = tuple(_randomize(t, vocab, g) for t in built.inputs)
    target = _randomize(built.target, vocab, g) if built.target is not None else None
    notes = []
    shrunk = {k: new for k, (old, new) in changes.items() if k not in _dropout_fields(changes)}
    if shrunk:
        notes.append(f"shrunk (--shrink): {RC.describe_changes({k: changes[k] for k in shrunk})}"
                     f" -> {built.n_params:,} parameters")
    dropped = _dropout_fields(changes)
    if dropped:
        notes.append(f"dropout set to 0 (random masks differ between layouts): "
                     f"{RC.describe_changes({k: changes[k] for k in dropped})}")
    return {"model": model, "inputs": inputs, "target": target, "loss_fn": built.loss_fn,
            "n_params": built.n_params, "notes": notes,
            "shrunk": {k: changes[k][1] for k in shrunk} if shrunk else None}


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _dropout_fields(changes: dict) -> list[str]:
    return [k for k in changes if RC.DROPOUT.search(k)]


def _vocab(cfg, model: nn.Module) -> int | None:
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int):
        return v
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else None


def _randomize(t, vocab: int | None, g: torch.Generator):
    """A random tensor like `t`: token ids in [0, vocab) for integer tensors, N(0, 1) for floats."""
    if not isinstance(t, torch.Tensor) or t.dtype == torch.bool:
        return t
    if t.is_floating_point():
        return torch.randn(t.shape, generator=g, dtype=t.dtype)
    if vocab is None:
        return t
    return torch.randint(0, vocab, t.shape, generator=g, dtype=t.dtype)


def _rank(rank: int, world: int, job: dict) -> dict:
    """Rank function for `spawn`: rebuild the model and batch, then verify_rank."""
    import warnings
    warnings.filterwarnings("ignore")       # each rank would repeat the compile's warnings
    prepared = _prepare(job, check_memory=False)
    return V.verify_rank(prepared["model"], job["mesh"], prepared["inputs"],
                         loss_fn=prepared["loss_fn"], target=prepared["target"],
                         steps=job["steps"], optimizer=job["optimizer"],
                         tolerance=job["tolerance"], perturb=job["perturb"],
                         local_batches=job["local_batches"], wrong_share=job["wrong_share"],
                         timeout=V.PG_TIMEOUT, **job["parallel"])
