"""tests/nccl_contract.py keeps NCCL's point-to-point contract over Gloo: one work per
batch_isend_irecv, receive buffers filled only when that work is waited on, a group's batches
completed in posting order, and wait() that returns on a dead peer (the process is then aborted by
the watchdog once the group's timeout has passed, as NCCL's does)."""
from __future__ import annotations

import os
import time
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from autopart.runtime.launch import spawn
from tests import nccl_contract
from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.composition import CCase

ROOT = Path(__file__).resolve().parent.parent


def test_contract_over_gloo(monkeypatch):
    monkeypatch.setenv(nccl_contract.ENV, "1")  # ranks install it importing tests.workers.common
    r0, r1 = spawn(nccl_contract.contract_checks, 2, 5.0, timeout=120, pg_timeout=30)
    for r in (r0, r1):
        assert r["installed_by_env"], r
        assert r["gloo_works"] == 4 and r["gloo_ok"], r      # Gloo: one work per op
        assert r["contract_works"] == 1, r                    # NCCL: one work per batch
        assert r["poisoned_before_wait"] == [True, True], r  # delivered, not yet visible
        assert r["wait_returned"] is True and r["filled_after_wait"], r
        assert r["in_order"] == (True, True) and r["earlier_filled_by_own_wait"], r
    assert r0["dead_wait"] is True, r0                        # did not raise
    assert r0["dead_wait_s"] < 10 and r0["dead_buffer_poisoned"], r0
    assert len(r0["dead_errors"]) == 1 and "recv from 1" in r0["dead_errors"][0], r0


@pytest.mark.full      # 15 s of spawn for the test aid's own abort path
def test_watchdog_aborts_after_the_timeout():
    with pytest.raises(RuntimeError, match=f"rank 0: exit code {nccl_contract.ABORT_EXIT_CODE}"):
        spawn(nccl_contract.watchdog_check, 2, 2.0, timeout=120, pg_timeout=30)


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
# tensor-parallel, one expert-parallel and one ZeRO case (their collectives keep Gloo's behaviour;
# what changes under the contract is every point-to-point transfer around them).
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
    comparison sees it) and its pipeline's transfers went through the contract. The failed
    transfers of the spawn (any case: the count is per process) are shown with a failure."""
    failed = sorted({e for r in ranks for e in r.get("contract", {}).get("errors", ())})
    try:
        assert_all_ranks_equal_plain(case, ranks)
    except AssertionError as e:
        raise AssertionError(f"{e}\ntransfers that failed under the contract in this spawn: "
                             f"{failed or 'none'}") from None
    for r in ranks:
        assert "contract" in r, f"{case.name}: rank {r['rank']} did not run under the contract"
        # a refusal case of the composition matrix is refused at compile: it sends nothing
        # (tests/composition.py checked the refusal in assert_all_ranks_equal_plain's problems)
        if case.pp > 1 and not getattr(case, "refused", ()):
            assert r["contract"]["batches"] > 0, f"{case.name}: no batch went through the contract"


@pytest.mark.parametrize("case", FAST_2, ids=[c.name for c in FAST_2])
def test_equivalence_under_the_contract(case, spawn_cache):
    results = run_group(spawn_cache, ("nccl-contract", "fast", 2), FAST_2,
                        rank_fn=nccl_contract.run_cases)
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
        "expert-parallel": ([c for cases in tx.GROUPS.values() for c in cases], run_cases),
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
                        rank_fn=partial(nccl_contract.under_contract, fn))
    _assert_ran_under_contract(next(c for c in cases if c.name == name), results[name])


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
