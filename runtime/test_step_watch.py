"""The step watch without processes: works that never complete (NCCL's dead peer), a store that
holds the other ranks' reports, a monitor that fires on a blocked host."""
from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from autopart.runtime.step_watch import PEER_FAILURE_EXIT, PeerFailure, StepWatch, first_unfinished


class Work:
    def __init__(self, completed=True):
        self.completed = completed

    def is_completed(self):
        return self.completed


def batch(works, what, ops=None):
    return SimpleNamespace(works=works, what=what, ops=ops if ops is not None else list(works))


class Store:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_first_unfinished_is_the_first_work_not_done_in_posting_order():
    done = batch([Work(), Work()], ["could not deliver 0SEND_F0 to rank 1", "was waiting for 0RECV_B0 from rank 1"])
    stuck = batch([Work(completed=False)], ["was waiting for 0RECV_B1 from rank 1"])
    pending = batch([Work(completed=False)], ["was waiting for 0RECV_B2 from rank 1"])
    assert first_unfinished([done]) is None
    assert first_unfinished([done, stuck, pending]) == "was waiting for 0RECV_B1 from rank 1"
    assert first_unfinished([done, pending]) == "was waiting for 0RECV_B2 from rank 1"
    # NCCL: one work for a batch of two ops, the whole batch named
    coalesced = batch([Work(completed=False)], ["a", "b"], ops=[1, 2])
    assert first_unfinished([coalesced]) == "was waiting for the batch [a; b]"


def test_an_error_in_the_step_names_the_transfer_and_the_other_ranks():
    store, clock = Store(), Clock()
    store.set("autopart/failure/g/2/2", "rank 2 failed at step 2: OutOfMemoryError: CUDA out of memory")
    watch = StepWatch(0, 3, 10.0, store=store, namespace="g", clock=clock)
    with pytest.raises(PeerFailure) as info:
        with watch.watching(2):
            watch.ctx = SimpleNamespace(batches=[batch([Work(completed=False)],
                                                       ["was waiting for 0RECV_B1 from rank 1"])])
            raise RuntimeError("Connection reset by peer\nmore lines")
    text = str(info.value)
    assert text.startswith("rank 0 was waiting for 0RECV_B1 from rank 1 at step 2: RuntimeError: "
                           "Connection reset by peer\n"), text
    assert "reported by rank 2: rank 2 failed at step 2: OutOfMemoryError" in text, text
    assert "no report from rank(s) [1]: dead, or stuck outside the step" in text, text
    assert store.data["autopart/failure/g/2/0"].decode() == text.splitlines()[0]   # published


def test_errors_that_are_not_the_peers_pass_through():
    from autopart.errors import AutopartError

    watch = StepWatch(0, 1, 10.0)
    with pytest.raises(AutopartError, match="bad input"):
        with watch.watching(1):
            raise AutopartError("bad input")
    with pytest.raises(KeyError):
        with watch.watching(1):
            raise KeyError("x")


@pytest.mark.parametrize("nccl", [False, True])
def test_the_monitor_fires_on_a_step_without_progress(nccl):
    """3/4 of the timeout without an action finishing: the report goes to stderr; under NCCL the
    groups are aborted and, if the host is still blocked, the process ends with the report
    printed. Gloo raises by itself at the timeout: nothing is aborted."""
    clock, err, events = Clock(), io.StringIO(), []
    watch = StepWatch(1, 2, 10.0, clock=clock, err=err,
                      abort=(lambda: events.append("abort")) if nccl else None,
                      exit_fn=lambda code: events.append(code))
    watch.step, watch.last = 3, 0.0
    watch.ctx = SimpleNamespace(batches=[batch([Work(completed=False)], ["was waiting for 1RECV_F0 from rank 0"])])
    clock.now = 7.4
    assert not watch.check_stall()
    clock.now = 7.6
    assert watch.check_stall() and not watch.check_stall()          # once per step
    assert "rank 1 was waiting for 1RECV_F0 from rank 0 at step 3: no progress for 7.6 s" in err.getvalue()
    assert events == (["abort", PEER_FAILURE_EXIT] if nccl else [])


def test_a_step_between_progress_marks_is_not_a_stall():
    clock = Clock()
    watch = StepWatch(0, 1, 10.0, clock=clock, err=io.StringIO())
    with watch.watching(1):
        for _ in range(10):
            clock.now += 7.0
            watch.progress()
            assert not watch.check_stall()
    clock.now += 100.0
    assert not watch.check_stall()                                   # between steps: not watched


def test_a_rank_stuck_in_its_own_compute_names_the_action():
    clock, err = Clock(), io.StringIO()
    watch = StepWatch(1, 1, 10.0, clock=clock, err=err)
    watch.step, watch.last, watch.ctx = 2, 0.0, SimpleNamespace(batches=[])
    watch.begin("1F0")
    clock.now = 8.0
    assert watch.check_stall()
    assert "rank 1 was running 1F0 at step 2: no progress for 8.0 s" in err.getvalue()


def test_a_rank_busy_in_its_own_compute_is_reported_not_ended():
    """No transfer stuck and the host inside an action (an Inductor compile of the first
    microbatch, say): the monitor says so and leaves the rank alone, also under NCCL."""
    clock, err, events = Clock(), io.StringIO(), []
    watch = StepWatch(0, 2, 10.0, clock=clock, err=err, abort=lambda: events.append("abort"),
                      exit_fn=lambda code: events.append(code))
    watch.step, watch.last = 1, 0.0
    watch.ctx = SimpleNamespace(batches=[batch([Work()], ["could not deliver 0SEND_F0 to rank 1"])])
    watch.begin("0F0")
    clock.now = 8.0
    assert watch.check_stall() and events == [] and watch.report is None
    assert "rank 0 was running 0F0 at step 1: no progress for 8.0 s" in err.getvalue()
    clock.now = 12.0
    assert not watch.check_stall()          # reported again only after another 3/4 timeout


def test_a_wait_that_stalled_and_then_ended_well_keeps_the_step_on_gloo():
    """A rank waiting past 3/4 of the timeout for a peer that was compiling (Gloo: nothing is
    aborted): the report is printed, and when the transfer arrives the step stands (it raised
    after the step before, so a slow Inductor compile on one rank failed its peers' step)."""
    clock, err = Clock(), io.StringIO()
    watch = StepWatch(2, 4, 10.0, clock=clock, err=err)
    with watch.watching(1):
        watch.ctx = SimpleNamespace(batches=[batch([Work(completed=False)],
                                                   ["was waiting for 1RECV_F0 from rank 0"])])
        clock.now = 8.0
        assert watch.check_stall()
        assert "rank 2 was waiting for 1RECV_F0 from rank 0 at step 1" in err.getvalue()
        watch.progress()                  # the transfer arrived, the step goes on to its end
