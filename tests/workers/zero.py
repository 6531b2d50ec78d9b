"""Rank functions for tests/test_zero.py: one train_step at each ZeRO level on the same model and
batch, its gradients against the plain model's, and the bytes it allocates as the dispatcher
sees them (tests/test_zero_buckets.LiveBytes); zero=3's parameter storage over a step."""
from __future__ import annotations

import copy
from datetime import timedelta

import torch

import autopart
from tests.test_zero_buckets import BUCKET, LiveBytes, build
from tests.workers.common import ATOL, RTOL, _compare

MICROBATCHES = 2


def one_step(rank: int, world: int, levels: tuple = (1, 2)) -> dict:
    """Per level: the peak bytes alive during train_step above what was alive before it, the
    bytes it leaves alive (the gradients it keeps), `.grad` of every parameter, and what differs
    from the plain model's gradient: after each of two train_steps under zero=1 each full-shaped
    `.grad` (this rank's chunks, zeros elsewhere), then under both levels the gradient that one
    SGD step at lr 1 subtracts from every parameter (each rank's reduced slice, all-gathered)."""
    model, loss_fn, x = build()
    ref = copy.deepcopy(model)
    loss_fn(ref(x), x).backward()
    plain = {n: p.grad for n, p in ref.named_parameters()}
    out = {"rank": rank}
    for zero in levels:
        pm = autopart.parallelize(copy.deepcopy(model), autopart.Mesh(dp=world), (x,),
                                  loss_fn=loss_fn, target=x, zero=zero,
                                  microbatches=MICROBATCHES, zero_bucket_size=BUCKET,
                                  timeout=timedelta(seconds=120))
        opt = pm.optimizer(torch.optim.SGD, lr=1.0)
        problems: list[str] = []
        pm.train_step(x, target=x)          # the first step lays out the buckets: not measured
        if zero == 1:
            problems += zero1_grad_problems(pm, plain, rank, world, "step 1")
        opt.zero_grad()
        with LiveBytes() as counter:
            pm.train_step(x, target=x)
        grads = {n: p.grad for n, p in pm.named_parameters()}
        if zero == 1:
            problems += zero1_grad_problems(pm, plain, rank, world, "step 2")
        problems += stepped_grad_problems(pm, opt, plain, f"zero={zero} step 2")
        out[zero] = {"peak": counter.peak, "kept": counter.live,
                     "grad_none": sorted(n for n, g in grads.items() if g is None),
                     "problems": problems}
    return out


def zero1_grad_problems(pm, plain: dict, index: int, size: int, what: str) -> list[str]:
    """zero=1 (docs/memory.md): `.grad` of every parameter is full-shaped and holds the plain
    gradient in the elements replica `index` of `size` owns, zeros elsewhere. Owned: the
    flattened parameter padded to a multiple of `size`, torch.chunk'ed in `size`, chunk
    `index` (computed here, not read from the runtime's layout)."""
    problems: list[str] = []
    for name, p in pm.named_parameters():
        if p.grad is None:
            problems.append(f"{what}: zero=1 left .grad of {name} None")
            continue
        flat = plain[name].reshape(-1)
        n = flat.numel()
        owned = torch.chunk(torch.arange(n + (-n % size)), size)[index]
        owned = owned[owned < n]
        want = torch.zeros_like(flat)
        want[owned] = flat[owned]
        _compare(f"{what} .grad of {name} ({owned.numel()} elements owned)", p.grad.reshape(-1),
                 want, RTOL, ATOL, problems)
    return problems


def stepped_grad_problems(pm, opt, plain: dict, what: str) -> list[str]:
    """One step of `opt` (SGD, lr 1, no momentum or decay: p -= grad) must move every parameter
    by the plain model's gradient: each rank's slice of the reduced gradient, all-gathered."""
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    opt.step()
    problems: list[str] = []
    for name, p in pm.named_parameters():
        _compare(f"{what}: the gradient SGD subtracted from {name}", before[name] - p.detach(),
                 plain[name], RTOL, ATOL, problems)
    return problems


def zero3_held(rank: int, world: int) -> dict:
    """zero3_held_once as the pass decides without a budget, and under a budget that holds
    every group for the step."""
    return {"default": zero3_held_once(rank, world),
            "budget": zero3_held_once(rank, world, memory_budget="1GB")}


def zero3_held_once(rank: int, world: int, **options) -> dict:
    """zero=3 on dp=`world`: the bytes of parameter storage a rank holds, sampled after every
    gather, release and all-gather post of the step (runtime/param_shards.py: only the moments
    to look), measured below autopart's records: the storages the rank's Parameter objects
    reference (`untyped_storage().nbytes()`, each storage once: the slice store between uses,
    a full storage while gathered) plus the all-gather buffers in flight (what the dispatcher
    saw `_post` allocate and torch has not freed, LiveBytes); before, during and after the
    second step; the all-gathers it posted. Also the memory model's count and what
    `pm.parameters()` hold."""
    from tests.workers.common import Case, build as build_case
    model, loss_fn, inputs, target = build_case(Case("zero3-held", model="gpt4"))
    x = inputs[0]
    pm = autopart.parallelize(model, autopart.Mesh(dp=world), inputs, loss_fn=loss_fn,
                              target=target, zero=3, microbatches=MICROBATCHES,
                              timeout=timedelta(seconds=120), **options)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    sharded = pm._sharded
    params = list({id(p): p for c in pm.program.chunks for p in c.gm.parameters()}.values())
    posted = LiveBytes(active=False)        # counts only inside _post: the gather buffers
    samples: list[tuple[int, int]] = []

    def by_params() -> int:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
        return sum(storages.values())

    def held() -> int:
        return by_params() + posted.live

    for name in ("gather", "release", "_post"):
        real = getattr(sharded, name)

        def sampled(*a, _real=real, _post=name == "_post", **k):
            posted.active = _post
            try:
                out = _real(*a, **k)
            finally:
                posted.active = False
            samples.append((by_params(), posted.live))
            return out
        setattr(sharded, name, sampled)
    pm.train_step(x, target=target)
    opt.step()
    opt.zero_grad()
    samples.clear()
    gathers, before = sharded.gathers, held()
    with posted:
        pm.train_step(x, target=target)          # the second step: measured
    during = max(a + b for a, b in samples)
    during_params = max(a for a, _ in samples)
    after_step = held()
    opt.step()
    return {"before": before, "during": during, "during_params": during_params,
            "after_step": after_step,
            "after_optimizer": held(), "gathers": sharded.gathers - gathers,
            "freed_after": [a for rows in pm.compiled.program.param_groups.values()
                            for _, a in rows],
            "samples": len(samples), "predicted": pm.compiled.memory[rank]["params"],
            "held_numel": sum(p.numel() for p in pm.parameters())}
