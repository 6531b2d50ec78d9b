"""NCCL's contract, kept over Gloo on CPU (a test aid: no product code imports it).

Gloo and NCCL give `torch.distributed.batch_isend_irecv` and async collectives different
contracts, and code written against Gloo's can be silently wrong, or hang, on GPUs. torch 2.13's
`batch_isend_irecv` (distributed_c10d.py) takes its `supports_coalescing` branch for NCCL: the
batch runs as one coalesced group and ONE work is returned for all its ops; Gloo does not coalesce
and returns one work per op. NCCL runs a group's batches on one stream, one after the other in
posting order, and a batch completes only once every op in it met its peer's matching op
(ncclSend/ncclRecv: "blocking for the GPU" until the peer runs the matching call); Gloo's sends
go out at once. On NCCL a receive buffer, or a collective's output, holds the data only in stream
order after its work's `wait()` (which only makes the current stream wait: it neither blocks the
host nor raises when the peer is dead; the process is aborted by NCCL's watchdog once the work
passes the group's timeout). A program that reads a buffer it has not waited on reads garbage.

`install()` (in a rank process, after nothing or after init_process_group) replaces
`torch.distributed.batch_isend_irecv`, and the async forms of the collectives the runtime posts
(all_reduce, all_gather_into_tensor / all_gather_single, reduce_scatter_tensor: the process
group's methods, so every caller is covered), with ones that keep that contract over Gloo:

- one `BatchWork` is returned per call, whatever the number of ops;
- each process group has a stream (a thread of this process): its batches run one at a time in
  posting order, whatever the host does. A batch starts when the batch before it completed; it
  posts its receives, tells each peer which of its receives is posted (a message of its own,
  tag CTRL_TAG), and sends each op only once the peer's matching receive is posted (messages
  match per pair in posting order, as NCCL's do). So a batch completes only when its peer's
  matching batches are running: a list that deadlocks on NCCL deadlocks here, and is reported
  when the group's timeout has passed (a failed transfer, below);
- receives land in private buffers; the caller's buffers are poisoned when the batch is posted
  (NaN for floating dtypes, the dtype's largest value for integers: an index out of range; bool
  has no invalid value: random bits, then the opposite of what arrived) and filled only by that
  BatchWork's `wait()`, which blocks until the stream ran the batch (what runs after it on the
  host is what NCCL would run after it on the stream);
- an async collective runs on copies of its tensors; its output is poisoned until its work's
  `wait()` delivers the result (sync collectives keep Gloo's behaviour: blocking, raising);
- no `wait()` raises: a failed transfer or collective (a dead peer: Gloo raises; a deadlock: no
  peer op within the timeout) is recorded in `errors`, its buffers stay poisoned, the batches
  after a failed one on its stream never run, and a watchdog thread aborts the process (exit code
  134, a line on stderr naming it) when the group's timeout has passed since it was posted, as
  NCCL's watchdog does (AUTOPART_TEST_NCCL_CONTRACT_ABORT=0: record only).

Not emulated: the order between a group's collectives and its batches (NCCL's share a stream),
CUDA streams, and isend/irecv called outside a batch (the runtime never does:
tests/test_nccl_contract.py checks that by grepping the product's sources).

Use: `install()` in a rank function (`run_cases` in tests/workers/nccl_contract.py wraps
tests.workers.equivalence.run_cases), or set AUTOPART_TEST_NCCL_CONTRACT=1 in the environment of a
test run: tests/workers/common.py installs the contract when it is imported, which every rank
process of the multi-process tests does.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup

ENV = "AUTOPART_TEST_NCCL_CONTRACT"
ABORT_ENV = "AUTOPART_TEST_NCCL_CONTRACT_ABORT"
ABORT_EXIT_CODE = 134                       # what SIGABRT (NCCL's watchdog) gives a process
CTRL_TAG = 0x6E63                           # "my receive is posted": the stream's own messages
# the process group's methods behind the collectives the runtime posts with async_op=True
# (runtime/buckets.py, runtime/sharding.py, runtime/param_shards.py)
ASYNC_COLLECTIVES = ("allreduce", "all_gather_single", "reduce_scatter_single",
                     "all_to_all_single")  # the last: the experts' (autopart/ops/ep_async.py)

TORCH_BATCH_ISEND_IRECV = c10d.batch_isend_irecv    # torch's own, whatever is installed later
errors: list[str] = []          # transfers and collectives that failed; wait() returned anyway
# "unflagged": batches posted while torch.distributed.batch_isend_irecv was a wrapper over this one
# without its keeps_nccl_contract: the runtime then lowered its lists for Gloo, not NCCL
stats = {"batches": 0, "ops": 0, "waits": 0, "collectives": 0, "unflagged": 0}
_original = None
_torch_collectives: dict = {}   # method name -> torch's, while installed
# id(group) -> (group, its _Stream): the group is held, so that its id is never reused
_streams: dict[int, tuple] = {}
_lock = threading.Lock()


def installed() -> bool:
    return _original is not None


def install() -> None:
    """Make batch_isend_irecv and the async collectives keep NCCL's contract in this process."""
    global _original
    if _original is None:
        _original = dist.batch_isend_irecv
        dist.batch_isend_irecv = c10d.batch_isend_irecv = batch_isend_irecv
        for name in ASYNC_COLLECTIVES:
            # the raw descriptor: getattr gives pybind's unbound builtin, which set back on the
            # class no longer binds `self` (uninstall would break every later collective)
            _torch_collectives[name] = ProcessGroup.__dict__[name]
            setattr(ProcessGroup, name, _stream_ordered(getattr(ProcessGroup, name)))


def uninstall() -> None:
    global _original
    if _original is not None:
        dist.batch_isend_irecv = c10d.batch_isend_irecv = _original
        _original = None
        for name, fn in _torch_collectives.items():
            setattr(ProcessGroup, name, fn)
        _torch_collectives.clear()


def install_from_env() -> None:
    if os.environ.get(ENV, "") not in ("", "0"):
        install()


def reset_counts() -> None:
    """Zero `stats` and clear `errors` (at each case's start: what a case reports is its own)."""
    for k in stats:
        stats[k] = 0
    errors.clear()


def poison(t: torch.Tensor, arrived: torch.Tensor | None = None) -> None:
    """Fill `t` with what no real transfer in these tests carries. bool has no such value: the
    opposite of what `arrived` (the data not yet delivered), random bits before it is known."""
    with torch.no_grad():      # NCCL writes the memory whatever autograd thinks of it
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
        elif arrived is not None:
            torch.logical_not(arrived, out=t)
        else:
            t.copy_(torch.rand(t.shape, device=t.device) < 0.5)


def _timeout_of(group) -> timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001  (a group without Gloo options: torch's default)
        return c10d.default_pg_timeout


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- point to point: batches on a stream ---------------------------------------------------------

@dataclass
class _Transfer:
    """One op of a batch. `seq`: its place among this pair's transfers in its direction, in
    posting order (what NCCL matches by)."""
    send: bool
    tensor: torch.Tensor              # the caller's: sent from, or filled by wait()
    peer: int                         # the peer's rank in the group
    tag: int
    seq: int
    rank: int                         # the peer's global rank (what messages name)
    private: torch.Tensor | None = None     # where a receive lands
    works: list = field(default_factory=list)
    keep: list = field(default_factory=list)    # the control messages' tensors, while in flight

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} #{self.seq} {'to' if self.send else 'from'} " \
               f"{self.rank}"


class _Stuck(RuntimeError):
    """A transfer of a batch that did not complete: what it waited for, and why."""


class _Stream:
    """One process group's NCCL stream on this rank: its batches run one at a time in posting
    order on a thread of their own, as NCCL's kernels run whatever the host does."""

    def __init__(self, group):
        self.group, self.queue, self.cond = group, collections.deque(), threading.Condition()
        self.posted = 0
        self.stuck: str | None = None       # the batch that failed: nothing after it runs
        self.count = {True: collections.Counter(), False: collections.Counter()}
        threading.Thread(target=self._run, daemon=True, name="nccl-contract-stream").start()

    def transfer(self, op) -> _Transfer:
        send = op.op is c10d.isend
        self.count[send][op.group_peer] += 1
        return _Transfer(send, op.tensor, op.group_peer, op.tag, self.count[send][op.group_peer],
                         op.peer)

    def post(self, work: "BatchWork") -> None:
        with self.cond:
            self.posted += 1
            work.index = self.posted
            self.queue.append(work)
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                work = self.queue.popleft()
            if self.stuck is None:
                work.run()
                self.stuck = work.failed and work.describe()
            else:
                work.fail(f"never ran: {self.stuck}, before it on the group's stream, did not "
                          "complete")
            work.done.set()


def _stream_of(group) -> _Stream:
    with _lock:
        if id(group) not in _streams:
            _streams[id(group)] = (group, _Stream(group))
        return _streams[id(group)][1]


class BatchWork:
    """The one work of a batch: its stream runs it; wait() waits for that, then fills the
    caller's receive buffers."""

    def __init__(self, group, transfers: list[_Transfer], what: str):
        self.group, self.transfers, self.what = group, transfers, what
        self.posted = time.monotonic()
        self.index = 0                      # its place on the group's stream (1: the first)
        self.done = threading.Event()       # the stream is through with it
        self.failed: str | None = None
        self._filled = False

    def describe(self) -> str:
        return f"{self.what} (batch {self.index} on its group's stream)"

    # -- on the stream's thread ------------------------------------------------------------------
    def run(self) -> None:
        try:
            receives = [t for t in self.transfers if not t.send]
            for t in receives:
                _post_receive(self.group, t)
            by_peer: dict[int, list] = {}
            for t in self.transfers:
                if t.send:
                    by_peer.setdefault(t.peer, []).append(t)
            _concurrently([lambda ts=ts: _send_when_posted(self.group, ts)
                           for ts in by_peer.values()])
            for t in self.transfers:
                _finish(t)
        except RuntimeError as e:
            self.fail(f"did not complete: {_first_line(e)}")
            return
        for t in receives:      # delivered, not yet waited on: bool gets the opposite
            if t.tensor.dtype == torch.bool:
                poison(t.tensor, arrived=t.private)

    def fail(self, why: str) -> None:
        _record(self, f"rank {dist.get_rank()}: {self.describe()} {why}")

    # -- the caller's ----------------------------------------------------------------------------
    def wait(self, timeout=None) -> bool:   # noqa: ARG002  (the Work signature)
        stats["waits"] += 1
        # bounded: each Gloo wait of the stream is bounded by the group's timeout
        if not self.done.wait(4 * _timeout_of(self.group).total_seconds() + 60):
            self.fail("was never run by its stream")
            self.done.set()
        if not self._filled and self.failed is None:
            with torch.no_grad():
                for t in self.transfers:
                    if not t.send:
                        t.tensor.copy_(t.private)
            self._filled = True
        return True

    def is_completed(self) -> bool:
        """NCCL's: the kernels ran, whether waited on or not; a transfer that failed never
        completes (its watchdog ends the process instead)."""
        return self.done.is_set() and self.failed is None

    def is_success(self) -> bool:
        return self._filled

    def exception(self):
        return None


def _post_receive(group, t: _Transfer) -> None:
    """Post the receive into its private buffer, then tell the peer it is posted: its seq and
    size (a mismatch, which NCCL does not check, fails the sender's batch)."""
    t.works.append(c10d.irecv(t.private, group=group, tag=t.tag, group_src=t.peer))
    token = torch.tensor([t.seq, t.private.numel()], dtype=torch.int64)
    t.keep.append(token)
    t.works.append(c10d.isend(token, group=group, tag=CTRL_TAG, group_dst=t.peer))


def _send_when_posted(group, sends: list[_Transfer]) -> None:
    """Send each of `sends` (one peer's, in posting order) once the peer's matching receive is
    posted."""
    for t in sends:
        token = torch.zeros(2, dtype=torch.int64)
        try:
            c10d.irecv(token, group=group, tag=CTRL_TAG, group_src=t.peer).wait()
        except RuntimeError as e:
            raise _Stuck(f"{t}: the peer's matching receive was never posted "
                         f"({_first_line(e)})") from e
        seq, numel = token.tolist()
        if (seq, numel) != (t.seq, t.tensor.numel()):
            raise _Stuck(f"{t} of {t.tensor.numel()} elements met the peer's receive #{seq} of "
                         f"{numel}")
        t.works.append(c10d.isend(t.tensor, group=group, tag=t.tag, group_dst=t.peer))


def _finish(t: _Transfer) -> None:
    for w in t.works:
        try:
            w.wait()
        except RuntimeError as e:
            raise _Stuck(f"{t}: {'not delivered' if t.send else 'nothing arrived'} "
                         f"({_first_line(e)})") from e


def _concurrently(fns: list) -> None:
    """Run `fns` at once (a batch's sends to different peers progress together, as in one NCCL
    group: one peer's late receive must not hold back another's); raise the first failure."""
    failures: list = []

    def guarded(fn) -> None:
        try:
            fn()
        except RuntimeError as e:
            failures.append(e)
    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in fns[1:]]
    for th in threads:
        th.start()
    if fns:
        guarded(fns[0])
    for th in threads:
        th.join()
    if failures:
        raise failures[0]


def batch_isend_irecv(p2p_op_list: list) -> list[BatchWork]:
    """torch.distributed.batch_isend_irecv as NCCL's coalescing branch behaves: one work, run on
    the group's stream (the runtime reads `keeps_nccl_contract` below and lowers its lists for
    NCCL: runtime/executor.py posts_never_wait)."""
    c10d._check_p2p_op_list(p2p_op_list)
    group = p2p_op_list[0].group or c10d._get_default_group()
    stream = _stream_of(group)
    transfers = [stream.transfer(op) for op in p2p_op_list]
    for t in transfers:
        if not t.send:
            t.private = torch.empty_like(t.tensor)
            poison(t.tensor)
    stats["batches"] += 1
    stats["ops"] += len(p2p_op_list)
    stats["unflagged"] += not getattr(dist.batch_isend_irecv, "keeps_nccl_contract", False)
    what = ", ".join(f"{'send to' if op.op is c10d.isend else 'recv from'} {op.peer}"
                     for op in p2p_op_list)
    work = BatchWork(group, transfers, f"batch [{what}]")
    stream.post(work)
    return [work]


# the runtime reads it: its StepWatch (waits that do not raise), its lowering (NCCL's)
batch_isend_irecv.keeps_nccl_contract = True


# -- async collectives ---------------------------------------------------------------------------

class CollectiveWork:
    """An async collective's work: wait() waits for Gloo's, then delivers the output."""

    def __init__(self, group, work, landing: list, what: str):
        self.group, self._work, self._landing, self.what = group, work, landing, what
        self.posted = time.monotonic()
        self._filled = False
        self.failed: str | None = None

    def wait(self, timeout=None) -> bool:   # noqa: ARG002  (the Work signature)
        stats["waits"] += 1
        if self._filled or self.failed is not None:
            return True
        try:
            self._work.wait()
        except RuntimeError as e:           # the peer died or timed out: NCCL would not raise
            _record(self, f"rank {dist.get_rank()}: {self.what} failed: {_first_line(e)}")
            return True
        with torch.no_grad():
            for private, user in self._landing:
                user.copy_(private)
        self._filled = True
        return True

    def is_completed(self) -> bool:
        return self._filled or (self.failed is None and self._work.is_completed())

    def is_success(self) -> bool:
        return self._filled

    def exception(self):
        return None


def _stream_ordered(torch_method):
    """The process group's collective `torch_method` (allreduce(tensors, opts) or
    name(output, input, opts)): an async call runs on copies and returns a CollectiveWork; the
    caller's output is poisoned until it is waited on."""
    def collective(group, *args):
        opts = args[-1] if args else None
        if not getattr(opts, "asyncOp", False) or len(args) not in (2, 3, 5):
            return torch_method(group, *args)
        if len(args) == 2:          # allreduce([tensor, ...], opts), in place
            users = list(args[0])
            privates = [t.clone() for t in users]
            work = torch_method(group, privates, opts)
        else:                       # (output, input, [alltoall's split sizes,] opts)
            users, privates = [args[0]], [torch.empty_like(args[0])]
            work = torch_method(group, privates[0], args[1].clone(), *args[2:])
        for t in users:
            poison(t)
        stats["collectives"] += 1
        return CollectiveWork(group, work, list(zip(privates, users)),
                              f"async {torch_method.__name__}")
    return collective


def _record(work, failure: str) -> None:
    """`work` (a BatchWork or CollectiveWork) failed: recorded, and NCCL's watchdog armed."""
    work.failed = failure
    errors.append(failure)
    _watchdog(failure, work.posted + _timeout_of(work.group).total_seconds())


def _watchdog(what: str, deadline: float) -> None:
    if os.environ.get(ABORT_ENV, "1") == "0":
        return

    def fire() -> None:
        time.sleep(max(0.0, deadline - time.monotonic()))
        print(f"[nccl-contract watchdog] {what}; the group's timeout has passed: aborting the "
              "process, as NCCL's watchdog does", file=sys.stderr, flush=True)
        os._exit(ABORT_EXIT_CODE)
    threading.Thread(target=fire, daemon=True, name="nccl-contract-watchdog").start()
