"""autopart's command line.

Each subcommand is one ``_add_<name>_command(subparsers)`` function that registers its parser
and sets ``run`` to the function carrying it out; list it in ``COMMANDS``. ``run(args)`` returns
the exit code. User errors (``ValueError``, which includes ``ScheduleError``) print one line to
stderr and exit 2, like argparse's own errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

from autopart.cli.compile import add_compile_command
from autopart.cli.export import add_export_command
from autopart.cli.plan import add_calibrate_command, add_plan_command
from autopart.schedule import SCHEDULES, Schedule, SimResult, make_schedule, simulate
from autopart.cli.verify import add_verify_command


def _add_schedule_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "schedule",
        help="print a pipeline schedule and its simulated bubble",
        description="Print each pipeline rank's action list, then the simulated makespan, bubble "
        "and peak in-flight microbatches. Costs are per model chunk and microbatch.",
    )
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel ranks")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    parser.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (default 1)")
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="default: 1f1b, or interleaved-1f1b when --virtual-stages > 1",
    )
    parser.add_argument("--forward-cost", type=float, default=1.0, help="one chunk's forward (default 1)")
    parser.add_argument("--backward-cost", type=float, default=None,
                        help="one chunk's full backward B = I + W (default 2, or the sum of the next two)")
    parser.add_argument("--input-grad-cost", type=float, default=None,
                        help="one chunk's input-gradient half I (default: half the backward)")
    parser.add_argument("--weight-grad-cost", type=float, default=None,
                        help="one chunk's weight-gradient half W (default: the rest of the backward)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--png", metavar="FILE", help="also draw the simulated timeline into this PNG file")
    parser.set_defaults(run=_run_schedule)


def _run_schedule(args: argparse.Namespace) -> int:
    name = args.schedule or ("interleaved-1f1b" if args.virtual_stages > 1 else "1f1b")
    schedule = make_schedule(name, args.pp, args.microbatches, args.virtual_stages)
    result = simulate(schedule, args.forward_cost, args.backward_cost,
                      input_grad_cost=args.input_grad_cost, weight_grad_cost=args.weight_grad_cost)
    costs = _unit_costs(result)
    if args.png:
        from autopart.cli.timeline import draw_simulated
        draw_simulated(schedule, result, args.png)
    if args.json:
        report = schedule.to_dict() | {
            "forward_cost": args.forward_cost,
            "backward_cost": costs["B"],
            "makespan": result.makespan,
            "ideal": result.ideal,
            "bubble": result.bubble,
            "peak_in_flight": list(result.peak_in_flight),
            "input_grad_cost": costs["I"],
            "weight_grad_cost": costs["W"],
            "chunk_ranks": list(schedule.chunk_ranks),
            "peak_awaiting_weight_grad": list(result.peak_awaiting_weight_grad),
        }
        print(json.dumps(report))
    else:
        print(_schedule_report(schedule, result, args.forward_cost, costs))
    return 0


def _unit_costs(result: SimResult) -> dict[str, float]:
    """Chunk 0's B, I and W cost as simulated (they follow from whichever flags were given)."""
    costs = {"B": None, "I": None, "W": None}
    for rows in result.timeline:
        for action, start, end in rows:
            if action.kind.value in costs and action.chunk == 0:
                costs[action.kind.value] = end - start
    if costs["B"] is None and costs["I"] is not None:
        costs["B"] = costs["I"] + costs["W"]
    if costs["I"] is None:
        costs["I"] = costs["W"] = costs["B"] / 2
    return costs


def _schedule_report(schedule: Schedule, result: SimResult, forward_cost: float, costs: dict) -> str:
    peaks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(result.peak_in_flight))
    split = any(a.kind.value == "I" for rank in schedule.ranks for a in rank)
    backward = (f"input-grad {costs['I']:g}, weight-grad {costs['W']:g}" if split
                else f"backward {costs['B']:g}")
    lines = [
        f"{schedule.name}: pp={schedule.pp}, microbatches={schedule.microbatches}, "
        f"virtual_stages={schedule.virtual_stages} ({schedule.placement})",
        "",
        schedule.grid(),
        "",
        f"makespan        {result.makespan:g} (ideal {result.ideal:g}; forward {forward_cost:g}, "
        f"{backward} per chunk)",
        f"bubble          {result.bubble:.4g} = (makespan - ideal) / ideal",
        f"peak in flight  {peaks} (microbatch-chunks)",
    ]
    if schedule.virtual_stages > 1:
        stages = ", ".join(f"{a:g}" for a in result.peak_activations)
        lines.append(f"                = {stages} full stages of activations")
    if split:
        awaiting = ", ".join(f"rank {r}: {n}" for r, n in enumerate(result.peak_awaiting_weight_grad))
        lines.append(f"awaiting W      {awaiting} (past I: only what W reads is kept)")
    return "\n".join(lines)


def _add_trace_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="draw a measured pipeline trace (Chrome/Perfetto JSON) as a timeline picture",
        description="Read a Chrome/Perfetto trace of pipeline actions (complete events with pid = rank and "
        "args chunk, microbatch, kind) and draw one row per rank.",
    )
    parser.add_argument("file", help="the trace JSON file")
    parser.add_argument("--png", metavar="OUT", required=True, help="the PNG file to write")
    parser.set_defaults(run=_run_trace)


def _run_trace(args: argparse.Namespace) -> int:
    from autopart.cli.timeline import draw_trace, load_trace, trace_slices, trace_steps

    trace = load_trace(args.file)
    draw_trace(trace, args.png)
    slices = trace_slices(trace)
    ranks = len({s.rank for s in slices})
    steps = trace_steps(trace)
    over = f"{steps} step{'s' * (steps != 1)}, " if steps else ""
    print(f"{args.png}: {len(slices)} actions on {ranks} ranks over {over}"
          f"{max(s.end for s in slices):.4g} ms")
    return 0


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_schedule_command, add_compile_command, add_verify_command, add_export_command,
    _add_trace_command, add_plan_command, add_calibrate_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopart", description="Compile a plain PyTorch model for distributed training.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def run() -> None:
    """The ``autopart`` console script (and ``python -m autopart``): main(), then exit_now()."""
    exit_now(main())


def exit_now(code: int) -> None:
    """Flush, run the exit handlers (atexit), and end the process without the interpreter's
    teardown: finalizing the modules of a process that imported torch and ran torch.export (and
    a last garbage collection over its ~300k objects) took 1.5-3 s here, a sixth of a whole
    `autopart plan` for megatron-1t, and leaves nothing a command needs undone."""
    import atexit
    _flush()
    atexit._run_exitfuncs()
    _flush()
    os._exit(0 if code is None else int(code))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):     # the reader left, or the stream is closed
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autopart`` command line; returns the exit code.

    >>> main(["schedule", "--pp", "2", "--microbatches", "1", "--json"])  # doctest: +ELLIPSIS
    {"name": "1f1b", "pp": 2, "microbatches": 1, "virtual_stages": 1, "ranks": [["0F0", ...
    0
    """
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:     # `autopart schedule ... | head`: the reader left, nothing wrong
        sys.stdout = open(os.devnull, "w")
        return 0
    except ValueError as error:  # bad user input, ScheduleError included; not worth a traceback
        print(f"autopart {args.command}: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
