"""Expert parallelism on real ranks equals the plain model: examples/switch.py (top-1 with
capacity, top-2 dropless) and an unmodified Hugging Face Mixtral, with experts sharded over ep of
the dp ranks, composed with pipeline and tensor parallelism. Every step's loss, the first step's
gradients (each rank's experts against the same experts' rows of the plain gradient), the clipped
gradient norm, every parameter after 3 SGD steps and full_state_dict() with full shapes.

Each dp rank's microbatches hold whole routing groups (16-token groups, one per sequence), and
the example averages its auxiliary losses over groups, so the plain model's loss on the global
batch is the mean of the per-microbatch losses.

Fast tier: python -m pytest -m "not full" tests/test_expert_parallel.py
Full matrix: python -m pytest tests/test_expert_parallel.py
"""
from __future__ import annotations

import pytest
import torch

import autopart
from tests.workers.common import SWITCH_SPECS, Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.composition import CCase, run_composition

FAST_2 = [
    Case("switch-dp2-ep2", model="switch", dp=2, ep=2, microbatches=2),
    Case("switch-top2-dp2-ep2", model="switch-top2", dp=2, ep=2, microbatches=2),
    # the dispatch's data-dependent sizes inside a recomputed layer: the program check stops
    # there as at top level (it raised "a bug in the pass")
    CCase("mixtral-dp2-ep2-recompute-full", model="mixtral", dp=2, ep=2, microbatches=2,
          batch=4, recompute="full"),
]
# full tier since the fast tier neared CI's 20 minutes (these 4 ranks took 58 s)
PP_4 = [
    Case("switch-dp2-ep2xpp2", model="switch", dp=2, ep=2, pp=2, microbatches=2),
    # the model returns (loss, routing counts): pm.last_stats sums them over the global batch
    Case("switch-stats-dp2-ep2xpp2", model="switch-stats", dp=2, ep=2, pp=2, microbatches=2),
]
FULL_4 = [
    Case("switch-dp4-ep4", model="switch", dp=4, ep=4, microbatches=2),
    Case("switch-top2-dp4-ep2", model="switch-top2", dp=4, ep=2, microbatches=2),
    Case("switch-dp2-ep2xpp2-interleaved", model="switch", dp=2, ep=2, pp=2,
         schedule="interleaved-1f1b", virtual_stages=2, microbatches=2),
    Case("switch-dp2-ep2xtp2", model="switch", dp=2, ep=2, tp=2, microbatches=2),
]
FULL_2 = [
    Case("mixtral-dp2-ep2", model="mixtral", dp=2, ep=2, microbatches=2, batch=4),
]
GROUPS = {("ep-fast", 2): FAST_2, ("ep-pp", 4): PP_4, ("ep-full", 4): FULL_4,
          ("ep-full", 2): FULL_2}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
CASES = [pytest.param(c, id=c.name) for c in FAST_2] + [
    pytest.param(c, id=c.name, marks=pytest.mark.full) for c in PP_4 + FULL_4 + FULL_2]


def _results(case, spawn_cache) -> list[dict]:
    key = _GROUP_OF[case.name]
    return run_group(spawn_cache, key, GROUPS[key], rank_fn=run_composition)[case.name]


@pytest.mark.parametrize("case", CASES)
def test_matches_plain_model(case: Case, spawn_cache):
    assert_all_ranks_equal_plain(case, _results(case, spawn_cache))


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_its_experts(case: Case, spawn_cache):
    """With ep ranks per expert group, each rank holds 1/ep of the expert weights (and, with
    tp, 1/tp of the split dense weights): less than the whole model."""
    ranks = _results(case, spawn_cache)
    for r in ranks:
        assert r["held_numel"] < r["total_numel"], r["case"]


# -- bad inputs, at compile time, in one process -------------------------------------------------

def _switch(spec: str):
    from examples.switch import SwitchGPT, config
    torch.manual_seed(0)
    cfg = config(spec)
    x = torch.zeros(8, cfg.block_size, dtype=torch.long)
    return SwitchGPT(cfg), (x, x.clone())


def test_experts_not_divisible_by_ep():
    model, inputs = _switch(SWITCH_SPECS["switch"] + ",num_experts=6")
    with pytest.raises(autopart.AutopartError) as e:
        autopart.compile(model, autopart.Mesh(dp=4, ep=4), inputs, microbatches=2)
    text = str(e.value)
    assert "transformer.h.1.mlp" in text and "6 experts" in text and "ep=4" in text
    assert "[1, 2]" in text and "8 experts" in text


def test_ep_not_dividing_dp():
    with pytest.raises(autopart.AutopartError, match=r"ep=3 must divide dp=4.*\[1, 2, 4\]"):
        autopart.Mesh(dp=4, ep=3)


def test_microbatch_not_holding_whole_routing_groups():
    model, inputs = _switch(SWITCH_SPECS["switch"] + ",group_size=32")
    with pytest.raises(autopart.AutopartError) as e:       # 1 x 16 tokens per microbatch
        autopart.compile(model, autopart.Mesh(dp=2, ep=2), inputs, microbatches=4)
    text = str(e.value)
    assert "transformer.h.1.mlp" in text and "groups of 32 tokens" in text and "1 x 16" in text
    assert "remedy" in text


def test_model_without_experts():
    from examples.gpt import GPT, lm_loss
    x = torch.zeros(4, 64, dtype=torch.long)
    with pytest.raises(autopart.AutopartError, match="has none"):
        autopart.compile(GPT("tiny"), autopart.Mesh(dp=2, ep=2), (x,), loss_fn=lm_loss, target=x)


def test_compile_shards_experts_and_explains():
    model, inputs = _switch(SWITCH_SPECS["switch"])
    c = autopart.compile(model, autopart.Mesh(dp=2, ep=2, pp=2), inputs, microbatches=2)
    assert set(c.plan.ep_shards) == {"transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj",
                                     "transformer.h.3.mlp.c_fc", "transformer.h.3.mlp.c_proj"}
    # values, not shapes: ep rank e (dp index mod ep) holds rows 2e, 2e+1 of the plain model's
    # experts, so the two ep ranks of a stage hold different experts, which together are all 4
    plain = dict(model.named_parameters())
    mesh = autopart.Mesh(dp=2, ep=2, pp=2)
    held: dict = {}
    for rank in range(4):
        params = c.programs[rank].parameters()
        for name, p in params.items():
            if name in c.plan.ep_shards:
                ep_rank = mesh.coords(rank)["dp"] % 2
                assert torch.equal(p, plain[name][2 * ep_rank:2 * ep_rank + 2]), (rank, name)
                held.setdefault(name, {})[ep_rank] = p
    assert set(held) == set(c.plan.ep_shards)
    for name, by_ep in held.items():
        assert not torch.equal(by_ep[0], by_ep[1]), f"{name}: both ep ranks hold the same experts"
        assert torch.equal(torch.cat([by_ep[0], by_ep[1]]), plain[name]), name
    # the expert region of each layer stays in one chunk
    for chunk in c.program.chunks:
        names = {n.target.__name__ for n in chunk.gm.graph.nodes if n.op == "call_function"
                 and getattr(n.target, "__module__", "") == "autopart.ep_ops"}
        assert names in (set(), {"dispatch_to_experts", "combine_from_experts"})
    text = c.explain()
    assert "expert parallelism over ep=2" in text and "transformer.h.1.mlp" in text
    assert "2 of 4 experts per rank" in text and "capacity 5" in text
    js = c.to_json()["expert_parallel"]
    assert [layer["name"] for layer in js] == ["transformer.h.1.mlp", "transformer.h.3.mlp"]


@pytest.mark.full
def test_switch_c_compiles_on_meta_with_pipeline_and_expert_parallelism():
    """Switch-C (1.57e12 parameters, 2048 experts in each of 30 layers) on the meta device:
    pp=2 x dp=64 with ep=64, 32 experts per rank, no expert region cut, each ep rank viewing its
    own 32 rows of the plain model's experts."""
    from examples.switch import SwitchGPT, config, example_inputs
    cfg = config("switch-c")
    with torch.device("meta"):
        model = SwitchGPT(cfg)
    mesh = autopart.Mesh(pp=2, dp=64, ep=64)
    c = autopart.compile(model, mesh, example_inputs(cfg, 128, "meta"), microbatches=2)
    assert len(c.plan.ep_shards) == 60 and c.plan.microbatch_size == 1
    rows = c.to_json()["expert_parallel"]
    assert len(rows) == 30 and {r["experts_per_rank"] for r in rows} == {32}
    # forward all-to-all per rank per microbatch: tokens of b groups x capacity 1, in and out
    assert rows[0]["a2a_bytes_per_microbatch"] == 2 * 2048 * 2080 * 4 * 63 / 64
    # a meta tensor has no values: which experts a rank holds shows in where its view starts in
    # the plain model's tensor. ep rank e (dp index mod 64) holds rows 32e .. 32e+31.
    name = "transformer.h.0.mlp.c_fc"
    plain = dict(model.named_parameters())[name]
    assert tuple(plain.shape) == (2048, 2080, 6144)
    starts = set()
    for dp in (0, 1, 63):
        w = c.programs[mesh.rank(pp=0, dp=dp)].parameters()[name]
        assert tuple(w.shape) == (32, 2080, 6144) and w.stride() == plain.stride()
        assert w.storage_offset() == 32 * dp * plain.stride(0), (dp, w.storage_offset())
        starts.add(w.storage_offset())
    assert len(starts) == 3
    assert "expert parallelism over ep=64" in c.explain()


def test_dropless_dispatch_syncs_the_host_once_per_moe_layer_and_microbatch():
    """all_to_all_single takes its split sizes as Python ints, so a dropless dispatch needs the
    per-expert row counts on the host: one sync per MoE layer per microbatch in the forward;
    the combine of the same rows and both backwards reuse that plan. Counted on a real step
    (Tensor.item/tolist/__int__... patched: tests/workers/overlap.counted_syncs), besides the
    ranks' agreement on host values before the step (refusals, the sequence length:
    runtime/batches.py host_sum's tolist of a CPU tensor) and the step's one read of a device
    value after it (the reduced [loss, flags, ids out of range]: runtime/state.py
    step_results' tolist)."""
    from autopart.runtime.launch import spawn
    from tests.workers.moe import expert_syncs
    for r in spawn(expert_syncs, 2, timeout=300):
        plans = [s for s in r["syncs"] if "(_row_plan)" in s]
        assert len(plans) == r["moe_layers"] * r["microbatches"] == 4, r["syncs"]
        others = [s for s in r["syncs"] if s not in plans]
        assert [s.split(" at ")[0] for s in others] == ["tolist", "tolist"], r["syncs"]
        assert "(host_sum)" in others[0] and "(step_results)" in others[1], r["syncs"]
