"""Bytes each rank reads from the token file per global batch, on several meshes: what
autopart.data.TokenLoader copies out of the memory map (its rows and sequence chunks, plus one
shifted token per chunk for targets), and what the kernel read from the disk for it
(/proc/self/io read_bytes, the file evicted from the page cache before each rank: page
granularity, read-ahead included).

    python bench/data_bytes.py                       # the meshes below, seq 2048, batch 64
    python bench/data_bytes.py --seq 1024 --batch 32 --steps 8 --json

One process plays each rank in turn (the loader needs only the rank's BatchShard, taken from
autopart.compile of examples/llama.py's tiny Llama at the benchmark's shapes: no process
group). The global batch is batch * (seq + 1) tokens of 2 bytes; a rank's expected share is
rows/batch * (its chunks' tokens + 1 per chunk where it reads both) / (seq + 1), zero for a
middle pipeline stage.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.llama`

MESHES = ["dp=1", "dp=2", "dp=4", "pp=2,dp=2", "pp=4", "tp=2,dp=2", "cp=2,dp=2"]


def shards(mesh: str, batch: int, seq: int) -> list:
    import autopart
    from autopart.runtime.batches import batch_shard
    from examples.llama import Llama, config, lm_loss
    m = autopart.Mesh.parse(mesh)
    torch.manual_seed(0)
    model = Llama(config(f"tiny,n_layer={max(4, m.pp)},block_size={seq}"))
    x = torch.zeros(batch, seq, dtype=torch.long)
    compiled = autopart.compile(model, m, (x,), loss_fn=lm_loss, target=x,
                                microbatches=max(2, m.pp))
    return [batch_shard(compiled, r) for r in range(m.world_size)]


def disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (no mapping of it is alive), so the next reads
    go to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def one_rank(path: Path, shard, args) -> dict:
    from autopart.data import TokenLoader
    gc.collect()                  # the previous rank's map closed: its pages can be dropped
    evict(path)
    before = disk_read_bytes()
    loader = TokenLoader(path, args.seq, args.batch, shard=shard, seed=0)
    for _ in range(args.steps):
        next(loader)
    out = {"copied": loader.bytes_read, "disk": disk_read_bytes() - before}
    del loader
    return out


def expected(shard, args) -> float:
    n = args.seq // shard.seq_chunks_total
    per_chunk = (n + 1 if shard.needs_inputs and shard.needs_targets else
                 n if shard.needs_inputs or shard.needs_targets else 0)
    return len(shard.rows) * len(shard.seq_chunks) * per_chunk / (args.batch * (args.seq + 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--windows", type=int, default=4096, help="the corpus's samples (default "
                   "4096: 16 MiB at seq 2048)")
    p.add_argument("--meshes", default=",".join(m.replace(",", "+") for m in MESHES),
                   help="meshes, + between axes, e.g. dp=2,pp=2+dp=2")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from autopart.data import write_tokens
    rows = []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        path = Path(tmp) / "bench.tokens"
        ids = np.random.default_rng(0).integers(0, 32000, args.windows * args.seq + 1)
        write_tokens(path, ids, dtype="uint16")
        whole = args.steps * args.batch * (args.seq + 1) * 2
        for mesh in (m.replace("+", ",") for m in args.meshes.split(",")):
            for shard in shards(mesh, args.batch, args.seq):
                got = one_rank(path, shard, args)
                rows.append({"mesh": mesh, "rank": shard.rank, "rows": len(shard.rows),
                             "chunks": f"{list(shard.seq_chunks)}/{shard.seq_chunks_total}",
                             "reads": "+".join(("inputs",) * shard.needs_inputs +
                                               ("targets",) * shard.needs_targets) or "none",
                             "copied": got["copied"], "disk": got["disk"],
                             "share": got["copied"] / whole, "expected": expected(shard, args)})
    print(f"global batch {args.batch} x {args.seq + 1} tokens (uint16), {args.steps} steps: "
          f"{whole} bytes in all; corpus {args.windows} windows", file=sys.stderr)
    print(f"{'mesh':10} {'rank':>4} {'rows':>4} {'chunks':>9} {'reads':>14} {'copied':>9} "
          f"{'share':>6} {'expected':>8} {'disk':>9}", file=sys.stderr)
    for r in rows:
        print(f"{r['mesh']:10} {r['rank']:>4} {r['rows']:>4} {r['chunks']:>9} {r['reads']:>14} "
              f"{r['copied']:>9} {r['share']:>6.3f} {r['expected']:>8.3f} {r['disk']:>9}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(rows))
    return 0 if all(abs(r["share"] - r["expected"]) < 1e-12 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
