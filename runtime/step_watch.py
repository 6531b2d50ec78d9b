"""Named failures under NCCL's contract as under Gloo's: the step, the action and the peer.

On Gloo a wait on a dead or silent peer raises, and the executor turns that into a PeerFailure
naming the action and the peer (runtime/executor.py). On NCCL `wait()` only orders streams: it
never blocks the host nor raises. The host runs through the step, then blocks in its first sync
(the health check's verdict), and NCCL's watchdog aborts the process once a work passes the
group's timeout, naming a sequence number. So each rank keeps a StepWatch:

- **the works say what is stuck.** The executor records every batch of transfers it posts in a
  step (`StepContext.batches`); the first whose work is not complete, or failed, is what this rank
  waits for ("was waiting for 0RECV_B1 from rank 1"), read from the works' own state
  (`is_completed`, `is_success`: NCCL's are the CUDA events of its kernels), thread-safe and
  without a sync.
- **the store says who.** A rank that fails publishes its report in the c10d store the ranks
  already share (under the model's world group name, so several models in one job never mix);
  every failing rank reads the others' for a short while, and names the ranks that said nothing
  (dead, or stuck outside the step).
- **a monitor thread for a blocked host.** When a step makes no progress (no action finished) for
  3/4 of the model's timeout, the monitor writes the report to stderr and to the store; where the
  backend would not raise by itself (NCCL) it aborts the process groups, so the blocked sync
  returns and train_step raises the report, and if the host is still blocked a little later it
  ends the process (exit code PEER_FAILURE_EXIT) with the report printed, before NCCL's watchdog
  would have, without the names. On Gloo it only records: Gloo raises at the timeout.

Between train_steps nothing is watched (a user's evaluation may take any time).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable

from autopart.errors import AutopartError

PEER_FAILURE_EXIT = 75          # the exit code of a rank the monitor ends (EX_TEMPFAIL)
# The monitor fires after STALL x the timeout without progress and ends a rank still blocked
# GRACE x the timeout later: before NCCL's watchdog (a work's enqueue + the timeout; the host's
# last progress comes after the enqueue of what it waits for), later than any step of a healthy
# job should go without finishing an action.
STALL, GRACE = 0.75, 0.1


class PeerFailure(RuntimeError):
    """A step that failed because a peer died or stopped responding within the timeout. The
    message names this rank, the action, the peer and the step."""


def first_unfinished(batches) -> str | None:
    """What the step's first transfer that did not complete was for, in posting order (`batches`:
    the executor's _Batch objects, each with `works` and `what`); None when all completed. On
    NCCL a transfer to a dead peer never completes; on Gloo a failed wait raises by itself."""
    for batch in list(batches):
        coalesced = len(batch.works) != len(batch.ops)
        for i, work in enumerate(list(batch.works)):
            try:
                done = work.is_completed()
            except RuntimeError:        # a work that failed may raise when asked
                done = False
            if not done:
                return ("was waiting for the batch [" + "; ".join(map(str, batch.what)) + "]") \
                    if coalesced else str(batch.what[i])
    return None


class StepWatch:
    """One rank's watch over its train_steps (see the module docstring). `store`: the c10d store,
    or None; `namespace`: keys of this model (its world group's name); `abort`: called by the
    monitor when the backend would not raise by itself (NCCL), or None (Gloo)."""

    def __init__(self, rank: int, world: int, timeout_s: float, store=None, namespace: str = "",
                 abort: Callable[[], None] | None = None, clock=time.monotonic, err=None,
                 exit_fn=os._exit):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.store, self.prefix, self.abort = store, f"autopart/failure/{namespace}/", abort
        self.clock, self.err, self.exit_fn = clock, err, exit_fn
        self.step: int | None = None     # the step running, None between steps
        self.action = None               # the compute action running, None between them
        self.ctx = None                  # its StepContext, once the driver made it
        self.last = clock()              # when the step last made progress
        self.report: str | None = None   # the monitor's, once it fired in this step
        self.aborted = False             # the monitor aborted the process groups (NCCL)
        self._thread: threading.Thread | None = None

    # -- the main thread ------------------------------------------------------------------------
    @contextmanager
    def watching(self, step: int):
        """Around one train_step: an error from a transfer or collective becomes a PeerFailure
        naming what this rank waited for and what the other ranks reported."""
        self.step, self.ctx, self.report, self.last = step, None, None, self.clock()
        self.aborted = False
        self.action = None
        self._start()
        try:
            yield self
        except (AutopartError, PeerFailure) as e:
            if isinstance(e, PeerFailure):
                self._publish(str(e))
            raise
        except RuntimeError as e:
            raise PeerFailure(self.report or self.describe(e)) from e
        finally:
            self.step = None
        if self.report is not None and self.aborted:
            # the monitor aborted the groups (NCCL) and the blocked sync returned after all: the
            # step's transfers cannot be trusted. Without an abort (Gloo) the wait that stalled
            # ended well (a peer compiling its first microbatch for longer than 3/4 of the
            # timeout, say): the step stands, its report was printed.
            raise PeerFailure(self.report)

    def begin(self, action) -> None:
        """A compute action starts (the executor calls this before each)."""
        self.action = action

    def progress(self) -> None:
        """An action finished (the executor calls this after each)."""
        self.last, self.action = self.clock(), None

    def describe(self, error: BaseException | None = None, stalled_s: float | None = None,
                 where: str | None = None) -> str:
        """This rank's report (published to the store), with the other ranks' reports; `where`:
        first_unfinished of the step's batches, when the caller has it already."""
        if where is None and self.ctx is not None:
            where = first_unfinished(self.ctx.batches)
        step = self.step
        action = self.action
        if where is not None:
            head = f"rank {self.rank} {where} at step {step}"
        elif action is not None:
            head = f"rank {self.rank} was running {action} at step {step}"
        else:
            head = f"rank {self.rank} failed at step {step}"
        if stalled_s is not None:
            head += f": no progress for {stalled_s:.1f} s (the timeout is {self.timeout_s:g} s)"
        elif error is not None:
            text = str(error).strip()
            head += f": {type(error).__name__}: {text.splitlines()[0] if text else ''}"
        self._publish(head)
        others = self._others()
        return head + ("\n  " + "\n  ".join(others) if others else "")

    # -- the store -------------------------------------------------------------------------------
    def _publish(self, text: str) -> None:
        if self.store is not None:
            _bounded(lambda: self.store.set(f"{self.prefix}{self.step}/{self.rank}", text), 2.0)

    def _others(self, wait_s: float | None = None) -> list[str]:
        """The other ranks' reports of this step, waiting a little for those not yet in; the
        silent ones named."""
        if self.store is None or self.world < 2:
            return []
        wait_s = min(2.0, self.timeout_s / 10) if wait_s is None else wait_s
        keys = {r: f"{self.prefix}{self.step}/{r}" for r in range(self.world) if r != self.rank}
        deadline, got = time.monotonic() + wait_s, {}
        while True:   # one bounded pass over the keys not yet in, not a thread per key
            left = {r: k for r, k in keys.items() if r not in got}
            got.update(_bounded(lambda: self._read(left), 1.0 + 0.01 * len(left)) or {})
            if len(got) == len(keys) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        lines = [f"reported by rank {r}: {got[r]}" for r in sorted(got) if got[r]]
        silent = sorted(set(keys) - set(got))
        if silent:
            lines.append(f"no report from rank(s) {silent}: dead, or stuck outside the step")
        return lines

    def _read(self, keys: dict) -> dict:
        """{rank: report} of those of `keys` (rank -> store key) the store holds already."""
        return {r: self.store.get(k).decode() for r, k in keys.items() if self.store.check([k])}

    # -- the monitor thread ----------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._monitor, daemon=True, name="autopart-step-watch")
            self._thread.start()

    def _monitor(self) -> None:
        poll = max(0.05, min(1.0, self.timeout_s / 20))
        while True:
            time.sleep(poll)
            self.check_stall()

    def check_stall(self) -> bool:
        """Fire once per step when it made no progress for STALL of the timeout; True if it fired."""
        step, stalled = self.step, self.clock() - self.last
        if step is None or self.report is not None or stalled < self.timeout_s * STALL:
            return False
        where = first_unfinished(self.ctx.batches) if self.ctx is not None else None
        busy = self.action is not None and where is None
        report = self.describe(stalled_s=stalled, where=where)
        self.report = None if busy else report
        print(f"autopart: {report}", file=self.err or sys.stderr, flush=True)
        if busy:     # in its own compute (an Inductor compile, say), no transfer stuck: report
            self.last = self.clock()     # once per STALL, and leave the rank alone
            return True
        if self.abort is not None:       # NCCL: nothing else would end the blocked sync in time
            self.aborted = True
            self.abort()
            time.sleep(min(self.timeout_s * GRACE, 30.0))
            if self.step == step:
                self.exit_fn(PEER_FAILURE_EXIT)
        return True


def watch_for(groups, rank: int) -> StepWatch:
    """The StepWatch of a model's RankGroups: the job's c10d store, keys under the model's world
    group's name; under NCCL the monitor aborts the groups (nothing else ends a blocked sync)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    store = _quiet(c10d._get_default_store)
    nccl = groups.world is not None and dist.get_backend(groups.world) == "nccl"
    # a batch_isend_irecv that keeps NCCL's contract over another backend (tests/nccl_contract.py)
    # says so: its waits do not raise either
    nccl = nccl or getattr(dist.batch_isend_irecv, "keeps_nccl_contract", False)
    abort = (lambda: _quiet(c10d._abort_process_group)) if nccl else None
    timeout = groups.timeout.total_seconds() if groups.timeout is not None else 300.0
    return StepWatch(rank, groups.mesh.world_size, timeout, store,
                     str(getattr(groups.world, "group_name", "")), abort)


def _bounded(fn, seconds: float):
    """fn() in a helper thread, given up after `seconds` (a store whose host died must not hang
    the report); None then."""
    out = [None]
    t = threading.Thread(target=lambda: out.__setitem__(0, _quiet(fn)), daemon=True)
    t.start()
    t.join(seconds)
    return out[0]


def _quiet(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001  (the store is a best effort: the report stands without it)
        return None


__all__ = ["PeerFailure", "StepWatch", "first_unfinished", "watch_for", "PEER_FAILURE_EXIT"]
