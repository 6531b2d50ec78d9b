"""Peak resident memory per process: a >=300M-parameter GPT trained 2 steps with Adam, plain in one
process vs autopart built on the meta device and loaded from a safetensors file.

    python bench/memory_scale.py [--config gpt2-medium-like] [--steps 2] [--mesh pp=4 --mesh pp=2,dp=2]

Prints each process's VmHWM (kernel high-water mark), minus that of a process that only imported
torch (printed), and the ratio to the plain process; and the checkpoint load time per rank vs
torch.load of the whole file. Target: every rank under 0.4 of the plain peak at pp=4.

Then, per mesh, the time from calling parallelize to the end of the first train_step with the
weights loaded by load_pretrained: deferred (parallelize leaves them unfilled, the default for a
meta model) against init-then-load (parallelize(..., seed=0) initializes every shard from scratch
first, what autopart did before). `--no-init-compare` skips the second run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "gpt2-124m,n_layer=24,n_embd=1024,n_head=16,block_size=256"   # ~350M, gpt2-medium-like


def hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def torch_only(_rank=0, _world=1) -> int:
    return hwm()


def plain(spec: str, path: str, steps: int) -> dict:
    from examples.gpt import GPT, lm_loss
    model = GPT(spec)
    t = time.perf_counter()
    model.load_state_dict(torch.load(path, weights_only=True), strict=False)
    load_s = time.perf_counter() - t
    x = _batch()                             # the same global batch the ranks train
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    phases = {"load": hwm()}
    for step in range(steps):
        lm_loss(model(x), x).backward()
        phases[f"backward{step + 1}"] = hwm()
        opt.step(), opt.zero_grad()
        phases[f"step{step + 1}"] = hwm()
    return {"hwm": hwm(), "load_s": load_s, "phases": phases}


def ranked(rank: int, world: int, spec: str, path: str, steps: int, mesh: dict,
           seed: int | None = None) -> dict:
    import autopart
    from examples.gpt import GPT, lm_loss
    with torch.device("meta"):
        model = GPT(spec)
    x = _batch()                     # the same global batch on every rank (train_step checks)
    phases = {"import": hwm()}       # the high-water mark after each phase: which one set it
    start = time.perf_counter()
    pm = autopart.parallelize(model, autopart.Mesh(**mesh), (x,), loss_fn=lm_loss, target=x,
                              microbatches=2, zero=1 if mesh.get("dp", 1) > 1 else 0, seed=seed)
    parallelize_s = time.perf_counter() - start
    phases["parallelize"] = hwm()
    t = time.perf_counter()
    pm.load_pretrained(path)
    load_s = time.perf_counter() - t
    phases["load"] = hwm()
    opt = pm.optimizer(torch.optim.Adam, lr=1e-4)
    first_step_s = None
    for step in range(steps):
        pm.train_step(x, target=x)
        first_step_s = first_step_s or time.perf_counter() - start
        phases[f"backward{step + 1}"] = hwm()
        opt.step(), opt.zero_grad()
        phases[f"step{step + 1}"] = hwm()
    state = {k: pm.compiled.memory[rank][k]
             for k in ("params", "grads", "master", "optimizer", "activations")}
    return {"hwm": hwm(), "load_s": load_s, "phases": phases, "model_state": state,
            "parallelize_s": parallelize_s, "first_step_s": first_step_s}


def main() -> None:
    import multiprocessing as mp
    from autopart.runtime.launch import spawn
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mesh", action="append", type=_mesh,
                    help="a mesh to measure, e.g. pp=4 or pp=2,dp=2 (repeatable; default both)")
    ap.add_argument("--no-init-compare", action="store_true",
                    help="skip the init-then-load run (parallelize(..., seed=0) before loading)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        base = pool.apply(torch_only)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "gpt.safetensors")
        with ctx.Pool(1) as pool:
            pool.apply(_save, (args.config, path))
            pt = path.replace(".safetensors", ".pt")
            pool.apply(_save_torch, (args.config, pt))
        with ctx.Pool(1) as pool:
            ref = pool.apply(plain, (args.config, pt, args.steps))
        print(f"torch-only process: {base / 2**20:.0f} MiB")
        print(f"plain: peak {ref['hwm'] / 2**20:.0f} MiB (net {(ref['hwm'] - base) / 2**20:.0f}), "
              f"torch.load of the whole file {ref['load_s']:.2f} s")
        print("    high-water mark after each phase (MiB): " + ", ".join(
            f"{k} {v / 2**20:.0f}" for k, v in ref["phases"].items()))
        for mesh in args.mesh or ({"pp": 4}, {"pp": 2, "dp": 2}):
            out = spawn(ranked, 4, args.config, path, args.steps, mesh, timeout=3600,
                        pg_timeout=1800)
            for r, o in enumerate(out):
                ratio = (o["hwm"] - base) / (ref["hwm"] - base)
                print(f"{mesh} rank {r}: peak {o['hwm'] / 2**20:.0f} MiB, net ratio to plain "
                      f"{ratio:.2f}, load_pretrained {o['load_s']:.2f} s")
                print("    high-water mark after each phase (MiB): " + ", ".join(
                    f"{k} {v / 2**20:.0f}" for k, v in o["phases"].items()))
                print("    explain's prediction (MiB): " + ", ".join(
                    f"{k} {v / 2**20:.0f}" for k, v in o["model_state"].items()))
            if args.no_init_compare:
                continue
            old = spawn(ranked, 4, args.config, path, 1, mesh, 0, timeout=3600, pg_timeout=1800)
            print(f"{mesh} parallelize -> first step, loaded with load_pretrained (slowest rank): "
                  f"deferred {max(o['first_step_s'] for o in out):.1f} s "
                  f"(parallelize {max(o['parallelize_s'] for o in out):.1f} s), init-then-load "
                  f"{max(o['first_step_s'] for o in old):.1f} s (parallelize "
                  f"{max(o['parallelize_s'] for o in old):.1f} s); ratio "
                  f"{max(o['first_step_s'] for o in out) / max(o['first_step_s'] for o in old):.2f}")


def _batch() -> torch.Tensor:
    return torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(0))


def _mesh(text: str) -> dict:
    """'pp=2,dp=2' -> {'pp': 2, 'dp': 2}."""
    try:
        return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected axis=size pairs joined by "
                                         "commas, e.g. pp=4 or pp=2,dp=2") from None


def _save(spec: str, path: str) -> None:
    from safetensors.torch import save_model
    from examples.gpt import GPT
    torch.manual_seed(0)
    save_model(GPT(spec), path)


def _save_torch(spec: str, path: str) -> None:
    from examples.gpt import GPT
    torch.manual_seed(0)
    torch.save(GPT(spec).state_dict(), path)


if __name__ == "__main__":
    main()
