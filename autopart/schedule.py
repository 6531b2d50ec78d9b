"""Pipeline schedules as data.

A schedule is one list of actions per pipeline rank. Model chunk ``k`` (``0 .. pp*v - 1`` in
model order) lives on rank ``k % pp``. Actions print as torch.distributed.pipelining's tokens:
``2F0`` is chunk 2's forward of microbatch 0, ``2B0`` its full backward, ``2SEND_F0`` / ``3RECV_F0``
move that forward's output from chunk 2 to chunk 3, ``3SEND_B0`` / ``2RECV_B0`` move the gradient
back. The runtime posts each maximal run of consecutive send/receive actions on a rank as one
``batch_isend_irecv`` and waits for it, so a schedule is only valid if no rank can block
forever under those (NCCL-like, rendezvous) semantics; :func:`validate` proves that by a dry run.

The generators, validator, simulator and stage partitioner are C++ (``autopart._C``); this module
holds the plain, printable data and the entry points.

>>> s = make_schedule("1f1b", pp=2, microbatches=2)
>>> print(s)
rank 0   | rank 1
---------+---------
0F0      | 1RECV_F0
0SEND_F0 | 1F0
0F1      | 1B0
0SEND_F1 | 1SEND_B0
0RECV_B0 | 1RECV_F1
0B0      | 1F1
0RECV_B1 | 1B1
0B1      | 1SEND_B1
>>> simulate(s).bubble  # (pp-1)/microbatches
0.5
"""

from __future__ import annotations

import enum
import json
import numbers
import operator
import re
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

from autopart import _C

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "balanced_partition",
    "make_schedule",
    "simulate",
    "validate",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


class ScheduleError(ValueError):
    """A schedule that cannot be built, or an action list that is incomplete, misordered or deadlocks."""


class Kind(str, enum.Enum):
    """What an action does. Declaration order is the code shared with the C++ core."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B)


_KINDS = tuple(Kind)
_CODE = {kind: code for code, kind in enumerate(_KINDS)}
_TOKEN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)")


@dataclass(frozen=True, slots=True, repr=False)
class Action:
    """One step of one rank: ``Action(2, Kind.SEND_F, 0)`` prints as ``2SEND_F0``.

    >>> Action.parse("3RECV_B1")
    3RECV_B1
    >>> Action(3, "F", 1).kind is Kind.F
    True
    """

    chunk: int
    kind: Kind
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind.__class__ is not Kind:
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                raise ScheduleError(f"unknown action kind {self.kind!r}; one of {[k.value for k in Kind]}") from None

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind.value}{self.microbatch}"

    __repr__ = __str__

    @classmethod
    def parse(cls, token: str) -> Action:
        """The action a token like ``2SEND_F0`` names."""
        match = _TOKEN.fullmatch(token.strip())
        if match is None:
            raise ScheduleError(f"not an action token: {token!r} (expected e.g. 2F0, 1B3, 2SEND_F0, 3RECV_B1)")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


@dataclass(frozen=True, repr=False)
class Schedule:
    """Per-rank action lists; ``print(schedule)`` shows them as a grid, one column per rank.

    >>> s = Schedule("handmade", pp=1, microbatches=1, virtual_stages=1,
    ...              ranks=((Action.parse("0F0"), Action.parse("0B0")),))
    >>> validate(s)
    >>> s.to_json()
    '{"name": "handmade", "pp": 1, "microbatches": 1, "virtual_stages": 1, "ranks": [["0F0", "0B0"]]}'
    """

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    ranks: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if not (isinstance(self.ranks, tuple) and all(isinstance(r, tuple) for r in self.ranks)):
            object.__setattr__(self, "ranks", tuple(tuple(r) for r in self.ranks))

    @property
    def num_chunks(self) -> int:
        return self.pp * self.virtual_stages

    def grid(self, marks: Iterable[tuple[int, int]] = ()) -> str:
        """The lists side by side, one row per step; ``marks`` = (rank, step) pairs shown ``>>x<<``."""
        return _format_grid(self.ranks, set(marks), range(max(map(len, self.ranks), default=0)))

    def __str__(self) -> str:
        return self.grid()

    def __repr__(self) -> str:
        actions = sum(map(len, self.ranks))
        return (
            f"Schedule(name={self.name!r}, pp={self.pp}, microbatches={self.microbatches}, "
            f"virtual_stages={self.virtual_stages}, ranks=<{len(self.ranks)} lists, {actions} actions>)"
        )

    def to_dict(self) -> dict:
        """A JSON-ready dict; actions as token strings."""
        return {
            "name": self.name,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "ranks": [[str(a) for a in rank] for rank in self.ranks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        ranks = tuple(tuple(Action.parse(t) for t in rank) for rank in data["ranks"])
        return cls(data["name"], data["pp"], data["microbatches"], data["virtual_stages"], ranks)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measures. Times are in the units of the costs given.

    ``bubble`` is (makespan - ideal) / ideal with ``ideal`` the largest total compute time of
    any rank (Narayanan et al.'s t_pb / t_id). ``idle[r]`` is makespan minus rank r's compute
    time. ``peak_in_flight[r]`` counts (chunk, microbatch) forwards whose backward has not run;
    ``peak_activations[r]`` is the same in full-stage units (a chunk holds 1/v of a stage).
    """

    makespan: float
    ideal: float
    bubble: float
    idle: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_activations: tuple[float, ...]


def make_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build and validate one of :data:`SCHEDULES`.

    gpipe: all forwards then all backwards. 1f1b: Megatron's non-interleaved schedule (pp - r - 1
    warmup forwards on rank r). interleaved-1f1b: Megatron's interleaved schedule, ``virtual_stages``
    chunks per rank, microbatches in groups of pp (so ``microbatches % pp == 0``). With pp=1,
    gpipe and 1f1b are plain gradient accumulation.

    gpipe and 1f1b send right after the producing compute and receive right before the consuming
    one (Megatron's send_forward_recv_backward pairs). interleaved-1f1b communicates once after
    every slot (a forward, a backward or a pair of both), all ranks in lock-step, as Megatron's
    interleaved loop does; anything else can deadlock under rendezvous semantics.

    >>> s = make_schedule("interleaved-1f1b", pp=2, microbatches=2, virtual_stages=2)
    >>> [str(a) for a in s.ranks[1] if a.kind.is_compute]
    ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1']
    """
    pp, microbatches, virtual_stages = map(operator.index, (pp, microbatches, virtual_stages))
    packed = _C.make_schedule(name, pp, microbatches, virtual_stages)
    schedule = Schedule(name, pp, microbatches, virtual_stages, _unpack(packed))
    _raise_problem(schedule, _C.check(pp, microbatches, virtual_stages, packed))
    return schedule


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every microbatch runs forward then backward through
    every chunk exactly once, in dependency order, and no rank can deadlock.

    The message names the problem and shows the grid with the offending steps marked.

    >>> s = make_schedule("1f1b", pp=2, microbatches=1)
    >>> broken = Schedule(s.name, 2, 1, 1, (s.ranks[0][:-1], s.ranks[1]))  # drop 0B0
    >>> validate(broken)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autopart.schedule.ScheduleError: 1f1b (pp=2, microbatches=1, virtual_stages=1): missing 0B0 on rank 0: ...
    rank 0   | rank 1
    ---------+---------
    >>0F0<<  | 1RECV_F0
    ...
    """
    _raise_problem(schedule, _C.check(schedule.pp, schedule.microbatches, schedule.virtual_stages, _pack(schedule)))


Costs = Union[float, Sequence[float]]


def simulate(
    schedule: Schedule,
    forward_cost: Costs = 1.0,
    backward_cost: Costs = 2.0,
    latency: float = 0.0,
    bandwidth: float = float("inf"),
    message_bytes: float = 0,
) -> SimResult:
    """Discrete-event simulation of ``schedule`` as the runtime would execute it.

    Costs are per chunk (one microbatch's forward / backward through one chunk): a number for all
    chunks or one per chunk. A message takes ``latency + message_bytes / bandwidth`` once both
    sender and receiver have posted it; a rank's batch ends when its last message does.

    >>> r = simulate(make_schedule("interleaved-1f1b", pp=4, microbatches=8, virtual_stages=2))
    >>> r.bubble == (4 - 1) / (2 * 8), r.peak_in_flight
    (True, (11, 9, 7, 5))
    """
    packed = _pack(schedule)
    _raise_problem(schedule, _C.check(schedule.pp, schedule.microbatches, schedule.virtual_stages, packed))
    raw = _C.simulate(
        schedule.pp,
        schedule.microbatches,
        schedule.virtual_stages,
        packed,
        _per_chunk(forward_cost, schedule.num_chunks, "forward_cost"),
        _per_chunk(backward_cost, schedule.num_chunks, "backward_cost"),
        float(latency),
        float(bandwidth),
        float(message_bytes),
    )
    return SimResult(
        makespan=raw.makespan,
        ideal=raw.ideal,
        bubble=raw.bubble,
        idle=tuple(raw.idle),
        peak_in_flight=tuple(raw.peak_in_flight),
        peak_activations=tuple(n / schedule.virtual_stages for n in raw.peak_in_flight),
    )


def balanced_partition(costs: Sequence[float], k: int) -> list[int]:
    """Cut ``costs`` (one per segment, e.g. per layer) into ``k`` contiguous non-empty parts.

    Minimizes the largest part's sum, ties broken by the smaller sum of squares. Returns the k-1
    cut indices; cut j is the boundary between segment j-1 and segment j.

    >>> balanced_partition([1, 1, 1, 1, 4], 2)
    [4]
    >>> balanced_partition([3, 1, 1, 1, 3, 1], 3)
    [1, 4]
    """
    return _C.balanced_partition([float(c) for c in costs], operator.index(k))


def _per_chunk(cost: Costs, chunks: int, what: str) -> list[float]:
    if isinstance(cost, numbers.Real):
        return [float(cost)] * chunks
    costs = [float(c) for c in cost]
    if len(costs) != chunks:
        raise ValueError(f"{what} needs one value per chunk (pp * virtual_stages = {chunks}), got {len(costs)}")
    return costs


def _unpack(packed: list[list[tuple[int, int, int]]]) -> tuple[tuple[Action, ...], ...]:
    kinds = _KINDS
    return tuple(tuple(Action(c, kinds[k], i) for c, k, i in rank) for rank in packed)


def _pack(schedule: Schedule) -> list[list[tuple[int, int, int]]]:
    code = _CODE
    return [[(a.chunk, code[a.kind], a.microbatch) for a in rank] for rank in schedule.ranks]


_CONTEXT_ROWS = 5  # rows shown around each mark when an error grid is long


def _raise_problem(schedule: Schedule, problem: tuple[str, list[tuple[int, int]]] | None) -> None:
    if problem is None:
        return
    message, marks = problem
    rows = range(max(map(len, schedule.ranks), default=0))
    if marks and len(rows) > 6 * _CONTEXT_ROWS:
        near = {row for _, step in marks for row in range(step - _CONTEXT_ROWS, step + _CONTEXT_ROWS + 1)}
        rows = [row for row in rows if row in near]
    header = (
        f"{schedule.name} (pp={schedule.pp}, microbatches={schedule.microbatches}, "
        f"virtual_stages={schedule.virtual_stages})"
    )
    raise ScheduleError(f"{header}: {message}\n{_format_grid(schedule.ranks, set(marks), rows)}")


def _format_grid(ranks: Sequence[Sequence[Action]], marks: set[tuple[int, int]], rows: Sequence[int]) -> str:
    """Rows (steps) side by side, one column per rank; a gap in ``rows`` prints as ``... n steps``."""

    def cell(rank: int, step: int) -> str:
        if step >= len(ranks[rank]):
            return ""
        text = str(ranks[rank][step])
        return f">>{text}<<" if (rank, step) in marks else text

    columns = [[f"rank {r}"] + [cell(r, step) for step in rows] for r in range(len(ranks))]
    widths = [max(map(len, column)) for column in columns]
    lines = [" | ".join(col[0].ljust(w) for col, w in zip(columns, widths)).rstrip()]
    lines.append("-+-".join("-" * w for w in widths))
    total = max(map(len, ranks), default=0)
    previous = -1
    for i, step in enumerate(rows, start=1):
        if step > previous + 1:
            lines.append(f"... {step - previous - 1} steps")
        lines.append(" | ".join(col[i].ljust(w) for col, w in zip(columns, widths)).rstrip())
        previous = step
    if previous < total - 1:
        lines.append(f"... {total - 1 - previous} steps")
    return "\n".join(lines)
