"""Wall time of the whole `autopart plan` process for megatron-1t on 3072 GPUs (the issue's < 10 s).

    python bench/plan_time.py [--repeat 3]

Runs the command as a user would (a fresh process each time: imports, capture of one layer, the
search with the C++ simulator), first with the layer-profile cache cleared (cold), then warm.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "autopart", "plan", "examples/gpt.py:GPT", "--config", "megatron-1t",
           "--gpus", "3072", "--batch", "3072", "--cluster", "a100-80gb-selene", "--json"]


def run(env) -> tuple[float, float]:
    """(wall, CPU user+sys) seconds of one whole process; CPU time is what other jobs on a
    shared machine inflate least."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(COMMAND, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true",
                    help="print one JSON line with every run on stdout (the text goes to stderr)")
    args = ap.parse_args()
    text = sys.stderr if args.json else sys.stdout
    cache = Path(tempfile.mkdtemp(prefix="autopart-plan-bench-"))
    env = dict(os.environ, AUTOPART_CACHE=str(cache))
    runs = []
    try:
        for i in range(args.repeat):
            shutil.rmtree(cache / "layers", ignore_errors=True)
            (cold, cold_cpu), (warm, warm_cpu) = run(env), run(env)
            runs.append({"cold_s": cold, "cold_cpu_s": cold_cpu, "warm_s": warm, "warm_cpu_s": warm_cpu})
            print(f"run {i + 1}: cold (one layer captured) {cold:.1f} s wall, {cold_cpu:.1f} s CPU; "
                  f"warm (profile cached) {warm:.1f} s wall, {warm_cpu:.1f} s CPU", file=text)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", file=text)
    if args.json:
        print(json.dumps({"bench": "plan_time", "runs": runs, "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
