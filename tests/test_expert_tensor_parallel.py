"""Expert tensor parallelism on real ranks equals the plain model: with tp > 1 each expert is
split like a dense MLP (first expert matmul column-parallel, second row-parallel, an all-reduce
over tp before the combine), every tp rank holding all experts (no ep) or its ep share of them.
examples/switch.py (stacked experts, bmm) and unmodified Hugging Face Mixtral / Qwen3-MoE (grouped
matmuls of sorted rows, fused gate|up): every step's loss, the first step's gradients, the
clipped norm and every parameter after 3 SGD steps, fp32 (tests/workers/equivalence.equivalence);
and which experts, and which part of each, every rank's compiled program holds, by value.

Fast tier: python -m pytest -m "not full" tests/test_expert_tensor_parallel.py
Full matrix: python -m pytest tests/test_expert_tensor_parallel.py
"""
from __future__ import annotations

import warnings

import pytest
import torch

import autopart
from tests.workers.common import SWITCH_SPECS, Case, build
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.workers.moe import WITHOUT_EXPERT_REDUCE, etp_cases

FAST_2 = [
    Case("switch-tp2", model="switch", tp=2),
    Case("mixtral-tp2", model="mixtral", tp=2, batch=4),
    # the same, the expert all-reduce left out: must differ (see test_expert_all_reduce_...)
    Case("switch-tp2" + WITHOUT_EXPERT_REDUCE, model="switch", tp=2, steps=1, clip=None),
]
FULL_4 = [
    Case("switch-tp2xdp2xep2", model="switch", tp=2, dp=2, ep=2, microbatches=2),
    Case("mixtral-tp2xdp2xep2", model="mixtral", tp=2, dp=2, ep=2, microbatches=2, batch=4),
    Case("switch-tp2xpp2", model="switch", tp=2, pp=2, microbatches=2),
    Case("qwen3-moe-tp2xpp2", model="qwen3-moe", tp=2, pp=2, microbatches=2),
]
FULL_2 = [Case("qwen3-moe-tp2", model="qwen3-moe", tp=2)]
GROUPS = {("etp-fast", 2): FAST_2, ("etp-full", 4): FULL_4, ("etp-full", 2): FULL_2}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
EQUAL = [c for c in FAST_2 + FULL_4 + FULL_2 if not c.name.endswith(WITHOUT_EXPERT_REDUCE)]
CASES = [pytest.param(c, id=c.name, marks=[] if c in FAST_2 else [pytest.mark.full])
         for c in EQUAL]


def _results(case, spawn_cache) -> list[dict]:
    key = _GROUP_OF[case.name]
    return run_group(spawn_cache, key, GROUPS[key], rank_fn=etp_cases)[case.name]


@pytest.mark.parametrize("case", CASES)
def test_matches_plain_model(case: Case, spawn_cache):
    assert_all_ranks_equal_plain(case, _results(case, spawn_cache))


def _experts_held(case: Case):
    """Compile `case` (one process) with every parameter random, so each expert, and each tp
    part of it, is unique: per rank, per plain expert weight (stacked over experts: 3-D) the
    rank holds, which plain expert each of its local experts is, by value (None: none), the
    tp part cut by the independent section slicing (tests/workers/common.py) at the rank's
    tp index."""
    from tests.workers import family  # noqa: F401  (registers qwen3-moe)
    from tests.workers.common import _chunk_sections
    model, loss_fn, inputs, target = build(case)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    plain = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 3}
    mesh = autopart.Mesh(tp=case.tp, dp=case.dp, ep=case.ep, pp=case.pp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = autopart.compile(model, mesh, inputs, loss_fn=loss_fn, target=target,
                             microbatches=case.microbatches)
    found = {}
    for rank, program in c.programs.items():
        tp_rank = mesh.coords(rank)["tp"]
        for name, held in program.parameters().items():
            if name not in plain:
                continue
            shard = c.plan.tp_shards.get(name) if case.tp > 1 else None
            whole = plain[name]
            parts = [whole[e:e + 1] if shard is None else
                     _chunk_sections(whole[e:e + 1], shard, case.tp, tp_rank)
                     for e in range(whole.shape[0])]
            found[rank, name] = (held.numel(), [
                next((e for e, part in enumerate(parts) if torch.equal(held[j:j + 1], part)), None)
                for j in range(held.shape[0])])
    return mesh, plain, found


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[] if c.name == "switch-tp2"
                                               else [pytest.mark.full]) for c in EQUAL])
def test_each_rank_holds_its_share_of_every_expert(case: Case):
    """Each rank holds 1/(tp * ep) of every expert weight, and which experts by value: those of
    its ep index (dp mod ep: experts k*E/ep .. (k+1)*E/ep - 1, in order), each its tp index's
    part; every expert weight held by some rank. At tp=2 without ep: half of every expert."""
    mesh, plain, found = _experts_held(case)
    assert plain and found, case.name
    assert {name for _, name in found} == set(plain), sorted(set(plain) - {n for _, n in found})
    for (rank, name), (numel, experts) in found.items():
        count, k = plain[name].shape[0] // case.ep, mesh.coords(rank)["dp"] % case.ep
        assert numel * case.tp * case.ep == plain[name].numel(), (rank, name, numel)
        assert experts == list(range(k * count, (k + 1) * count)), (rank, name, experts)


def test_expert_all_reduce_is_needed(spawn_cache):
    """Without the all-reduce after the row-parallel expert matmul each tp rank combines only
    its partial sum of every expert's output: the loss differs from the plain model (so the
    equalities above test the expert split, not a model whose experts do not matter)."""
    case = next(c for c in FAST_2 if c.name.endswith(WITHOUT_EXPERT_REDUCE))
    ranks = _results(case, spawn_cache)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert any("step 1 loss" in p for p in r["problems"]), r["problems"]


# -- compile time, one process --------------------------------------------------------------------

def _switch():
    torch.manual_seed(0)
    from examples.switch import SwitchGPT, config
    model = SwitchGPT(config(SWITCH_SPECS["switch"]))
    x = torch.zeros(8, 16, dtype=torch.long)
    return model, (x, x.clone())


def test_switch_experts_split_column_then_row_with_one_all_reduce_each():
    """tp=2, no ep: each MoE layer's first expert weight [E, C, F] is split along F (its
    output features), the second [E, F, C] along F (contracted), and one all-reduce over tp
    follows each second expert matmul, before the combine."""
    model, inputs = _switch()
    c = autopart.compile(model, autopart.Mesh(tp=2), inputs)
    shards = c.plan.tp_shards
    for layer in (1, 3):
        assert shards[f"transformer.h.{layer}.mlp.c_fc"].dim == 2
        assert shards[f"transformer.h.{layer}.mlp.c_proj"].dim == 1
    gm = c.program.gm
    rows = [n for n in gm.graph.nodes if n.target is torch.ops.aten.bmm.default
            and n.args[1].op == "get_attr" and n.args[1].target.endswith("c_proj")]
    assert len(rows) == 2
    for n in rows:
        assert [u.target.__name__ for u in n.users] == ["reduce_from_tp"], n.users
    held = c.programs[0].parameters()
    assert tuple(held["transformer.h.1.mlp.c_fc"].shape) == (4, 32, 32)
    assert tuple(held["transformer.h.1.mlp.c_proj"].shape) == (4, 32, 32)


def test_sequence_parallel_with_experts_and_no_ep_is_refused():
    """Expert tensor parallelism is not done under sequence parallelism: refused, naming the
    experts, sequence parallelism and the meshes that work."""
    model, inputs = _switch()
    with pytest.raises(autopart.AutopartError) as e:
        autopart.compile(model, autopart.Mesh(tp=2), inputs, sequence_parallel=True)
    text = str(e.value)
    assert "experts" in text and "sequence parallelism" in text, text
    assert "drop sequence_parallel" in text and "Mesh(tp=2, dp=2, ep=2)" in text, text
    assert "node:" in text, text


def test_sequence_parallel_with_ep_keeps_experts_whole_over_tp():
    """With ep, sequence parallelism still compiles: ep shards the experts, each stays whole
    over tp (as before expert tensor parallelism)."""
    model, inputs = _switch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = autopart.compile(model, autopart.Mesh(tp=2, dp=2, ep=2), inputs, microbatches=2,
                             sequence_parallel=True)
    assert "transformer.h.1.mlp.c_fc" in c.plan.ep_shards
    assert "transformer.h.1.mlp.c_fc" not in c.plan.tp_shards
