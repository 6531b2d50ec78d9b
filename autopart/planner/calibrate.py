"""`autopart calibrate`: measure this machine into the `local` cluster (a few seconds).

Matmuls of a few shapes give the peak and a per-op overhead (time = overhead + flops / peak: on a
CPU each op runs synchronously, so a tiny model pays it per op); an in-place add gives memory
bandwidth; a
Gloo all-reduce and a send/recv between two local processes give link bandwidth and latency.
Efficiencies are 1: what was measured is already what runs.
"""
from __future__ import annotations

import math
import os
import socket
import time

from autopart.planner.cluster import Cluster

SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (1024, 1024, 64), (2048, 256, 256))


def _best_time(fn, repeat: int = 3) -> float:
    fn()                                   # warm up (allocation, thread pool)
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_gemms() -> list[tuple[tuple[int, int, int], float]]:
    import torch
    out = []
    for m, n, k in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        reps = max(1, int(2e8 // (2 * m * n * k)))
        t = _best_time(lambda: [a @ b for _ in range(reps)]) / reps
        out.append(((m, n, k), 2 * m * n * k / t))
    return out


def fit_gemms(rates) -> tuple[float, float]:
    """(peak, per-op overhead) minimizing the relative error of time = overhead + flops / peak
    (weighted least squares: the small shapes, whose time is mostly overhead, count as much)."""
    rows = [(1 / t, x / t) for x, t in ((2 * m * n * k, 2 * m * n * k / r) for (m, n, k), r in rates)]
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    r1, r2 = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = s11 * s22 - s12 * s12
    overhead, inverse_peak = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if overhead < 0 or inverse_peak <= 0:        # noise: fall back to the best rate, no overhead
        return max(r for _, r in rates), 0.0
    return 1 / inverse_peak, overhead


def measure_op_overhead() -> float:
    """Seconds of one tiny op (dispatch, no work): what each op of a tiny model pays at least."""
    import torch
    x = torch.zeros(8)
    return _best_time(lambda: [x.add_(1.0) for _ in range(1000)]) / 1000


def measure_memory_bandwidth() -> float:
    import torch
    x = torch.zeros(16 * 2**20)            # 64 MB
    return 2 * x.numel() * 4 / _best_time(lambda: x.add_(1.0))


def _worker(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    # bounded: a peer that never comes (killed, port taken) fails the measurement in a minute
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    small, big = torch.zeros(16), torch.zeros(4 * 2**20)      # 64 B, 16 MB
    results = {}
    for name, t in (("small", small), ("big", big)):
        dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(t)
        results[f"allreduce_{name}"] = (time.perf_counter() - start) / 3
    start = time.perf_counter()
    for _ in range(3):
        if rank == 0:
            dist.send(big, 1)
            dist.recv(big, 1)
        else:
            dist.recv(big, 0)
            dist.send(big, 0)
    results["p2p_big"] = (time.perf_counter() - start) / 6
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure_links() -> dict:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    big = 4 * 2**20 * 4
    latency = max(results["allreduce_small"] / 2, 1e-6)      # 2 ring steps for 2 ranks
    allreduce_bw = big / max(results["allreduce_big"] - 2 * latency, 1e-9)   # 2(n-1)/n = 1
    p2p_bw = big / max(results["p2p_big"] - latency, 1e-9)
    return {"latency_s": latency, "allreduce_bw": allreduce_bw, "p2p_bw": p2p_bw}


def calibrate() -> Cluster:
    peak, _ = fit_gemms(measure_gemms())
    overhead = measure_op_overhead()
    hbm = measure_memory_bandwidth()
    links = measure_links()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8e9
    return Cluster("local", max(2, os.cpu_count() or 2), peak, hbm, float(memory), links["allreduce_bw"],
                   links["p2p_bw"], gemm_efficiency=1.0, gemm_half_dim=0.0, attention_score_bytes=0.0,
                   intra_efficiency=1.0, inter_efficiency=1.0, memory_efficiency=1.0,
                   latency_s=links["latency_s"], op_overhead_s=overhead)


__all__ = ["calibrate", "measure_gemms", "fit_gemms"]
