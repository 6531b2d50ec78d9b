"""Does every rank compile one program? Hugging Face Gemma3 (its forward loops over
`set(config.layer_types)`, so each process traces its rotary tables in its own hash-seed order)
parallelized on 4 ranks, `--runs` times, each run a fresh spawn whose processes draw their own
hash seeds. Counts the runs in which the ranks agreed, with autopart's capture once (rank 0
captures and sends its graph, autopart/one_program.py) and, with `--without`, with each rank
tracing its own (the digest check then finds the runs whose ranks traced different forwards).

    python bench/same_program.py --runs 20            # capture once: expect 20/20
    python bench/same_program.py --runs 20 --without  # each rank traces: some runs disagree
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, world: int, without: bool, mesh: str):
    import torch
    import autopart
    from autopart.errors import AutopartError
    import autopart.api as api
    from tests.workers.common import Case
    from tests.workers.family import build_family
    if without:
        api.capture_once = lambda capture, model, inputs: capture()
    model, loss_fn, inputs, target = build_family(Case("gemma3", model="gemma3", batch=4, seq=16))
    start = time.perf_counter()
    try:
        autopart.parallelize(model, autopart.Mesh(**mesh), inputs, loss_fn=loss_fn, target=target,
                             microbatches=2)
        agreed = True
    except AutopartError as e:
        if "different programs" not in str(e):
            raise
        agreed = False
    return agreed, time.perf_counter() - start, os.environ.get("PYTHONHASHSEED")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--without", action="store_true", help="each rank traces its own")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    from autopart.runtime.launch import spawn
    os.environ.pop("PYTHONHASHSEED", None)      # every spawned process draws its own seed
    mesh = {"pp": 2, "tp": 2}
    agreed, seconds = 0, []
    for i in range(args.runs):
        per_rank = spawn(_rank, 4, args.without, mesh, timeout=args.timeout, pg_timeout=300)
        ok = all(a for a, _, _ in per_rank)
        agreed += ok
        seconds += [s for _, s, _ in per_rank]
        print(f"run {i + 1}: {'one program' if ok else 'ranks differ'}", file=sys.stderr, flush=True)
    seconds.sort()
    print(f"gemma3 Mesh(pp=2, tp=2), 4 ranks, {'each rank traces' if args.without else 'capture once'}: "
          f"{agreed}/{args.runs} runs compiled one program; parallelize median "
          f"{seconds[len(seconds) // 2]:.1f} s a rank")


if __name__ == "__main__":
    main()
