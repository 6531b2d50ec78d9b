"""The views that name what a rank holds of a plain tensor, against the tensors compiled rank
programs really hold: the tests' own (tests/workers/common.py `_local_view`, every equivalence,
checkpoint and meta test's expected shards) and `autopart verify`'s (autopart/verification.py
`local_view`). Both slice the plain tensor themselves, from the placement (dim, sections) and
the rank's mesh coordinates; neither may call autopart/localize.py, which cut the programs'
tensors, or a wrong cut there would be repeated on the expected side and pass. One process,
compile only (a few seconds each).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import autopart
from autopart import verification
from tests.workers.common import Case, _local_view, build


def _compiled(case: Case):
    model, loss_fn, inputs, target = build(case)
    with torch.no_grad():      # no zero biases or unit norms: every part of a tensor its own
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = autopart.Mesh(tp=case.tp, dp=case.dp, ep=case.ep)
    c = autopart.compile(model, mesh, inputs, loss_fn=loss_fn, target=target,
                         microbatches=case.microbatches)
    return c, SimpleNamespace(compiled=c, mesh=mesh, zero=0), plain


def _differing(c, pm, plain: dict, view_of) -> dict[int, list[str]]:
    """rank -> the parameters whose held tensor is not the view's slice of the plain one."""
    out = {}
    for rank, program in c.programs.items():
        view = view_of(pm, rank)
        out[rank] = [n for n, t in program.parameters().items()
                     if not torch.equal(t.detach(), view(n, plain[n]))]
    return out


# GPT: a fused q|k|v weight (three sections); Switch: experts cut over ep, then each over tp
CASES = [pytest.param(Case("gpt4-tp2", model="gpt4", tp=2), id="gpt4-tp2"),
         pytest.param(Case("switch-tp2xdp2xep2", model="switch", tp=2, dp=2, ep=2,
                           microbatches=2), id="switch-tp2xdp2xep2", marks=pytest.mark.full)]


VIEWS = {"tests": _local_view, "verify": verification.local_view}


@pytest.mark.parametrize("case", CASES)    # the 8-rank Switch compile: ~30 s CPU, full tier
def test_views_are_what_the_ranks_hold_and_do_not_follow_localize(case, monkeypatch):
    c, pm, plain = _compiled(case)
    sharded = set(c.plan.tp_shards) | set(c.plan.ep_shards)
    assert sharded, "nothing sharded: nothing tested"
    for view_of in VIEWS.values():
        assert _differing(c, pm, plain, view_of) == {r: [] for r in c.programs}
    # localize giving each rank its neighbour's part: the views must not move with it
    from autopart import localize
    real = localize.shard_tensor
    monkeypatch.setattr(localize, "shard_tensor",
                        lambda full, dim, sections, size, rank:
                        real(full, dim, sections, size, (rank + 1) % size))
    c, pm, plain = _compiled(case)
    for which, view_of in VIEWS.items():
        for rank, names in _differing(c, pm, plain, view_of).items():
            held = set(c.programs[rank].parameters())
            assert set(names) == sharded & held, (which, rank, sorted(names))


def test_zero3_chunks_partition_each_shard_and_verify_agrees():
    """zero=3's held views (tests/workers/common.py `held_view`, autopart/verification.py's):
    for every trainable parameter, the dp replicas' chunks laid end to end are the rank's shard
    flattened, each chunk ceil(n / dp) elements (the last ones shorter), and the two views, each
    computed on its own, agree on every rank. (What the runtime really holds is compared with
    them on real ranks: tests/test_zero.py.)"""
    from tests.workers.common import held_view
    case = Case("gpt4-tp2xdp2", model="gpt4", tp=2, dp=2)
    c, shim, plain = _compiled(case)
    for rank, program in c.programs.items():
        params = dict(program.parameters())
        pm = SimpleNamespace(compiled=c, mesh=shim.mesh, zero=3,
                             named_parameters=lambda params=params: params.items())
        ours, verify, local = held_view(pm, rank), verification.held_view(pm, rank), \
            _local_view(pm, rank)
        at = pm.mesh.coords(rank)
        replicas = [pm.mesh.rank(pp=at["pp"], dp=d, tp=at["tp"]) for d in range(case.dp)]
        for name in params:
            chunks = [held_view(pm, r)(name, plain[name]) for r in replicas]
            flat = local(name, plain[name]).reshape(-1)
            assert torch.equal(torch.cat(chunks), flat), name
            assert chunks[0].numel() == -(-flat.numel() // case.dp), name
            assert torch.equal(ours(name, plain[name]), verify(name, plain[name])), (rank, name)
