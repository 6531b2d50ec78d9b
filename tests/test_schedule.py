"""Pipeline schedules: generators against hand-derived goldens and an independent oracle, the
simulator against the closed-form bubbles, and the stage partitioner against brute force (the
validator against broken lists: tests/test_schedule_validator.py)."""

from __future__ import annotations

import itertools
import random

import pytest
import schedule_oracle

from autopart import _C
from autopart.schedule import (
    SCHEDULES,
    Action,
    InFlight,
    Kind,
    Schedule,
    ScheduleError,
    balanced_partition,
    in_flight,
    make_schedule,
    simulate,
    validate,
)

CLASSIC = ("gpipe", "1f1b", "interleaved-1f1b")  # one fused backward (B) per chunk and microbatch
ZERO_BUBBLE = ("zb-h1", "zb-v", "dualpipe-v")


def compute_tokens(schedule: Schedule, rank: int) -> list[str]:
    return [str(a) for a in schedule.ranks[rank] if a.kind.is_compute]


# --- goldens, derived by hand from the definitions (Narayanan et al. 2021 section 2.2, Megatron) ---

# pp=4, v=2, m=8 (the paper's Figure 4). Rank r holds chunks r and r+4. Forwards go in groups of
# 4 microbatches: 0-3 through chunk r, 0-3 through chunk r+4, 4-7 through r, 4-7 through r+4;
# backwards take the chunks in reverse. Warmup = 2*(4-r-1) + (2-1)*4 = 10, 8, 6, 4 forwards, then
# (forward, backward) pairs, then the remaining backwards.
INTERLEAVED_4_2_8 = [
    "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 "
    "0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
    "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",
    "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 "
    "1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 "
    "5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7",
    "2F0 2F1 2F2 2F3 6F0 6F1 "
    "6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 "
    "6B6 6B7 2B4 2B5 2B6 2B7",
    "3F0 3F1 3F2 3F3 "
    "7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 "
    "3B4 3B5 3B6 3B7",
]

# pp=4, m=8: rank r warms up with 4-r-1 forwards.
ONE_F_ONE_B_4_8 = [
    "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
    "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
    "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
    "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
]

# Sends right after the producing compute, receives right before the consuming one; adjacent
# ones form a batch (0SEND_F1 + 0RECV_B0 is Megatron's send_forward_recv_backward).
ONE_F_ONE_B_2_3_GRID = """\
rank 0   | rank 1
---------+---------
0F0      | 1RECV_F0
0SEND_F0 | 1F0
0F1      | 1B0
0SEND_F1 | 1SEND_B0
0RECV_B0 | 1RECV_F1
0B0      | 1F1
0F2      | 1B1
0SEND_F2 | 1SEND_B1
0RECV_B1 | 1RECV_F2
0B1      | 1F2
0RECV_B2 | 1B2
0B2      | 1SEND_B2"""

# pp=2, v=2, m=2: rank 0 holds chunks 0, 2 (warmup 4 = everything), rank 1 chunks 1, 3 (warmup
# 2). One batch after every slot; rank r's t-th batch is lock-step t + r, and a message is received
# in the batch of the step it is sent in: 1F0's output leaves rank 1 at its batch 1 (step 2) and
# reaches rank 0 in its batch 2, right before 2F0.
INTERLEAVED_2_2_2_GRID = """\
rank 0   | rank 1
---------+---------
0F0      | 1RECV_F0
0SEND_F0 | 1F0
0F1      | 1SEND_F0
0SEND_F1 | 1RECV_F1
2RECV_F0 | 1F1
2F0      | 1SEND_F1
2SEND_F0 | 3RECV_F0
2RECV_F1 | 3F0
2F1      | 3B0
2SEND_F1 | 3SEND_B0
2RECV_B0 | 3RECV_F1
2B0      | 3F1
2SEND_B0 | 3B1
2RECV_B1 | 3SEND_B1
2B1      | 1RECV_B0
2SEND_B1 | 1B0
0RECV_B0 | 1SEND_B0
0B0      | 1RECV_B1
0RECV_B1 | 1B1
0B1      | 1SEND_B1"""


@pytest.mark.parametrize("rank", range(4))
def test_interleaved_matches_figure_4_order(rank):
    s = make_schedule("interleaved-1f1b", pp=4, microbatches=8, virtual_stages=2)
    assert compute_tokens(s, rank) == INTERLEAVED_4_2_8[rank].split()


@pytest.mark.parametrize("rank", range(4))
def test_1f1b_order(rank):
    s = make_schedule("1f1b", pp=4, microbatches=8)
    assert compute_tokens(s, rank) == ONE_F_ONE_B_4_8[rank].split()


def test_1f1b_grid_with_communication():
    assert str(make_schedule("1f1b", pp=2, microbatches=3)) == ONE_F_ONE_B_2_3_GRID


def test_interleaved_grid_with_communication():
    assert make_schedule("interleaved-1f1b", pp=2, microbatches=2, virtual_stages=2).grid() == INTERLEAVED_2_2_2_GRID


def test_gpipe_lists():
    s = make_schedule("gpipe", pp=2, microbatches=2)
    assert [str(a) for a in s.ranks[0]] == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1".split()
    assert [str(a) for a in s.ranks[1]] == "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1".split()


@pytest.mark.parametrize(("name", "order"), [("gpipe", "0F0 0F1 0F2 0B0 0B1 0B2"), ("1f1b", "0F0 0B0 0F1 0B1 0F2 0B2")])
def test_single_rank_is_gradient_accumulation(name, order):
    s = make_schedule(name, pp=1, microbatches=3)
    assert [str(a) for a in s.ranks[0]] == order.split()
    assert simulate(s).bubble == 0.0


# --- against the oracle, and valid everywhere ---


@pytest.mark.parametrize("name", SCHEDULES)
def test_compute_order_matches_oracle(name):
    for pp, v, m in schedule_oracle.allowed_cases(name):
        s = make_schedule(name, pp, m, v)
        for rank in range(pp):
            expected = schedule_oracle.compute_order(name, pp, m, v, rank)
            assert compute_tokens(s, rank) == expected, (name, pp, v, m, rank)


@pytest.mark.parametrize("name", CLASSIC)
def test_every_allowed_case_is_valid_and_has_the_closed_form_bubble(name):
    for pp, v, m in schedule_oracle.allowed_cases(name):
        s = make_schedule(name, pp, m, v)
        validate(s)
        # Integer costs keep every time exact: the bubble is (pp-1) chunk (forward + backward)s.
        for forward, backward in [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)]:
            r = simulate(s, forward, backward)
            assert r.makespan - r.ideal == (pp - 1) * (forward + backward), (name, pp, v, m, forward, backward)
            assert r.bubble == (pp - 1) / (v * m)


@pytest.mark.parametrize(("pp", "v", "m"), [(4, 2, 8), (4, 4, 4), (8, 2, 16), (3, 3, 6)])
def test_interleaved_bubble_with_stage_cost_split_over_chunks(pp, v, m):
    # A chunk is 1/v of a stage: stage forward 1, backward 2 -> bubble (p-1)/(v*m), i.e. the
    # bubble time (p-1)*(t_f+t_b)/v of the paper.
    r = simulate(make_schedule("interleaved-1f1b", pp, m, v), 1 / v, 2 / v)
    assert r.bubble == pytest.approx((pp - 1) / (v * m), rel=1e-12)
    assert r.makespan - r.ideal == pytest.approx((pp - 1) * 3 / v, rel=1e-12)


@pytest.mark.parametrize("name", CLASSIC)
def test_peak_in_flight_closed_forms(name):
    for pp, v, m in schedule_oracle.allowed_cases(name):
        r = simulate(make_schedule(name, pp, m, v))
        if name == "gpipe":
            expected = [m] * pp
        elif name == "1f1b":
            expected = [min(pp - rank, m) for rank in range(pp)]  # warmup + 1
        else:
            expected = [min(2 * (pp - rank - 1) + (v - 1) * pp + 1, v * m) for rank in range(pp)]
        assert list(r.peak_in_flight) == expected, (name, pp, v, m)
        assert r.peak_activations == tuple(n / v for n in expected)


def test_big_interleaved_simulation_runs():
    r = simulate(make_schedule("interleaved-1f1b", pp=64, microbatches=512, virtual_stages=2))
    assert r.bubble == 63 / 1024


# --- zero-bubble schedules: I and W, V placement ---

# pp=3, m=4, derived by hand from ZB-H1's definition: rank r warms up with pp-r-1 forwards, runs
# I where 1F1B runs B, and holds back r weight gradients (W of the k-th I right after the
# (k+r)-th I), the held-back ones at the end.
ZB_H1_3_4 = [
    "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
    "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
    "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
]


@pytest.mark.parametrize("rank", range(3))
def test_zb_h1_order(rank):
    assert compute_tokens(make_schedule("zb-h1", pp=3, microbatches=4), rank) == ZB_H1_3_4[rank].split()


def test_schedule_names_come_from_the_cpp_core():
    assert SCHEDULES == tuple(_C.schedule_names()) == CLASSIC + ZERO_BUBBLE


@pytest.mark.parametrize("name", SCHEDULES)
def test_chunk_ranks(name):
    for pp, v, m in schedule_oracle.allowed_cases(name, max_pp=5):
        s = make_schedule(name, pp, m, v)
        expected = tuple(schedule_oracle.chunk_rank(name, pp, c) for c in range(pp * v))
        assert s.chunk_ranks == expected and [s.rank_of_chunk(c) for c in range(pp * v)] == list(expected)
        # every action sits on the rank holding its chunk
        assert all(s.chunk_ranks[a.chunk] == r for r, actions in enumerate(s.ranks) for a in actions)


def test_v_placement_text_and_errors():
    s = make_schedule("zb-v", pp=4, microbatches=8, virtual_stages=2)
    assert s.chunk_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.placement == "chunk k on rank k for k < 4, else 7 - k"
    assert make_schedule("1f1b", pp=4, microbatches=8).placement == "chunk k on rank k % 4"
    with pytest.raises(ScheduleError, match="chunk 8 out of range: there are 8 chunks"):
        _C.chunk_rank("zb-v", 4, 2, 8)
    with pytest.raises(ScheduleError, match="zb-v places two chunks per rank in a V"):
        _C.chunk_rank("zb-v", 4, 3, 0)


def unit_split(s: Schedule):
    """F = I = W = 1 per chunk (so B = 2)."""
    return simulate(s, 1.0, input_grad_cost=1.0, weight_grad_cost=1.0)


def closed_form_bubble_time(name: str, p: int, v: int, m: int) -> int:
    """Idle time of the busiest rank in one step, F = I = W = 1 per chunk (see make_schedule)."""
    if name == "zb-h1":
        return p - 1 + max(0, p - m) if v == 1 else p - 1
    if name == "zb-v":
        return max(p - 1, 4 * p - 2 - 2 * m)
    return 2 * (p - 1)  # dualpipe-v: DeepSeek-V3's (PP-1)(F&B + B - 3W) with F&B = F + B


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_zero_bubble_closed_forms(name):
    for p, v, m in schedule_oracle.allowed_cases(name):
        r = unit_split(make_schedule(name, p, m, v))
        assert r.ideal == 3 * v * m, (name, p, v, m)
        assert r.makespan - r.ideal == closed_form_bubble_time(name, p, v, m), (name, p, v, m)
        assert r.bubble == closed_form_bubble_time(name, p, v, m) / (3 * v * m)


def test_zb_h1_bubble_is_a_third_of_1f1b():
    # Qi et al.: 1F1B idles (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W); with F = I = W: 3(p-1) vs p-1.
    for p, m in [(2, 4), (4, 8), (8, 32)]:
        one_f_one_b = simulate(make_schedule("1f1b", p, m), 1.0, 2.0)
        zb = unit_split(make_schedule("zb-h1", p, m))
        assert one_f_one_b.bubble == (p - 1) / m and zb.bubble == (p - 1) / (3 * m)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_simulation_matches_the_oracle_timing(name):
    # The oracle times the orders itself (each compute as early as its inputs allow, free
    # messages): the lowering and the rendezvous simulator must not add any wait.
    for p, v, m in schedule_oracle.allowed_cases(name):
        r = unit_split(make_schedule(name, p, m, v))
        assert (r.makespan, r.ideal) == schedule_oracle.unit_time_makespan(name, p, m, v), (name, p, v, m)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_in_flight_matches_the_oracle(name):
    for p, v, m in schedule_oracle.allowed_cases(name):
        s = make_schedule(name, p, m, v)
        expected = [schedule_oracle.peak_in_flight(schedule_oracle.compute_order(name, p, m, v, r)) for r in range(p)]
        memory = in_flight(s)
        assert memory == InFlight(tuple(e[0] for e in expected), tuple(e[1] for e in expected)), (name, p, v, m)
        r = unit_split(s)
        assert (r.peak_in_flight, r.peak_awaiting_weight_grad) == (memory.peak_in_flight, memory.peak_awaiting_weight_grad)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_peak_in_flight_zero_bubble_closed_forms(name):
    for p, v, m in schedule_oracle.allowed_cases(name):
        peaks = in_flight(make_schedule(name, p, m, v)).peak_in_flight
        if name == "zb-h1":
            assert peaks == (min(p, m),) * p if v == 1 else (p * v,) * p, (p, v, m)  # 1F1B's rank 0
        elif m >= 2 * p:  # zb-v: p stages of activations (2p chunks of half a stage), as 1F1B
            assert peaks == ((2 * p,) if name == "zb-v" else (2 * p + 1,)) * p, (name, p, m)


def test_every_backward_is_split_or_fused_once():
    for name in ZERO_BUBBLE:
        for p, v, m in schedule_oracle.allowed_cases(name, max_pp=4):
            s = make_schedule(name, p, m, v)
            kinds = [(a.chunk, a.microbatch, a.kind) for actions in s.ranks for a in actions if a.kind.is_compute]
            for c in range(p * v):
                for i in range(m):
                    mine = sorted(k.value for cc, ii, k in kinds if (cc, ii) == (c, i))
                    assert mine in (["B", "F"], ["F", "I", "W"]), (name, p, v, m, c, i, mine)
            if name != "dualpipe-v":
                assert all(k is not Kind.B for _, _, k in kinds)


def test_timeline():
    s = make_schedule("zb-v", pp=3, microbatches=6, virtual_stages=2)
    r = simulate(s, 1.0, input_grad_cost=1.0, weight_grad_cost=2.0, latency=0.25)
    assert [a for a, _, _ in r.timeline[1]] == list(s.ranks[1])
    ends = {}
    for rank, rows in enumerate(r.timeline):
        computes = [(start, end) for a, start, end in rows if a.kind.is_compute]
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(computes, computes[1:]))  # one at a time, in order
        assert sum(e - b for b, e in computes) == r.ideal - r.idle[rank] + (r.makespan - r.ideal)
        assert max(end for _, _, end in rows) <= r.makespan
        for a, start, end in rows:
            if a.kind.is_compute:
                assert end - start == {"F": 1.0, "I": 1.0, "W": 2.0}[a.kind.value]
            else:
                assert end - start == 0.25
                ends[str(a)] = (start, end)
    # both ends of a message move together
    for token, times in ends.items():
        if "SEND" in token:
            assert ends[str(Action.parse(token).__class__(*_matching(Action.parse(token))))] == times


def _matching(a: Action) -> tuple[int, Kind, int]:
    return (a.chunk + 1, Kind.RECV_F, a.microbatch) if a.kind is Kind.SEND_F else (a.chunk - 1, Kind.RECV_B, a.microbatch)


@pytest.mark.parametrize(
    ("kwargs", "backward", "makespan"),
    [
        ({}, 2.0, None),
        ({"backward_cost": 4.0}, 4.0, None),
        ({"input_grad_cost": 1.0, "weight_grad_cost": 3.0}, 4.0, None),
        ({"input_grad_cost": 0.5}, 2.0, None),
        ({"weight_grad_cost": 1.5, "backward_cost": 3.0}, 3.0, None),
    ],
)
def test_backward_is_input_plus_weight_grad(kwargs, backward, makespan):
    # pp=1: one rank runs everything back to back, so makespan = total compute.
    fused = simulate(make_schedule("1f1b", 1, 2), 1.0, **kwargs)
    split = simulate(make_schedule("zb-h1", 1, 2), 1.0, **kwargs)
    assert fused.makespan == split.makespan == 2 * (1.0 + backward)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backward_cost": 3.0, "input_grad_cost": 1.0, "weight_grad_cost": 1.0},
         r"backward_cost 3.0 is not input_grad_cost \+ weight_grad_cost \(1.0 \+ 1.0\)"),
        ({"input_grad_cost": 3.0}, r"input_grad_cost 3.0 exceeds backward_cost 2.0 \(B = I \+ W\)"),
        ({"input_grad_cost": [1.0, 1.0, 1.0], "weight_grad_cost": 1.0}, "input_grad_cost needs one value per chunk"),
        ({"input_grad_cost": -1.0, "weight_grad_cost": 1.0}, "input-gradient cost of chunk 0 must be finite and >= 0"),
    ],
)  # fmt: skip
def test_simulate_rejects_bad_split_costs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(make_schedule("zb-h1", pp=2, microbatches=2), **kwargs)


def test_size_guard_refuses_early():
    import time

    began = time.perf_counter()
    with pytest.raises(ScheduleError, match="about 12 million actions"):
        make_schedule("1f1b", 512, 4096)
    assert time.perf_counter() - began < 1.0


# --- the simulator's cost model ---


def test_communication_cost():
    # gpipe pp=2 m=1: F, message, F, B, message, B; each message 0.5 + 100/400 = 0.75.
    s = make_schedule("gpipe", pp=2, microbatches=1)
    r = simulate(s, 1.0, 2.0, latency=0.5, bandwidth=400.0, message_bytes=100)
    assert r.makespan == 6.0 + 2 * 0.75
    assert r.ideal == 3.0
    assert r.idle == (4.5, 4.5)


def test_per_chunk_costs():
    s = make_schedule("1f1b", pp=2, microbatches=4)
    r = simulate(s, forward_cost=[1.0, 3.0], backward_cost=[2.0, 6.0])
    assert r.ideal == 4 * 9.0
    assert r.idle[0] > r.idle[1]  # rank 0 waits for the slow last stage


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward_cost": [1.0, 1.0, 1.0]}, "one value per chunk"),
        ({"backward_cost": -1.0}, "backward cost of chunk 0 must be finite and >= 0"),
        ({"latency": float("nan")}, "latency must be finite"),
        ({"bandwidth": 0.0}, "bandwidth must be > 0"),
    ],
)
def test_simulate_rejects_bad_costs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(make_schedule("1f1b", pp=2, microbatches=2), **kwargs)


# --- make_schedule's errors ---


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("zb-x", 4, 8, 1), "unknown schedule 'zb-x'; choose one of: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v, "
                            "dualpipe-v$"),
        (("zb-v", 4, 8, 1), r"zb-v places two chunks per rank in a V \(virtual_stages=2\), got virtual_stages=1; "
                            "use 'zb-h1'"),
        (("dualpipe-v", 4, 8, 3), "dualpipe-v places two chunks per rank in a V"),
        (("dualpipe-v", 4, 6, 2), r"dualpipe-v needs microbatches >= 2\*pp = 8 .* got 6; use more microbatches or 'zb-v'"),
        (("zb-h1", 4, 6, 2), "zb-h1 needs microbatches divisible by pp=4 .* got 6; nearest valid: 4 or 8"),
        (("zb-h1", 1, 4, 2), "zb-h1 needs pp >= 2 .* got pp=1; on one rank use zb-h1 with virtual_stages=1"),
        (("1f1b", 512, 4096, 1), "1f1b with pp=512, microbatches=4096, virtual_stages=1 has about 12 million actions, "
                                 "more than the 5 million this builds; use fewer microbatches"),
        (("1f1b", 0, 8, 1), "pp must be >= 1, got 0"),
        (("1f1b", 4, 0, 1), "microbatches must be >= 1, got 0"),
        (("1f1b", 4, 8, 0), "virtual_stages must be >= 1, got 0"),
        (("gpipe", 4, 8, 2), "gpipe runs one model chunk per rank .* use 'interleaved-1f1b'"),
        (("1f1b", 4, 8, 2), "1f1b runs one model chunk per rank .* use 'interleaved-1f1b'"),
        (("interleaved-1f1b", 1, 8, 2), "needs pp >= 2 .* got pp=1; on one rank use '1f1b'"),
        (("interleaved-1f1b", 4, 8, 1), "needs virtual_stages >= 2, got 1; use '1f1b' for one chunk per rank"),
        (("interleaved-1f1b", 4, 6, 2), "needs microbatches divisible by pp=4 .* got 6; nearest valid: 4 or 8"),
        (("interleaved-1f1b", 4, 2, 2), "got 2; nearest valid: 4$"),
        (("interleaved-1f1b", 4, 13, 2), "got 13; nearest valid: 12 or 16"),
    ],
)
def test_make_schedule_errors(args, match):
    with pytest.raises(ScheduleError, match=match):
        make_schedule(*args)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)
    with pytest.raises(ValueError):
        _C.make_schedule("1f1b", 0, 1, 1)  # raised from C++ as autopart.schedule.ScheduleError
    with pytest.raises(ScheduleError):
        _C.make_schedule("1f1b", 0, 1, 1)


# --- the data types ---


def test_action_tokens_round_trip():
    for token in ["2F0", "13B7", "2SEND_F0", "3RECV_F0", "3SEND_B0", "2RECV_B0", "2I3", "2W3"]:
        assert str(Action.parse(token)) == token
    assert Action.parse("2SEND_F0") == Action(2, Kind.SEND_F, 0) == Action(2, "SEND_F", 0)
    assert Action(2, "SEND_F", 0).kind is Kind.SEND_F
    with pytest.raises(ScheduleError, match="not an action token: '2X0'"):
        Action.parse("2X0")
    with pytest.raises(ScheduleError, match="unknown action kind 'X'"):
        Action(0, "X", 0)


def test_kind_codes_match_the_cpp_core():
    assert _C.kind_names() == [k.value for k in Kind]


def test_schedule_json_round_trip_and_repr():
    s = make_schedule("interleaved-1f1b", pp=2, microbatches=4, virtual_stages=2)
    assert Schedule.from_json(s.to_json()) == s
    assert repr(s) == "Schedule(name='interleaved-1f1b', pp=2, microbatches=4, virtual_stages=2, ranks=<2 lists, 80 actions>)"  # 32 computes, 3 boundaries x 2 directions x 2 ends x 4 mb
    assert s.grid().splitlines()[0] == "rank 0   | rank 1"


def test_grid_marks():
    s = make_schedule("1f1b", pp=2, microbatches=1)
    assert s.grid(marks=[(1, 0)]).splitlines()[2] == "0F0      | >>1RECV_F0<<"


# --- stage partitioning ---


def brute_force(costs, k):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = (0, *cuts, len(costs))
        parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        key = (max(parts), sum(p * p for p in parts))
        best = key if best is None or key < best else best
    return best


def score(costs, cuts):
    bounds = (0, *cuts, len(costs))
    parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert all(b > a for a, b in zip(bounds, bounds[1:]))
    return max(parts), sum(p * p for p in parts)


def test_balanced_partition_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)]
        cuts = balanced_partition(costs, k)
        assert len(cuts) == k - 1 and cuts == sorted(cuts)
        assert score(costs, cuts) == brute_force(costs, k), (costs, k, cuts)


def test_balanced_partition_examples():
    assert balanced_partition([5], 1) == []
    assert balanced_partition([1, 2, 3], 3) == [1, 2]
    assert balanced_partition([1] * 8, 4) == [2, 4, 6]
    # Max 4 either way ([1,1,1,1 | 4] or [...]); only one split reaches it.
    assert balanced_partition([1, 1, 1, 1, 4], 2) == [4]
    # Largest part 4 in both [3 | 1 1 1 | 3 1] and [3 1 | 1 1 | 3 1]; squares pick the first.
    assert balanced_partition([3, 1, 1, 1, 3, 1], 3) == [1, 4]


def test_balanced_partition_large():
    rng = random.Random(1)
    costs = [rng.uniform(0.5, 2.0) for _ in range(2000)]
    cuts = balanced_partition(costs, 128)
    largest, _ = score(costs, cuts)
    assert largest <= sum(costs) / 128 + 2.0


@pytest.mark.parametrize(
    ("costs", "k", "match"),
    [
        ([1.0, 2.0], 0, "k must be >= 1, got 0"),
        ([1.0, 2.0], 3, "cannot split 2 segments into 3 non-empty parts"),
        ([1.0, -2.0], 1, r"costs must be finite and >= 0, got costs\[1\] = -2"),
        ([float("inf")], 1, "costs must be finite"),
    ],
)
def test_balanced_partition_errors(costs, k, match):
    with pytest.raises(ValueError, match=match):
        balanced_partition(costs, k)


def test_docstring_examples():
    import doctest

    import autopart.schedule

    assert doctest.testmod(autopart.schedule, optionflags=doctest.ELLIPSIS).failed == 0

