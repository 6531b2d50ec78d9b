"""Rank functions for tests/test_host_syncs.py: a real train_step on 2 Gloo ranks, its host
reads of tensor values counted, and embedding ids past the table given to one rank only."""
from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import torch

# Tensor methods that copy a tensor's value to the host (on CUDA: wait for the device), and the
# two that hand its memory to the host (`.cpu()` of a device tensor, `.numpy()`)
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")
# the one function allowed to read a tensor that holds no device value: it all-reduces host
# integers in a CPU tensor it made itself, over the CPU (Gloo) group (runtime/batches.py)
HOST_VALUES = ("batches.py", "host_sum")
STEADY_STEPS = 3


def _gpt(mesh: dict, nonfinite: str | None = None, seed: int = 0):
    import autopart
    from examples.gpt import GPT, config, lm_loss
    torch.manual_seed(seed)
    model = GPT(config("tiny,n_layer=2,block_size=16"))
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, 1)
    labels[0, 8:] = -100            # ignored labels: the token count reads the labels' values
    pm = autopart.parallelize(model, autopart.Mesh(**mesh), (tokens,), loss_fn=lm_loss,
                              target=labels, microbatches=2, timeout=timedelta(seconds=120),
                              **({} if nonfinite is None else {"nonfinite": nonfinite}))
    return pm, tokens, labels


class Reads:
    """Counts the READS made on any tensor while active: (method, file, function, device)."""

    def __init__(self):
        self.seen: list[tuple[str, str, str, str]] = []
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}

    def __enter__(self):
        def counting(name, fn):
            def wrapper(t, *args, **kwargs):
                caller = traceback.extract_stack(limit=2)[0]
                self.seen.append((name, Path(caller.filename).name, caller.name, str(t.device)))
                return fn(t, *args, **kwargs)
            return wrapper
        for name, fn in self._originals.items():
            setattr(torch.Tensor, name, counting(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(torch.Tensor, name, fn)

    def of_device_values(self) -> list[str]:
        return [f"{m} at {f} ({fn})" for m, f, fn, _ in self.seen if (f, fn) != HOST_VALUES]

    def of_host_values(self) -> list[tuple]:
        return [r for r in self.seen if (r[1], r[2]) == HOST_VALUES]


def steady_reads(mesh: dict, nonfinite: str | None) -> dict:
    """Per steady step (the batch shapes of the step before; the first step also checks that
    every rank got the same batch, with one all-gather of hashes): the reads of device values
    and of the host values' CPU tensor, each train_step followed by an SGD step."""
    pm, tokens, labels = _gpt(mesh, nonfinite)
    opt = pm.optimizer(torch.optim.SGD, lr=0.1)
    pm.train_step(tokens, target=labels)
    opt.step()
    opt.zero_grad()
    per_step = []
    for _ in range(STEADY_STEPS):
        with Reads() as reads:
            loss = pm.train_step(tokens, target=labels)
        opt.step()
        opt.zero_grad()
        per_step.append({"device": reads.of_device_values(),
                         "host": [(m, dev) for m, _, _, dev in reads.of_host_values()],
                         "loss": float(loss)})
    return {"steps": per_step}


def bad_ids(rank: int, nonfinite: str | None) -> dict:
    """dp=2, each rank given its own share; rank 1's holds ids past the table (300 of 256).
    Before: one good step, an SGD step, and a good step left unzeroed (.grad accumulated).
    Then the bad step (raises on every rank), an SGD step anyway (a loop that catches and goes
    on), and a good step."""
    from autopart.errors import AutopartError
    pm, tokens, labels = _gpt({"dp": 2}, nonfinite)
    opt = pm.optimizer(torch.optim.SGD, lr=0.1)
    (x,), y = pm.local_batch(tokens, target=labels)
    pm.train_step(x, target=y, local=True)
    opt.step()
    pm.train_step(x, target=y, local=True)      # .grad now holds two steps' gradients
    params = {n: p.detach().clone() for n, p in pm.named_parameters()}
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    steps = pm.steps
    bad = x.clone()
    if rank == 1:
        bad[1, 3], bad[0, 0] = 300, 0
    try:
        pm.train_step(bad, target=y, local=True)
        error = None
    except AutopartError as e:
        error = str(e)
    same_grads = all(torch.equal(p.grad, grads[n]) for n, p in pm.named_parameters())
    steps_after = pm.steps
    opt.zero_grad()
    opt.step()                                  # no gradient: the parameters stay
    same_params = all(torch.equal(p.detach(), params[n]) for n, p in pm.named_parameters())
    after = float(pm.train_step(x, target=y, local=True))
    return {"error": error, "same_grads": same_grads, "same_params": same_params,
            "steps": (steps, steps_after), "skipped": list(pm.skipped_steps),
            "after": after}


def host_sync_cases(rank: int, world: int) -> dict:
    """Every case of tests/test_host_syncs.py on this rank, in one spawn (the imports cost
    seconds per rank): {name: result} or {name: {"raised": traceback}}."""
    out = {}
    cases = {"dp2-raise": lambda: steady_reads({"dp": 2}, None),
             "dp2-skip": lambda: steady_reads({"dp": 2}, "skip"),
             "dp2-ignore": lambda: steady_reads({"dp": 2}, "ignore"),
             "pp2-raise": lambda: steady_reads({"pp": 2}, None),
             "ids-raise": lambda: bad_ids(rank, None),
             "ids-skip": lambda: bad_ids(rank, "skip"),
             "ids-ignore": lambda: bad_ids(rank, "ignore")}
    for name, fn in cases.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001  (reported by the test process, per case)
            out[name] = {"raised": f"rank {rank}:\n{traceback.format_exc()}"}
            break           # the ranks may be out of step now: the later cases would hang
    return out
