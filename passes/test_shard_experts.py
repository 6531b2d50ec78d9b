"""shard_experts: MoE layers found from ops and dataflow, the all-to-all rewrite, the expert
parameters it marks, its errors; then the rewritten programs on 2 Gloo ranks against the plain
model (loss, routing counts, gradients, parameters after 3 SGD steps).

One process: python -m pytest passes/test_shard_experts.py -k "not ranks"
"""
from __future__ import annotations

import re
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from autopart.localize import localize_module
from autopart.ops import ep as ep_ops
from autopart.capture import capture
from autopart.errors import AutopartError
from autopart.passes.shard_experts import find_moe_layers, shard_experts
from autopart.ir import ParamShard
from examples.switch import SwitchGPT, config, example_inputs

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.workers.moe import EPCase, GatedMoE  # noqa: E402


def _switch_program(spec: str, batch: int = 2):
    torch.manual_seed(0)
    cfg = config(spec)
    return capture(SwitchGPT(cfg), example_inputs(cfg, batch)), cfg


def _counts(gm) -> Counter:
    return Counter(getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                   if n.op == "call_function")


@pytest.fixture(scope="module")
def tiny():
    return _switch_program("tiny")                  # 4 layers, MoE in blocks 1 and 3, top-1


def test_layers_found_on_the_switch_example(tiny):
    program, cfg = tiny
    rewritten, report = shard_experts(program, ep=2)
    assert [layer["name"] for layer in report["layers"]] == ["transformer.h.1.mlp",
                                                             "transformer.h.3.mlp"]
    for layer, i in zip(report["layers"], (1, 3)):
        assert layer["num_experts"] == 4 and layer["experts_per_rank"] == 2
        assert layer["capacity"] == cfg.capacity == 5 and layer["group_size"] == 16
        assert layer["router"] == f"transformer.h.{i}.mlp.router.weight"
        assert set(layer["routing"]) >= {"argmax", "one_hot"}
        assert layer["params"] == (f"transformer.h.{i}.mlp.c_fc", f"transformer.h.{i}.mlp.c_proj")
        # [E, G*cap, C] float32 dispatched and combined: 4 * (64/16 groups * 5) * b * 64 * 4 bytes
        # each way, half of it to the other rank
        assert layer["tokens_per_expert"] == "20*b"
        assert layer["a2a_bytes"] == str(2 * 4 * 20 * 64 * 4 // 2) + "*b"
        assert layer["a2a_bytes_at_capture"] == 2 * 4 * 20 * 2 * 64 * 4 // 2
        assert "switch.py" in layer["source"]
    plan = rewritten.ep
    assert plan.params == {f"transformer.h.{i}.mlp.{w}": ParamShard(0, (4,))
                           for i in (1, 3) for w in ("c_fc", "c_proj")}
    assert plan.as_dict()["params"]["transformer.h.1.mlp.c_fc"] == {"dim": 0, "experts": 4,
                                                                    "per_rank": 2}
    assert report["skipped"] == []


def test_the_rewrite_puts_the_experts_between_two_all_to_alls(tiny):
    program, cfg = tiny
    rewritten, _ = shard_experts(program, ep=2)
    counts = _counts(rewritten.gm)
    assert counts["dispatch_to_experts"] == counts["combine_from_experts"] == 2
    assert counts["bmm.default"] == 4
    for n in rewritten.gm.graph.nodes:
        if n.target is torch.ops.aten.bmm.default:
            src = n.args[0]
            assert src.target in (ep_ops.dispatch_to_experts, torch.ops.aten.gelu.default)
            assert tuple(n.meta["val"].shape)[0] == 2           # this rank's 2 experts
        if n.target is ep_ops.combine_from_experts:
            assert n.args[0].target is torch.ops.aten.bmm.default
            assert tuple(n.meta["val"].shape)[0] == 4           # every expert, own tokens
    code = rewritten.gm.code
    assert "dispatch_to_experts(reshape_1, ep_comm)" in code
    assert isinstance(rewritten.gm.ep_comm, ep_ops.EPComm) and rewritten.gm.ep_comm.size == 2
    # the original program is untouched; ep=1 leaves the graph as it is
    assert _counts(program.gm)["dispatch_to_experts"] == 0
    same, report = shard_experts(program, ep=1)
    assert same.gm is program.gm and len(report["layers"]) == 2


def test_localized_rank_keeps_only_its_experts(tiny):
    program, _ = tiny
    rewritten, _ = shard_experts(program, ep=2)
    plan = rewritten.ep
    full = rewritten.gm.get_parameter("transformer.h.1.mlp.c_fc")
    for rank in range(2):
        gm = localize_module(rewritten.gm, ep_shards=plan.params, ep=(2, rank), copy=True)
        local = gm.get_parameter("transformer.h.1.mlp.c_fc")
        assert local.shape == (2, 64, 256)
        assert torch.equal(local, full[2 * rank:2 * rank + 2])
        assert gm.ep_comm.rank == rank
        assert gm.get_parameter("transformer.h.1.mlp.router.weight") is \
            rewritten.gm.get_parameter("transformer.h.1.mlp.router.weight")


def test_top2_and_dropless_capacities():
    program, cfg = _switch_program("tiny,n_layer=2,top_k=2,capacity_factor=none")
    _, report = shard_experts(program, ep=4)
    (layer,) = report["layers"]
    assert layer["capacity"] == cfg.capacity == 16 and layer["experts_per_rank"] == 1
    assert layer["tokens_per_expert"] == "64*b"


def renamed_switch_module() -> types.ModuleType:
    """examples/switch.py with its classes, attributes and fields renamed and the expert matmuls
    written as einsums."""
    source = (ROOT / "examples" / "switch.py").read_text()
    source = source.replace("torch.bmm(h, self.c_fc)", 'torch.einsum("enm,emf->enf", h, self.c_fc)')
    source = source.replace("torch.bmm(h, self.c_proj)",
                            'torch.einsum("enf,efm->enm", h, self.c_proj)')
    names = {"MoE": "Sparse", "router": "chooser", "c_fc": "wi", "c_proj": "wo", "mlp": "ffn",
             "transformer": "trunk", "Block": "Layer", "num_experts": "n_routes"}
    for old, new in names.items():
        source = re.sub(rf"\b{old}\b", new, source)
    module = types.ModuleType("renamed_switch")
    module.__file__ = "renamed_switch.py"
    sys.modules["renamed_switch"] = module
    exec(compile(source, "renamed_switch.py", "exec"), module.__dict__)
    return module


def test_renamed_model_with_einsum_experts_gets_the_same_plan():
    module = renamed_switch_module()
    torch.manual_seed(0)
    cfg = module.config("tiny,n_layer=2")
    program = capture(module.SwitchGPT(cfg), module.example_inputs(cfg, 2))
    rewritten, report = shard_experts(program, ep=2)
    (layer,) = report["layers"]
    assert layer["name"] == "trunk.h.1.ffn" and layer["capacity"] == 5
    assert layer["params"] == ("trunk.h.1.ffn.wi", "trunk.h.1.ffn.wo")
    assert layer["router"] == "trunk.h.1.ffn.chooser.weight"
    counts = _counts(rewritten.gm)
    assert counts["dispatch_to_experts"] == counts["combine_from_experts"] == 1


def test_gated_experts_with_topk_bias_and_a_replicated_scale():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 16))
    program = capture(GatedMoE(), (x, x))
    rewritten, report = shard_experts(program, ep=2)
    (layer,) = report["layers"]
    assert set(layer["params"]) == {"w_gate", "w_up", "b_up", "w_down"}   # not `scale`
    assert "topk" in layer["routing"] and layer["router"] == "gate.weight"
    assert len(layer["matmuls"]) == 3 and layer["capacity"] == layer["group_size"] == 8
    counts = _counts(rewritten.gm)
    # gate and up read the same dispatched tokens: one all-to-all in, one out
    assert counts["dispatch_to_experts"] == counts["combine_from_experts"] == 1
    assert rewritten.ep.params["b_up"] == ParamShard(0, (4,))


def test_num_experts_not_divisible_by_ep(tiny):
    program, _ = tiny
    for ep in (3, 8):
        with pytest.raises(AutopartError) as info:
            shard_experts(program, ep=ep)
        text = str(info.value)
        assert f"'transformer.h.1.mlp' has 4 experts, not divisible by ep={ep}" in text
        assert "node:   bmm" in text and "switch.py" in text
        assert "use ep in [1, 2, 4]" in text


def test_bad_ep_values(tiny):
    program, _ = tiny
    for ep in (0, -2, 1.5, True):
        with pytest.raises(AutopartError, match="positive integer"):
            shard_experts(program, ep=ep)


def test_a_dense_model_has_no_experts_to_shard():
    from examples.gpt import GPT, lm_loss
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 16))
    program = capture(GPT(config_gpt()), (x,), loss_fn=lm_loss, target=x)
    assert find_moe_layers(program).layers == []
    with pytest.raises(AutopartError, match="the model has none") as info:
        shard_experts(program, ep=2)
    assert "use ep=1" in str(info.value)


def config_gpt():
    from examples.gpt import config as gpt_config
    return gpt_config("tiny,n_layer=1")


class PerHead(torch.nn.Module):
    """A weight stacked over 4 heads, multiplied head by head: expert-shaped, but unrouted."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.w = torch.nn.Parameter(torch.randn(4, 4, 4) * 0.3)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x, y):
        B, T = x.shape
        h = self.emb(x).reshape(B * T, 4, 4).transpose(0, 1)       # (heads, tokens, 4)
        h = torch.bmm(h, self.w).transpose(0, 1).reshape(B, T, 16)
        return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, 32), y.reshape(-1))


def test_stacked_weights_without_routing_are_not_experts():
    x = torch.randint(0, 32, (2, 8))
    program = capture(PerHead(), (x, x))
    plan = find_moe_layers(program)
    assert plan.layers == [] and len(plan.skipped) == 1
    assert "not computed from a top-k/argmax/one-hot routing" in plan.skipped[0][1]
    with pytest.raises(AutopartError, match="not computed from a top-k"):
        shard_experts(program, ep=2)


def test_an_expert_weight_used_whole_elsewhere_is_refused():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 16))
    program = capture(GatedMoE(shared_use=True), (x, x))
    with pytest.raises(AutopartError, match="expert weight w_down is also used by") as info:
        shard_experts(program, ep=2)
    assert "needs all 4 experts" in str(info.value)


def _hf_program(impl: str = "grouped_mm"):
    transformers = pytest.importorskip("transformers")
    from tests.workers.moe import hf_loss
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        experts_implementation=impl)
    x = torch.randint(0, 128, (2, 16))
    return capture(transformers.MixtralForCausalLM(cfg), (x,), loss_fn=hf_loss, target=x)


def test_hugging_face_mixtral_grouped_mm_experts():
    """transformers 5.x Mixtral (also Qwen2-MoE, OLMoE): stacked gate_up_proj [E, 2F, C] and
    down_proj [E, C, F], top-2 rows sorted by expert and run as grouped matmuls with per-expert
    offsets; dropless, so the rows each rank sends are data-dependent."""
    rewritten, report = shard_experts(_hf_program(), ep=2)
    assert [layer["name"] for layer in report["layers"]] == ["model.layers.0.mlp",
                                                             "model.layers.1.mlp"]
    layer = report["layers"][0]
    assert layer["layout"] == "sorted-rows" and layer["capacity"] is layer["group_size"] is None
    assert layer["params"] == ("model.layers.0.mlp.experts.gate_up_proj",
                               "model.layers.0.mlp.experts.down_proj")
    assert layer["router"] == "model.layers.0.mlp.gate.weight"
    assert {"topk", "sort"} <= set(layer["routing"])
    assert layer["tokens_per_expert"] == "2*b*s"           # top-2: two rows per token
    assert layer["a2a_bytes"] == "256*b*s"                 # (rows x 32 floats) x2 ways, half away
    counts = _counts(rewritten.gm)
    assert counts["sorted_layout"] == counts["dispatch_rows"] == counts["combine_rows"] == 2
    assert counts["grouped_mm_fallback.default"] == 4


def test_hugging_face_batched_mm_experts_are_explained():
    program = _hf_program("batched_mm")
    with pytest.raises(AutopartError, match="gathered per token") as info:
        shard_experts(program, ep=2)
    assert "experts_implementation='batched_mm'" in str(info.value)


def test_row_dispatch_plan_orders_rows_by_local_expert():
    # 2 ranks x 4 experts; rank 1 keeps experts 2, 3. Rows per expert: rank 0 [1, 2, 3, 1],
    # rank 1 [0, 1, 2, 2]. Rank 1 receives (from 0: 3 rows of e2, 1 of e3; from 1: 2 of e2,
    # 2 of e3) and orders them e2 (rank 0's, then rank 1's), then e3.
    layout = torch.tensor([[3, 1], [2, 2]])
    offsets_r1 = torch.cumsum(torch.tensor([0, 1, 2, 2]), 0)
    send, recv, perm = ep_ops._row_plan(offsets_r1, layout, 2)
    assert send == [1, 4] and recv == [4, 4]
    arrived = ["0e2a", "0e2b", "0e2c", "0e3a", "1e2a", "1e2b", "1e3a", "1e3b"]
    assert [arrived[i] for i in perm] == ["0e2a", "0e2b", "0e2c", "1e2a", "1e2b",
                                          "0e3a", "1e3a", "1e3b"]
    assert ep_ops.local_offsets(layout, offsets_r1).tolist() == [5, 8]


# -- on ranks ---------------------------------------------------------------------------------

RANK_CASES = [
    EPCase("top1", "tiny,n_layer=2"),
    EPCase("top1-skewed", "tiny,n_layer=2", skew=True),
    EPCase("top2-skewed", "tiny,n_layer=2,top_k=2", skew=True),
    EPCase("top1-dropless-skewed", "tiny,n_layer=2,capacity_factor=none", skew=True),
    EPCase("top2-dropless-skewed", "tiny,n_layer=2,top_k=2,capacity_factor=none", skew=True),
    EPCase("gated-swiglu-topk", "gated", batch=8),
    EPCase("hf-mixtral", "hf-mixtral"),
    EPCase("bug-expert-grads-not-divided-by-ep", "tiny,n_layer=2", bug=True, steps=1),
]


@pytest.fixture(scope="module")
def two_ranks():
    from autopart.runtime.launch import spawn
    from tests.workers.moe import ep_cases
    per_rank = spawn(ep_cases, 2, RANK_CASES, timeout=240, pg_timeout=60)
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(RANK_CASES)}


@pytest.mark.parametrize("name", [c.name for c in RANK_CASES if not c.bug])
def test_ranks_match_the_plain_model(two_ranks, name):
    results = two_ranks[name]
    for r in results:
        assert r["problems"] == [], f"rank {r['rank']}: " + "\n".join(r["problems"])
    if name.startswith("top"):
        assert results[0]["local_shapes"]["transformer.h.1.mlp.c_fc"] == (2, 64, 256)
    if name == "hf-mixtral":
        assert results[0]["local_shapes"]["model.layers.1.mlp.experts.down_proj"] == (2, 32, 64)


def test_skewed_router_binds_capacity_and_idles_an_expert(two_ranks):
    for name in ("top1-skewed", "top2-skewed"):
        counts = two_ranks[name][0]["counts"][0]        # the plain model's, matched by the ranks
        routed, processed = counts["routed"][0], counts["processed"][0]
        assert processed[-1] == routed[-1] == 0                    # the last expert: no tokens
        assert processed[0] < routed[0]                            # expert 0 over capacity
    assert two_ranks["top1-skewed"][0]["counts"][0]["dropped_tokens"][0] > 0
    dropless = two_ranks["top2-dropless-skewed"][0]["counts"][0]
    assert dropless["processed"] == dropless["routed"] and dropless["dropped_tokens"] == [0]


def test_the_ep_times_too_large_expert_gradient_is_caught(two_ranks):
    problems = two_ranks["bug-expert-grads-not-divided-by-ep"][0]["problems"]
    grads = sorted(p for p in problems if p.startswith("grad "))
    assert [g.split(":")[0] for g in grads] == ["grad transformer.h.1.mlp.c_fc",
                                                "grad transformer.h.1.mlp.c_proj"], problems
    assert all("norm ratio 2.000" in g for g in grads)
    assert all("mlp.c_" in p for p in problems)        # the dense parameters stay right


@pytest.mark.full
def test_hugging_face_olmoe_and_qwen2_moe_on_two_ranks():
    from autopart.runtime.launch import spawn
    from tests.workers.moe import ep_cases
    cases = [EPCase("hf-olmoe", "hf-olmoe"), EPCase("hf-qwen2-moe", "hf-qwen2-moe")]
    for rank_results in spawn(ep_cases, 2, cases, timeout=240, pg_timeout=60):
        for r in rank_results:
            assert r["problems"] == [], f"{r['case']} rank {r['rank']}: {r['problems']}"


@pytest.mark.full
def test_four_ranks_dp4_with_ep4_ep2_and_ep1():
    from autopart.runtime.launch import spawn
    from tests.workers.moe import ep_cases
    cases = [EPCase("dp4-ep4-top1-skewed", "tiny,n_layer=2", skew=True, ep=4, batch=8),
             EPCase("dp4-ep2-top2-skewed", "tiny,n_layer=2,top_k=2", skew=True, ep=2, batch=8),
             EPCase("dp4-ep1-top1", "tiny,n_layer=2", ep=1, batch=8)]
    per_rank = spawn(ep_cases, 4, cases, timeout=300, pg_timeout=60)
    for rank_results in per_rank:
        for r in rank_results:
            assert r["problems"] == [], f"{r['case']} rank {r['rank']}: {r['problems']}"


@pytest.mark.full
def test_switch_c_on_the_meta_device():
    """1.57e12 parameters, 2048 experts in each of 30 layers, never allocated."""
    cfg = config("switch-c")
    with torch.device("meta"):
        model = SwitchGPT(cfg)
    program = capture(model, example_inputs(cfg, 8, "meta"))
    rewritten, report = shard_experts(program, ep=64)
    assert len(report["layers"]) == 30
    layer = report["layers"][0]
    assert layer["experts_per_rank"] == 32 and layer["capacity"] == 1
    assert layer["group_size"] == 2048 and layer["tokens_per_expert"] == "b"
    expert = sum(program.params[p].numel for p in rewritten.ep.params)
    assert expert == 30 * 2048 * 2 * 2080 * 6144
