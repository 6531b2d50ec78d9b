"""One program on every rank when the traced op order depends on the process
(autopart/node_order.py): a forward that builds per-kind tables looping over a Python set, as
Gemma3 does over set(config.layer_types), traces its ops in an order set by the string hash
seed. Here the order is chosen per model so that both orders are traced in one process."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopart
from autopart import node_order
from autopart.runtime.launch import spawn


class SetOrdered(nn.Module):
    """Two layers, one scaled by a 'sliding' table and one by a 'full' one; the tables are
    built in `kinds` order (the order Python's set iteration gave)."""

    def __init__(self, kinds=("sliding", "full")):
        super().__init__()
        self.kinds = kinds
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.theta = {"sliding": 10.0, "full": 1000.0}
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        h = self.emb(x)
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        tables = {k: torch.cos(pos / self.theta[k]).unsqueeze(-1) for k in self.kinds}
        for layer, kind in zip(self.layers, ("sliding", "full")):
            h = h + torch.tanh(layer(h)) * tables[kind]
        return self.head(h)


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _compiled(kinds, **kw):
    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 8))
    return autopart.compile(SetOrdered(kinds), autopart.Mesh(pp=2), (x,), loss_fn=_loss,
                            target=x, microbatches=2, **kw)


def test_the_two_orders_compile_different_programs_without_agreement():
    """The guard this file's fix is for: two hash seeds, two digests."""
    assert _compiled(("sliding", "full")).digest() != _compiled(("full", "sliding")).digest()


def test_rank0_order_gives_one_program():
    reference = []

    def record(structure):
        reference[:] = structure
        return structure

    first = _compiled(("sliding", "full"), agree_order=record)
    other = _compiled(("full", "sliding"), agree_order=lambda structure: list(reference))
    assert other.digest() == first.digest()
    assert [c.code for c in other.program.chunks] == [c.code for c in first.program.chunks]
    # the reordered rank's captured-graph hash is rank 0's (check_same_program's cause test)
    assert other.traced and other.traced == first.traced


def test_different_computations_are_left_for_the_digest_check():
    """Keys that are not the same multiset (another op somewhere): follow changes nothing."""
    from autopart.capture import capture
    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 8))
    a = capture(SetOrdered(("sliding", "full")), (x,), loss_fn=_loss, target=x)
    keys = node_order.structure(a.gm.graph)     # (key, inputs) per node
    reordered, changed = node_order.follow(a, list(reversed(keys)))
    assert not changed and reordered.gm is a.gm         # reversed: not a topological order
    other = keys[:-2] + [("0" * 16, keys[-2][1])] + keys[-1:]
    same, changed = node_order.follow(a, other)
    assert not changed and same.gm is a.gm


def _rank_fn(rank, world):
    """Rank r traces the tables in its own order; parallelize must still agree and train."""
    torch.manual_seed(0)
    kinds = ("sliding", "full") if rank % 2 == 0 else ("full", "sliding")
    model = SetOrdered(kinds)
    ref = SetOrdered(("sliding", "full"))
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, 32, (4, 8))
    pm = autopart.parallelize(model, autopart.Mesh(pp=2), (x,), loss_fn=_loss, target=x,
                              microbatches=2)
    loss = pm.train_step(x, target=x)
    plain = _loss(ref(x), x)
    return float(loss), float(plain)


def test_parallelize_agrees_when_ranks_trace_different_orders():
    per_rank = spawn(_rank_fn, 2, timeout=300, pg_timeout=120)
    for loss, plain in per_rank:
        assert abs(loss - plain) <= 1e-6 * abs(plain), (loss, plain)
