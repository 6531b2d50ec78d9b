"""Rank functions for tests/test_failures.py: programs that differ between ranks, non-finite
losses, and a rank killed during save or load."""
from __future__ import annotations

from datetime import timedelta

import torch

from tests.workers.common import Case, build


def mismatched_programs(rank: int, world: int, differ: str = "model") -> str:
    """Rank 1 builds a deeper model than the others (differ="model"), or the same model with
    another recompute option ("options"): parallelize must refuse on every rank."""
    import autopart
    from examples.gpt import GPT, config, lm_loss

    torch.manual_seed(0)
    deeper = rank == 1 and differ == "model"
    model = GPT(config(f"tiny,n_layer={4 if deeper else 2},n_embd=32,n_head=2,block_size=16"))
    x = torch.randint(0, 256, (4, 16))
    recompute = "full" if rank == 1 and differ == "options" else "none"
    try:
        autopart.parallelize(model, autopart.Mesh(pp=world), (x,), loss_fn=lm_loss, target=x,
                             microbatches=2, timeout=timedelta(seconds=60), recompute=recompute)
        return "no error"
    except autopart.AutopartError as e:
        return f"AutopartError: {e}"


def nonfinite_loss(rank: int, world: int, mode: str, where: str = "norm", zero: int = 0) -> dict:
    """Three steps; in step 2 something is non-finite: where="norm", the final norm's weight (on
    the last pipeline rank) is NaN, so the loss of every microbatch and every gradient upstream
    are NaN; where="loss", only microbatch 1's loss is +inf (the loss adds -log(0) when its
    targets are all 0) while every gradient stays finite; where="grad", microbatch 1's loss stays
    finite while the gradients are NaN (the loss adds sqrt(0 * out.sum() + 0) on targets all 0: a
    zero value whose derivative is inf * 0). zero=2: data parallel over the ranks,
    gradients in the optimizer's slices, instead of a pipeline. Report or skip that step."""
    import autopart

    case = Case("nan", pp=world, microbatches=2)
    model, loss_fn, inputs, target = build(case)
    if where == "loss":
        def loss_fn(out, y, _lm=loss_fn):    # + inf on targets all 0, + 0 (no gradient) else
            return _lm(out, y) - (y != 0).any().float().log()
    elif where == "grad":
        def loss_fn(out, y, _lm=loss_fn):    # + 0 with NaN gradients on targets all 0, else + 1
            return _lm(out, y) + (out.sum() * 0 + (y != 0).any().float()).sqrt()
    mesh, layout = (autopart.Mesh(dp=world), dict(zero=zero)) if zero else \
        (autopart.Mesh(pp=world), dict(microbatches=2))
    pm = autopart.parallelize(model, mesh, inputs, loss_fn=loss_fn, target=target,
                              timeout=timedelta(seconds=60), nonfinite=mode, **layout)
    norm = dict(pm.named_parameters()).get("transformer.ln_f.weight")
    bad_target = target.clone()
    bad_target[target.shape[0] // 2:] = 0                      # microbatch 1 of 2
    out = {"errors": [], "losses": [], "grads_after_skip": None}
    for step in (1, 2, 3):
        if norm is not None and where == "norm":
            with torch.no_grad():
                norm.fill_(float("nan") if step == 2 else 1.0)
        y = bad_target if where != "norm" and step == 2 else target
        try:
            out["losses"].append(float(pm.train_step(*inputs, target=y)))
        except autopart.AutopartError as e:
            out["errors"].append(str(e))
            break
        if step == 2:
            out["grads_after_skip"] = sum(p.grad is not None for p in pm.parameters())
        for p in pm.parameters():
            p.grad = None
    out["skipped"] = list(pm.skipped_steps)
    return out


def save_on_one_rank(rank: int, world: int, hold_s: float, path: str) -> str:
    """Rank 0 saves; the others never call save (they stay alive `hold_s` seconds): rank 0 must
    fail within parallelize's timeout (10 s), naming the ranks that did not come."""
    import time
    import autopart

    case = Case("one-saves", dp=world)
    model, loss_fn, inputs, target = build(case)
    pm = autopart.parallelize(model, autopart.Mesh(dp=world), inputs, loss_fn=loss_fn,
                              target=target, timeout=timedelta(seconds=10))
    if rank != 0:
        time.sleep(hold_s)
        return "did not save"
    start = time.perf_counter()
    try:
        pm.save(path)
        return f"no error after {time.perf_counter() - start:.1f} s"
    except autopart.AutopartError as e:
        return f"AutopartError after {time.perf_counter() - start:.1f} s: {e}"


def killed_in_checkpoint(rank: int, world: int, what: str, victim: int, path: str,
                         timeout_s: float, stuck_s: float = 0.0) -> None:
    """Rank function: Mesh(dp=world), one step, then pm.save(path) (what="save") or pm.load of
    the checkpoint saved just before (what="load"), in which rank `victim` exits (os._exit(13),
    as a killed process) where DCP's work begins. The others must raise within the timeout; the
    error says how long after the start of `what` ("rank 0 failed after 0.4 s in save: ...").
    With `stuck_s`, the victim first hangs that long inside DCP (alive, silent), then exits."""
    import os
    import time
    import torch.distributed.checkpoint as dcp
    import autopart

    case = Case("dies-in-checkpoint", dp=world)
    model, loss_fn, inputs, target = build(case)
    pm = autopart.parallelize(model, autopart.Mesh(dp=world), inputs, loss_fn=loss_fn,
                              target=target, timeout=timedelta(seconds=timeout_s))
    pm.train_step(*inputs, target=target)
    if what == "load":
        pm.save(path)
    if rank == victim:
        setattr(dcp, what, lambda *args, **kwargs: (time.sleep(stuck_s), os._exit(13)))
    started = time.monotonic()
    try:
        pm.save(path) if what == "save" else pm.load(path)
    except Exception as e:
        raise RuntimeError(f"rank {rank} failed after {time.monotonic() - started:.1f} s in "
                           f"{what}: {type(e).__name__}: {e}") from e
