"""Train the tiny GPT on a small text corpus with pipeline x data parallelism, then compare with
the plain single-process model on the same batches, and save a checkpoint (out/ckpt).

    python examples/train_gpt.py                  # starts 4 rank processes itself (pp=2 x dp=2)
    torchrun --nproc-per-node 4 examples/train_gpt.py   # or let torchrun start them
    torchrun --nproc-per-node 4 examples/train_gpt.py --device cuda   # 4 GPUs, NCCL
    python examples/train_gpt.py --precision bf16 --steps 50   # bf16 against the fp32 curve
    autopart export out/ckpt out/gpt-tiny          # the checkpoint as the plain model's safetensors

Characters are tokens (bytes, vocabulary 256). Every rank sees the same global batch;
autopart takes each rank's data-parallel shard and microbatches from it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.gpt`

from examples.gpt import GPT, config, lm_loss  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


def batches(steps: int, batch: int, seq: int, seed: int = 0):
    """`steps` global batches of (tokens, next tokens), int64[batch, seq], drawn at random."""
    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq] for s in starts])
        y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
        yield x, y


def make_model(args) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(config(args.config))


def make_optimizer(params, args):
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)


def train_parallel(rank: int, world: int, args) -> list[float]:
    """One rank's training loop; returns the loss of every step."""
    import autopart
    from autopart.runtime.launch import rank_device
    device = rank_device(args.device)           # cuda:LOCAL_RANK with --device cuda
    model = make_model(args).to(device)
    mesh = autopart.Mesh.parse(args.mesh)
    xs = [(x.to(device), y.to(device))
          for x, y in batches(args.steps, args.batch, model.config.block_size, args.seed)]
    pm = autopart.parallelize(model, mesh, (xs[0][0],), loss_fn=lm_loss, target=xs[0][1],
                              microbatches=args.microbatches, schedule=args.schedule,
                              virtual_stages=args.virtual_stages, precision=args.precision)
    del model      # this rank now holds only its share of the weights (through pm)
    opt = make_optimizer(pm.parameters(), args)
    if rank == 0:
        print(pm.explain(), flush=True)
    losses = []
    for step, (x, y) in enumerate(xs):
        start = time.perf_counter()
        loss = pm.train_step(x, target=y)
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - start
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  {x.numel() / seconds:8.0f} tokens/s",
                  flush=True)
    if args.save:       # collective: every rank writes its own shards, rank 0 the marker
        pm.save(args.save, optimizer=opt, extra={"step": args.steps})
        if rank == 0:
            print(f"saved checkpoint {args.save}; as the plain model's safetensors: "
                  f"autopart export {args.save} OUT/", flush=True)
    return losses


def train_plain(args) -> list[float]:
    """The unmodified model on one process, same init, same batches, same optimizer."""
    model = make_model(args)
    opt = make_optimizer(model.parameters(), args)
    losses = []
    for x, y in batches(args.steps, args.batch, model.config.block_size, args.seed):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def compare(parallel: list[float], plain: list[float], precision: str = "fp32") -> bool:
    """Print both curves; True when they agree: to fp32 round-off (the same recipe), or for
    bf16 within 2% of the fp32 plain model's loss at every step (the issue's target)."""
    print(f"\nstep  autopart ({precision})   plain (fp32)")
    for i, (a, b) in enumerate(zip(parallel, plain)):
        if i % max(1, len(plain) // 10) == 0 or i == len(plain) - 1:
            print(f"{i:4d}  {a:.5f}  {b:.5f}")
    worst = max(abs(a - b) for a, b in zip(parallel, plain))
    print(f"largest loss difference from the plain model: {worst:.2e}")
    if precision == "fp32":
        return worst < 1e-3
    relative = max(abs(a - b) / abs(b) for a, b in zip(parallel, plain))
    print(f"largest relative loss difference, {precision} vs the fp32 plain model: {relative:.2%}")
    return relative < 0.02


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="pp=2,dp=2", help="the layout, e.g. pp=2,dp=2 or tp=2,pp=2 "
                   "(default pp=2,dp=2)")
    p.add_argument("--config", default="tiny", help="a GPT config of examples/gpt.py, with "
                   "overrides, e.g. tiny,n_layer=8 (default tiny)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--schedule", default="1f1b", help="the pipeline schedule (default 1f1b; "
                   "see autopart schedule --help)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per pipeline rank (default 1)")
    # 3e-3 trains this model faster but chaotically: two runs that differ only in the order of
    # fp32 sums (parallel vs plain) drift apart by ~1e-3 after 20 steps. At 1e-3 they agree to
    # round-off (5e-7) over the whole run.
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: parallelize(precision='bf16'), compared with the fp32 plain model")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before all ranks are killed")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: each rank on cuda:LOCAL_RANK over NCCL; cpu: Gloo")
    p.add_argument("--save", default="out/ckpt", metavar="DIR",
                   help="the checkpoint directory written after the last step (default out/ckpt; "
                        "an empty string saves none)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:       # under torchrun
        from datetime import timedelta

        import torch.distributed as dist

        from autopart.runtime.launch import init_process_group
        if args.device == "cpu":
            torch.set_num_threads(1)
        # the backend follows the device: NCCL on cuda:LOCAL_RANK (set first), Gloo on the CPU
        init_process_group(args.device, timeout=timedelta(seconds=args.timeout))
        losses = train_parallel(dist.get_rank(), dist.get_world_size(), args)
        ok = dist.get_rank() != 0 or compare(losses, train_plain(args), args.precision)
        dist.destroy_process_group()
        return 0 if ok else 1
    import autopart
    from autopart.runtime.launch import spawn
    world = autopart.Mesh.parse(args.mesh).world_size
    print(f"starting {world} rank processes for {args.mesh} on this machine", flush=True)
    losses = spawn(train_parallel, world, args, timeout=args.timeout, device=args.device)[0]
    return 0 if compare(losses, train_plain(args), args.precision) else 1


if __name__ == "__main__":
    sys.exit(main())
