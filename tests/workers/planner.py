"""Rank functions for tests/test_planner.py (module level, so that the rank processes can import
them)."""
from __future__ import annotations

import copy

import torch

from tests.workers.common import ATOL, RTOL, _compare

STEPS = 2


def auto_mesh(rank: int, world: int) -> dict:
    """parallelize(mesh="auto") on bench/planner_local.py's tiny GPT, two SGD steps, against a deep copy
    of the plain model (taken before parallelize) trained on the same batch in this process: the
    loss of each step must be the plain model's (the second one after an optimizer step, so the
    gradients of the first count too)."""
    import autopart
    from bench.planner_local import BATCH, CONFIG
    from examples.gpt import GPT, lm_loss
    torch.manual_seed(0)
    model = GPT(CONFIG)
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, model.config.block_size))
    pm = autopart.parallelize(model, "auto", (tokens,), loss_fn=lm_loss, target=tokens)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, ref_losses, problems = [], [], []
    for step in range(STEPS):
        loss = pm.train_step(tokens, target=tokens)
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(ref(tokens), tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _compare(f"rank {rank} step {step + 1} loss", loss, ref_loss, RTOL, ATOL, problems)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    return {"mesh": str(pm.mesh), "losses": losses, "ref_losses": ref_losses, "problems": problems}


def timed_steps(rank: int, world: int, axes: dict, microbatches: int) -> dict:
    """bench/planner_local.py's step (train_step + Adam) on this layout: median wall seconds and median
    CPU seconds of this process per step, one torch thread (so that the CPU time is the work done,
    not threads spinning for a core the machine's other processes hold)."""
    import statistics
    import time
    import autopart
    from bench.planner_local import BATCH, CONFIG, STEPS
    from examples.gpt import GPT, lm_loss
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, model.config.block_size))
    pm = autopart.parallelize(model, autopart.Mesh(**axes), (tokens,), loss_fn=lm_loss,
                              target=tokens, microbatches=microbatches)
    opt = torch.optim.Adam(pm.parameters(), lr=1e-4)
    wall, cpu = [], []
    for i in range(STEPS + 1):
        w, c = time.perf_counter(), time.process_time()
        pm.train_step(tokens, target=tokens)
        opt.step()
        opt.zero_grad()
        if i:
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}
