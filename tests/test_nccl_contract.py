"""tests/nccl_contract.py keeps NCCL's contract over Gloo: one work per batch_isend_irecv, a
group's batches run in posting order and each completes only against its peer's matching batch (a
list that deadlocks on NCCL deadlocks, reported in bounded time), receive buffers of every dtype
and async collectives' outputs poisoned until waited on, and wait() that returns on a dead peer
(the process is then aborted by the watchdog once the group's timeout has passed, as NCCL's is)."""
from __future__ import annotations

import math
import os
import re
import time
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from autopart.runtime.launch import spawn
from tests import nccl_contract
from tests.workers import nccl_contract as workers
from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.composition import CCase

ROOT = Path(__file__).resolve().parent.parent


DEADLOCK_S = 3.0       # the lists' groups' timeout: a deadlock is reported after it


@pytest.fixture(scope="module")
def checked():
    """One spawn of tests/workers/nccl_contract.py contract_checks: (rank 0's, rank 1's)."""
    with pytest.MonkeyPatch.context() as mp:    # ranks install it importing tests.workers.common
        mp.setenv(nccl_contract.ENV, "1")
        return spawn(workers.contract_checks, 2, 5.0, DEADLOCK_S, timeout=180, pg_timeout=30)


def test_contract_over_gloo(checked):
    r0, r1 = checked
    for r in (r0, r1):
        assert r["installed_by_env"], r
        assert r["gloo_works"] == 4 and r["gloo_ok"], r      # Gloo: one work per op
        assert r["contract_works"] == 1, r                    # NCCL: one work per batch
        assert r["poisoned_before_wait"] == [True, True], r  # delivered, not yet visible
        assert r["wait_returned"] is True and r["filled_after_wait"], r
        assert r["in_order"] == (True, True, True) and r["earlier_filled_by_own_wait"], r
    assert r0["dead_wait"] is True, r0                        # did not raise
    assert r0["dead_wait_s"] < 10 and r0["dead_buffer_poisoned"], r0
    assert "recv from 1" in r0["dead_errors"][0] and "did not complete" in r0["dead_errors"][0], r0


def test_every_receive_dtype_is_poisoned_until_waited(checked):
    """bool has no invalid value: until wait() a bool receive holds the opposite of what
    arrived, an int64 one the dtype's largest value."""
    for rank, r in enumerate(checked):
        sent_by_peer = [[True, False, True, True][i] ^ bool(1 - rank) for i in range(4)]
        ints = [1 + 10 * (1 - rank) + i for i in range(4)]
        before, after = r["dtypes_before_wait"], r["dtypes_after_wait"]
        assert before["torch.bool"] == [not b for b in sent_by_peer], r
        assert before["torch.int64"] == [2 ** 63 - 1] * 4, r
        assert after == {"torch.bool": sent_by_peer, "torch.int64": ints}, r


def test_async_collectives_deliver_only_at_wait(checked):
    """all_reduce, reduce_scatter_tensor (in place: the output a view of the input) and
    all_gather_into_tensor with async_op=True: NaN until wait(), which returns, then the result
    (worked out by hand from what each rank put in)."""
    reduced = [3.0] * 4                                       # 1 + 2
    rows = [[0 + 10, 1 + 11], [2 + 12, 3 + 13]]               # arange(4) + 10 * rank, summed
    gathered = [7.0, 7.0, 8.0, 8.0]
    for rank, r in enumerate(checked):
        before = r["collectives_before_wait"]
        assert all(math.isnan(x) for xs in before.values() for x in xs), r
        assert r["collective_waits"] == [True] * 3, r
        assert r["collectives_after_wait"] == {"all_reduce": reduced, "reduce_scatter": rows[rank],
                                               "all_gather": gathered}, r
    r0 = checked[0]
    assert r0["dead_collective_wait"] is True and r0["dead_collective_poisoned"], r0
    assert any("async allreduce failed" in e for e in r0["dead_errors"]), r0


def test_a_list_that_deadlocks_on_nccl_deadlocks_under_the_contract(checked):
    """tests/workers/nccl_contract.py DEADLOCK: each rank's first batch holds a receive whose
    send is in the peer's second batch. NCCL never completes it; under the contract each rank's
    first batch is reported, naming the receive that got nothing, once the group's timeout has
    passed, and its second never runs. SAFE, the same transfers batched pairwise, delivers all."""
    for rank, r in enumerate(checked):
        safe, stuck = r["safe"], r["deadlock"]
        assert not safe["errors"], safe
        assert safe["received"] == {a: [workers.carried(a.replace("RECV", "SEND"))] * 4
                                    for a in safe["received"]}, safe
        assert len(safe["received"]) == 2, safe
        first = re.escape("batch [send to {0}, recv from {0}, recv from {0}] (batch 1 on its "
                          "group's stream) did not complete: recv #2 from {0}: nothing arrived"
                          .format(1 - rank))
        assert len(stuck["errors"]) == 2, stuck
        assert re.search(f"^rank {rank}: {first}", stuck["errors"][0]), stuck
        assert "batch 2 on its group's stream) never ran" in stuck["errors"][1], stuck
        stuck_recv = "0RECV_B1" if rank == 0 else "1RECV_F1"
        assert all(math.isnan(x) for x in stuck["received"][stuck_recv]), stuck
        assert stuck["wait_s"] < DEADLOCK_S + 20, stuck       # bounded: the group's timeout


def test_contract_counts_are_per_case():
    """under_contract gives each case what it posted (the `batches > 0` check of a pipeline
    case must be able to fail in a spawn's second case)."""
    posts = {"a": 3, "b": 0}

    def fn(rank, world, cases):     # stands for a rank function whose cases post batches
        for c in cases:
            nccl_contract.stats["batches"] += posts[c.name]
        return [{"case": c.name, "rank": rank, "problems": []} for c in cases]
    was = nccl_contract.installed()
    try:
        out = workers.under_contract(fn, 0, 1, [SimpleNamespace(name=n) for n in posts])
    finally:
        (nccl_contract.install if was else nccl_contract.uninstall)()
    assert {r["case"]: r["contract"]["batches"] for r in out} == posts, out


@pytest.mark.full      # 15 s of spawn for the test aid's own abort path
def test_watchdog_aborts_after_the_timeout():
    with pytest.raises(RuntimeError, match=f"rank 0: exit code {nccl_contract.ABORT_EXIT_CODE}"):
        spawn(workers.watchdog_check, 2, 2.0, timeout=120, pg_timeout=30)


def test_runtime_posts_point_to_point_only_in_batches():
    """The contract wraps batch_isend_irecv only: the product must not call isend/irecv alone
    (a blocking dist.send/recv needs no wrapper: its data is there, in stream order, when it
    returns, on both backends)."""
    calls = re.compile(r"\bdist\.(isend|irecv)\s*\(")
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("runtime", "autopart")
             for p in (ROOT / d).rglob("*.py") if not p.name.startswith("test_")
             for i, line in enumerate(p.read_text().splitlines(), 1) if calls.search(line)]
    assert not found, found


def test_the_runtime_sends_no_unbatched_point_to_point():
    """Nor blocking dist.send/recv in what runs while training (runtime/: the step, state
    gathering, checkpoints): under NCCL each unbatched pair on the world group builds a 2-rank
    communicator of its own. Only the planner's link calibration (a ping-pong timed once,
    autopart/planner/calibrate.py) sends alone."""
    calls = re.compile(r"\bdist\.(send|recv|isend|irecv)\s*\(")
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("runtime", "autopart")
             for p in (ROOT / d).rglob("*.py")
             if not p.name.startswith("test_") and p.name != "calibrate.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if calls.search(line)]
    assert not found, found


# -- the equivalence cases, under the contract ----------------------------------------------------
# Fast tier: the pipelines whose batches mix sends and receives (1F1B, interleaved, zb-v), and one
# tensor-parallel, one expert-parallel and one ZeRO case (their sync collectives keep Gloo's
# behaviour; the async ones, the gradient buckets' all-reduces and ZeRO's reduce-scatters, deliver
# only at wait()).
# Full tier: every case of the pipeline, zero-bubble, tensor- and expert-parallel equivalence
# suites and the composition matrix (every schedule with tp, sp, dp, ep, ZeRO, recompute, bf16,
# compile), each group in one spawn as in its own file.

M = dict(microbatches=4)
FAST_2 = [
    Case("contract-gpt4-pp2-1f1b", model="gpt4", pp=2, **M),
    Case("contract-gpt4-pp2-interleaved-v2", model="gpt4", pp=2, schedule="interleaved-1f1b",
         virtual_stages=2, **M),
    Case("contract-gpt4-pp2-zb-v", model="gpt4", pp=2, schedule="zb-v", virtual_stages=2, **M),
    Case("contract-gpt4-tp2", model="gpt4", tp=2, microbatches=2),
    Case("contract-switch-dp2-ep2", model="switch", dp=2, ep=2, microbatches=2),
    CCase("contract-gpt4-dp2-zero1", model="gpt4", dp=2, zero=1, microbatches=2),
    # context parallelism: the ring passes K/V and dK/dV by batch_isend_irecv, two batches in
    # flight at once in the backward
    Case("contract-gpt4-cp2-ring", model="gpt4", cp=2, batch=4, seq=16),
]


def _assert_ran_under_contract(case, ranks: list[dict]) -> None:
    """The case equals the plain model (a transfer that failed left NaN in its buffers: the
    comparison sees it), its pipeline's transfers and its data-parallel gradients' async
    collectives went through the contract (counted per case). The case's failed transfers are
    shown with a failure."""
    failed = sorted({e for r in ranks for e in r.get("contract", {}).get("errors", ())})
    try:
        assert_all_ranks_equal_plain(case, ranks)
    except AssertionError as e:
        raise AssertionError(f"{e}\ntransfers that failed under the contract in this case: "
                             f"{failed or 'none'}") from None
    for r in ranks:
        assert "contract" in r, f"{case.name}: rank {r['rank']} did not run under the contract"
        # a refusal case of the composition matrix is refused at compile: it sends nothing
        # (tests/composition.py checked the refusal in assert_all_ranks_equal_plain's problems)
        if case.pp > 1 and not getattr(case, "refused", ()):
            assert r["contract"]["batches"] > 0, f"{case.name}: no batch went through the contract"
        assert r["contract"]["unflagged"] == 0, \
            f"{case.name}: rank {r['rank']} posted {r['contract']['unflagged']} batches through a " \
            "wrapper of batch_isend_irecv that hides keeps_nccl_contract: the runtime lowered " \
            "its lists for Gloo, not NCCL (functools.wraps keeps the flag)"
        if case.dp > 1 and not getattr(case, "refused", ()):
            assert r["contract"]["collectives"] > 0, \
                f"{case.name}: no async collective went through the contract"


@pytest.mark.parametrize("case", FAST_2, ids=[c.name for c in FAST_2])
def test_equivalence_under_the_contract(case, spawn_cache):
    results = run_group(spawn_cache, ("nccl-contract", "fast", 2), FAST_2,
                        rank_fn=workers.run_cases)
    _assert_ran_under_contract(case, results[case.name])


def _full_groups() -> dict:
    """(suite, world[, case]) -> (cases, the suite's rank function): every equivalence case the
    suites define, fast and full tier, in one spawn per world size (per case for the
    composition matrix), as their own files run them."""
    from tests import composition as cm
    from tests import test_equivalence as te
    from tests import test_expert_parallel as tx
    from tests import test_tensor_parallel as tt
    from tests import test_zero_bubble as tz
    from tests.workers.equivalence import run_cases
    from tests.workers.zb import zb_cases
    suites = {
        "pipeline": ([c for cases in te.GROUPS.values() for c in cases], run_cases),
        "zero-bubble": (tz.FAST_2 + tz.FULL_2 + tz.FULL_4, zb_cases),
        "tensor-parallel": ([c for cases in tt.GROUPS.values() for c in cases], run_cases),
        # its own rank function (composition cases among its own: the wire is recorded)
        "expert-parallel": ([c for cases in tx.GROUPS.values() for c in cases],
                            cm.run_composition),
        "composition": ([row.case() for row in cm.combos()], cm.run_composition),
    }
    groups: dict = {}
    for suite, (cases, fn) in suites.items():
        for c in cases:     # the composition matrix: one spawn per case, as its own file does
            key = (suite, c.world, c.name) if suite == "composition" else (suite, c.world)
            groups.setdefault(key, ([], fn))[0].append(c)
    return groups


FULL_GROUPS = _full_groups()
FULL = [pytest.param(key, c.name, id=f"{key[0]}-{c.name}", marks=pytest.mark.full)
        for key, (cases, _) in FULL_GROUPS.items() for c in cases]


@pytest.mark.timeout(1500)     # the first test of a group runs its whole spawn (1200 s at most)
@pytest.mark.parametrize("key,name", FULL)
def test_every_equivalence_case_under_the_contract(key, name, spawn_cache):
    cases, fn = FULL_GROUPS[key]
    results = run_group(spawn_cache, ("nccl-contract", *key), cases, timeout=1200,
                        rank_fn=partial(workers.under_contract, fn))
    _assert_ran_under_contract(next(c for c in cases if c.name == name), results[name])


# zero=1's reduce-scatters per layer group, each posted by the last microbatch's backward and
# waited only later (the contract's async collectives deliver at wait(): a reduce-scatter read
# before its wait would leave NaN in the gradients), with a pipeline and 4 microbatches
ZERO1_GROUPS = CCase("contract-hf-gpt2-pp2xdp2-zero1-groups", model="c-hf-gpt2-tied", pp=2,
                     dp=2, microbatches=4, zero=1, optim="adamw", clip=0.05)


@pytest.mark.full
def test_zero1_per_group_reduce_scatters_under_the_contract(spawn_cache):
    results = run_group(spawn_cache, ("nccl-contract", "zero1-groups", 4), [ZERO1_GROUPS],
                        rank_fn=workers.run_cases)
    _assert_ran_under_contract(ZERO1_GROUPS, results[ZERO1_GROUPS.name])


def test_the_full_tier_has_every_schedule():
    from autopart.schedule import SCHEDULES
    ran = {c.schedule for cases, _ in FULL_GROUPS.values() for c in cases if c.pp > 1}
    assert ran == set(SCHEDULES), set(SCHEDULES) - ran
    assert {k[0] for k in FULL_GROUPS} == {"pipeline", "zero-bubble", "tensor-parallel",
                                          "expert-parallel", "composition"}


@pytest.mark.full
@pytest.mark.timeout(3300)
def test_checkpoint_suite_under_the_contract():
    """tests/test_checkpoint.py, both tiers, every rank process under the contract (through
    the environment: its rank functions are its own)."""
    env = dict(os.environ, **{nccl_contract.ENV: "1"})
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "test_checkpoint.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=3000)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


# -- failures under the contract: named, although no wait raises ----------------------------------

@pytest.mark.parametrize("how", ["exit", pytest.param("hang", marks=pytest.mark.full)])
def test_a_dead_or_stuck_peer_is_named_under_the_contract(how, monkeypatch, capfd):
    """Issue 33 row 7. Rank 1 dies (exit) or stops responding (hang) in its first forward of step
    2. No wait raises under NCCL's contract. Dead: the survivor's next collective fails and its
    error names the step, the transfer that never completed and its peer, and that rank 1 sent no
    report. Stuck: nothing raises at all; each rank's StepWatch fires after 3/4 of the timeout,
    prints the report (the step, the action, the peer, the other rank's report) and ends the rank
    (exit code 75) before the contract's watchdog would (134, nothing named)."""
    from autopart.runtime.step_watch import PEER_FAILURE_EXIT
    from tests.workers.equivalence import die_mid_step

    monkeypatch.setenv(nccl_contract.ENV, "1")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(die_mid_step, 2, how, 1, 10.0, 1, timeout=240, pg_timeout=300)
    elapsed = time.monotonic() - start
    text = str(info.value) + "\n" + capfd.readouterr().err
    waited = r"rank 0 was waiting for the batch \[[^\]]*from rank 1[^\]]*\] at step 2"
    if how == "exit":
        assert re.search(r"rank 0 failed after [0-9.]+ s in step 2: PeerFailure: " + waited, text), text[-3000:]
        assert "no report from rank(s) [1]: dead, or stuck outside the step" in text, text[-3000:]
    else:
        assert f"--- rank 0: exit code {PEER_FAILURE_EXIT}" in text, text[-3000:]
        assert re.search("autopart: " + waited + r": no progress for [0-9.]+ s \(the timeout is 10 s\)", text), text[-3000:]
        assert re.search(r"reported by rank 1: rank 1 was running 1F0 at step 2", text), text[-3000:]
    assert elapsed < 120, f"spawn took {elapsed:.0f} s"


def test_uninstalling_the_contract_leaves_torch_collectives_working():
    """install then uninstall in this process puts back torch's own methods on ProcessGroup
    (before: uninstall set back pybind's unbound function, which no longer binds `self`, and
    every later collective of the pytest process raised 'allreduce(): incompatible function
    arguments': 4 single-process tests after this file failed)."""
    from torch.distributed import ProcessGroup
    names = nccl_contract.ASYNC_COLLECTIVES
    was = nccl_contract.installed()
    nccl_contract.uninstall()
    before = {n: ProcessGroup.__dict__[n] for n in names}
    try:
        nccl_contract.install()
        nccl_contract.uninstall()
        assert {n: ProcessGroup.__dict__[n] for n in names} == before
    finally:
        (nccl_contract.install if was else nccl_contract.uninstall)()


def test_the_runtime_lowers_for_nccl_under_its_contract():
    """On CPU the runtime posts receives early (Gloo's contract); under tests/nccl_contract.py it
    must run NCCL's lowering, the lists the GPUs run, or these tests would not test them."""
    import torch
    from autopart.runtime.executor import posts_never_wait
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    was = nccl_contract.installed()     # AUTOPART_TEST_NCCL_CONTRACT=1 installs it at import
    try:
        nccl_contract.uninstall()
        assert posts_never_wait(cpu) and not posts_never_wait(cuda)
        nccl_contract.install()
        assert not posts_never_wait(cpu)
    finally:
        (nccl_contract.install if was else nccl_contract.uninstall)()
