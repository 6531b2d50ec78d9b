"""Sharded checkpoint save/load (autopart.runtime.checkpoint on torch.distributed.checkpoint) on 4
ranks against torch.save/torch.load of the plain model's state dict and optimizer state in one
process, for the example GPT with Adam state.

    python bench/checkpoint_vs_torch.py                        # gpt2-124m, pp=2 x dp=2
    python bench/checkpoint_vs_torch.py --mesh pp=4 --repeat 3
    python bench/checkpoint_vs_torch.py --config tiny,n_layer=8 --json

torch: one process builds the model, takes one Adam step, then times
`torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)` and
`torch.load(f)` followed by `model.load_state_dict` + `opt.load_state_dict` (autopart's load
also copies into the live tensors), file fsynced like DCP's.

autopart: 4 rank processes (Gloo, one thread each) parallelize the same model, take one Adam
step, then time `save(pm, path, optimizer=opt)` (each rank writes its shards; replicas once;
checksums; the marker; the rename) and `load(pm, path, optimizer=fresh_opt)` with and without the
CRC-32 check of the files. A step starts at a barrier and lasts as long as its slowest rank. Each
measurement is the best of --repeat runs (the machine is shared). After the first load, every
rank checks that its parameters and Adam moments equal what it saved (bitwise).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _build(spec: str):
    from examples.gpt import GPT, config
    torch.manual_seed(0)
    return GPT(config(spec))


def _batch(cfg, batch: int, seq: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return x, torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def _timed(fn, barrier=None) -> float:
    if barrier:
        barrier()
    start = time.perf_counter()
    fn()
    if barrier:
        barrier()
    return time.perf_counter() - start


def torch_ops(args):
    """(save, load, model, file, folder): the plain model after one Adam step, and its
    torch.save / torch.load of the model's and the optimizer's state."""
    from examples.gpt import lm_loss
    model = _build(args.config)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = _batch(_cfg(args.config), args.batch, args.seq)
    lm_loss(model(x), y).backward()
    opt.step(), opt.zero_grad()
    d = Path(tempfile.mkdtemp(prefix="torch-ckpt-", dir=args.dir))
    f = d / "model.pt"

    def save():
        with open(f, "wb") as stream:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, stream)
            stream.flush()
            os.fsync(stream.fileno())

    def load():
        state = torch.load(f)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    return save, load, model, f, d


def torch_side(args) -> dict:
    save, load, model, f, d = torch_ops(args)
    saves, loads = [], []
    for _ in range(args.repeat):
        saves.append(_timed(save))
        loads.append(_timed(load))
    size = f.stat().st_size
    shutil.rmtree(d)
    return {"save_s": min(saves), "load_s": min(loads), "bytes": size,
            "params": sum(p.numel() for p in model.parameters())}


def _cfg(spec):
    from examples.gpt import config
    return config(spec)


def rank_side(rank: int, world: int, args) -> dict:
    import autopart
    from autopart.runtime import checkpoint
    from examples.gpt import lm_loss

    model = _build(args.config)
    x, y = _batch(_cfg(args.config), args.batch, args.seq)
    mesh = autopart.Mesh.parse(args.mesh)
    pm = autopart.parallelize(model, mesh, (x,), loss_fn=lm_loss, target=y,
                              microbatches=args.microbatches)
    del model
    opt = torch.optim.Adam(pm.parameters(), lr=1e-4)
    pm.train_step(x, target=y)
    opt.step(), opt.zero_grad()
    path = Path(args.dir) / "autopart-ckpt"
    barrier = dist.barrier
    saves, loads, loads_nv = [], [], []
    problems = []
    # --paired: rank 0 also times torch.save / torch.load of the plain model right after each of
    # autopart's (the other ranks wait at the barrier), so every round has its own ratio
    t_save, t_load, *t_rest = torch_ops(args) if args.paired and rank == 0 else (None,) * 5
    t_saves, t_loads = [], []
    for i in range(args.repeat):
        saves.append(_timed(lambda: checkpoint.save(pm, path, optimizer=opt), barrier))
        if args.paired:
            t_saves.append(_timed(t_save or (lambda: None), barrier))
        before = {n: p.detach().clone() for n, p in pm.named_parameters()}
        moments = {n: opt.state[p]["exp_avg"].clone() for n, p in pm.named_parameters()}
        with torch.no_grad():
            for p in pm.parameters():
                p.zero_()
        fresh = torch.optim.Adam(pm.parameters(), lr=1e-4)
        loads.append(_timed(lambda: checkpoint.load(pm, path, optimizer=fresh), barrier))
        if args.paired:
            t_loads.append(_timed(t_load or (lambda: None), barrier))
        if i == 0:
            for n, p in pm.named_parameters():
                if not torch.equal(p, before[n]) or not torch.equal(fresh.state[p]["exp_avg"],
                                                                    moments[n]):
                    problems.append(f"rank {rank}: {n} differs after load")
        loads_nv.append(_timed(lambda: checkpoint.load(pm, path, optimizer=fresh, verify=False),
                               barrier))
        opt = fresh
    marker = checkpoint.read_marker(path)
    mine = sum(f["bytes"] for name, f in marker["files"].items()
               if name.startswith(f"__{rank}_"))
    held = sum(p.numel() for p in pm.parameters())
    out = {"rank": rank, "save_s": min(saves), "load_s": min(loads), "load_noverify_s":
           min(loads_nv), "bytes_written": mine, "held_params": held, "problems": problems,
           "total_bytes": sum(f["bytes"] for f in marker["files"].values())}
    if args.paired:
        out.update(save_all=saves, load_all=loads, load_noverify_all=loads_nv)
        if rank == 0:
            model, f, d = t_rest
            out["torch"] = {"save_s": min(t_saves), "load_s": min(t_loads), "bytes": f.stat().st_size,
                            "params": sum(p.numel() for p in model.parameters()),
                            "save_all": t_saves, "load_all": t_loads}
            shutil.rmtree(d)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gpt2-124m,block_size=64",
                   help="examples.gpt config spec (default gpt2-124m, block_size=64)")
    p.add_argument("--mesh", default="pp=2,dp=2", help="a 4-rank mesh (default pp=2,dp=2)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", action="store_true")
    p.add_argument("--paired", action="store_true",
                   help="time torch.save/load on rank 0 right after autopart's in every round "
                        "(instead of in a process of its own first); --json then adds the "
                        "per-round ratios")
    args = p.parse_args(argv)
    from autopart import Mesh
    from autopart.runtime.launch import spawn

    world = Mesh.parse(args.mesh).world_size
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    try:
        plain = None if args.paired else torch_side(args)
        ranks = spawn(rank_side, world, args, timeout=args.timeout, pg_timeout=600)
        plain = plain or ranks[0]["torch"]
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    problems = [q for r in ranks for q in r["problems"]]
    save = max(r["save_s"] for r in ranks)
    load = max(r["load_s"] for r in ranks)
    load_nv = max(r["load_noverify_s"] for r in ranks)
    out = {"config": args.config, "mesh": args.mesh, "params": plain["params"],
           "torch": plain, "autopart": {"save_s": save, "load_s": load,
                                        "load_noverify_s": load_nv, "ranks": ranks},
           "save_ratio": save / plain["save_s"], "load_ratio": load / plain["load_s"],
           "load_noverify_ratio": load_nv / plain["load_s"], "problems": problems,
           "loadavg": os.getloadavg()}
    if args.paired:   # per round: the slowest rank's time / torch's
        out["round_ratios"] = {
            key: [max(r[f"{key}_all"][i] for r in ranks) / plain[f"{base}_all"][i]
                  for i in range(args.repeat)]
            for key, base in (("save", "save"), ("load", "load"), ("load_noverify", "load"))}
    mib = 2 ** 20
    lines = [f"checkpoint of examples.gpt {args.config} ({plain['params'] / 1e6:.1f}M parameters) "
             f"with Adam state; autopart on {world} ranks ({args.mesh}), best of {args.repeat}"
             + (" (torch on rank 0, paired round by round)" if args.paired else ""),
             "",
             f"{'':28s}{'torch (1 process)':>20s}{'autopart':>12s}{'ratio':>8s}",
             f"{'save s':28s}{plain['save_s']:20.2f}{save:12.2f}{out['save_ratio']:8.2f}",
             f"{'load s (CRC-32 verified)':28s}{plain['load_s']:20.2f}{load:12.2f}"
             f"{out['load_ratio']:8.2f}",
             f"{'load s (sizes only)':28s}{plain['load_s']:20.2f}{load_nv:12.2f}"
             f"{out['load_noverify_ratio']:8.2f}",
             f"{'bytes on disk MiB':28s}{plain['bytes'] / mib:20.1f}"
             f"{ranks[0]['total_bytes'] / mib:12.1f}",
             "",
             "bytes each rank wrote (replicas deduplicated by DCP's planner):"]
    for r in ranks:
        lines.append(f"  rank {r['rank']}: {r['bytes_written'] / mib:8.1f} MiB "
                     f"(holds {r['held_params'] / 1e6:.1f}M parameters)  save {r['save_s']:.2f} s"
                     f"  load {r['load_s']:.2f} s")
    lines.append(f"load average {out['loadavg'][0]:.1f} (2 cores shared)")
    if problems:
        lines += ["PROBLEMS:"] + problems
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(out, default=str))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
