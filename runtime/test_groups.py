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
