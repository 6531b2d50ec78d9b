"""run_actions, one rank's training step, checked without processes: the ranks of a pipeline are
threads of this process, and torch.distributed's point-to-point calls inside the executor are
replaced by a queue per (sender, receiver) pair that records every batch. The chunks are
compiled from the model itself and share its parameters, so after all ranks ran their actions
the model's .grad holds every rank's contribution (tied weights: both stages', summed by
autograd) and must equal the plain model's gradient on the same global batch.

The multi-process runtime (groups, reductions, the ParallelModel API) is tested in
runtime/test_parallel_model.py and tests/test_equivalence.py.
"""
from __future__ import annotations

import copy
import queue
import threading
from collections import defaultdict

import pytest
import torch

import autopart
from autopart.runtime import executor
from autopart.runtime.compute import StepContext
from autopart.runtime.executable import executable
from autopart.runtime.executor import run_actions
from autopart.runtime.step import step_loss_scale
from tests.workers.common import ATOL, RTOL, Case, build

_COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ThreadComm:
    """Stands in for torch.distributed inside the executor: isend/irecv between threads.

    coalesce=False: Gloo's contract, one work per op. coalesce=True: NCCL's, one work for the
    whole batch (torch's batch_isend_irecv coalesces on NCCL), the receive buffers poisoned (NaN,
    or the largest integer) when the batch is posted and filled only when that work is waited
    on: a receive read without waiting on the work that covers it shows as NaN or a bad index."""

    def __init__(self, wait_s: float = 60.0, coalesce: bool = False):
        self.wait_s, self.coalesce = wait_s, coalesce
        self._lock = threading.Lock()
        self._queues: dict = {}
        self._local = threading.local()
        self.batches: dict[int, list] = defaultdict(list)   # rank -> [[(kind, peer, dtype, shape)]]

    class P2POp:
        def __init__(self, op, tensor, peer, group=None):
            self.op, self.tensor, self.peer, self.group = op, tensor, peer, group

    @staticmethod
    def isend(*_):
        raise AssertionError("the executor must batch its sends")

    @staticmethod
    def irecv(*_):
        raise AssertionError("the executor must batch its receives")

    def set_rank(self, rank: int) -> None:
        self._local.rank = rank

    def get_rank(self) -> int:      # the executor names this rank in a failed wait's message
        return self._local.rank

    def _queue(self, src: int, dst: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((src, dst), queue.Queue())

    def batch_isend_irecv(self, ops):
        me = self._local.rank
        self.batches[me].append([("send" if o.op is self.isend else "recv", o.peer, o.tensor.dtype,
                                  tuple(o.tensor.shape)) for o in ops])
        works = []
        for o in ops:
            if o.op is self.isend:
                self._queue(me, o.peer).put(o.tensor.clone())
                works.append(_Done())
            else:
                works.append(_Recv(self._queue(o.peer, me), o.tensor, self.wait_s))
                if self.coalesce:
                    _poison(o.tensor)
        return [_Coalesced(works)] if self.coalesce else works


class _Done:
    def wait(self):
        return True


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).max)


class _Coalesced:
    """NCCL's one work for a batch: waiting it completes (and fills) every op of the batch."""

    def __init__(self, works: list):
        self.works, self.done = works, False

    def wait(self):
        if not self.done:       # as a real work: waiting twice is harmless
            for w in self.works:
                w.wait()
            self.done = True
        return True


class _Recv:
    def __init__(self, q: queue.Queue, buf: torch.Tensor, wait_s: float):
        self.q, self.buf, self.wait_s = q, buf, wait_s

    def wait(self):
        got = self.q.get(timeout=self.wait_s)      # queue.Empty fails the test instead of hanging
        assert got.shape == self.buf.shape and got.dtype == self.buf.dtype, (
            f"received {got.dtype}{tuple(got.shape)} into a {self.buf.dtype}{tuple(self.buf.shape)}"
            " buffer: sender and receiver disagree on the boundary")
        self.buf.copy_(got)
        return True


def _run_pipeline(case: Case, monkeypatch, coalesce: bool = False) -> tuple:
    """Compile `case` (pp ranks, dp=1) and run every rank's actions in its own thread."""
    model, loss_fn, inputs, target = build(case)
    ref = copy.deepcopy(model)
    compiled = autopart.compile(model, autopart.Mesh(pp=case.pp), inputs, loss_fn=loss_fn,
                                target=target, microbatches=case.microbatches,
                                schedule=case.schedule, virtual_stages=case.virtual_stages)
    plan = compiled.plan
    comm = ThreadComm(coalesce=coalesce)
    monkeypatch.setattr(executor, "dist", comm)
    names = compiled.program.inputs
    batch = dict(zip(names, list(inputs) + ([target] if target is not None else [])))
    mbs = plan.microbatch_size
    losses, errors = {}, {}

    def rank_main(r: int) -> None:
        comm.set_rank(r)
        ctx = StepContext(
            chunks={c.chunk: c for c in compiled.programs[r].chunks}, peer=lambda p: p,
            microbatch=lambda i: {k: v[i * mbs:(i + 1) * mbs] for k, v in batch.items()},
            batch=mbs, seq=inputs[0].shape[1], device=torch.device("cpu"),
            loss_scale=step_loss_scale(plan, compiled.program.loss_count, names,
                                       list(batch.values())))
        try:
            losses[r] = run_actions(compiled.schedule.ranks[r], ctx)
        except BaseException as e:  # noqa: BLE001  (reported by the test thread)
            errors[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(case.pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank thread is still running: deadlock"
    if errors:
        raise next(iter(errors.values()))
    return model, ref, loss_fn, inputs, target, compiled, comm, losses


def _plain_microbatch_losses(ref, loss_fn, inputs, target, m: int,
                             compiled=None) -> list[torch.Tensor]:
    """The plain model's loss of each microbatch as the program computes it: its mean, or for a
    token-weighted loss (passes/weigh_loss_by_tokens.py) its sum over the counted tokens."""
    mbs = inputs[0].shape[0] // m
    counter = compiled.program.loss_count if compiled is not None else None
    out = []
    for i in range(m):
        sl = slice(i * mbs, (i + 1) * mbs)
        y = ref(*(t[sl] for t in inputs))
        loss = (loss_fn(y, target[sl]) if loss_fn is not None else y).detach()
        if counter is not None:
            feed = dict(zip(compiled.program.inputs, [t[sl] for t in inputs] +
                            ([target[sl]] if target is not None else [])))
            loss = loss * counter.gm(*(feed[n] for n in counter.inputs))
        out.append(loss)
    return out


def _assert_grads_equal(model, ref, loss_fn, inputs, target) -> None:
    y = ref(*inputs)
    (loss_fn(y, target) if loss_fn is not None else y).backward()
    plain = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = plain[name].grad
        assert p.grad is not None or r is None or not r.any(), f"{name}: no gradient"
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(g, r if r is not None else torch.zeros_like(p), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"gradient of {name}: {m}")


PIPELINES = [
    Case("gpt-pp2-gpipe", pp=2, schedule="gpipe", microbatches=4),
    Case("gpt-pp2-1f1b", pp=2, microbatches=4),
    Case("gpt-pp2-interleaved-v2", pp=2, schedule="interleaved-1f1b", virtual_stages=2,
         microbatches=4),
    Case("gpt-pp4-1f1b-mbs1", pp=4, batch=4, microbatches=4),
    Case("gpt-pp4-interleaved-v2", pp=4, schedule="interleaved-1f1b", virtual_stages=2,
         microbatches=4),
    Case("hf-pp2-1f1b", model="hf", pp=2, batch=4, seq=32, microbatches=2),
    Case("toy-pp2-mbs1", model="toy", pp=2, batch=4, microbatches=4),
    Case("toy-pp4-1f1b", model="toy", pp=4, microbatches=4),
]


def _assert_one_batch_per_run_of_transfers(compiled, comm) -> None:
    """Each maximal run of consecutive SEND/RECV actions is one batch_isend_irecv, whose ops
    follow the boundaries: forward sends of every output, backward sends of float ones only."""
    for r, actions in enumerate(compiled.schedule.ranks):
        runs, prev = [], False
        for a in actions:
            if a.kind in _COMM and not prev:
                runs.append([])
            if a.kind in _COMM:
                runs[-1].append(a)
            prev = a.kind in _COMM
        assert len(comm.batches[r]) == len(runs), f"rank {r}: {len(comm.batches[r])} batches"
        chunks = {c.chunk: c for c in compiled.programs[r].chunks}
        for run, ops in zip(runs, comm.batches[r]):
            expected = []
            for a in run:
                c = chunks[a.chunk]
                if a.kind == "SEND_F":
                    expected += [("send", s.peer_rank, s.dtype) for s in c.sends]
                elif a.kind == "RECV_F":
                    expected += [("recv", s.peer_rank, s.dtype) for s in c.recvs]
                elif a.kind == "SEND_B":
                    expected += [("send", s.peer_rank, s.dtype) for s in c.recvs
                                 if s.differentiable]
                else:
                    expected += [("recv", s.peer_rank, s.dtype) for s in c.sends
                                 if s.differentiable]
            assert [op[:3] for op in ops] == expected, f"rank {r}, run {run}"


@pytest.mark.parametrize("case", PIPELINES, ids=[c.name for c in PIPELINES])
def test_pipeline_equals_plain(case: Case, monkeypatch):
    model, ref, loss_fn, inputs, target, compiled, comm, losses = _run_pipeline(case, monkeypatch)
    last = compiled.plan.chunk_ranks[-1]
    assert all(not losses[r] for r in losses if r != last), "only the last stage computes losses"
    expected = _plain_microbatch_losses(ref, loss_fn, inputs, target, case.microbatches,
                                        compiled)
    assert len(losses[last]) == case.microbatches
    # the schedule decides the order of microbatches; compare as multisets
    torch.testing.assert_close(sorted(float(x) for x in losses[last]),
                               sorted(float(x) for x in expected), rtol=RTOL, atol=ATOL)
    _assert_grads_equal(model, ref, loss_fn, inputs, target)
    _assert_one_batch_per_run_of_transfers(compiled, comm)


# NCCL's contract (one work per batch, receives filled on its wait): the schedules whose batches
# mix sends and receives (1F1B's steady state: SEND_F then RECV_B), interleaved, and Toy's int64
# and bool boundaries (a missed wait reads an index out of range)
COALESCED = [PIPELINES[1], PIPELINES[2], PIPELINES[4], PIPELINES[7]]


@pytest.mark.parametrize("case", COALESCED, ids=[c.name for c in COALESCED])
def test_pipeline_equals_plain_when_batches_coalesce(case: Case, monkeypatch):
    model, ref, loss_fn, inputs, target, compiled, comm, losses = _run_pipeline(
        case, monkeypatch, coalesce=True)
    last = compiled.plan.chunk_ranks[-1]
    expected = _plain_microbatch_losses(ref, loss_fn, inputs, target, case.microbatches,
                                        compiled)
    assert len(losses[last]) == case.microbatches
    torch.testing.assert_close(sorted(float(x) for x in losses[last]),
                               sorted(float(x) for x in expected), rtol=RTOL, atol=ATOL)
    _assert_grads_equal(model, ref, loss_fn, inputs, target)
    assert any(len(ops) > 1 and ops[0][0] == "send" and any(o[0] == "recv" for o in ops)
               for batches in comm.batches.values() for ops in batches), \
        "no batch posts a send before a receive: the case does not exercise the contract"


def test_non_float_boundaries_cross_forward_only(monkeypatch):
    """Toy sends an int64 and a bool activation across every cut: forward only, never a grad."""
    case = Case("toy-pp4", model="toy", pp=4, microbatches=4)
    *_, compiled, comm, _ = _run_pipeline(case, monkeypatch)
    dtypes = {s.dtype for p in compiled.programs.values() for c in p.chunks for s in c.recvs}
    assert {torch.int64, torch.bool} <= dtypes, dtypes
    for r, batches in comm.batches.items():
        for ops in batches:
            for kind, peer, dtype, _ in ops:
                if kind == "send" and peer < r:     # backward: towards the previous stage
                    assert dtype.is_floating_point, f"rank {r} sent a {dtype} gradient"
    extra = [c for p in compiled.programs.values() for c in p.chunks if "mask" in c.inputs]
    assert len(extra) > 1, "the later chunks need the second user input, `mask`"


@pytest.mark.parametrize("case", [Case("gpt-pp1-m4", microbatches=4),
                                  Case("toy-pp1-mbs1", model="toy", batch=4, microbatches=4)],
                         ids=lambda c: c.name)
def test_single_stage_accumulates_microbatches(case: Case, monkeypatch):
    model, ref, loss_fn, inputs, target, compiled, comm, losses = _run_pipeline(case, monkeypatch)
    assert not comm.batches, "one stage sends nothing"
    expected = _plain_microbatch_losses(ref, loss_fn, inputs, target, case.microbatches,
                                        compiled)
    torch.testing.assert_close(torch.stack(losses[0]), torch.stack(expected), rtol=RTOL, atol=ATOL)
    _assert_grads_equal(model, ref, loss_fn, inputs, target)

# The executor runs a copy of each chunk program with flat parameter attributes and direct op
# bindings (runtime/executable.py): it must compute bit for bit what the emitted program does.
EXECUTABLE_CASES = [
    Case("gpt-pp2-interleaved-v2", pp=2, schedule="interleaved-1f1b", virtual_stages=2,
         microbatches=4),
    Case("hf-pp2-1f1b", model="hf", pp=2, batch=4, seq=32, microbatches=2),
    Case("toy-pp4-1f1b", model="toy", pp=4, microbatches=4)]


@pytest.mark.parametrize("case", EXECUTABLE_CASES, ids=lambda c: c.name)
def test_executable_matches_program(case: Case):
    model, loss_fn, inputs, target = build(case)
    compiled = autopart.compile(model, autopart.Mesh(pp=case.pp), inputs, loss_fn=loss_fn,
                                target=target, microbatches=case.microbatches,
                                schedule=case.schedule, virtual_stages=case.virtual_stages)
    values = dict(zip(compiled.program.inputs, list(inputs) + ([target] if target is not None else [])))
    carried = []
    chunks = sorted((c for p in compiled.programs.values() for c in p.chunks), key=lambda c: c.chunk)
    for chunk in dict((c.chunk, c) for c in chunks).values():
        fast = executable(chunk.gm)
        assert fast is executable(chunk.gm), "built once"
        results = []
        for fn in (chunk.gm, fast):
            chunk.gm.zero_grad(set_to_none=True)
            recv = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in carried]
            out = fn(*recv, *(values[n] for n in chunk.inputs))
            floats = [o for o in out if o.is_floating_point()]
            torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
            grads = {n: p.grad.clone() for n, p in chunk.gm.named_parameters() if p.grad is not None}
            results.append((out, [r.grad for r in recv], grads))
        (out_a, rg_a, g_a), (out_b, rg_b, g_b) = results
        assert all(torch.equal(a, b) for a, b in zip(out_a, out_b)), f"chunk {chunk.chunk} outputs"
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(rg_a, rg_b))
        assert g_a.keys() == g_b.keys() and all(torch.equal(g_a[k], g_b[k]) for k in g_a)
        carried = [o.detach() for o in out_a]
