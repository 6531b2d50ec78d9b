"""NCCL's point-to-point contract, kept over Gloo on CPU (a test aid: no product code imports it).

Gloo and NCCL give `torch.distributed.batch_isend_irecv` different contracts, and code written
against Gloo's can be silently wrong on GPUs. torch 2.13's `batch_isend_irecv` (distributed_c10d.py)
takes its `supports_coalescing` branch for NCCL: the batch runs as one coalesced group and ONE work
is returned for all its ops; Gloo does not coalesce and returns one work per op. On NCCL a
receive buffer holds the data only in stream order after that work's `wait()` (which itself only
makes the current stream wait: it neither blocks the host nor raises when the peer is dead; the
process is aborted by NCCL's watchdog once the work passes the group's timeout). A program that
reads a receive it has not waited on reads garbage, with no error.

`install()` (in a rank process, after nothing or after init_process_group) replaces
`torch.distributed.batch_isend_irecv` with one that keeps that contract over the real Gloo ops:

- one `BatchWork` is returned per call, whatever the number of ops;
- receives land in private buffers; the caller's buffers are poisoned when the batch is posted
  (NaN for floating dtypes, the dtype's largest value for integers: an index out of range) and
  filled only by that BatchWork's `wait()`;
- works of one process group complete in posting order (NCCL runs a group's batches on one
  stream): waiting a batch first completes the transfers of the batches posted before it on the
  same group, without filling their buffers (each batch's buffers need its own wait);
- `wait()` never raises: a failed transfer (a dead peer: Gloo raises) is recorded in `errors`,
  its buffers stay poisoned, and a watchdog thread aborts the process (exit code 134, a line on
  stderr) when the group's timeout has passed since the batch was posted, as NCCL's watchdog
  does (AUTOPART_TEST_NCCL_CONTRACT_ABORT=0: record only).

Not emulated: collectives (they keep Gloo's behaviour: blocking, raising on a dead peer), CUDA
streams, and isend/irecv called outside a batch (the runtime never does: tests/test_nccl_contract.py
checks that by grepping the product's sources).

Use: `install()` in a rank function (`run_cases` below wraps tests.workers.equivalence.run_cases),
or set AUTOPART_TEST_NCCL_CONTRACT=1 in the environment of a test run: tests/workers/common.py
installs the contract when it is imported, which every rank process of the multi-process tests
does.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "AUTOPART_TEST_NCCL_CONTRACT"
ABORT_ENV = "AUTOPART_TEST_NCCL_CONTRACT_ABORT"
ABORT_EXIT_CODE = 134                       # what SIGABRT (NCCL's watchdog) gives a process

TORCH_BATCH_ISEND_IRECV = c10d.batch_isend_irecv    # torch's own, whatever is installed later
errors: list[str] = []                      # transfers that failed; wait() returned anyway
stats = {"batches": 0, "ops": 0, "waits": 0}
_original = None
# id(group) -> (group, its BatchWorks not yet transferred): the group is held, so that its id
# is never reused by a later group
_pending: dict[int, tuple] = {}
_lock = threading.Lock()


def installed() -> bool:
    return _original is not None


def install() -> None:
    """Make torch.distributed.batch_isend_irecv keep NCCL's contract in this process."""
    global _original
    if _original is None:
        _original = dist.batch_isend_irecv
        dist.batch_isend_irecv = batch_isend_irecv
        c10d.batch_isend_irecv = batch_isend_irecv


def uninstall() -> None:
    global _original
    if _original is not None:
        dist.batch_isend_irecv = c10d.batch_isend_irecv = _original
        _original = None


def install_from_env() -> None:
    if os.environ.get(ENV, "") not in ("", "0"):
        install()


def poison(t: torch.Tensor) -> None:
    """Fill `t` with a value no real transfer in these tests carries."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).max)


def _timeout_of(group) -> timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001  (a group without Gloo options: torch's default)
        return c10d.default_pg_timeout


class BatchWork:
    """The one work of a batch: wait() completes the batch, then fills its receive buffers."""

    def __init__(self, group, works: list, landing: list, what: str):
        self.group, self._works, self._landing, self.what = group, works, landing, what
        self.posted = time.monotonic()
        self._transferred = False
        self._failed: str | None = None
        self._filled = False

    def _transfer(self) -> None:
        if self._transferred:
            return
        self._transferred = True
        for w in self._works:
            try:
                w.wait()
            except RuntimeError as e:       # the peer died or timed out: NCCL would not raise
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self._failed = f"rank {dist.get_rank()}: {self.what} failed: {first}"
                errors.append(self._failed)
                _watchdog(self._failed, self.posted + _timeout_of(self.group).total_seconds())
                return

    def wait(self, timeout=None) -> bool:   # noqa: ARG002  (the Work signature)
        stats["waits"] += 1
        with _lock:
            queue = _pending.get(id(self.group), (None, []))[1]
            earlier = queue[:queue.index(self) + 1] if self in queue else []
            del queue[:len(earlier)]
        for work in earlier:                # in posting order, as on one NCCL stream
            work._transfer()
        self._transfer()
        if not self._filled and self._failed is None:
            with torch.no_grad():           # NCCL writes the memory whatever autograd thinks of it
                for private, user in self._landing:
                    user.copy_(private)
            self._filled = True
        return True

    def is_completed(self) -> bool:
        """NCCL's: the kernels ran, whether waited on or not; a transfer to a dead peer never
        completes (its watchdog ends the process instead)."""
        return self._failed is None and (self._filled or all(w.is_completed() for w in self._works))

    def is_success(self) -> bool:
        return self._filled

    def exception(self):
        return None


def batch_isend_irecv(p2p_op_list: list) -> list[BatchWork]:
    """torch.distributed.batch_isend_irecv as NCCL's coalescing branch behaves: one work (the
    runtime reads `keeps_nccl_contract` below and lowers its lists for NCCL: runtime/executor.py
    posts_never_wait)."""
    c10d._check_p2p_op_list(p2p_op_list)
    group = p2p_op_list[0].group or c10d._get_default_group()
    works, landing, parts = [], [], []
    for op in p2p_op_list:
        if op.op is c10d.isend:
            works.append(c10d.isend(op.tensor, group=op.group, tag=op.tag,
                                    group_dst=op.group_peer))
            parts.append(f"send to {op.peer}")
        else:
            private = torch.empty_like(op.tensor)
            poison(op.tensor)
            landing.append((private, op.tensor))
            works.append(c10d.irecv(private, group=op.group, tag=op.tag,
                                    group_src=op.group_peer))
            parts.append(f"recv from {op.peer}")
    stats["batches"] += 1
    stats["ops"] += len(p2p_op_list)
    work = BatchWork(group, works, landing, "batch [" + ", ".join(parts) + "]")
    with _lock:
        _pending.setdefault(id(group), (group, []))[1].append(work)
    return [work]


# the runtime reads it: its StepWatch (waits that do not raise), its lowering (NCCL's)
batch_isend_irecv.keeps_nccl_contract = True


def _watchdog(what: str, deadline: float) -> None:
    if os.environ.get(ABORT_ENV, "1") == "0":
        return

    def fire() -> None:
        time.sleep(max(0.0, deadline - time.monotonic()))
        print(f"[nccl-contract watchdog] {what}; the group's timeout has passed: aborting the "
              "process, as NCCL's watchdog does", file=sys.stderr, flush=True)
        os._exit(ABORT_EXIT_CODE)
    threading.Thread(target=fire, daemon=True, name="nccl-contract-watchdog").start()


# -- rank functions ------------------------------------------------------------------------------

def run_cases(rank: int, world: int, cases: list) -> list[dict]:
    """tests.workers.equivalence.run_cases under the contract."""
    from tests.workers import equivalence
    return under_contract(equivalence.run_cases, rank, world, cases)


def under_contract(fn, rank: int, world: int, *args):
    """Rank function `fn(rank, world, *args)` run under the contract (pass
    functools.partial(under_contract, fn) as a rank function). Each per-case result dict (a
    list of them: tests.workers.equivalence.run_cases's form) gets "contract": the batches this
    rank posted through the contract and the transfers that failed."""
    install()
    out = fn(rank, world, *args)
    if isinstance(out, list):
        for r in out:
            if isinstance(r, dict):
                r["contract"] = dict(stats, errors=list(errors))
    return out


def contract_checks(rank: int, world: int, timeout_s: float) -> dict:
    """Rank function for tests/test_nccl_contract.py (world 2): what Gloo and the contract do."""
    import os as _os
    assert world == 2
    peer, out = 1 - rank, {}
    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))

    def batch(n: int, base: float):
        sends = [torch.full((4,), base + 10 * rank + i) for i in range(n)]
        recvs = [torch.zeros(4) for _ in range(n)]
        ops = [dist.P2POp(dist.isend, s, peer, group) for s in sends]
        ops += [dist.P2POp(dist.irecv, r, peer, group) for r in recvs]
        return ops, recvs

    def expected(n: int, base: float):
        return [[base + 10 * peer + i] * 4 for i in range(n)]

    import tests.workers.common  # noqa: F401  (installs the contract when the environment asks)
    out["installed_by_env"] = installed()
    ops, recvs = batch(2, 0.0)
    works = TORCH_BATCH_ISEND_IRECV(ops)            # Gloo as it is
    out["gloo_works"] = len(works)
    for w in works:
        w.wait()
    out["gloo_ok"] = [r.tolist() for r in recvs] == expected(2, 0.0)

    install()
    ops, recvs = batch(2, 100.0)
    works = dist.batch_isend_irecv(ops)
    out["contract_works"] = len(works)
    time.sleep(0.5)                      # Gloo has long delivered: the data sits in private buffers
    out["poisoned_before_wait"] = [bool(r.isnan().all()) for r in recvs]
    out["wait_returned"] = works[0].wait()
    out["filled_after_wait"] = [r.tolist() for r in recvs] == expected(2, 100.0)

    ops1, r1 = batch(1, 200.0)
    w1 = dist.batch_isend_irecv(ops1)
    ops2, r2 = batch(1, 300.0)
    w2 = dist.batch_isend_irecv(ops2)
    w2[0].wait()                         # completes batch 1's transfer too, fills only batch 2
    out["in_order"] = (bool(r1[0].isnan().all()), r2[0].tolist() == expected(1, 300.0)[0])
    w1[0].wait()
    out["earlier_filled_by_own_wait"] = r1[0].tolist() == expected(1, 200.0)[0]

    dist.barrier(group)
    if rank == 1:                        # the dead peer: gone before rank 0's receive is served
        return out
    _os.environ[ABORT_ENV] = "0"         # the watchdog is tested on its own (watchdog_check)
    buf = torch.zeros(4)
    start = time.monotonic()
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1, group)])
    try:
        out["dead_wait"] = works[0].wait()
    except Exception as e:  # noqa: BLE001
        out["dead_wait"] = f"raised {type(e).__name__}: {e}"
    out["dead_wait_s"] = time.monotonic() - start
    out["dead_errors"] = list(errors)
    out["dead_buffer_poisoned"] = bool(buf.isnan().all())
    return out


def watchdog_check(rank: int, world: int, timeout_s: float) -> None:
    """Rank function: rank 1 leaves; rank 0's wait on a receive from it returns, and the
    watchdog aborts rank 0 once the group's timeout has passed (rank 0 never returns)."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))
    install()
    dist.barrier(group)
    if rank == 1:
        return None
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(4), 1, group)])
    works[0].wait()
    time.sleep(4 * timeout_s + 5)        # bounded: the watchdog must end the process first
    return "not aborted"

