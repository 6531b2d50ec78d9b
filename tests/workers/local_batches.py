"""Rank functions for tests/test_local_batches.py: each rank's train_step fed only its share of
the global batch (pm.local_batch), trained against the plain model on the whole batch; and the
refusals of local batches that are wrong (a share of the wrong size, tp peers given different
shares)."""
from __future__ import annotations

import traceback
from dataclasses import asdict
from datetime import timedelta

import torch

from autopart.errors import AutopartError
from tests.workers.common import Case
from tests.workers.equivalence import equivalence


def local_cases(rank: int, world: int, cases: list[Case], bad: bool = False) -> list[dict]:
    """Every case in turn through tests/workers/equivalence.py with train_step given
    pm.local_batch(...) of the global batch; each result also says what the rank was fed (the
    shapes, None where it passed nothing) and its BatchShard. `bad`: then bad_shares' result."""
    out = []
    for i, case in enumerate(cases):
        fed: list = []

        def feed(pm, inputs, target):
            x, t = pm.local_batch(*inputs, target=target)
            fed.append({"shapes": [None if v is None else tuple(v.shape) for v in (*x, t)],
                        "shard": asdict(pm.batch_shard)})
            # dp=1 under cp: the shapes cannot tell a share from a shorter global batch
            return x, t, ({"local": True} if case.dp == 1 and case.cp > 1 else {})
        try:
            r = equivalence(case, rank, feed=feed)
        except Exception:  # noqa: BLE001  (reported by the test process, per case)
            out.append({"case": case.name, "rank": rank,
                        "problems": [f"raised on rank {rank}:\n{traceback.format_exc()}"]})
            out += [{"case": c.name, "rank": rank, "problems": ["not run"]}
                    for c in cases[i + 1:]]
            return out
        out.append({**r, "fed": fed[0]})
    if bad:
        out.append({"case": "bad", "rank": rank, **bad_shares(rank)})
    if world == 2 and any(c.cp == 2 and c.dp == 1 for c in cases):
        out.append({"case": "unsaid", "rank": rank, "problems": [], "error": unsaid_share()})
    return out


def unsaid_share() -> str:
    """Mesh(cp=2): each rank's share passed without local=True is read as a shorter global
    batch; the batch check refuses it (the cp peers' "global batches" differ), naming local=."""
    import autopart
    from examples.gpt import GPT, lm_loss
    from tests.workers.common import gpt_config
    torch.manual_seed(0)
    x = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    pm = autopart.parallelize(GPT(gpt_config(2)), autopart.Mesh(cp=2), (x,), loss_fn=lm_loss,
                              target=x, timeout=timedelta(seconds=120))
    xs, ts = pm.local_batch(x, target=x)
    return _attempt(lambda: pm.train_step(*xs, target=ts))


def _attempt(fn) -> str:
    try:
        fn()
        return ""
    except AutopartError as e:
        return str(e)


def bad_shares(rank: int) -> dict:
    """Mesh(tp=2, dp=2), batch_check_every=3: step 1 with rank 3's share one row short
    (refused on every rank, nothing moved), then good; steps 2 and 3 with rank 1 (tp peer of
    rank 0) given another global batch's share: step 2 is not checked, step 3 is."""
    import autopart
    from examples.gpt import GPT, lm_loss
    from tests.workers.common import gpt_config
    torch.manual_seed(0)
    model = GPT(gpt_config(2))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (8, 16), generator=g)
    other = torch.randint(0, 128, (8, 16), generator=g)
    pm = autopart.parallelize(model, autopart.Mesh(tp=2, dp=2), (x,), loss_fn=lm_loss, target=x,
                              batch_check_every=3, timeout=timedelta(seconds=120))
    (xs,), ts = pm.local_batch(x, target=x)
    short = _attempt(lambda: pm.train_step(xs[:3] if rank == 3 else xs, target=ts))
    steps_after_refusal = pm.steps
    first = float(pm.train_step(xs, target=ts))
    (os_,), ot = pm.local_batch(other, target=other)
    mine = (os_, ot) if rank == 1 else (xs, ts)
    unchecked = _attempt(lambda: pm.train_step(mine[0], target=mine[1]))
    checked = _attempt(lambda: pm.train_step(mine[0], target=mine[1]))
    return {"short": short, "steps_after_refusal": steps_after_refusal, "first": first,
            "unchecked": unchecked, "checked": checked, "problems": []}
