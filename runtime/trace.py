"""Measured timelines: every action each rank really ran, as one Chrome / Perfetto trace.

`parallelize(..., trace="step.json")` (or AUTOPART_TRACE=step.json on every rank) gives each rank
a Recorder. The executor records each compute (F, B, I, W) from start to end, each send while it
is posted, each receive while the rank waits for its data (zero when the data arrived during
earlier work; the post time is in args.posted_us), and each gradient bucket's all-reduce from
when it was posted to when its wait returned (kind REDUCE, on a second row of the rank: tid 1;
autopart.cli.timeline leaves those out). After every train_step the ranks' events are gathered to
rank 0, which rewrites the one file with every step so far: one process (track) per
global rank, a slice per action named like the schedule's token (`2F0`), with args chunk,
microbatch, kind and step. Times are microseconds from a barrier all ranks passed when the
recorder was made, so ranks on different hosts line up to within that barrier's skew.

Open the file in https://ui.perfetto.dev or chrome://tracing, or draw it:
`autopart.cli.timeline.draw_trace(autopart.cli.timeline.load_trace("step.json"), "step.png")`.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from autopart.runtime.groups import barrier


class Recorder:
    """One rank's trace; `end_step` (collective over the default group) writes the file."""

    def __init__(self, path: str | os.PathLike, rank: int, world: int):
        self.path, self.rank, self.world = Path(path), rank, world
        self.step = 0
        self.pending: list[dict] = []          # this step's events, not yet gathered
        self.written: list[dict] = []          # rank 0: every event gathered so far
        if dist.is_initialized():
            barrier()                          # a common time origin for every rank
        self.origin = time.perf_counter()

    def record(self, action, start: float, end: float, posted: float | None = None) -> None:
        args = {"chunk": action.chunk, "microbatch": action.microbatch, "kind": str(action.kind),
                "step": self.step}
        if posted is not None:
            args["posted_us"] = self._us(posted)
        self.pending.append({"name": str(action), "ph": "X", "pid": self.rank, "tid": 0,
                             "ts": self._us(start),
                             "dur": round(max(end - start, 0.0) * 1e6, 1), "args": args})

    def record_reduction(self, bucket: int, elements: int, posted: float, start: float,
                         end: float) -> None:
        """A gradient bucket's all-reduce (runtime/gradients.py): a slice from when it was posted
        to when its wait returned, on its own row (tid 1) beside the actions; args.wait_us is
        when the rank began waiting for it, args.kind REDUCE."""
        args = {"kind": "REDUCE", "bucket": bucket, "elements": elements, "step": self.step,
                "posted_us": self._us(posted), "wait_us": self._us(start)}
        self.pending.append({"name": f"REDUCE{bucket}", "ph": "X", "pid": self.rank, "tid": 1,
                             "ts": self._us(posted), "dur": round(max(end - posted, 0.0) * 1e6, 1),
                             "args": args})

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 1)

    def end_step(self) -> None:
        """Gather this step's events on rank 0 and rewrite the trace file there."""
        events, self.pending = self.pending, []
        gathered = [None] * self.world if self.rank == 0 else None
        if dist.is_initialized() and self.world > 1:
            dist.gather_object(events, gathered, dst=0)
        else:
            gathered = [events]
        self.step += 1
        if self.rank != 0:
            return
        for part in gathered:
            self.written.extend(part)
        meta = [{"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
                for r in range(self.world)]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + self.written, "displayTimeUnit": "ms"}))
        tmp.replace(self.path)       # a reader never sees half a file


def trace_path(trace: str | os.PathLike | None) -> str | None:
    """The trace file asked for: the argument, else AUTOPART_TRACE, else None."""
    return str(trace) if trace else (os.environ.get("AUTOPART_TRACE") or None)


__all__ = ["Recorder", "trace_path"]
