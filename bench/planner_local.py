"""The `local` cluster checked against this machine: predicted against measured step time of a few
tiny layouts on real processes (Gloo, CPU).

    python -m bench.planner_local      # after `autopart calibrate`

The machine may be shared and loaded: the error is printed, not bounded.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "tiny,n_layer=4,n_embd=128,block_size=128"
BATCH = 8
LAYOUTS = ({"dp": 2}, {"pp": 2}, {"tp": 2})
STEPS = 3


def _steps(rank: int, world: int, mesh_axes: dict, microbatches: int) -> float:
    """Rank function: median seconds of a train step plus the optimizer step."""
    import torch
    import autopart
    sys.path.insert(0, str(ROOT))
    from examples.gpt import GPT, lm_loss
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, model.config.block_size))
    pm = autopart.parallelize(model, autopart.Mesh(**mesh_axes), (tokens,), loss_fn=lm_loss, target=tokens,
                              microbatches=microbatches)
    opt = torch.optim.Adam(pm.parameters(), lr=1e-4)
    times = []
    for i in range(STEPS + 1):
        start = time.perf_counter()
        pm.train_step(tokens, target=tokens)
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare() -> list[dict]:
    from autopart.planner import plan
    from autopart.runtime.launch import spawn
    rows = []
    for axes in LAYOUTS:
        full = {"tp": 1, "pp": 1, "dp": 1, **axes}
        microbatches = 2
        mbs = BATCH // (full["dp"] * microbatches)
        ranked = plan(f"{ROOT / 'examples' / 'gpt.py'}:GPT", CONFIG, gpus=2, batch=BATCH, cluster="local",
                      tp=full["tp"], pp=full["pp"], dp=full["dp"], microbatch_size=mbs, schedule="1f1b",
                      recompute="none")
        predicted = ranked[0].step_time
        measured = max(spawn(_steps, 2, axes, microbatches, timeout=600))
        rows.append({"mesh": ranked[0].layout.mesh, "microbatch_size": mbs, "predicted_s": predicted,
                     "measured_s": measured, "error": predicted / measured - 1})
    return rows


def main() -> None:
    print(f"{'mesh':<16} {'mbs':>3} {'predicted s':>11} {'measured s':>10} {'error':>7}")
    for r in compare():
        print(f"{r['mesh']:<16} {r['microbatch_size']:>3} {r['predicted_s']:>11.4f} {r['measured_s']:>10.4f} "
              f"{r['error']:>+7.0%}")


if __name__ == "__main__":
    main()

