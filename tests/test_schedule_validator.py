"""The schedule validator (autopart.schedule.validate, the C++ core's dry run) against broken
action lists: missing, misordered and unneeded actions, split backwards, V placement and
deadlocks under NCCL's rendezvous semantics, each refused with the action and the step."""

from __future__ import annotations

import pytest

from autopart.schedule import Action, Schedule, ScheduleError, make_schedule, simulate, validate


def with_rank(schedule: Schedule, rank: int, tokens: str) -> Schedule:
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(Action.parse(t) for t in tokens.split())
    return Schedule(schedule.name, schedule.pp, schedule.microbatches, schedule.virtual_stages, tuple(ranks))



def zb(rank: int, tokens: str, name="zb-h1", pp=2, m=1, v=1) -> Schedule:
    return with_rank(make_schedule(name, pp, m, v), rank, tokens)


@pytest.mark.parametrize(
    ("rank", "tokens", "match"),
    [
        (1, "1RECV_F0 1F0 1W0 1I0 1SEND_B0", r"1W0 runs before its input gradient \(I\) \(1I0 at step 3\)"),
        (1, "1RECV_F0 1F0 1I0 1SEND_B0", "missing 1W0 on rank 1: microbatch 0's weight gradient of chunk 1 is never computed"),
        (1, "1RECV_F0 1F0 1B0 1SEND_B0 1W0", "1B0 and 1W0 on rank 1: a backward runs once, fused"),
        (1, "1RECV_F0 1F0 1I0 1B0 1SEND_B0 1W0", "1B0 and 1I0 on rank 1: a backward runs once"),
        (1, "1RECV_F0 1F0 1SEND_B0 1I0 1W0", r"1SEND_B0 runs before the backward producing it \(1I0 at step 3\)"),
        (0, "0F0 0SEND_F0 0I0 0RECV_B0 0W0", r"0I0 runs before its output gradient arrives \(0RECV_B0 at step 3\)"),
    ],
)
def test_validator_checks_split_backwards(rank, tokens, match):
    with pytest.raises(ScheduleError, match=match):
        validate(zb(rank, tokens))


def test_validator_checks_input_grad_order_on_one_rank():
    # zb-v pp=1: chunks 0 and 1 both on rank 0; chunk 0's I needs chunk 1's I first.
    s = Schedule("zb-v", 1, 1, 2, (tuple(Action.parse(t) for t in "0F0 1F0 0I0 1I0 1W0 0W0".split()),))
    with pytest.raises(ScheduleError, match=r"0I0 runs before the next chunk's backward \(1I0 at step 3\)"):
        validate(s)


def test_validator_checks_v_placement():
    s = make_schedule("zb-v", pp=2, microbatches=2, virtual_stages=2)
    tokens = " ".join(str(a) for a in s.ranks[0])
    with pytest.raises(ScheduleError, match=r"2F0 belongs on rank 1 \(in a V: chunk k lives on rank k for k < pp"):
        validate(with_rank(s, 0, "2F0 " + tokens))
    # the same list under a loop placement's name is wrong: chunk 3 would live on rank 1
    with pytest.raises(ScheduleError, match=r"belongs on rank 1 \(chunk k lives on rank k % pp\)"):
        validate(Schedule("handmade", 2, 2, 2, s.ranks))


def test_deadlock_from_late_input_grad_is_caught():
    # zb-h1 pp=2 m=2: rank 1 runs both forwards before sending any gradient back, but rank 0
    # waits for microbatch 0's gradient before sending microbatch 1.
    s = make_schedule("zb-h1", pp=2, microbatches=2)
    broken = with_rank(s, 0, "0F0 0SEND_F0 0RECV_B0 0I0 0W0 0F1 0SEND_F1 0RECV_B1 0I1 0W1")
    broken = with_rank(broken, 1, "1RECV_F0 1F0 1RECV_F1 1F1 1I0 1SEND_B0 1I1 1SEND_B1 1W0 1W1")
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(broken)


# --- the validator ---


def broken(rank: int, tokens: str, name="1f1b", pp=2, m=2, v=1) -> Schedule:
    return with_rank(make_schedule(name, pp, m, v), rank, tokens)


def test_validator_catches_missing_backward():
    s = broken(1, "1RECV_F0 1F0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")  # no 1B0
    with pytest.raises(ScheduleError) as error:
        validate(s)
    message = str(error.value)
    assert "missing 1B0 on rank 1: microbatch 0 never runs backward through chunk 1" in message
    assert ">>1F0<<" in message
    assert message.splitlines()[1].startswith("rank 0")


def test_validator_catches_backward_before_forward():
    s = broken(1, "1RECV_F0 1B0 1F0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")
    with pytest.raises(ScheduleError, match=r"rank 1 step 1: 1B0 runs before its forward \(1F0 at step 2\)") as error:
        validate(s)
    assert ">>1B0<<" in str(error.value) and ">>1F0<<" in str(error.value)


def test_validator_catches_compute_before_its_input_arrives():
    s = broken(1, "1F0 1RECV_F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")
    with pytest.raises(ScheduleError, match=r"1F0 runs before its input arrives \(1RECV_F0 at step 1\)"):
        validate(s)


def test_validator_catches_send_before_compute():
    s = broken(0, "0SEND_F0 0F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1")
    with pytest.raises(ScheduleError, match=r"0SEND_F0 runs before the forward producing it"):
        validate(s)


def test_validator_catches_deadlock_from_swapped_send_and_receive():
    # gpipe pp=2 m=2, but rank 0 waits for 0B0's gradient before sending microbatch 1 forward:
    # rank 1 needs microbatch 1 before it can produce that gradient.
    s = broken(0, "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0B0 0RECV_B1 0B1", name="gpipe")
    with pytest.raises(ScheduleError) as error:
        validate(s)
    message = str(error.value)
    assert "deadlock" in message
    assert "rank 0 is blocked at step 1 in batch [0SEND_F0 0RECV_B0]: 0RECV_B0 waits for rank 1 to post 1SEND_B0" in message
    assert "rank 1 is blocked at step 2 in batch [1RECV_F1]: 1RECV_F1 waits for rank 0 to post 0SEND_F1" in message
    assert ">>0RECV_B0<<" in message and ">>1RECV_F1<<" in message


def test_validator_catches_messages_posted_in_different_orders():
    # pp=2 interleaved: rank 0 sends both activations and gradients to rank 1. Swapping them in
    # one batch keeps the rendezvous but NCCL would hand each to the other's receive.
    s = make_schedule("interleaved-1f1b", pp=2, microbatches=4, virtual_stages=2)
    tokens = [str(a) for a in s.ranks[0]]
    i = next(i for i in range(len(tokens) - 1) if "SEND_F" in tokens[i] and "SEND_B" in tokens[i + 1])
    tokens[i], tokens[i + 1] = tokens[i + 1], tokens[i]
    with pytest.raises(ScheduleError, match="NCCL matches messages between two ranks by posting order"):
        validate(with_rank(s, 0, " ".join(tokens)))


@pytest.mark.parametrize(
    ("rank", "tokens", "match"),
    [
        (0, "0RECV_F0 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1", "0RECV_F0 is not needed: chunk 0 is the first"),
        (0, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0B1", r"0B1 appears twice on rank 0 \(steps 7 and 8\)"),
        (0, "0F0 1F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1", r"1F0 belongs on rank 1 \(chunk k lives on rank k % pp\)"),
        (0, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0F2", "0F2 names microbatch 2 but there are 2"),
        (0, "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0RECV_B1 0B1", "missing 0SEND_F1 on rank 0: 1RECV_F1 would wait forever"),
    ],
)
def test_validator_catches_malformed_lists(rank, tokens, match):
    with pytest.raises(ScheduleError, match=match):
        validate(broken(rank, tokens))


def test_validator_catches_unneeded_communication_on_one_rank():
    s = Schedule("handmade", 1, 1, 2, ((Action.parse("0F0"), Action.parse("0SEND_F0"), Action.parse("1RECV_F0"),
                                        Action.parse("1F0"), Action.parse("1B0"), Action.parse("0B0")),))
    with pytest.raises(ScheduleError, match="chunks 0 and 1 are both on rank 0, nothing crosses ranks"):
        validate(s)


def test_validator_checks_rank_count():
    s = make_schedule("1f1b", pp=2, microbatches=2)
    with pytest.raises(ScheduleError, match="the schedule has 1 rank lists but pp=2"):
        validate(Schedule(s.name, 2, 2, 1, s.ranks[:1]))


def test_error_grid_of_a_long_schedule_shows_the_marked_window():
    s = make_schedule("1f1b", pp=8, microbatches=32)
    tokens = [str(a) for a in s.ranks[3]]
    i, j = tokens.index("3F20"), tokens.index("3B20")
    tokens[i], tokens[j] = tokens[j], tokens[i]
    with pytest.raises(ScheduleError) as error:
        validate(with_rank(s, 3, " ".join(tokens)))
    message = str(error.value)
    assert ">>3B20<<" in message and ">>3F20<<" in message
    assert "\n... 104 steps\n" in message  # rows before the first mark's window are elided
    assert len(message.splitlines()) < 30


def test_simulating_an_invalid_schedule_raises():
    with pytest.raises(ScheduleError, match="missing"):
        simulate(broken(1, "1RECV_F0 1F0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"))
