"""Failures end: a rank that dies or stops responding mid-step makes every other rank raise within
the timeout given to parallelize (a hang is the failure these tests catch, so each one asserts the
time it took), and a mesh that does not match the process group fails on every rank, clearly.

Fast tier: python -m pytest -m "not full" tests/test_failures.py
"""
from __future__ import annotations

import re
import time

import pytest

from autopart.runtime.launch import spawn
from tests.workers.equivalence import die_mid_step, mesh_mismatch
from tests.workers.failure import killed_in_checkpoint, mismatched_programs, nonfinite_loss

TIMEOUT_S = 10.0     # parallelize(timeout=...): bounds every wait of the training step
PG_TIMEOUT = 300.0   # the default group's, deliberately longer: parallelize's own must apply
MARGIN_S = 15.0      # scheduling noise on a loaded 2-core machine


def _failures(world: int, how: str, victim: int, dp: int = 1) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(die_mid_step, world, how, victim, TIMEOUT_S, dp, timeout=240, pg_timeout=PG_TIMEOUT)
    return str(info.value), time.monotonic() - start


def _assert_survivors_raised(text: str, world: int, victim: int, code: int) -> None:
    assert f"{world} of {world} ranks failed" in text, text[-3000:]
    assert re.search(rf"--- rank {victim}: exit code {code}\b", text), text[-3000:]
    for rank in range(world):
        if rank == victim:
            continue
        m = re.search(rf"rank {rank} failed after ([0-9.]+) s in step (\d)", text)
        assert m, f"rank {rank} did not raise a timely error (killed instead?):\n{text[-3000:]}"
        assert m.group(2) == "2", f"rank {rank} failed in step {m.group(2)}, expected 2"
        assert float(m.group(1)) <= TIMEOUT_S + MARGIN_S, (
            f"rank {rank} took {m.group(1)} s to notice, timeout {TIMEOUT_S} s")


def test_killed_rank_makes_the_others_fail_pp2():
    text, elapsed = _failures(2, "exit", victim=1)
    _assert_survivors_raised(text, 2, victim=1, code=13)
    assert elapsed < 120, f"spawn took {elapsed:.0f} s"


def test_the_survivors_error_names_the_action_the_peer_and_the_step():
    # rank 1 dies in its first forward of step 2; rank 0 is then waiting on (or sending to) it.
    # Gloo fails one transfer; NCCL's contract (AUTOPART_TEST_NCCL_CONTRACT=1) a coalesced batch,
    # whose transfers are all named
    text, _ = _failures(2, "exit", victim=1)
    action = r"(was waiting for \dRECV_[FB]\d+ from|could not deliver \dSEND_[FB]\d+ to) rank 1"
    assert re.search(rf"rank 0 ({action}|was waiting for the batch \[[^\]]*{action}[^\]]*\]) "
                     r"at step 2", text), text[-3000:]


@pytest.mark.parametrize("what", ["save", pytest.param("load", marks=pytest.mark.full)])
def test_a_rank_killed_in_save_or_load_is_named_by_the_survivors(what, tmp_path):
    """Rank 1 dies as DCP's save (load) begins: rank 0 once raised Gloo's bare "Connection closed
    by peer" from DCP's gather; it must name the phase, the rank that went silent and a remedy,
    within the timeout."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(killed_in_checkpoint, 2, what, 1, str(tmp_path / "ck"), TIMEOUT_S, timeout=240,
              pg_timeout=PG_TIMEOUT)
    text = str(info.value)
    assert re.search(r"--- rank 1: exit code 13\b", text), text[-3000:]
    m = re.search(rf"rank 0 failed after ([0-9.]+) s in {what}: (.*)", text)
    assert m, text[-3000:]
    assert float(m.group(1)) <= TIMEOUT_S + MARGIN_S, m.group(0)
    assert m.group(2).startswith(f"PeerFailure: {what}: rank 0 failed after"), m.group(0)
    assert f"no report from rank(s) [1]: dead, or stuck outside {what}" in text, text[-3000:]
    assert f"remedy: restart every rank and {'resume' if what == 'save' else 'load'}" in text
    assert time.monotonic() - start < 150


# full tier: 37 s (a rank stuck until the timeout); the fast tier keeps a rank killed in save
@pytest.mark.full
@pytest.mark.parametrize("what", ["save", "load"])
def test_a_rank_stuck_in_save_or_load_fails_the_others_within_parallelizes_timeout(what, tmp_path):
    """Rank 1 hangs inside DCP's save (load) past the timeout and its margin: DCP's collectives
    run on the model's group, so rank 0 raises within parallelize's timeout, naming the silent
    rank, not after the default group's (PG_TIMEOUT, 300 s here; 30 minutes by torch's default).
    Before, rank 0 waited for rank 1 (41 s of a 40 s hang)."""
    stuck_s = TIMEOUT_S + MARGIN_S + 5.0
    with pytest.raises(RuntimeError) as info:
        spawn(killed_in_checkpoint, 2, what, 1, str(tmp_path / "ck"), TIMEOUT_S, stuck_s,
              timeout=240, pg_timeout=PG_TIMEOUT)
    text = str(info.value)
    m = re.search(rf"rank 0 failed after ([0-9.]+) s in {what}: (.*)", text)
    assert m, text[-3000:]
    assert float(m.group(1)) <= TIMEOUT_S + MARGIN_S < stuck_s, m.group(0)
    assert f"no report from rank(s) [1]: dead, or stuck outside {what}" in text, text[-3000:]


@pytest.mark.parametrize("differ", ["model", pytest.param("options", marks=pytest.mark.full)])
def test_ranks_that_compiled_different_programs_are_named(differ):
    """The ranks that differ are named, and the cause: a deeper model on rank 1 was traced
    differently (the remedy names the model, the inputs and a process-dependent forward); the
    same model with another recompute option was traced alike (the remedy names the options)."""
    errors = spawn(mismatched_programs, 2, differ, timeout=240)
    for rank, error in enumerate(errors):
        assert error.startswith("AutopartError: the ranks compiled different programs"), error
        assert "ranks [0] compiled" in error and "ranks [1] compiled" in error, error
        if differ == "model":
            assert "They traced different forwards (ranks [0] traced" in error, error
            assert "PYTHONHASHSEED" in error and "same model" in error, error
        else:
            assert "They traced the same forward" in error, error
            assert "same parallelize options" in error and "PYTHONHASHSEED" not in error, error


def test_nonfinite_loss_raises_with_the_step_stage_and_microbatch():
    per_rank = spawn(nonfinite_loss, 2, "raise", timeout=240)
    for r in per_rank:
        assert len(r["losses"]) == 1 and len(r["errors"]) == 1, r
        error = r["errors"][0]
        assert "non-finite values at step 2" in error, error
        assert "rank 1: the loss of microbatch 0 is nan (pipeline stage 1)" in error, error
        assert "rank 0: the gradient of" in error, error


@pytest.mark.full      # fast: runtime/test_nonfinite.py's reduced-loss flag, in one process
def test_a_non_finite_loss_alone_is_found_from_the_reduced_loss():
    """Only microbatch 1's loss is inf and every gradient is finite: no rank checks its losses
    (the reduced global loss carries them), yet every rank raises, naming that microbatch."""
    per_rank = spawn(nonfinite_loss, 2, "raise", "loss", timeout=240)
    for r in per_rank:
        assert len(r["losses"]) == 1 and len(r["errors"]) == 1, r
        error = r["errors"][0]
        assert "non-finite values at step 2" in error, error
        assert "rank 1: the loss of microbatch 1 is inf (pipeline stage 1)" in error, error
        assert "gradient" not in error and "microbatch 0" not in error, error


@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.full), 2])   # 0: full tier
def test_non_finite_gradients_under_a_finite_loss_are_found(zero):
    """The loss is finite and the gradients NaN: found by each rank's check of its gradients
    (`.grad`, or zero=2's reduced slices, each rank its own part), on every rank."""
    per_rank = spawn(nonfinite_loss, 2, "raise", "grad", zero, timeout=240)
    for r in per_rank:
        assert len(r["losses"]) == 1 and len(r["errors"]) == 1, r
        error = r["errors"][0]
        assert "non-finite values at step 2" in error and "loss" not in error, error
        assert "rank 0: the gradient of" in error, error
        if zero:
            assert "rank 1: the gradient of" in error, error


def test_nonfinite_step_is_skipped_on_request():
    per_rank = spawn(nonfinite_loss, 2, "skip", timeout=240)
    for r in per_rank:
        assert r["errors"] == [] and r["skipped"] == [2], r
        assert r["grads_after_skip"] == 0, "a skipped step leaves no gradient to step with"
        assert r["losses"][2] == r["losses"][2] and abs(r["losses"][2]) < 1e3, r   # finite again


@pytest.mark.full      # 32 s; the fast tier keeps the killed-rank case, the full one 4-rank hangs
def test_unresponsive_rank_makes_the_others_fail_within_the_timeout_pp2():
    # rank 1 sleeps 2 * TIMEOUT_S + 5 s in step 2: rank 0 must give up after TIMEOUT_S, well
    # before the default group's 300 s, with an error rather than waiting for rank 1
    text, elapsed = _failures(2, "hang", victim=1)
    _assert_survivors_raised(text, 2, victim=1, code=14)
    assert elapsed < 150, f"spawn took {elapsed:.0f} s"


@pytest.mark.full
@pytest.mark.parametrize("how,victim,dp", [("exit", 0, 1), ("exit", 2, 1), ("hang", 1, 1),
                                           ("exit", 3, 2), ("hang", 0, 2)],
                         ids=["exit-first-pp4", "exit-middle-pp4", "hang-pp4",
                              "exit-pp2xdp2", "hang-pp2xdp2"])
def test_failing_rank_makes_all_others_fail_4_ranks(how, victim, dp):
    text, elapsed = _failures(4, how, victim, dp)
    _assert_survivors_raised(text, 4, victim, 13 if how == "exit" else 14)
    assert elapsed < 200, f"spawn took {elapsed:.0f} s"


def test_mesh_of_another_size_fails_clearly_on_every_rank():
    meshes = [dict(pp=4), dict(pp=1), dict(pp=2, dp=2)]
    per_rank = spawn(mesh_mismatch, 2, meshes, timeout=240)
    for rank, errors in enumerate(per_rank):
        for sizes, error in zip(meshes, errors):
            n = 1
            for v in sizes.values():
                n *= v
            assert error.startswith("AutopartError: "), (rank, sizes, error)
            assert f"needs {n} processes but the process group has 2" in error, (rank, error)
            assert "remedy" in error, error
