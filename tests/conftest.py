"""Shared fixtures for the multi-process tests (the rank functions are in tests/workers/).

Each `spawn` of N ranks costs a few seconds of imports per rank on a small machine, so the cases
that share a world size run in one spawn (tests.workers.equivalence.run_group), cached per session
in `spawn_cache`, and every test of that group reads its own case's per-rank results from it.
"""
from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:           # `examples` and `tests.workers` for the rank processes too
    sys.path.insert(0, str(ROOT))       # (spawned processes inherit sys.path)


@pytest.fixture(scope="session")
def spawn_cache() -> dict:
    """group key -> {case name: per-rank results}, or the exception its spawn raised."""
    return {}


@pytest.fixture
def single_process_group(tmp_path):
    """An initialized world of one Gloo rank in this process (for pp=1 meshes, no spawn)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()
