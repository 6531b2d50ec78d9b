"""tests/nccl_contract.py keeps NCCL's point-to-point contract over Gloo: one work per
batch_isend_irecv, receive buffers filled only when that work is waited on, a group's batches
completed in posting order, and wait() that returns on a dead peer (the process is then aborted by
the watchdog once the group's timeout has passed, as NCCL's does)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from autopart.runtime.launch import spawn
from tests import nccl_contract

ROOT = Path(__file__).resolve().parent.parent


def test_contract_over_gloo():
    r0, r1 = spawn(nccl_contract.contract_checks, 2, 5.0, timeout=120, pg_timeout=30)
    for r in (r0, r1):
        assert r["gloo_works"] == 4 and r["gloo_ok"], r      # Gloo: one work per op
        assert r["contract_works"] == 1, r                    # NCCL: one work per batch
        assert r["poisoned_before_wait"] == [True, True], r  # delivered, not yet visible
        assert r["wait_returned"] is True and r["filled_after_wait"], r
        assert r["in_order"] == (True, True) and r["earlier_filled_by_own_wait"], r
    assert r0["dead_wait"] is True, r0                        # did not raise
    assert r0["dead_wait_s"] < 10 and r0["dead_buffer_poisoned"], r0
    assert len(r0["dead_errors"]) == 1 and "recv from 1" in r0["dead_errors"][0], r0


def test_watchdog_aborts_after_the_timeout():
    with pytest.raises(RuntimeError, match=f"rank 0: exit code {nccl_contract.ABORT_EXIT_CODE}"):
        spawn(nccl_contract.watchdog_check, 2, 2.0, timeout=120, pg_timeout=30)


def test_runtime_posts_point_to_point_only_in_batches():
    """The contract wraps batch_isend_irecv only: the product must not call isend/irecv alone
    (blocking dist.send/recv are synchronous on both backends and need no wrapper)."""
    calls = re.compile(r"\bdist\.(isend|irecv)\s*\(")
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("runtime", "autopart") for p in (ROOT / d).rglob("*.py")
             if not p.name.startswith("test_")
             for i, line in enumerate(p.read_text().splitlines(), 1) if calls.search(line)]
    assert not found, found
