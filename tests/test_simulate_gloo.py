"""The simulator under Gloo's semantics (`simulate(..., sends_wait=False)`: a post never waits,
a compute waits for the receive it reads), against an oracle written from the runtime's
description (tests/schedule_oracle.py posted_makespan), and its deadlock check."""

from __future__ import annotations

import random

import pytest
import schedule_oracle

from autopart.schedule import (SCHEDULES, Action, Schedule, ScheduleError, make_schedule,
                               simulate)
from autopart.schedule_lowering import hoist_receives


@pytest.mark.parametrize("name", SCHEDULES)
def test_gloo_simulation_matches_the_oracle(name):
    """sends_wait=False (the runtime on Gloo) against schedule_oracle.posted_makespan, written
    from the runtime's description: the lists the runtime runs there (receives posted early) and
    the schedule's own, random per-chunk costs, with and without a message latency."""
    rng = random.Random(name)
    for p, v, m in schedule_oracle.allowed_cases(name, max_pp=4):
        if m > 2 * p + 1:
            continue
        s = make_schedule(name, p, m, v)
        n = s.num_chunks
        f, i, w = ([rng.uniform(0.5, 3.0) for _ in range(n)] for _ in range(3))
        costs = {"F": f, "I": i, "W": w, "B": [a + b for a, b in zip(i, w)]}
        for lists in (hoist_receives(s, independent_posts=True), s):
            for latency in (0.0, 0.7):
                got = simulate(lists, f, latency=latency, input_grad_cost=i, weight_grad_cost=w,
                               sends_wait=False).makespan
                want = schedule_oracle.posted_makespan(
                    [[str(a) for a in r] for r in lists.ranks], lambda c, k: costs[k][c], latency)
                assert got == pytest.approx(want, rel=1e-12), (name, p, v, m, latency)


def test_gloo_semantics_accept_the_early_receives_nccl_refuses():
    s = make_schedule("1f1b", 2, 4)
    early = hoist_receives(s, independent_posts=True)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(early)                               # NCCL: rank 0's first batch waits
    r = simulate(early, 1.0, 2.0, sends_wait=False)   # Gloo: free messages, 1F1B's own bubble
    assert (r.makespan, r.ideal) == (15.0, 12.0)


def test_gloo_semantics_name_a_real_deadlock():
    # rank 0 sends F0 only after B0, whose gradient rank 1 makes only after F0 arrives
    s = Schedule("handmade", pp=2, microbatches=1, virtual_stages=1, ranks=(
        tuple(map(Action.parse, ["0F0", "0RECV_B0", "0B0", "0SEND_F0"])),
        tuple(map(Action.parse, ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]))))
    with pytest.raises(ScheduleError, match=r"posting never waits(.|\n)*rank 0 is blocked at step 2 "
                                            r"\(0B0\)(.|\n)*rank 1 is blocked at step 1 \(1F0\)"):
        simulate(s, sends_wait=False)

