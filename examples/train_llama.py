"""Train examples/llama.py's Llama from a token file, each rank reading only its share of every
global batch (autopart.data.TokenLoader over pm.batch_shard), saving and resuming the model, the
optimizer and the loader's position; then check the run against the plain model.

    python examples/train_llama.py --make-corpus            # writes out/corpus.tokens, trains dp=2
    python examples/train_llama.py --steps 6 --save out/llama-ckpt --save-every 3
    python examples/train_llama.py --steps 10 --resume out/llama-ckpt --mesh pp=2  # another mesh
    torchrun --nproc-per-node 4 examples/train_llama.py --mesh pp=2,dp=2 --corpus my.tokens

`--make-corpus` writes examples/data/corpus.txt's bytes (vocabulary 256 fits the tiny config's
128: the text is ASCII) as a token file; a real corpus comes from a tokenizer:
`autopart.data.write_tokens(path, ids)`. The check trains the plain model in one process on the
global batches the loader defines (the same stream, whole) from step 0 and compares the losses.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.llama`

from examples.llama import Llama, config, lm_loss  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "corpus.txt"


def make_corpus(path: str) -> None:
    from autopart.data import write_tokens
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_tokens(path, list(TEXT.read_bytes()))
    print(f"wrote {path}: {TEXT.stat().st_size} tokens (the bytes of {TEXT.name})", flush=True)


def make_model(args) -> Llama:
    torch.manual_seed(args.seed)
    return Llama(config(args.config))


def loader_for(args, shard=None):
    from autopart.data import TokenLoader
    return TokenLoader(args.corpus, args.seq, args.batch, shard=shard, seed=args.seed)


def train_parallel(rank: int, world: int, args) -> dict:
    """One rank's loop: parallelize, resume if asked, train from its loader, save."""
    import autopart
    x0 = torch.zeros(args.batch, args.seq, dtype=torch.long)      # shapes only, for compiling
    pm = autopart.parallelize(make_model(args), autopart.Mesh.parse(args.mesh), (x0,),
                              loss_fn=lm_loss, target=x0, microbatches=args.microbatches)
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=0.0)
    loader = loader_for(args, pm.batch_shard)     # reads this rank's rows and chunks only
    if args.resume:
        pm.load(args.resume, optimizer=opt, loader=loader)
        if rank == 0:
            print(f"resumed {args.resume} at step {loader.step}", flush=True)
    first, losses = loader.step, []
    while loader.step < args.steps:
        start = time.perf_counter()
        batch = next(loader)
        loss = pm.train_step(*batch.inputs, target=batch.target, local=True)   # its share
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {batch.step:3d}  loss {losses[-1]:.4f}  "
                  f"{time.perf_counter() - start:.3f} s", flush=True)
        done = batch.step + 1
        if args.save and (done == args.steps or args.save_every and done % args.save_every == 0):
            pm.save(args.save, optimizer=opt, loader=loader)   # collective; atomic
    return {"rank": rank, "first": first, "losses": losses, "bytes_read": loader.bytes_read,
            "shard": pm.batch_shard}


def train_plain(args) -> list[float]:
    """The unmodified model in one process on the whole global batches, from step 0."""
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loader, losses = loader_for(args), []
    for _ in range(args.steps):
        batch = next(loader)
        loss = lm_loss(model(*batch.inputs), batch.target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def report(results: list[dict], args) -> bool:
    """Bytes each rank read; the losses against the plain model's (True: within 1e-4)."""
    from autopart.data import TokenFile
    steps = len(results[0]["losses"])
    whole = args.batch * (args.seq + 1) * TokenFile(args.corpus).itemsize * max(steps, 1)
    for r in results:
        s = r["shard"]
        print(f"rank {r['rank']}: read {r['bytes_read']} bytes ({r['bytes_read'] / whole:.2f} of "
              f"the global batches'); rows {len(s.rows)}/{args.batch}, inputs "
              f"{'yes' if s.needs_inputs else 'no'}, targets {'yes' if s.needs_targets else 'no'}")
    if not args.check:
        return True
    plain, first = train_plain(args), results[0]["first"]
    worst = max(abs(a - b) for a, b in zip(results[0]["losses"], plain[first:]))
    print(f"largest loss difference from the plain model over steps {first}..{args.steps - 1}: "
          f"{worst:.2e}")
    return worst < 1e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="out/corpus.tokens", help="the token file "
                   "(autopart.data.write_tokens; default out/corpus.tokens)")
    p.add_argument("--make-corpus", action="store_true", help="write --corpus first, from "
                   "examples/data/corpus.txt")
    p.add_argument("--mesh", default="dp=2", help="the layout (default dp=2)")
    p.add_argument("--config", default="tiny", help="a config of examples/llama.py (default tiny)")
    p.add_argument("--steps", type=int, default=8, help="train until this global step (default 8)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--microbatches", type=int, default=2, help="per step (default 2)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the order of "
                   "the samples (default 0)")
    p.add_argument("--save", default="", metavar="DIR", help="checkpoint here after the last "
                   "step (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0, metavar="N")
    p.add_argument("--resume", default="", metavar="DIR", help="load model, optimizer and "
                   "loader position first (saved on any mesh)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the comparison with the plain model")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before ranks are killed")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.make_corpus and os.environ.get("RANK", "0") == "0":
        make_corpus(args.corpus)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:       # under torchrun
        from datetime import timedelta

        import torch.distributed as dist

        from autopart.runtime.launch import init_process_group
        torch.set_num_threads(1)
        init_process_group("cpu", timeout=timedelta(seconds=args.timeout))
        dist.barrier()                        # rank 0 wrote the corpus
        results: list = [None] * dist.get_world_size()
        dist.all_gather_object(results, train_parallel(dist.get_rank(),
                                                       dist.get_world_size(), args))
        ok = dist.get_rank() != 0 or report(results, args)
        dist.destroy_process_group()
        return 0 if ok else 1
    import autopart
    from autopart.runtime.launch import spawn
    world = autopart.Mesh.parse(args.mesh).world_size
    print(f"starting {world} rank processes for {args.mesh}", flush=True)
    results = spawn(train_parallel, world, args, timeout=args.timeout)
    return 0 if report(results, args) else 1


if __name__ == "__main__":
    sys.exit(main())
