"""One program by construction (autopart/one_program.py): parallelize captures on rank 0 only and
every other rank compiles the graph rank 0 sent, so ranks whose forwards would trace differently
(Gemma3 and ModernBERT loop over `set(config.layer_types)`, in an order set by each process's
string hash seed) compile one program, and train equal to the plain model.

Fast: the round trip alone; an error on rank 0 reaching the others; ModernBERT at tp=2 on two
ranks with different hash seeds. Full: Gemma3 at tp=2 x pp=2 the same way, and 20 fresh spawns
of each (the acceptance count), every one with its own seeds.
"""
from __future__ import annotations

import random
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopart
from autopart.one_program import program_bytes, program_from_bytes
from tests.test_bad_inputs import ReturnsNone
from tests.workers.common import Case
from tests.workers.one_program import (exports_and_equivalence, seeds_with_both_orders,
                                       spawn_with_seeds)

SPAWN_TIMEOUT, PG_TIMEOUT = 540.0, 300.0     # a spawn fails before pytest-timeout (600 s)


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


def test_the_two_orders_compile_different_programs():
    """Why one capture matters: the two set orders, each captured, compile different programs
    (the models below then really trace differently on different ranks)."""
    x = torch.randint(0, 32, (4, 8))
    digests = []
    for kinds in (("sliding", "full"), ("full", "sliding")):
        torch.manual_seed(0)
        digests.append(autopart.compile(SetOrdered(kinds), autopart.Mesh(pp=2), (x,),
                                        loss_fn=_loss, target=x, microbatches=2).digest())
    assert digests[0] != digests[1]


def _compile(model, capture_once):
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    return autopart.compile(model, autopart.Mesh(pp=2), (x,), loss_fn=_loss, target=x,
                            microbatches=2, capture_once=capture_once)


def test_the_program_rebuilt_from_bytes_compiles_to_the_same_program():
    """What a receiving rank compiles (the bytes rebuilt around its own model) is what rank 0
    compiles from its capture: same digest, same chunk code, same symbolic sizes; its weights
    are the receiving model's own tensors, not copies of rank 0's."""
    torch.manual_seed(0)
    sender, receiver = SetOrdered(), SetOrdered()
    receiver.load_state_dict(sender.state_dict())
    sent = {}

    def send(capture):
        sent["program"] = capture()
        return sent["program"]

    first = _compile(sender, send)
    program = program_from_bytes(program_bytes(sent["program"]), receiver)
    second = _compile(receiver, lambda capture: program)
    assert second.digest() == first.digest() and second.traced == first.traced
    assert [c.code for c in second.program.chunks] == [c.code for c in first.program.chunks]
    assert program.symbols == sent["program"].symbols and program.dynamic
    own = dict(receiver.named_parameters())
    assert all(program.gm.get_parameter(name) is own[name] for name in program.params)
    shapes = _shapes(program)
    assert shapes == _shapes(sent["program"])
    assert any("s" in s for s in shapes)         # symbolic sizes survived the trip


def _shapes(program) -> list[str]:
    return [str(n.meta["val"].shape) for n in program.gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)]


def _two_orders_rank(rank: int, world: int) -> dict:
    """Rank 0's capture fails (forward returns None): every rank must raise its error, not wait
    out a timeout. Then rank r builds SetOrdered in its own table order: parallelize must give
    both rank 0's program, and rank 0 alone may run torch.export. Last, rank 0 cannot serialize
    its graph: every rank traces its own, as before capture once."""
    from datetime import timedelta
    try:
        autopart.parallelize(ReturnsNone(), autopart.Mesh(dp=2), (torch.zeros(2, 4),),
                             timeout=timedelta(seconds=60))
        error = "no error"
    except autopart.AutopartError as e:
        error = str(e)
    torch.manual_seed(0)
    model = SetOrdered(("sliding", "full") if rank == 0 else ("full", "sliding"))
    plain = SetOrdered()
    plain.load_state_dict(model.state_dict())
    x = torch.randint(0, 32, (4, 8))
    real, calls = torch.export.export, []
    torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        pm = autopart.parallelize(model, autopart.Mesh(pp=2), (x,), loss_fn=_loss, target=x,
                                  microbatches=2)
    finally:
        torch.export.export = real
    out = {"error": error, "exports": len(calls), "loss": float(pm.train_step(x, target=x)),
           "plain": float(_loss(plain(x), x))}
    # a graph rank 0 cannot serialize: every rank traces its own (the same order here)
    from autopart import one_program
    real_bytes, calls[:] = one_program.program_bytes, []
    one_program.program_bytes = lambda program: 1 / 0
    torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        pm = autopart.parallelize(SetOrdered(), autopart.Mesh(pp=2), (x,), loss_fn=_loss,
                                  target=x, microbatches=2)
    finally:
        torch.export.export, one_program.program_bytes = real, real_bytes
    return {**out, "own_exports": len(calls), "own_loss": float(pm.train_step(x, target=x))}


def test_ranks_tracing_different_orders_get_rank0s_program_and_its_errors():
    from autopart.runtime.launch import spawn
    ranks = spawn(_two_orders_rank, 2, timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)
    assert "forward returned None" in ranks[0]["error"], ranks
    assert ranks[1]["error"] == ranks[0]["error"], ranks
    assert ranks[0]["exports"] >= 1 and ranks[1]["exports"] == 0, ranks
    for r in ranks:
        assert abs(r["loss"] - r["plain"]) <= 1e-6 * abs(r["plain"]), r
        assert r["own_exports"] >= 1 and r["own_loss"] == r["own_loss"], r


def test_fingerprint_tells_models_and_inputs_apart():
    """A rank whose model or inputs differ from rank 0's traces its own (capture_once), so the
    digest check names the difference instead of compiling rank 0's model over other weights."""
    from autopart.one_program import fingerprint
    x = torch.zeros(4, 8, dtype=torch.long)
    torch.manual_seed(0)
    base = fingerprint(SetOrdered(), (x, x))
    assert fingerprint(SetOrdered(("full", "sliding")), (x, x)) == base   # values, order: same
    wider = SetOrdered()
    wider.head = nn.Linear(16, 33)
    frozen = SetOrdered()
    frozen.emb.weight.requires_grad_(False)
    assert len({base, fingerprint(wider, (x, x)), fingerprint(frozen, (x, x)),
                fingerprint(SetOrdered(), (x[:2], x[:2])),
                fingerprint(SetOrdered(), (x.float(), x))}) == 5


@pytest.mark.parametrize("traced_differ", [True, False])
def test_the_mismatch_message_claims_only_what_holds(traced_differ, monkeypatch):
    """check_same_program's causes: once it said every rank takes rank 0's op order (false:
    the ranks traced on their own); now they share rank 0's capture unless their models or
    inputs differ, and the message says so."""
    from autopart.runtime import groups
    monkeypatch.setattr(groups, "_differing", lambda digest, g, verb: (
        f"ranks [0] {verb} a; ranks [1] {verb} b" if verb == "compiled" or traced_differ
        else ""))
    with pytest.raises(autopart.AutopartError) as e:
        groups.check_same_program("d", None, "t")
    text = str(e.value)
    assert "already takes rank 0's order" not in text and "rank 0's capture" in text, text
    if traced_differ:
        assert "model or example inputs differ from rank 0's" in text, text
    else:
        assert "same parallelize options" in text and "PYTHONHASHSEED" not in text, text


def _run_seeded(case: Case, seeds: list[int]) -> list[dict]:
    return spawn_with_seeds(exports_and_equivalence, seeds, case, timeout=SPAWN_TIMEOUT,
                            pg_timeout=PG_TIMEOUT)


def _assert_one_program(case: Case, ranks: list[dict]) -> None:
    """Rank 0 alone ran torch.export, its set order differed from rank 1's (the setup), and
    every rank trained equal to the plain model (parallelize itself raises if the ranks
    compiled different programs)."""
    assert [r["rank"] for r in ranks] == list(range(case.world))
    assert ranks[0]["order"] != ranks[1]["order"], ranks    # seeds_with_both_orders
    problems = [f"rank {r['rank']} (PYTHONHASHSEED={r['hashseed']}): {p}" for r in ranks
                for p in r["problems"]]
    assert not problems, f"{case}\n" + "\n".join(problems)
    assert ranks[0]["exports"] >= 1 and all(r["exports"] == 0 for r in ranks[1:]), \
        [(r["rank"], r["exports"]) for r in ranks]


MODERNBERT = Case("modernbert-tp2", model="modernbert", tp=2)
GEMMA3 = Case("gemma3-tp2xpp2", model="gemma3", tp=2, pp=2, microbatches=2)


def _draw() -> int:
    return random.SystemRandom().randrange(1, 2**32 - 1)


def test_modernbert_tp2_one_program_with_each_rank_its_own_hash_seed():
    seeds = seeds_with_both_orders(MODERNBERT.world, _draw)
    _assert_one_program(MODERNBERT, _run_seeded(MODERNBERT, seeds))


@pytest.mark.full
@pytest.mark.timeout(SPAWN_TIMEOUT + 60)    # one 4-rank spawn: 5 minutes on 2 loaded cores
def test_gemma3_tp2xpp2_one_program_with_each_rank_its_own_hash_seed():
    seeds = seeds_with_both_orders(GEMMA3.world, _draw)
    _assert_one_program(GEMMA3, _run_seeded(GEMMA3, seeds))


@pytest.mark.full
@pytest.mark.timeout(20 * SPAWN_TIMEOUT)     # 20 spawns, each bounded by SPAWN_TIMEOUT
@pytest.mark.parametrize("case", [GEMMA3, MODERNBERT], ids=lambda c: c.name)
def test_twenty_runs_each_with_fresh_hash_seeds(case: Case):
    """The acceptance count: 20 fresh spawns, each rank its own seed, one step each."""
    one_step = Case(case.name, model=case.model, tp=case.tp, pp=case.pp,
                    microbatches=case.microbatches, steps=1, clip=None)
    for run in range(20):
        seeds = seeds_with_both_orders(case.world, _draw)
        print(f"run {run + 1}: PYTHONHASHSEED per rank {seeds}", file=sys.stderr, flush=True)
        _assert_one_program(one_step, _run_seeded(one_step, seeds))
