"""Start N rank processes on this machine (Gloo on CPU), each with one thread and a bounded life.

A rank that fails or hangs makes the whole launch fail within `timeout` seconds: the survivors
are killed, never left waiting.
"""
from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results, pg_timeout: float):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    try:
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001  (report any failure to the parent)
        results[rank] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0,
          pg_timeout: float = 60.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` processes; return each rank's result.

    `fn` must be importable (a module-level function). Raises RuntimeError naming the failed
    ranks (with their tracebacks) or the timeout."""
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, pg_timeout),
                         daemon=True) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        _wait(procs, timeout)
        results = dict(results)
    finally:   # also when interrupted (Ctrl-C, a test timeout): no stray rank or manager process
        for p in procs:
            if p.is_alive():
                p.kill()
        manager.shutdown()
    failed = {r: results.get(r, ("error", f"exit code {procs[r].exitcode}")) for r in range(world_size)
              if results.get(r, ("error",))[0] != "ok"}
    if failed:
        detail = "\n".join(f"--- rank {r}: {msg[1]}" for r, msg in sorted(failed.items()))
        raise RuntimeError(f"{len(failed)} of {world_size} ranks failed:\n{detail}")
    return [results[r][1] for r in range(world_size)]


def _wait(procs, timeout: float) -> None:
    import time
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"ranks still running after {timeout:.0f} s: killed")
        if any(p.exitcode not in (None, 0) for p in procs):
            # one rank died: give the others the process-group timeout to fail, then kill them
            grace = time.monotonic() + 90
            while any(p.is_alive() for p in procs) and time.monotonic() < min(grace, deadline):
                time.sleep(0.05)
            for p in procs:
                p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=5)
