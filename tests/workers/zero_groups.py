"""Rank functions for tests/test_zero_groups.py: zero=1 at the default bucket size, its
reduce-scatters per layer group posted during the backward; the run against the plain model and
the runtime's trace of when each reduce-scatter was posted and waited."""
from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import autopart
from tests.workers.common import _compare, _local_view

STEPS, MICROBATCHES, RTOL, ATOL = 2, 2, 1e-5, 1e-5
ADAMW = dict(lr=1e-3, weight_decay=0.1)


def trained(rank: int, world: int, trace_dir: str) -> dict:
    """STEPS AdamW steps of the test GPT (tests/test_zero_buckets.build) at dp=`world` zero=1,
    MICROBATCHES microbatches, traced; and of the plain model on the same batch. Returns what
    differs, the trace's events (rank 0) and the parameter names of each reduce-scatter group."""
    from tests.test_zero_buckets import build
    model, loss_fn, x = build()
    ref = copy.deepcopy(model)
    path = Path(trace_dir) / "zero1.json"
    pm = autopart.parallelize(model, autopart.Mesh(dp=world), (x,), loss_fn=loss_fn, target=x,
                              zero=1, microbatches=MICROBATCHES, trace=str(path),
                              timeout=timedelta(seconds=120))
    opt, ref_opt = pm.optimizer(torch.optim.AdamW, **ADAMW), \
        torch.optim.AdamW(ref.parameters(), **ADAMW)
    mine, ref_params = _local_view(pm, rank), dict(ref.named_parameters())
    problems: list[str] = []
    for step in range(1, STEPS + 1):
        loss = pm.train_step(x, target=x)
        ref_loss = loss_fn(ref(x), x)
        ref_loss.backward()
        _compare(f"step {step} loss", loss, ref_loss, RTOL, 1e-6, problems)
        opt.step(), ref_opt.step()
        for name, p in pm.named_parameters():
            _compare(f"step {step} {name}", p, mine(name, ref_params[name]), RTOL, ATOL, problems)
        opt.zero_grad(), ref_opt.zero_grad()
    dist.barrier()
    out = {"rank": rank, "problems": problems,
           "groups": [b.names for b in pm._grads._layout.buckets]}
    if rank == 0:
        out["events"] = json.loads(path.read_text())["traceEvents"]
    return out
