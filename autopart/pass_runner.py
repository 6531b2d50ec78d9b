"""The pass runner: a literal list of passes, each timed, optionally dumped, failures located.

Printing, dumping and timing live here, around the passes, not inside them.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from autopart.capture import Program
from autopart.errors import AutopartError


@dataclass(frozen=True)
class PassResult:
    name: str
    seconds: float
    report: Any


PassFn = Callable[..., tuple[Program, Any]]


def run_passes(program: Program, passes: list[tuple[str, PassFn, dict]],
               dump_dir: str | os.PathLike | None = None) -> tuple[Program, list[PassResult]]:
    """Run `passes` in order: each `(name, fn, options)` maps `fn(program, **options)` to
    `(new_program, report)`. With `dump_dir` (or AUTOPART_DUMP), every program is written
    before the first pass and after each one."""
    dump_dir = dump_dir or os.environ.get("AUTOPART_DUMP")
    results: list[PassResult] = []
    if dump_dir:
        _dump(program, Path(dump_dir) / "00_captured")
    for i, (name, fn, options) in enumerate(passes, 1):
        start = time.perf_counter()
        try:
            program, report = fn(program, **options)
        except AutopartError as e:
            after = f" (after {results[-1].name})" if results else " (the first pass)"
            raise AutopartError(f"pass {name}{after} failed: {e}") from e
        results.append(PassResult(name, time.perf_counter() - start, report))
        if dump_dir:
            _dump(program, Path(dump_dir) / f"{i:02d}_{name}")
    return program, results


def _dump(program: Program, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    chunks = program.decisions.get("chunks")
    if chunks:
        for c in chunks:
            (folder / f"rank{c.rank}_chunk{c.chunk}.py").write_text(c.code)
        return
    stages = program.decisions.get("stages")
    lines = []
    for node in program.gm.graph.nodes:
        if stages is not None and node.name in stages.chunk_of:
            lines.append(f"{node.format_node()}    # chunk {stages.chunk_of[node.name]}")
        else:
            lines.append(node.format_node())
    (folder / "program.txt").write_text("\n".join(lines) + "\n")
    (folder / "program.py").write_text(program.gm.code)
