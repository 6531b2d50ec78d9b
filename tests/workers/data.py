"""Rank functions and references for tests/test_data_loader.py: examples/llama.py's Llama (tiny,
2 layers) trained by rank processes fed by autopart.data.TokenLoader, and the same model trained
plain on the global batches that the loader's documented definition gives, recomputed here
from the raw token array."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from tests.workers.common import ATOL, RTOL, _compare

SEQ, BATCH, SEED, MICROBATCHES, LR = 16, 8, 3, 2, 1e-3
MODEL = "tiny,n_layer=2"


# -- the reference: the documented stream, the plain model -----------------------------------------

def expected_global(tokens: np.ndarray, seq: int, batch: int, seed: int, step: int):
    """Global step `step`'s (inputs, targets) by the definition in autopart/data/loader.py:
    row j is window perm_e[o] of (tokens - 1) // seq windows of seq + 1 tokens, where
    step * batch + j = e * windows + o and perm_e = default_rng([seed, e]).permutation."""
    windows = (len(tokens) - 1) // seq
    rows = []
    for j in range(batch):
        epoch, offset = divmod(step * batch + j, windows)
        i = int(np.random.default_rng([seed, epoch]).permutation(windows)[offset])
        rows.append(np.asarray(tokens[i * seq:i * seq + seq + 1], dtype=np.int64))
    w = torch.from_numpy(np.stack(rows))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def make_model():
    from examples.llama import Llama, config
    torch.manual_seed(0)
    return Llama(config(MODEL))


def plain_training(tokens: np.ndarray, steps: int) -> dict:
    """The unmodified model, one process, on the global batches: losses and final parameters."""
    from examples.llama import lm_loss
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = expected_global(tokens, SEQ, BATCH, SEED, step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- each rank's share, by autopart's own pm.batch_shard and its cut ----------------------------

def shards_of(mesh: dict, batch: int = BATCH, seq: int = SEQ) -> list:
    """Every rank's BatchShard (runtime/batches.py batch_shard, what pm.batch_shard is) of the
    Llama compiled for `mesh` in this process (one layer per pipeline stage at least)."""
    import autopart
    from autopart.runtime.batches import batch_shard
    from examples.llama import Llama, config, lm_loss
    m = autopart.Mesh(**mesh)
    torch.manual_seed(0)
    model = Llama(config(f"{MODEL},n_layer={max(2, m.pp)}"))
    x = torch.zeros(batch, seq, dtype=torch.long)
    rows = batch // m.dp        # microbatches: at least one per stage, dividing a replica's rows
    mbs = next(k for k in range(max(MICROBATCHES, m.pp), rows + 1) if rows % k == 0)
    compiled = autopart.compile(model, m, (x,), loss_fn=lm_loss, target=x, microbatches=mbs)
    return [batch_shard(compiled, r) for r in range(m.world_size)]


def local_cut(shard, t: torch.Tensor, targets: bool = False) -> torch.Tensor | None:
    """What pm.local_batch gives a rank with `shard` of global tensor `t` (tokens or targets,
    both on the sequence): BatchShard.cut, None where the rank reads none."""
    if not (shard.needs_targets if targets else shard.needs_inputs):
        return None
    return shard.cut(t, sequence=shard.seq_chunks_total > 1)


def same(got, want) -> bool:
    """Both None, or equal tensors (dtype and shape included)."""
    if got is None or want is None:
        return got is None and want is None
    return got.dtype == want.dtype and torch.equal(got, want)


# -- the rank processes -------------------------------------------------------------------------

@dataclass
class RankRun:
    rank: int
    first_step: int
    losses: list
    params: dict
    bytes_read: int
    problems: list = field(default_factory=list)
    shard: object = None        # its pm.batch_shard
    seen: list = field(default_factory=list)    # (step, inputs, targets) the loader gave it

    def check_against(self, plain: dict, tokens) -> None:
        """This rank's losses and parameters are the plain model's; its shares were right."""
        problems = list(self.problems)
        for i, loss in enumerate(self.losses):
            step = self.first_step + i
            _compare(f"rank {self.rank} loss of step {step}", torch.tensor(loss),
                     torch.tensor(plain["losses"][step]), RTOL, ATOL, problems)
        assert self.params, f"rank {self.rank} holds no parameter"
        for name, p in self.params.items():
            _compare(f"rank {self.rank} {name}", p, plain["params"][name], RTOL, ATOL, problems)
        assert not problems, "\n".join(problems)

    def check_same_as(self, other: "RankRun") -> None:
        """The losses of the steps both ran, and the parameters this rank holds, are another
        run's (another mesh: the same up to fp32 round-off)."""
        problems = []
        for i, loss in enumerate(self.losses):
            step = self.first_step + i
            _compare(f"rank {self.rank} loss of step {step}", torch.tensor(loss),
                     torch.tensor(other.losses[step - other.first_step]), RTOL, ATOL, problems)
        for name, p in self.params.items():
            _compare(f"rank {self.rank} {name}", p, other.params[name], RTOL, ATOL, problems)
        assert not problems, "\n".join(problems)


def assembled(runs: list[RankRun], batch: int = BATCH, seq: int = SEQ) -> dict:
    """step -> the global (inputs, targets) put back together from what the loader gave each
    rank, placed by its BatchShard's rows and sequence positions; -1 where no rank read it."""
    out: dict = {}
    for r in runs:
        rows = torch.tensor(r.shard.rows)[:, None]
        positions = torch.tensor(r.shard.positions(seq))[None, :]
        for step, x, y in r.seen:
            whole = out.setdefault(step, tuple(torch.full((batch, seq), -1) for _ in "xy"))
            for into, part in zip(whole, (x, y)):
                if part is not None:
                    into[rows, positions] = part
    return out


def train_ranks(rank: int, world: int, spec: dict) -> RankRun:
    """Train from the loader: load `spec['load']` first (model, optimizer, loader), save at
    step `save_at`, rank 1 dies (os._exit) after step `die_after`. Each batch is checked to be
    pm.local_batch of the global batch of its step."""
    import autopart
    from autopart.data import TokenLoader
    from examples.llama import lm_loss
    tokens = np.asarray(spec["tokens"])
    x0 = torch.zeros(BATCH, SEQ, dtype=torch.long)
    pm = autopart.parallelize(make_model(), autopart.Mesh(**spec["mesh"]), (x0,), loss_fn=lm_loss,
                              target=x0, microbatches=MICROBATCHES)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    loader = TokenLoader(spec["corpus"], SEQ, BATCH, shard=pm.batch_shard, seed=SEED)
    if spec.get("load"):
        pm.load(spec["load"], optimizer=opt, loader=loader)
    first, losses, problems, seen = loader.step, [], [], []
    while loader.step < spec["steps"]:
        b = next(loader)
        x, y = expected_global(tokens, SEQ, BATCH, SEED, b.step)
        problems += _share_problems(pm, b, x, y)
        seen.append((b.step, b.inputs[0], b.target))
        losses.append(pm.train_step(*b.inputs, target=b.target, local=True).item())
        opt.step()
        opt.zero_grad()
        if spec.get("save_at") == b.step + 1:
            pm.save(spec["ckpt"], optimizer=opt, loader=loader)
        if spec.get("die_after") == b.step + 1 and rank == 1:
            os._exit(17)
    params = {n: p.detach().clone() for n, p in pm.named_parameters()}
    bytes_read = loader.bytes_read
    if spec.get("bad_saves"):
        problems += _bad_saves(pm, opt, loader, spec["bad_saves"])
    return RankRun(rank, first, losses, params, bytes_read, problems, pm.batch_shard, seen)


def _bad_saves(pm, opt, loader, where: str) -> list[str]:
    """A checkpoint without the loader's state loaded with loader=, and a save whose ranks'
    loaders disagree: each refused on every rank, with the reason."""
    from autopart.errors import AutopartError
    out = []
    pm.save(where, optimizer=opt)
    for what, pattern, act in (
            ("load(loader=) of a save without", "holds no loader state.*remedy",
             lambda: pm.load(where, loader=loader)),
            ("save(loader=) of loaders that disagree",
             r"state on rank\(s\) \[1\] differs from rank 0's.*remedy",
             lambda: (next(loader) if pm.rank == 1 else None,
                      pm.save(where + "-skewed", loader=loader)))):
        try:
            act()
            out.append(f"rank {pm.rank}: {what} was not refused")
        except AutopartError as e:
            if not re.search(pattern, str(e), re.S):
                out.append(f"rank {pm.rank}: {what}: unexpected message {e}")
    if os.path.exists(where + "-skewed"):
        out.append(f"rank {pm.rank}: the refused save left {where}-skewed behind")
    return out


def _share_problems(pm, b, x, y) -> list[str]:
    """b, the loader's batch, against pm.local_batch of the global batch (x, y)."""
    inputs, target = pm.local_batch(x, target=y)
    if len(b.inputs) == len(inputs) and all(map(same, b.inputs, inputs)) and same(b.target, target):
        return []
    return [f"rank {pm.rank} step {b.step}: the loader's batch is not pm.local_batch of the "
            f"global batch ({pm.batch_shard})"]


def run_ranks(world: int, spec: dict, timeout: float, pg_timeout: float = 60.0) -> list[RankRun]:
    from autopart.data import TokenFile
    from autopart.runtime.launch import spawn
    f = TokenFile(spec["corpus"])
    spec = dict(spec, tokens=np.fromfile(f.path, dtype=f.dtype, offset=32).tolist())
    return spawn(train_ranks, world, spec, timeout=timeout, pg_timeout=pg_timeout)
