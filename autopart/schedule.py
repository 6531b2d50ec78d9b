"""Pipeline schedules as data.

A schedule is one list of actions per pipeline rank. Model chunk ``k`` (``0 .. pp*v - 1`` in
model order) lives on rank ``schedule.rank_of_chunk(k)``: ``k % pp``, or for zb-v and dualpipe-v
in a V (rank ``k`` for ``k < pp``, then ``2pp-1-k``). Actions print as torch.distributed.pipelining's
tokens: ``2F0`` is chunk 2's forward of microbatch 0, ``2B0`` its full backward, or split, ``2I0``
its input gradient (what chunk 1 waits for) and ``2W0`` its weight gradient (needed only by the
optimizer step); ``2SEND_F0`` / ``3RECV_F0`` move that forward's output from chunk 2 to chunk 3,
``3SEND_B0`` / ``2RECV_B0`` move the gradient back. Each run of consecutive sends/receives is one
``batch_isend_irecv``; :func:`validate` proves by a dry run that no rank blocks forever under NCCL's
(rendezvous) semantics. Generators, validator, simulator, partitioner: C++ (``autopart._C``).

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
import functools
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
    "InFlight",
    "balanced_partition",
    "in_flight",
    "in_flight_per_chunk",
    "make_schedule",
    "simulate",
    "validate",
]

SCHEDULES: tuple[str, ...] = tuple(_C.schedule_names())  # the names live in the C++ core only


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
    I = "I"  # noqa: E741  (torch's token: the input-gradient half of a backward)
    W = "W"  # the weight-gradient half

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.I, Kind.W)


_KINDS = tuple(Kind)
_CODE = {kind: code for code, kind in enumerate(_KINDS)}
_TOKEN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")


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
            raise ScheduleError(f"not an action token: {token!r} (expected e.g. 2F0, 1B3, 2I3, 2W3, 2SEND_F0, 3RECV_B1)")
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

    @property
    def chunk_ranks(self) -> tuple[int, ...]:
        """Pipeline rank of each chunk, from the C++ core (the one source of placement).

        >>> make_schedule("zb-v", pp=3, microbatches=6, virtual_stages=2).chunk_ranks
        (0, 1, 2, 2, 1, 0)
        """
        return _chunk_ranks(self.name, self.pp, self.virtual_stages)

    def rank_of_chunk(self, chunk: int) -> int:
        return self.chunk_ranks[chunk]

    @property
    def placement(self) -> str:
        """Where chunks live, in words: ``chunk k on rank k % 4``."""
        return _C.placement_text(self.name, self.pp)

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
    time. ``peak_in_flight[r]`` counts (chunk, microbatch) forwards whose backward (B, or W when
    split) has not run; ``peak_activations[r]`` is the same in full-stage units (a chunk holds 1/v
    of a stage). ``peak_awaiting_weight_grad[r]`` counts those past their I: they hold only what
    W reads. ``timeline[r]`` lists ``(action, start, end)`` for every action of rank r in list
    order: a compute while it runs, a send or receive while its message moves (from the later of
    the two sides' posts; zero length without latency or bandwidth costs).
    """

    makespan: float
    ideal: float
    bubble: float
    idle: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_activations: tuple[float, ...]
    peak_awaiting_weight_grad: tuple[int, ...] = ()
    timeline: tuple[tuple[tuple[Action, float, float], ...], ...] = ()


def make_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build and validate one of :data:`SCHEDULES`.

    gpipe: all forwards then all backwards. 1f1b: Megatron's non-interleaved schedule (pp - r - 1
    warmup forwards on rank r). interleaved-1f1b: Megatron's interleaved schedule, ``virtual_stages``
    chunks per rank, microbatches in groups of pp (so ``microbatches % pp == 0``). With pp=1,
    gpipe and 1f1b are plain gradient accumulation.

    The zero-bubble schedules split each backward into I then W and run W late, in what would be
    bubbles (Qi et al. 2024; the orders of torch.distributed.pipelining's schedules).
    zb-h1: 1F1B with I for B and rank r running each W r backwards late (virtual_stages=1); with
    virtual_stages >= 2 the interleaved form (ScheduleInterleavedZeroBubble: (v-1)*pp + pp-1-r
    warmup forwards, microbatches % pp == 0). zb-v (ScheduleZBVZeroBubble) and dualpipe-v
    (DeepSeek-V3's DualPipe cut in half; ScheduleDualPipeV; microbatches >= 2*pp, fused B in its
    steady state): virtual_stages=2, chunks in a V (:attr:`Schedule.chunk_ranks`).

    With unit costs F = I = W = 1 per chunk (B = 2), one step's bubble, (makespan - ideal) /
    ideal, is exactly (tested for every pp <= 8, m <= 4*pp):

    ================  ==========================================  ===============
    gpipe, 1f1b       (p-1) / m                                    ideal 3m
    interleaved-1f1b  (p-1) / (v*m)                                ideal 3vm
    zb-h1, v = 1      (p-1 + max(0, p-m)) / (3m)                   ideal 3m
    zb-h1, v >= 2     (p-1) / (3*v*m)                              ideal 3vm
    zb-v              max(p-1, 4p-2-2m) / (6m)                     ideal 6m
    dualpipe-v        (p-1) / (6m)                                 ideal 6m
    ================  ==========================================  ===============

    So once m >= p (zb-v: m >= 3p/2) the zero-bubble schedules leave p-1 chunk-forwards idle per
    rank: the fill that one synchronous step cannot avoid (the papers' zero assumes consecutive
    steps overlap). Peak microbatch-chunks in flight (F until W) then: zb-h1 min(p, m) on every
    rank (1F1B's rank 0), p*v interleaved; zb-v 2p (p stages, as 1F1B); dualpipe-v 2p+1.

    Communication: gpipe and 1f1b send right after the producing compute and receive right before
    the consuming one (Megatron's send_forward_recv_backward pairs). interleaved-1f1b communicates
    once after every slot, all ranks in lock-step, as Megatron's interleaved loop does. The
    zero-bubble schedules are laid on a unit-time table and each message is received in the
    receiver's first gap at or after the time it was sent; both keep every wait pointing at a
    batch no later in the table, so no rank can deadlock, whatever the costs (a careless placement
    can deadlock under the runtime's rendezvous semantics).

    >>> s = make_schedule("interleaved-1f1b", pp=2, microbatches=2, virtual_stages=2)
    >>> [str(a) for a in s.ranks[1] if a.kind.is_compute]
    ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1']
    """
    pp, microbatches, virtual_stages = map(operator.index, (pp, microbatches, virtual_stages))
    packed = _C.make_schedule(name, pp, microbatches, virtual_stages)
    schedule = Schedule(name, pp, microbatches, virtual_stages, _unpack(packed))
    _raise_problem(schedule, _C.check(pp, microbatches, virtual_stages, packed, name))
    return schedule


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every microbatch runs forward then backward through
    every chunk exactly once, in dependency order, and no rank can deadlock.

    A backward is either B or I then W (never both): W after its own I, I after the next chunk's
    I (or B) or the receive of its gradient. Chunks must sit where ``schedule.chunk_ranks`` says
    (the placement follows the schedule's name). The memory this order holds is :func:`in_flight`.
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
    _raise_problem(schedule, _check(schedule, _pack(schedule)))


@dataclass(frozen=True)
class InFlight:
    """Activation memory a schedule holds, per rank, in (chunk, microbatch) units.

    ``peak_in_flight[r]``: most forwards on rank r whose B or W has not run (all of their
    activations are alive). ``peak_awaiting_weight_grad[r]``: most I done whose W has not (after I
    only what W reads is left, e.g. the inputs of the linear layers).
    """

    peak_in_flight: tuple[int, ...]
    peak_awaiting_weight_grad: tuple[int, ...]


def in_flight(schedule: Schedule) -> InFlight:
    """Validate ``schedule`` and count the activations it keeps alive per rank.

    >>> in_flight(make_schedule("zb-h1", pp=4, microbatches=8))
    InFlight(peak_in_flight=(4, 4, 4, 4), peak_awaiting_weight_grad=(1, 2, 3, 4))
    """
    packed = _pack(schedule)
    _raise_problem(schedule, _check(schedule, packed))
    peaks, awaiting, _ = _C.in_flight(schedule.pp, schedule.microbatches, schedule.virtual_stages, packed,
                                      schedule.name)
    return InFlight(tuple(peaks), tuple(awaiting))


def in_flight_per_chunk(schedule: Schedule) -> list[int]:
    """Per chunk, the most microbatches whose activations it holds at once (at least 1), counted
    by the C++ core with its per-rank `in_flight`: +1 at the chunk's forward, -1 at its backward
    (at the weight-gradient half for a split backward, the last to read them). The cut's memory
    bound reads it."""
    packed = _pack(schedule)
    _, _, per_chunk = _C.in_flight(schedule.pp, schedule.microbatches, schedule.virtual_stages,
                                   packed, schedule.name)
    return [max(1, n) for n in per_chunk]


Costs = Union[float, Sequence[float]]


def simulate(
    schedule: Schedule,
    forward_cost: Costs = 1.0,
    backward_cost: Costs | None = None,
    latency: float = 0.0,
    bandwidth: float = float("inf"),
    message_bytes: float = 0,
    *,
    input_grad_cost: Costs | None = None,
    weight_grad_cost: Costs | None = None,
    sends_wait: bool = True,
) -> SimResult:
    """Discrete-event simulation of ``schedule`` as the runtime would execute it.

    Costs are per chunk (one microbatch's forward / backward through one chunk): a number for all
    chunks or one per chunk. The backward B is I then W, so B = I + W: by default B = 2 and
    I = W = B / 2; give ``input_grad_cost`` and ``weight_grad_cost`` to split it otherwise (B is
    then their sum; one of them alone takes the rest of B). A message takes
    ``latency + message_bytes / bandwidth`` once both sender and receiver have posted it; a rank's
    batch ends when its last message does (NCCL: a group's batches run in order on one stream).

    ``sends_wait=False``: Gloo's semantics (a post never waits; a compute waits for the receive it
    reads and those posted before it), for ``hoist_receives(schedule, independent_posts=True)``,
    the lists the runtime runs there (docs/schedules.md).

    >>> r = simulate(make_schedule("interleaved-1f1b", pp=4, microbatches=8, virtual_stages=2))
    >>> r.bubble == (4 - 1) / (2 * 8), r.peak_in_flight
    (True, (11, 9, 7, 5))
    >>> r = simulate(make_schedule("zb-h1", pp=4, microbatches=8), input_grad_cost=1, weight_grad_cost=1)
    >>> r.makespan - r.ideal, r.bubble == (4 - 1) / (3 * 8)
    (3.0, True)
    >>> r.timeline[0][:2]
    ((0F0, 0.0, 1.0), (0SEND_F0, 1.0, 1.0))
    """
    chunks = schedule.num_chunks
    forward = _per_chunk(forward_cost, chunks, "forward_cost")
    backward, input_grad, weight_grad = _backward_costs(backward_cost, input_grad_cost, weight_grad_cost, chunks)
    packed = _pack(schedule)
    _raise_problem(schedule, _check(schedule, packed, sends_wait))
    raw = _C.simulate(
        schedule.pp, schedule.microbatches, schedule.virtual_stages, packed, forward, backward,
        float(latency), float(bandwidth), float(message_bytes), input_grad, weight_grad, schedule.name,
        sends_wait,
    )  # fmt: skip
    return SimResult(
        makespan=raw.makespan,
        ideal=raw.ideal,
        bubble=raw.bubble,
        idle=tuple(raw.idle),
        peak_in_flight=tuple(raw.peak_in_flight),
        peak_activations=tuple(n / schedule.virtual_stages for n in raw.peak_in_flight),
        peak_awaiting_weight_grad=tuple(raw.peak_awaiting_weight_grad),
        timeline=tuple(
            tuple((action, start, end) for action, (start, end) in zip(actions, times))
            for actions, times in zip(schedule.ranks, raw.times)
        ),
    )


def _backward_costs(
    backward: Costs | None, input_grad: Costs | None, weight_grad: Costs | None, chunks: int
) -> tuple[list[float], list[float], list[float]]:
    """Per-chunk (B, I, W) with B = I + W; what is not given follows from what is."""
    if input_grad is None and weight_grad is None:
        full = _per_chunk(2.0 if backward is None else backward, chunks, "backward_cost")
        return full, [b / 2 for b in full], [b / 2 for b in full]
    if input_grad is not None and weight_grad is not None:
        i = _per_chunk(input_grad, chunks, "input_grad_cost")
        w = _per_chunk(weight_grad, chunks, "weight_grad_cost")
        full = [a + b for a, b in zip(i, w)]
        if backward is not None and any(
            abs(b - f) > 1e-9 * max(1.0, abs(f)) for b, f in zip(_per_chunk(backward, chunks, "backward_cost"), full)
        ):
            raise ValueError(
                f"backward_cost {backward} is not input_grad_cost + weight_grad_cost ({input_grad} + {weight_grad}); "
                "give the two halves alone (B is their sum) or B alone (split evenly)"
            )
        return full, i, w
    full = _per_chunk(2.0 if backward is None else backward, chunks, "backward_cost")
    given_name = "input_grad_cost" if input_grad is not None else "weight_grad_cost"
    given = _per_chunk(input_grad if input_grad is not None else weight_grad, chunks, given_name)
    rest = [b - g for b, g in zip(full, given)]
    if any(r < 0 for r in rest):
        raise ValueError(
            f"{given_name} {input_grad if input_grad is not None else weight_grad} exceeds backward_cost "
            f"{2.0 if backward is None else backward} (B = I + W); give both input_grad_cost and weight_grad_cost"
        )
    return (full, given, rest) if input_grad is not None else (full, rest, given)


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


def _check(schedule: Schedule, packed: list, sends_wait: bool = True) -> tuple[str, list[tuple[int, int]]] | None:
    return _C.check(schedule.pp, schedule.microbatches, schedule.virtual_stages, packed, schedule.name, sends_wait)


@functools.lru_cache(maxsize=256)
def _chunk_ranks(name: str, pp: int, virtual_stages: int) -> tuple[int, ...]:
    return tuple(_C.chunk_rank(name, pp, virtual_stages, chunk) for chunk in range(pp * virtual_stages))


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
