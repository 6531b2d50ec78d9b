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


def combine_forward_backward(pp: int, microbatches: int) -> Schedule:
    """1F1B whose steady state runs each forward beside a backward of another microbatch, with no
    transfer between them (Megatron-Core's combined 1F1B; DualPipe's overlapped F&B): rank r
    runs pp - r warmup forwards (one more than 1F1B), then F(i + pp - r) with B(i), then the
    remaining backwards. Every pair's receives are posted before it and its sends after it, so
    that the runtime can run the two as one action (runtime/executor.py combined_computes): the
    backward's all-to-alls behind the forward's compute and the other way round
    (passes/overlap_experts.py). The last rank, whose 1F1B runs F(i) B(i) with nothing to pair,
    gets its pair from the extra warmup forward; each rank holds one more microbatch's
    activations than under 1F1B.

    >>> print(' '.join(map(str, combine_forward_backward(2, 4).ranks[1])))
    1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1RECV_F2 1F2 1B1 1SEND_B1 1RECV_F3 1F3 1B2 1SEND_B2 1B3 1SEND_B3
    """
    ranks = []
    for r in range(pp):
        warm = min(pp - r, microbatches)
        order = [[("F", i)] for i in range(warm)]
        order += [[("F", i + warm), ("B", i)] for i in range(microbatches - warm)]
        order += [[("B", i)] for i in range(microbatches - warm, microbatches)]
        ranks.append(tuple(a for step in order for a in _with_transfers(r, pp, step)))
    schedule = Schedule("1f1b", pp, microbatches, 1, tuple(ranks))
    validate(schedule)
    return schedule


def _with_transfers(r: int, pp: int, step: list) -> list[Action]:
    """One step's computes (one, or a forward-backward pair) with the receives they read before
    them and the sends of what they produce after them."""
    recv = {"F": (Kind.RECV_F, r > 0), "B": (Kind.RECV_B, r < pp - 1)}
    send = {"F": (Kind.SEND_F, r < pp - 1), "B": (Kind.SEND_B, r > 0)}
    out = [Action(r, recv[k][0], m) for k, m in step if recv[k][1]]
    out += [Action(r, Kind(k), m) for k, m in step]
    return out + [Action(r, send[k][0], m) for k, m in step if send[k][1]]
