"""Rank functions under NCCL's contract (tests/nccl_contract.py): the equivalence cases run under
it, one case at a time, and what tests/test_nccl_contract.py checks of the contract itself."""
from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tests import nccl_contract as contract


def run_cases(rank: int, world: int, cases: list) -> list[dict]:
    """tests.workers.equivalence.run_cases under the contract, a case at a time; a case of the
    composition matrix (tests/composition.py CCase) by the matrix's own rank function, which
    records what its claims are judged by (the dtypes on the wire)."""
    return under_contract(_run_one, rank, world, cases)


def _run_one(rank: int, world: int, cases: list) -> list[dict]:
    from tests import composition
    from tests.workers import equivalence
    matrix = all(isinstance(c, composition.CCase) for c in cases)
    return (composition.run_composition if matrix else equivalence.run_cases)(rank, world, cases)


def under_contract(fn, rank: int, world: int, cases: list, *rest) -> list[dict]:
    """Rank function `fn(rank, world, cases, *rest)` (tests.workers.equivalence.run_cases's form)
    run under the contract one case at a time (pass functools.partial(under_contract, fn) as a
    rank function). Each case's result dicts get "contract": what that case posted through the
    contract (`stats`, zeroed at its start) and its transfers that failed. As run_cases, a case
    that raised ends the run: a peer may be stuck in its communication."""
    contract.install()
    out: list[dict] = []
    for i, case in enumerate(cases):
        contract.reset_counts()
        results = fn(rank, world, [case], *rest)
        for r in results:
            r["contract"] = dict(contract.stats, errors=list(contract.errors))
        out += results
        if any(p.startswith("raised on rank") for r in results for p in r.get("problems", ())):
            out += [{"case": c.name, "rank": rank,
                     "problems": [f"not run: case {case.name!r} failed before it"]}
                    for c in cases[i + 1:]]
            break
    return out


# -- the contract's own checks (world 2) ---------------------------------------------------------

# Hand-made lists of two pipeline ranks (chunk 0 on rank 0, chunk 1 on rank 1), only their
# transfers: each run between "|" is one batch_isend_irecv, as the executor posts them.
# DEADLOCK deadlocks on NCCL: each rank's first batch holds a receive (0RECV_B1, 1RECV_F1) whose
# send is in the peer's second batch, which its stream starts only after the peer's first batch
# completed. SAFE holds the same transfers, batched so that every batch meets its peer's.
DEADLOCK = ("0SEND_F0 0RECV_B0 0RECV_B1 | 0SEND_F1", "1SEND_B0 1RECV_F0 1RECV_F1 | 1SEND_B1")
SAFE = ("0SEND_F0 0RECV_B0 | 0SEND_F1 0RECV_B1", "1SEND_B0 1RECV_F0 | 1SEND_B1 1RECV_F1")


def carried(action: str) -> float:
    """What a SEND_F/SEND_B of microbatch m carries, and so what its RECV_ must get."""
    kind, mb = re.fullmatch(r"\d(?:SEND|RECV)_([FB])(\d+)", action).groups()
    return (100.0 if kind == "B" else 0.0) + int(mb) + 1


def run_lists(lists: tuple[str, str], rank: int, group) -> dict:
    """Post this rank's batches of `lists` (all at once, as the executor does), then wait on
    each in order: what each receive holds, the failures recorded, how long the waits took."""
    peer, posted = 1 - rank, []
    for batch in lists[rank].split("|"):
        ops, recvs = [], {}
        for a in batch.split():
            if "SEND" in a:
                ops.append(dist.P2POp(dist.isend, torch.full((4,), carried(a)), peer, group))
            else:
                recvs[a] = torch.zeros(4)
                ops.append(dist.P2POp(dist.irecv, recvs[a], peer, group))
        posted.append((dist.batch_isend_irecv(ops), recvs))
    before, start = len(contract.errors), time.monotonic()
    received = {}
    for works, recvs in posted:
        for w in works:
            w.wait()
        received.update({a: t.tolist() for a, t in recvs.items()})
    return {"received": received, "errors": contract.errors[before:],
            "wait_s": time.monotonic() - start}


def _one_batch(rank: int, group, n: int, base: float):
    peer = 1 - rank
    sends = [torch.full((4,), base + 10 * rank + i) for i in range(n)]
    recvs = [torch.zeros(4) for _ in range(n)]
    ops = [dist.P2POp(dist.isend, s, peer, group) for s in sends]
    ops += [dist.P2POp(dist.irecv, r, peer, group) for r in recvs]
    return ops, recvs


def _expected(rank: int, n: int, base: float) -> list:
    return [[base + 10 * (1 - rank) + i] * 4 for i in range(n)]


def _batches(rank: int, group) -> dict:
    """Gloo as it is, then the contract: one work, buffers filled by it, posting order."""
    out = {}
    ops, recvs = _one_batch(rank, group, 2, 0.0)
    works = contract.TORCH_BATCH_ISEND_IRECV(ops)       # Gloo as it is
    out["gloo_works"] = len(works)
    for w in works:
        w.wait()
    out["gloo_ok"] = [r.tolist() for r in recvs] == _expected(rank, 2, 0.0)
    contract.install()
    ops, recvs = _one_batch(rank, group, 2, 100.0)
    works = dist.batch_isend_irecv(ops)
    out["contract_works"] = len(works)
    time.sleep(0.5)                      # delivered by now: the data sits in private buffers
    out["poisoned_before_wait"] = [bool(r.isnan().all()) for r in recvs]
    out["wait_returned"] = works[0].wait()
    out["filled_after_wait"] = [r.tolist() for r in recvs] == _expected(rank, 2, 100.0)
    ops1, r1 = _one_batch(rank, group, 1, 200.0)
    w1 = dist.batch_isend_irecv(ops1)
    ops2, r2 = _one_batch(rank, group, 1, 300.0)
    w2 = dist.batch_isend_irecv(ops2)
    w2[0].wait()                         # batch 1 ran before it on the stream; not filled
    out["in_order"] = (bool(r1[0].isnan().all()), r2[0].tolist() == _expected(rank, 1, 300.0)[0],
                       w1[0].is_completed())
    w1[0].wait()
    out["earlier_filled_by_own_wait"] = r1[0].tolist() == _expected(rank, 1, 200.0)[0]
    return out


def _other_dtypes(rank: int, group) -> dict:
    """bool and int64 receives: what each holds after delivery, before and after wait()."""
    sent = {torch.bool: torch.tensor([True, False, True, True]) ^ bool(rank),
            torch.int64: torch.tensor([1, 2, 3, 4]) + 10 * rank}
    recvs = {dtype: torch.zeros(4, dtype=dtype) for dtype in sent}
    ops = [dist.P2POp(dist.isend, t, 1 - rank, group) for t in sent.values()]
    ops += [dist.P2POp(dist.irecv, t, 1 - rank, group) for t in recvs.values()]
    works = dist.batch_isend_irecv(ops)
    time.sleep(0.5)
    before = {str(d): t.tolist() for d, t in recvs.items()}
    works[0].wait()
    return {"dtypes_before_wait": before,
            "dtypes_after_wait": {str(d): t.tolist() for d, t in recvs.items()}}


def _async_collectives(rank: int, group) -> dict:
    """The runtime's async collectives (the forms of runtime/buckets.py, sharding.py,
    param_shards.py): each output before and after wait()."""
    reduced = torch.full((4,), float(rank + 1))
    bucket = torch.arange(4.0) + 10 * rank
    mine = bucket[2 * rank:2 * rank + 2]            # in place: the row is a view of the input
    full = torch.zeros(4)
    piece = torch.full((2,), 7.0 + rank)
    works = [dist.all_reduce(reduced, group=group, async_op=True),
             dist.reduce_scatter_tensor(mine, bucket, group=group, async_op=True),
             dist.all_gather_into_tensor(full, piece, group=group, async_op=True)]
    time.sleep(0.5)                      # Gloo has long finished: the results sit in copies
    outputs = {"all_reduce": reduced, "reduce_scatter": mine, "all_gather": full}
    before = {k: t.tolist() for k, t in outputs.items()}
    returned = [w.wait() for w in works]
    return {"collectives_before_wait": before, "collective_waits": returned,
            "collectives_after_wait": {k: t.tolist() for k, t in outputs.items()}}


def _dead_peer(rank: int, group) -> dict:
    """Rank 1 leaves; rank 0's receive from it and all-reduce with it: wait() returns, the
    buffers stay poisoned, the failures are recorded."""
    dist.barrier(group)
    if rank == 1:                        # the dead peer: gone before rank 0's receive is served
        return {}
    out, before, buf = {}, len(contract.errors), torch.zeros(4)
    start = time.monotonic()
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1, group)])
    try:
        out["dead_wait"] = works[0].wait()
    except Exception as e:  # noqa: BLE001
        out["dead_wait"] = f"raised {type(e).__name__}: {e}"
    out["dead_wait_s"] = time.monotonic() - start
    out["dead_buffer_poisoned"] = bool(buf.isnan().all())
    reduced = torch.ones(4)
    try:
        out["dead_collective_wait"] = dist.all_reduce(reduced, group=group, async_op=True).wait()
    except Exception as e:  # noqa: BLE001
        out["dead_collective_wait"] = f"raised {type(e).__name__}: {e}"
    out["dead_collective_poisoned"] = bool(reduced.isnan().all())
    out["dead_errors"] = contract.errors[before:]
    return out


def contract_checks(rank: int, world: int, timeout_s: float, deadlock_s: float) -> dict:
    """Rank function for tests/test_nccl_contract.py (world 2): what Gloo and the contract do.
    The lists run on groups of their own, with a timeout of `deadlock_s`."""
    assert world == 2
    os.environ[contract.ABORT_ENV] = "0"     # the watchdog is tested on its own (watchdog_check)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))
    import tests.workers.common  # noqa: F401  (installs the contract when the environment asks)
    out = {"installed_by_env": contract.installed()}
    out.update(_batches(rank, group))
    out.update(_other_dtypes(rank, group))
    out.update(_async_collectives(rank, group))
    for name, lists in (("safe", SAFE), ("deadlock", DEADLOCK)):
        out[name] = run_lists(lists, rank, dist.new_group([0, 1], timeout=timedelta(
            seconds=deadlock_s)))
    out.update(_dead_peer(rank, group))
    return out


def watchdog_check(rank: int, world: int, timeout_s: float) -> None:
    """Rank function: rank 1 leaves; rank 0's wait on a receive from it returns, and the
    watchdog aborts rank 0 once the group's timeout has passed (rank 0 never returns)."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout_s))
    contract.install()
    dist.barrier(group)
    if rank == 1:
        return None
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(4), 1, group)])
    works[0].wait()
    time.sleep(4 * timeout_s + 5)        # bounded: the watchdog must end the process first
    return "not aborted"
