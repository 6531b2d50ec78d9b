"""runtime/groups.py: the barrier names this rank's device under NCCL (torch warned on every
barrier of the GPU smoke without it), and leaves Gloo's call as it was."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.runtime import groups


def test_barrier_names_the_current_device_under_nccl_only(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend in ("nccl", "gloo"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        groups.barrier("g")
    assert calls == [{"group": "g", "device_ids": [3]}, {"group": "g"}]


def test_host_values_get_a_gloo_group_beside_an_nccl_world_only(monkeypatch):
    """RankGroups.host (runtime/batches.py agree's group of host values): the world group where
    it is Gloo; beside an NCCL world, a Gloo group of the same ranks with the same timeout, made
    last on every rank (so every rank makes the groups in one order)."""
    from datetime import timedelta
    from types import SimpleNamespace

    from autopart.mesh import Mesh
    made = []

    def new_group(ranks, timeout=None, backend=None):
        made.append((tuple(ranks), timeout, backend))
        return f"group {len(made)} ({backend})"

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(groups, "barrier", lambda group=None: None)
    timeout = timedelta(seconds=7)
    for backend in ("gloo", "nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        made.clear()
        g = groups.build_groups(Mesh(dp=2), SimpleNamespace(shared_params={}), timeout)
        if backend == "gloo":
            assert g.host is g.world and all(b is None for _, _, b in made), made
        else:
            assert g.host != g.world and made[-1] == ((0, 1), timeout, "gloo"), made
            assert g.host == f"group {len(made)} (gloo)"
