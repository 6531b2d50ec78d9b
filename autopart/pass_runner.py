"""The pass runner: a literal list of passes, checked for order, each timed, optionally dumped,
failures located.

Each `Pass` declares the `Program` fields it reads (`requires`) and the ones it fills
(`provides`), as torch.fx's PassBase.requires/ensures do. Before anything runs, the runner checks
that every requirement is met by capture or by an earlier pass in the list: a list in the wrong
order is an error naming the pass and what it lacks, not a crash inside a pass. Printing,
dumping and timing live here, around the passes, not inside them.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from autopart.errors import AutopartError
from autopart.ir import Program

# What capture fills: these fields are set before the first pass.
CAPTURED = ("gm", "params", "buffers", "inputs", "symbols", "stats")


@dataclass(frozen=True)
class Pass:
    """One compiler pass: `fn(program, **options) -> (program, report)`."""
    name: str
    fn: Callable[..., tuple[Program, Any]]
    requires: tuple[str, ...]           # Program fields that must be set before it runs
    provides: tuple[str, ...]           # Program fields it sets
    options: dict = field(default_factory=dict)
    after: tuple[str, ...] = ()         # passes that, when in the list, must run before it


@dataclass(frozen=True)
class PassResult:
    name: str
    seconds: float
    report: Any


def check_order(passes: list[Pass]) -> None:
    """Raise unless each pass's requirements are provided by capture or an earlier pass, and
    each pass runs after the passes it must follow."""
    have = set(CAPTURED)
    position = {p.name: i for i, p in enumerate(passes)}
    for i, p in enumerate(passes):
        late = [q for q in p.after if position.get(q, -1) > i]
        if late:
            raise AutopartError(f"pass list out of order: {p.name} (pass {i + 1}) must run after "
                                f"{late}.\n  remedy: move {late} before {p.name}")
        missing = [f for f in p.requires if f not in have]
        if missing:
            providers = {f: [q.name for q in passes if f in q.provides] for f in missing}
            where = "; ".join(f"{f!r} is provided by {', '.join(v) if v else 'no pass in the list'}"
                              for f, v in providers.items())
            raise AutopartError(
                f"pass list out of order: {p.name} (pass {i + 1}) requires {missing}, which no "
                f"earlier pass provides ({where}).\n  remedy: run those passes before {p.name}")
        have.update(p.provides)


def run_passes(program: Program, passes: list[Pass],
               dump_dir: str | os.PathLike | None = None) -> tuple[Program, list[PassResult]]:
    """Check the order, then run `passes`. With `dump_dir` (or AUTOPART_DUMP), every program is
    written before the first pass and after each one."""
    check_order(passes)
    dump_dir = dump_dir or os.environ.get("AUTOPART_DUMP")
    results: list[PassResult] = []
    if dump_dir:
        _dump(program, Path(dump_dir) / "00_captured")
    for i, p in enumerate(passes, 1):
        start = time.perf_counter()
        try:
            program, report = p.fn(program, **p.options)
        except AutopartError as e:
            after = f" (after {results[-1].name})" if results else " (the first pass)"
            raise AutopartError(f"pass {p.name}{after} failed: {e}") from e
        unset = [f for f in p.provides if getattr(program, f) is None]
        if unset:
            raise AutopartError(f"pass {p.name} did not set {unset}, which it declares it provides")
        results.append(PassResult(p.name, time.perf_counter() - start, report))
        if dump_dir:
            _dump(program, Path(dump_dir) / f"{i:02d}_{p.name}")
    return program, results


def _dump(program: Program, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if program.chunks:
        for c in program.chunks:
            (folder / f"rank{c.rank}_chunk{c.chunk}.py").write_text(c.code)
        return
    stages = program.stages
    lines = []
    for node in program.gm.graph.nodes:
        if stages is not None and node.name in stages.chunk_of:
            lines.append(f"{node.format_node()}    # chunk {stages.chunk_of[node.name]}")
        else:
            lines.append(node.format_node())
    (folder / "program.txt").write_text("\n".join(lines) + "\n")
    (folder / "program.py").write_text(program.gm.code)
