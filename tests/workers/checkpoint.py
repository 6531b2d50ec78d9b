"""Rank functions for tests/test_checkpoint.py (module level, so spawned ranks can import them).

A test is a chain of `Phase`s run one after another in the same rank processes (each phase a new
`parallelize`, possibly on another mesh of the same world size): load a checkpoint or start from
the initial weights, train some steps, save. After loading and after training, every rank
compares its parameters and optimizer state with the plain, unmodified model trained the same
number of steps from the same initial weights with the same optimizer on the same batches (the
batch of step s is a function of s alone). Chains that change the world size are split into
several spawns; the checkpoint directory carries the state between them.
"""
from __future__ import annotations

import copy
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from tests.workers.common import ATOL, RTOL, Case, _compare, _local_view, build, held_view


@dataclass(frozen=True)
class Phase:
    name: str
    mesh: dict                          # e.g. {"pp": 2, "tp": 2}
    steps: int = 2                      # optimizer steps in this phase (after loading)
    load: str | None = None             # checkpoint directory to load first
    save: str | None = None             # checkpoint directory to save to afterwards
    model: str = "gpt4"                 # a tests.workers.common.build model
    optim: str = "adamw"                # sgd (momentum) | adam | adamw
    microbatches: int = 2
    schedule: str = "1f1b"
    virtual_stages: int = 1
    batch: int = 8
    save_model: bool = False            # pass model= to save (records a HF config)
    save_at: int | None = None          # save after this step (default: after the last) and go on
    return_params: bool = False         # return this rank's parameters (bitwise comparisons)
    random_batches: bool = False        # batches drawn from the global RNG (exact resume)
    zero: int = 0                       # 1, 2: parallelize(zero=), pm.optimizer (ZeroOptimizer)


def optimizer_spec(kind: str) -> tuple[type, dict]:
    if kind == "sgd":
        return torch.optim.SGD, dict(lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam, dict(lr=1e-3)
    return torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)


def optimizer(kind: str, params):
    cls, kwargs = optimizer_spec(kind)
    return cls(params, **kwargs)


def batch(phase: Phase, step: int, vocab: int, inputs, target):
    """The global batch of optimizer step `step` (1-based): a function of the step alone, or
    drawn from the global RNG (so that resuming needs the RNG state)."""
    g = None if phase.random_batches else torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, tuple(inputs[0].shape), generator=g)
    if target is None:                  # switch: (idx, targets) are both inputs
        return (x, torch.randint(0, vocab, tuple(inputs[1].shape), generator=g)), None
    return (x,), torch.randint(0, vocab, tuple(target.shape), generator=g)


def _vocab(model_name: str) -> int:
    return {"gpt4": 128, "gpt": 128, "hf": 256, "switch": 128, "switch-top2": 128,
            "extras": 64}[model_name]


def _param_atol(optim: str) -> float:
    return 1e-5 if optim in ("adam", "adamw") else ATOL   # see tests/workers/equivalence.py


def run_phase(phase: Phase, rank: int, pg_timeout: float = 60.0) -> dict:
    """One phase on this rank: parallelize, maybe load, train, compare with the plain model,
    maybe save. Returns {"problems": [...], ...}."""
    import autopart

    start = time.perf_counter()
    case = Case(phase.name, model=phase.model, batch=phase.batch)
    model, loss_fn, inputs, target = build(case)
    plain = copy.deepcopy(model)         # the unmodified model, initial weights
    mesh = autopart.Mesh(**phase.mesh)
    pm = autopart.parallelize(model, mesh, inputs, loss_fn=loss_fn, target=target,
                              microbatches=phase.microbatches, schedule=phase.schedule,
                              virtual_stages=phase.virtual_stages, zero=phase.zero,
                              timeout=timedelta(seconds=pg_timeout))
    if phase.zero:
        cls, kwargs = optimizer_spec(phase.optim)
        opt = pm.optimizer(cls, **kwargs)
    else:
        opt = optimizer(phase.optim, pm.parameters())
    mine = _local_view(pm, rank)
    problems: list[str] = []
    done = 0
    extra = {}
    timings = {"parallelize": time.perf_counter() - start}
    if phase.load is not None:
        t = time.perf_counter()
        extra = pm.load(phase.load, optimizer=opt)
        timings["load"] = time.perf_counter() - t
        done = int(extra.get("step", 0))
    vocab = _vocab(phase.model)

    # the plain model, trained `done` steps, then compared; then both train phase.steps more
    ref_opt = optimizer(phase.optim, plain.parameters())
    ref_params = dict(plain.named_parameters())
    if phase.random_batches and phase.load is None:
        torch.manual_seed(1234)          # a loaded checkpoint restores the RNG instead
    rng = torch.get_rng_state()
    if phase.random_batches:             # replay the draws of the steps already done
        torch.manual_seed(1234)
    for step in range(1, done + 1):
        _plain_step(plain, loss_fn, ref_opt, *batch(phase, step, vocab, inputs, target))
    torch.set_rng_state(rng)
    if phase.load is not None:
        _compare_state(pm, opt, ref_params, ref_opt, mine, f"{phase.name} after load "
                       f"(step {done})", _param_atol(phase.optim), problems)
    out = {"phase": phase.name, "rank": rank, "problems": problems, "extra": extra}
    last = done + phase.steps
    for step in range(done + 1, last + 1):
        b = batch(phase, step, vocab, inputs, target)    # one draw, for both models
        pm.train_step(*b[0], target=b[1])
        opt.step(), opt.zero_grad()
        _plain_step(plain, loss_fn, ref_opt, *b)
        if phase.save is not None and step == (phase.save_at or last):
            t = time.perf_counter()
            marker = pm.save(phase.save, optimizer=opt, extra={"step": step, "phase": phase.name},
                             model=model if phase.save_model else None)
            out["save_seconds"] = time.perf_counter() - t
            out["files"] = marker["files"]
    _compare_state(pm, opt, ref_params, ref_opt, mine, f"{phase.name} after step {last}",
                   _param_atol(phase.optim), problems)
    out.update(seconds=time.perf_counter() - start, timings=timings)
    if phase.return_params:
        out["params"] = {n: p.detach().clone() for n, p in pm.named_parameters()}
        out["full_state_dict"] = pm.full_state_dict()
        out["state"] = {n: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                        for n, p in pm.named_parameters() if p in opt.state}
    return out


def _plain_step(model, loss_fn, opt, inputs, target) -> None:
    out = model(*inputs)
    loss = loss_fn(out, target) if loss_fn is not None else out
    if isinstance(loss, tuple):
        loss = loss[0]
    loss.backward()
    opt.step(), opt.zero_grad()


def _compare_state(pm, opt, ref_params, ref_opt, mine, what: str, atol: float,
                   problems: list[str]) -> None:
    """This rank's parameters and optimizer state against the plain model's (its local view)."""
    holds = held_view(pm, pm.rank)      # zero=3: the parameter is this rank's 1-D slice
    for name, p in pm.named_parameters():
        ref = ref_params[name]
        _compare(f"{what}: parameter {name}", p, holds(name, ref), RTOL, atol, problems)
        if pm.zero:
            continue
        ref_state, state = ref_opt.state.get(ref, {}), opt.state.get(p, {})
        if set(ref_state) != set(state):
            problems.append(f"{what}: optimizer state keys of {name}: {sorted(state)} != plain "
                            f"{sorted(ref_state)}")
            continue
        for key, v in ref_state.items():
            if not torch.is_tensor(v):
                continue
            local = mine(name, v) if v.dim() > 0 and v.shape == ref.shape else v
            # Adam's second moment is ~grad^2: its round-off scales with it, tiny in absolute
            _compare(f"{what}: optimizer {key} of {name}", state[key], local, 1e-4,
                     atol if key != "exp_avg_sq" else 1e-9, problems)
    if pm.zero:
        _compare_zero_state(opt, ref_params, ref_opt, mine, what, atol, problems)
    for g, rg in zip(opt.param_groups, ref_opt.param_groups):
        for k, v in rg.items():
            if k != "params" and g.get(k) != v:
                problems.append(f"{what}: param group {k} = {g.get(k)} != plain {v}")


def _compare_zero_state(opt, ref_params, ref_opt, mine, what: str, atol: float,
                        problems: list[str]) -> None:
    """zero=1, 2: each slice state tensor against this rank's slice of the plain optimizer's
    state, cut here from the layout's names and replica index: each parameter's plain state
    flattened, zero-padded to a multiple of the replica count d, its index-th of d equal chunks;
    those chunks end to end in the layout's order."""
    for index, lay in enumerate(opt.layouts):
        state = opt.slice_state(index)      # its buckets' state joined: one slice-long tensor
        ref_states = [ref_opt.state.get(ref_params[n], {}) for n in lay.names]
        keys = set().union(*ref_states) if ref_states else set()
        if set(state) != keys:
            problems.append(f"{what}: slice optimizer state keys {sorted(state)} != plain "
                            f"{sorted(keys)}")
            continue
        for key in sorted(keys):
            ref = [st[key] for st in ref_states]
            if ref[0].dim() == 0:
                for name, v in zip(lay.names, ref):
                    _compare(f"{what}: optimizer {key} (of {name})", state[key], v, 0, 0, problems)
                continue
            chunks = []
            for n, v in zip(lay.names, ref):
                flat = mine(n, v).reshape(-1)
                size = -(-flat.numel() // lay.size)
                flat = torch.cat([flat, flat.new_zeros(size * lay.size - flat.numel())])
                chunks.append(flat[lay.index * size:(lay.index + 1) * size])
            _compare(f"{what}: slice optimizer {key} (replica {lay.index} of {lay.size})",
                     state[key], torch.cat(chunks), 1e-4, atol if key != "exp_avg_sq" else 1e-9,
                     problems)


def run_chain(rank: int, world: int, phases: list[Phase], pg_timeout: float = 60.0) -> list[dict]:
    """Rank function: every phase in turn; a phase that raises ends the chain (its peers may be
    stuck in its collectives)."""
    out = []
    for phase in phases:
        try:
            out.append(run_phase(phase, rank, pg_timeout))
        except Exception:  # noqa: BLE001  (reported per phase by the test process)
            out.append({"phase": phase.name, "rank": rank,
                        "problems": [f"raised on rank {rank}:\n{traceback.format_exc()}"]})
            break
    return out


def killed_mid_save(rank: int, world: int, path: str, victim: int) -> None:
    """Rank function: train 1 step, save to `path` (complete), train 1 more, save to `path`
    again while rank `victim` dies (os._exit) halfway through writing its file."""
    from torch.distributed.checkpoint import filesystem

    phase = Phase("kill", {"pp": world}, steps=1, save=path)
    run_phase(phase, rank, pg_timeout=15.0)
    if rank == victim:
        original = filesystem._write_item

        def dying_write(transforms, stream, data, *args, **kwargs):
            stream.write(b"\0" * 100)          # a partly written file, then the process dies
            stream.flush()
            os._exit(17)
        filesystem._write_item = dying_write
        del original
    # the second save: step 2, same path; must never finish
    run_phase(Phase("kill-2", {"pp": world}, steps=1, load=path, save=path), rank,
              pg_timeout=15.0)


__all__ = ["Phase", "run_chain", "run_phase", "killed_mid_save", "optimizer", "optimizer_spec",
           "batch"]
