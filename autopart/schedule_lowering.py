"""Lowerings of a schedule for the runtime: the action lists a rank runs, made from the
validated ones (autopart/schedule.py) by moving when each receive is posted.

The schedule module holds the action IR, the C++ core's generators, validator and simulator;
this one holds what only the runtime runs (runtime/parallel_model.py: `hoist_receives`), so
the IR's module does not grow with each lowering. Each lowering's result is validated (or kept
deadlock-free by construction, as its docstring says) with the schedule module's validator.
"""
from __future__ import annotations

from autopart.schedule import Action, Kind, Schedule, ScheduleError, validate


def hoist_receives(schedule: Schedule, *, independent_posts: bool = False) -> Schedule:
    """The lowering the runtime runs: `schedule` with its receives posted earlier, so that their
    data lands while the rank computes.

    NCCL (the default): each receive moves up past the computes before it, as far as the
    validator still proves the lists deadlock-free; the order of the transfers never changes,
    only batches merge. The validator's model is NCCL's: a group's batches run in posting order
    on one stream, so a receive posted early holds back every batch posted after it.

    `independent_posts=True` (Gloo: one work per operation, a post never waits for anything,
    a receive is waited on only when a compute needs it): each receive is posted right after the
    compute that consumes the receive two before it (_posted_early). Deadlock-free whenever the
    schedule is: the computes, the sends and the receives each keep their order, and each wait
    happens before the same compute as in the validated lists; only when a receive is posted
    changes, which no peer waits on. Measured gains: docs/schedules.md."""
    if independent_posts:
        return Schedule(schedule.name, schedule.pp, schedule.microbatches,
                        schedule.virtual_stages, tuple(map(_posted_early, schedule.ranks)))
    ranks = [list(r) for r in schedule.ranks]
    for r in range(len(ranks)):
        i = 0
        while i < len(ranks[r]):
            if ranks[r][i].kind in (Kind.RECV_F, Kind.RECV_B):
                i = _hoist_one(schedule, ranks, r, i)
            i += 1
    return Schedule(schedule.name, schedule.pp, schedule.microbatches,
                    schedule.virtual_stages, tuple(tuple(a) for a in ranks))


def _posted_early(actions, ahead: int = 2) -> tuple[Action, ...]:
    """One rank's list with each receive moved up to just after the compute that consumes the
    receive `ahead` receives before it (the first `ahead` receives: to the start), never later
    than it was and never before the previous receive (messages match in posting order): at
    most `ahead` receive buffers wait ahead of their use."""
    receives = (Kind.RECV_F, Kind.RECV_B)
    others = [a for a in actions if a.kind not in receives]     # computes and sends, in order
    index = {(a.chunk, a.kind, a.microbatch): i for i, a in enumerate(others)}
    recvs: list[Action] = []
    slots: list[int] = []           # per receive: it goes just before others[slot]
    passed = 0                      # computes and sends before the current action
    for a in actions:
        if a.kind not in receives:
            passed += 1
            continue
        slot = 0 if len(recvs) < ahead else _after_consumer(recvs[-ahead], index)
        slots.append(min(max(slot, slots[-1] if slots else 0), passed))
        recvs.append(a)
    out, j = [], 0
    for i, a in enumerate(others):
        while j < len(recvs) and slots[j] == i:
            out.append(recvs[j])
            j += 1
        out.append(a)
    return tuple(out + recvs[j:])


def _after_consumer(recv: Action, index: dict) -> int:
    """The index in `index`'s list just after the compute that reads `recv`'s data."""
    kinds = (Kind.F,) if recv.kind is Kind.RECV_F else (Kind.B, Kind.I)
    return next(index[(recv.chunk, k, recv.microbatch)] for k in kinds
                if (recv.chunk, k, recv.microbatch) in index) + 1


def _hoist_one(schedule, ranks: list, r: int, i: int) -> int:
    """Move ranks[r][i] to the earliest valid place after the previous transfer; its new index."""
    actions = ranks[r]
    top = i
    while top > 0 and actions[top - 1].kind.is_compute:
        top -= 1
    for j in range(top, i):
        trial = actions[:j] + [actions[i]] + actions[j:i] + actions[i + 1:]
        candidate = [trial if k == r else a for k, a in enumerate(ranks)]
        try:
            validate(Schedule(schedule.name, schedule.pp, schedule.microbatches,
                              schedule.virtual_stages, tuple(map(tuple, candidate))))
        except ScheduleError:
            continue
        ranks[r] = trial
        return j
    return i


__all__ = ["hoist_receives"]


def pair_microbatches(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule `name` over microbatches taken two at a time (passes/overlap_experts.py):
    built for microbatches / 2 units, each action of unit u then run for microbatch 2u and
    2u + 1 back to back (F0 F1, SEND_F0 SEND_F1 in one batch, ...), so that the runtime can run
    each pair of computes as one paired program. Deadlock-free as the unit schedule is (each
    unit's transfers move as one batch, in the unit schedule's order); validated all the same.
    The pipeline fills with half as many units as microbatches: the bubble is the unit
    schedule's, (pp - 1) / (microbatches / 2) for 1F1B, against what the overlap hides.

    >>> print(pair_microbatches("1f1b", pp=1, microbatches=4).ranks[0])
    (0F0, 0F1, 0B0, 0B1, 0F2, 0F3, 0B2, 0B3)
    """
    if microbatches % 2:
        raise ScheduleError(f"pairing microbatches needs an even count, not {microbatches}")
    from autopart.schedule import make_schedule
    units = make_schedule(name, pp, microbatches // 2, virtual_stages)
    paired = Schedule(name, pp, microbatches, virtual_stages,
                      tuple(_expand(r) for r in units.ranks))
    validate(paired)
    return paired


def _expand(actions) -> tuple[Action, ...]:
    """Each run of transfers stays one run (one batch): its actions for 2u then 2u + 1, each
    compute twice in a row."""
    out: list[Action] = []
    i = 0
    while i < len(actions):
        j = i + 1
        if actions[i].kind in _TRANSFERS:
            while j < len(actions) and actions[j].kind in _TRANSFERS:
                j += 1
        out += [Action(a.chunk, a.kind, 2 * a.microbatch + k) for a in actions[i:j]
                for k in (0, 1)]
        i = j
    return tuple(out)


_TRANSFERS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)

