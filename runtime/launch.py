"""Start N rank processes on this machine, each with one thread and a bounded life; and the one
place that decides a rank's device and backend.

A rank computes on the device its caller chose, and the backend follows that device: "cpu"
(the default) runs Gloo, "cuda" runs NCCL on cuda:LOCAL_RANK, set as the current device before
the process group exists (`rank_device`, `backend_for`, `init_process_group`; under torchrun
call `init_process_group(device="cuda")`). The count of GPUs decides nothing: a caller that
builds CPU models gets Gloo on a GPU machine too.

A rank that fails or hangs makes the whole launch fail within `timeout` seconds: the survivors
are killed, never left waiting.
"""
from __future__ import annotations

import contextlib
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


def local_rank() -> int:
    """This process's index among the ranks of its machine: LOCAL_RANK (torchrun and `spawn`
    set it); without it, the current CUDA device (0 unless the caller set one)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def rank_device(device: str | torch.device | None = None) -> torch.device:
    """The device this rank computes on. "cuda" (no index) means cuda:LOCAL_RANK; an explicit
    device is kept as given. None: the device the initialized default process group serves,
    cuda:LOCAL_RANK under NCCL, else the CPU (what a meta-device model materializes on)."""
    if device is None:
        nccl = dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())
        device = "cuda" if nccl else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank())
    return device


def backend_for(device: str | torch.device) -> str:
    """The process-group backend for ranks computing on `device`: NCCL on CUDA, else Gloo."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(device: str | torch.device = "cpu",
                       timeout: timedelta = timedelta(minutes=10), **kwargs) -> torch.device:
    """Initialize this rank's default process group for `device` (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and LOCAL_RANK from the environment, as torchrun sets them, unless given in
    `kwargs`): with CUDA, cuda:LOCAL_RANK becomes the current device first, then NCCL; on the
    CPU, Gloo. Returns the rank's device, for the model: `model.to(device)`."""
    device = rank_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=timeout, **kwargs)
    return device


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results, pg_timeout: float,
            device: str = "cpu"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    init_process_group(device, timedelta(seconds=pg_timeout), rank=rank, world_size=world)
    try:
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001  (report any failure to the parent)
        results[rank] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _environment(values: dict):
    """os.environ with `values` set, put back as it was after (a spawned child copies it)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0,
          pg_timeout: float = 60.0, device: str = "cpu",
          rank_env: Callable[[int], dict] | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` processes; return each rank's result.
    `device`: "cpu" (Gloo) or "cuda" (rank r on cuda:r, NCCL); `fn` builds its model there
    (`rank_device()` inside `fn` says which). `rank_env(r)`: environment variables rank r's
    interpreter starts with (PYTHONHASHSEED is read at start-up, before `fn` could set it).

    `fn` must be importable (a module-level function). Raises RuntimeError naming the failed
    ranks (with their tracebacks) or the timeout."""
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    port = free_port()
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"spawn(device={device!r}) of {world_size} ranks needs {world_size} "
                           f"GPUs; this machine has {torch.cuda.device_count()}")
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, pg_timeout,
                                               device), daemon=True) for r in range(world_size)]
    try:
        for r, p in enumerate(procs):
            with _environment(rank_env(r) if rank_env else {}):
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
