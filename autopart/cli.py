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

from autopart.compile_cli import add_compile_command
from autopart.export_cli import add_export_command
from autopart.schedule import SCHEDULES, Schedule, SimResult, make_schedule, simulate


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
    parser.add_argument("--backward-cost", type=float, default=2.0, help="one chunk's backward (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.set_defaults(run=_run_schedule)


def _run_schedule(args: argparse.Namespace) -> int:
    name = args.schedule or ("interleaved-1f1b" if args.virtual_stages > 1 else "1f1b")
    schedule = make_schedule(name, args.pp, args.microbatches, args.virtual_stages)
    result = simulate(schedule, args.forward_cost, args.backward_cost)
    if args.json:
        report = schedule.to_dict() | {
            "forward_cost": args.forward_cost,
            "backward_cost": args.backward_cost,
            "makespan": result.makespan,
            "ideal": result.ideal,
            "bubble": result.bubble,
            "peak_in_flight": list(result.peak_in_flight),
        }
        print(json.dumps(report))
    else:
        print(_schedule_report(schedule, result, args.forward_cost, args.backward_cost))
    return 0


def _schedule_report(schedule: Schedule, result: SimResult, forward_cost: float, backward_cost: float) -> str:
    peaks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(result.peak_in_flight))
    lines = [
        f"{schedule.name}: pp={schedule.pp}, microbatches={schedule.microbatches}, "
        f"virtual_stages={schedule.virtual_stages} (chunk k on rank k % {schedule.pp})",
        "",
        schedule.grid(),
        "",
        f"makespan        {result.makespan:g} (ideal {result.ideal:g}; forward {forward_cost:g}, "
        f"backward {backward_cost:g} per chunk)",
        f"bubble          {result.bubble:.4g} = (makespan - ideal) / ideal",
        f"peak in flight  {peaks} (microbatch-chunks)",
    ]
    if schedule.virtual_stages > 1:
        stages = ", ".join(f"{a:g}" for a in result.peak_activations)
        lines.append(f"                = {stages} full stages of activations")
    return "\n".join(lines)


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_schedule_command, add_compile_command, add_export_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopart", description="Compile a plain PyTorch model for distributed training.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


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
