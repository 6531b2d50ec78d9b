"""Pictures of pipeline timelines: one row per rank, time left to right.

Two sources, one drawing: a simulated run (:func:`autopart.schedule.simulate`'s ``timeline``) and a
measured one, a Chrome / Perfetto trace (``{"traceEvents": [...]}``, complete events ``"ph": "X"``
with ``ts`` / ``dur`` in microseconds, ``pid`` the global rank, ``args`` holding ``chunk``,
``microbatch`` and ``kind``: F, B, I, W or SEND_F / RECV_F / SEND_B / RECV_B; REDUCE events, the
gradient all-reduces autopart's traces hold beside the actions, are left out). Forward, fused
backward, input gradient, weight gradient and transfers get their own colours; whatever a row
leaves uncovered is idle time and shows in the idle colour, so the bubble is visible. Each box
holds its microbatch number; a rank's later chunks are drawn lighter.

    >>> from autopart.schedule import make_schedule, simulate
    >>> s = make_schedule("zb-v", pp=4, microbatches=8, virtual_stages=2)
    >>> draw_simulated(s, simulate(s), "zb-v.png")  # doctest: +SKIP

matplotlib is imported only when drawing, through its object-oriented API and the Agg canvas,
so it never changes the caller's pyplot backend.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["Slice", "draw_simulated", "draw_trace", "load_trace", "simulated_slices", "trace_slices",
           "trace_steps", "trace_title"]

COLORS = {
    "F": "#4C72B0",
    "B": "#8172B2",
    "I": "#DD8452",
    "W": "#55A868",
    "transfer": "#7F7F7F",
    "idle": "#F4CCCC",
}
LEGEND = {
    "F": "forward (F)",
    "B": "backward (B = I + W)",
    "I": "input grad (I)",
    "W": "weight grad (W)",
    "transfer": "transfer",
    "idle": "idle (bubble)",
}
COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SKIPPED_KINDS = ("REDUCE",)  # gradient all-reduces: read, not drawn (see _is_reduction)


@dataclass(frozen=True)
class Slice:
    """One box: ``kind`` is F, B, I, W or a SEND_*/RECV_* kind; ``shade`` 0 for a rank's first
    chunk, 1 for its second, ..."""

    rank: int
    start: float
    end: float
    kind: str
    chunk: int
    microbatch: int
    shade: int = 0


def simulated_slices(schedule, result) -> list[Slice]:
    """The boxes of a simulated run; transfers only where a message takes time."""
    slices = []
    for rank, rows in enumerate(result.timeline):
        local = sorted({a.chunk for a, _, _ in rows})
        for action, start, end in rows:
            if not action.kind.is_compute and end <= start:
                continue
            slices.append(Slice(rank, start, end, action.kind.value, action.chunk, action.microbatch,
                                local.index(action.chunk)))
    return slices


def draw_simulated(schedule, result, path: str | Path, *, title: str | None = None,
                   xlabel: str = "time (cost units)") -> Path:
    """Draw ``result`` (from ``simulate(schedule, ...)``) into the PNG file ``path``; ``xlabel``
    names the unit of the costs simulated (seconds, when a cost model gave them)."""
    if not result.timeline:
        raise ValueError("this SimResult has no timeline; simulate the schedule with autopart.schedule.simulate")
    title = title or (
        f"{schedule.name}: pp={schedule.pp}, microbatches={schedule.microbatches}, "
        f"virtual_stages={schedule.virtual_stages}; simulated bubble {result.bubble:.1%} "
        f"(makespan {result.makespan:g}, ideal {result.ideal:g})"
    )
    return _draw(simulated_slices(schedule, result), schedule.pp, result.makespan, title, xlabel, path)


def load_trace(path: str | Path) -> dict:
    """Read and check a Chrome / Perfetto trace file; raises ValueError naming what is wrong."""
    try:
        trace = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read trace {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"trace {path} is not JSON: {error.msg} at line {error.lineno}") from None
    trace_slices(trace)  # raises on a malformed event
    return trace


def trace_slices(trace: dict) -> list[Slice]:
    """The boxes of a measured trace, times in milliseconds from its first event."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError('a trace is a JSON object with a "traceEvents" list')
    complete = [(n, e) for n, e in enumerate(events) if isinstance(e, dict) and e.get("ph") == "X"
                and not _is_reduction(e)]
    if not complete:
        raise ValueError('the trace has no complete events ("ph": "X") to draw')
    rows = _rows_by_rank([_event_row(n, e) for n, e in complete], events)
    origin = min(ts for _, ts, _, _ in rows)
    local = {}
    for rank, _, _, args in rows:
        local.setdefault(rank, set()).add(args[1])
    order = {rank: sorted(chunks) for rank, chunks in local.items()}
    return [
        Slice(rank, (ts - origin) / 1e3, (ts + dur - origin) / 1e3, kind, chunk, mb, order[rank].index(chunk))
        for rank, ts, dur, (kind, chunk, mb) in rows
    ]


def _is_reduction(event: dict) -> bool:
    """A gradient bucket's all-reduce (autopart/runtime/trace.py): it overlaps the rank's
    actions on a row of its own, so the one-row-per-rank drawing leaves it out."""
    args = event.get("args")
    return isinstance(args, dict) and args.get("kind") in SKIPPED_KINDS


def _rows_by_rank(rows: list, events: list) -> list:
    """Give each event its rank: ``pid`` when the pids are 0..n-1 (autopart's own traces); else the
    rank a ``process_name`` metadata event names ("rank 3"); else the pids' order. A profiler's
    trace carries OS process ids (31338): taken as ranks they would draw 31,339 rows."""
    pids = sorted({pid for pid, *_ in rows})
    if pids == list(range(len(pids))):
        return rows
    named = {e.get("pid"): _rank_in_name(e) for e in events
             if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "process_name"}
    to_rank = {pid: named.get(pid) for pid in pids}
    if sorted(r for r in to_rank.values() if r is not None) != list(range(len(pids))):
        to_rank = {pid: n for n, pid in enumerate(pids)}   # the pids' order stands for the ranks'
    return [(to_rank[pid], *rest) for pid, *rest in rows]


def _rank_in_name(event: dict) -> int | None:
    match = re.fullmatch(r"\s*(?:rank|Rank|RANK)\s*[:#]?\s*(\d+)\s*", str((event.get("args") or {}).get("name", "")))
    return int(match.group(1)) if match else None


def draw_trace(trace: dict, path: str | Path, *, title: str | None = None) -> Path:
    """Draw a measured trace (from :func:`load_trace`) into the PNG file ``path``."""
    slices = trace_slices(trace)
    ranks = max(s.rank for s in slices) + 1
    span = max(s.end for s in slices)
    return _draw(slices, ranks, span, title or trace_title(trace), "time (ms)", path)


def trace_title(trace: dict) -> str:
    """'measured: 4 ranks, 3 steps in 321 ms (107 ms a step), busiest rank idle 12.0%': a trace
    holds every step so far (runtime/trace.py), so its span is theirs together."""
    slices = trace_slices(trace)
    ranks = max(s.rank for s in slices) + 1
    span = max(s.end for s in slices)
    busy = [sum(s.end - s.start for s in slices if s.rank == r and s.kind in COMPUTE_KINDS) for r in range(ranks)]
    idle = 1 - max(busy) / span if span > 0 else 0.0
    steps = trace_steps(trace)
    timing = (f"{_ms(span)} ms" if steps is None else f"one step, {_ms(span)} ms" if steps == 1
              else f"{steps} steps in {_ms(span)} ms ({_ms(span / steps)} ms a step)")
    return f"measured: {ranks} ranks, {timing}, busiest rank idle {idle:.1%}"


def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"     # 1508, not 1.51e+03


def trace_steps(trace: dict) -> int | None:
    """How many train_steps the trace's drawn events span (args.step, which autopart's traces
    carry); None when they do not say."""
    steps = {e["args"].get("step") for e in trace["traceEvents"] if isinstance(e, dict)
             and e.get("ph") == "X" and isinstance(e.get("args"), dict) and not _is_reduction(e)}
    return None if None in steps or not steps else len(steps)


def _event_row(n: int, event: dict) -> tuple[int, float, float, tuple[str, int, int]]:
    args = event.get("args") or {}
    try:
        rank, ts, dur = int(event["pid"]), float(event["ts"]), float(event["dur"])
        kind, chunk, mb = str(args["kind"]), int(args["chunk"]), int(args["microbatch"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"trace event #{n} ({event.get('name', '?')}) needs pid, ts, dur and args.kind / chunk / "
            f"microbatch: {error!r} in {json.dumps(event)[:120]}"
        ) from None
    if kind not in COMPUTE_KINDS + COMM_KINDS:
        raise ValueError(f"trace event #{n} has kind {kind!r}; one of {', '.join(COMPUTE_KINDS + COMM_KINDS)}")
    if rank < 0 or dur < 0 or not math.isfinite(ts + dur):
        raise ValueError(f"trace event #{n} has pid {rank}, ts {ts}, dur {dur}: need pid >= 0 and finite dur >= 0")
    return rank, ts, dur, (kind, chunk, mb)


def _color(kind: str, shade: int) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    base = to_rgb(COLORS[kind if kind in COMPUTE_KINDS else "transfer"])
    mix = min(0.45 * shade, 0.7)  # a rank's later chunks lighter, towards white
    return tuple(c + (1 - c) * mix for c in base)


def _draw(slices: Sequence[Slice], ranks: int, span: float, title: str, xlabel: str, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    width = min(max(6.0, 2.0 + 0.22 * span * _boxes_per_unit(slices, span)), 26.0)
    figure = Figure(figsize=(width, 1.4 + 0.45 * ranks), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.barh(range(ranks), [span] * ranks, left=0, height=0.8, color=COLORS["idle"], zorder=0)
    points_per_unit = (width * 0.8 * 72) / span if span > 0 else 0
    for s in slices:
        axes.barh(s.rank, s.end - s.start, left=s.start, height=0.8, color=_color(s.kind, s.shade),
                  edgecolor="white", linewidth=0.6, zorder=1)
        if s.kind in COMPUTE_KINDS and (s.end - s.start) * points_per_unit >= 6.5 * len(str(s.microbatch)):
            axes.text((s.start + s.end) / 2, s.rank, str(s.microbatch), ha="center", va="center",
                      fontsize=7, color="white" if s.shade == 0 else "black", zorder=2)
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top
    axes.set_xlim(0, span)
    axes.set_xlabel(xlabel)
    axes.set_title(title, fontsize=9)
    kinds = [k for k in COMPUTE_KINDS if any(s.kind == k for s in slices)]
    kinds += ["transfer"] * any(s.kind in COMM_KINDS for s in slices) + ["idle"]
    handles = [Patch(color=COLORS[k], label=LEGEND[k]) for k in kinds]
    if any(s.shade for s in slices):
        handles.append(Patch(color=_color("F", 1), label="lighter: a rank's later chunk"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, 0.3 / (1.4 + 0.45 * ranks), 1, 1))
    path = Path(path)
    figure.savefig(path)
    return path


def _boxes_per_unit(slices: Iterable[Slice], span: float) -> float:
    """Scale the width so the typical compute box is wide enough for its number."""
    lengths = sorted(s.end - s.start for s in slices if s.kind in COMPUTE_KINDS and s.end > s.start)
    return 1.0 / lengths[len(lengths) // 2] if lengths and span > 0 else 1.0
