"""split_tensor_parallel: the Megatron pattern, found from ops and dataflow, on several models.

These tests check the decisions and the rewritten graph in one process; tests/test_tensor_parallel.py
runs the programs on real ranks against the plain model.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from autopart.ops import tp as tp_ops
from autopart.capture import capture
from autopart.errors import AutopartError
from autopart.localize import shard_tensor, unshard_tensor
from autopart.ir import ParamShard
from autopart.passes.split_tensor_parallel import split_tensor_parallel
from examples.gpt import GPT, config, lm_loss
from tests.workers.common import renamed_gpt_module



def _program(model, batch=2, seq=16, vocab=256):
    x = torch.randint(0, vocab, (batch, seq))
    return capture(model, (x,), loss_fn=lm_loss, target=x)


def _counts(gm) -> Counter:
    return Counter(getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                   if n.op == "call_function")


def test_megatron_pattern_on_the_example_gpt():
    cfg = config("tiny,n_layer=2")
    program, report = split_tensor_parallel(_program(GPT(cfg)), tp=2)
    counts = _counts(program.gm)
    # per layer: one all-reduce after attention's output projection and one after the MLP,
    # plus the vocabulary-parallel embedding's all-reduce
    assert counts["reduce_from_tp"] == 2 * cfg.n_layer + 1
    assert counts["copy_to_tp"] == 2 * cfg.n_layer + 1          # f before each region (and the head)
    assert counts["vocab_parallel_cross_entropy"] == 1 and counts["cross_entropy_loss"] == 0
    assert counts["scatter_to_tp"] == counts["gather_from_tp"] == 0
    shards = program.tp.params
    h = cfg.n_embd
    assert shards["transformer.h.0.attn.c_attn.weight"] == ParamShard(0, (h, h, h))   # q | k | v
    assert shards["transformer.h.0.attn.c_proj.weight"] == ParamShard(1, (h,))
    assert shards["transformer.h.0.mlp.c_fc.weight"] == ParamShard(0, (4 * h,))
    assert shards["transformer.h.0.mlp.c_proj.weight"] == ParamShard(1, (4 * h,))
    assert shards["transformer.wte.weight"] == ParamShard(0, (cfg.vocab_size,))
    assert "transformer.h.0.ln_1.weight" not in shards and "transformer.wpe.weight" not in shards
    assert report["replicated_linears"] == []


def test_views_are_rewritten_to_local_head_counts():
    cfg = config("tiny,n_layer=1")     # 4 heads of 16
    program, _ = split_tensor_parallel(_program(GPT(cfg)), tp=2)
    code = program.gm.code
    assert code.count(", 2, 16])") == 3         # q, k, v viewed as 2 local heads
    assert "split.Tensor(linear, 32, 2)" in code  # the fused qkv output split in local thirds
    assert "[-1, 128]" in code                  # logits viewed with the local vocabulary


def test_renamed_model_gets_the_same_plan():
    module = renamed_gpt_module()
    cfg = module.config("tiny,n_layer=2")
    torch.manual_seed(0)
    renamed = module.GPT(cfg)
    plain, _ = split_tensor_parallel(_program(GPT(config("tiny,n_layer=2"))), tp=2)
    other, _ = split_tensor_parallel(_program(renamed), tp=2)
    assert _counts(other.gm) == _counts(plain.gm)
    shards = other.tp.params
    assert shards["trunk.h.0.mx.w0.weight"] == ParamShard(0, (64, 64, 64))
    assert shards["trunk.h.1.wd.w1.weight"] == ParamShard(1, (256,))


def _hf_gpt2(n_layer=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_loss(out, target):
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _hf_program(model, seq=16):
    x = torch.randint(0, 256, (2, seq))
    return capture(model, (x,), loss_fn=hf_loss, target=x)


def test_hugging_face_gpt2_conv1d_and_fused_qkv():
    program, report = split_tensor_parallel(_hf_program(_hf_gpt2()), tp=2)
    shards = program.tp.params
    # Conv1D stores weights [in, out]: columns are dim 1, rows dim 0
    assert shards["transformer.h.0.attn.c_attn.weight"] == ParamShard(1, (64, 64, 64))
    assert shards["transformer.h.0.attn.c_attn.bias"] == ParamShard(0, (64, 64, 64))
    assert shards["transformer.h.0.attn.c_proj.weight"] == ParamShard(0, (64,))
    assert shards["transformer.h.1.mlp.c_proj.weight"] == ParamShard(0, (256,))
    counts = _counts(program.gm)
    assert counts["reduce_from_tp"] == 2 * 2 + 1
    assert report["replicated_linears"] == []


def _llama(kv_heads):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=kv_heads,
                                   vocab_size=256, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def test_grouped_query_attention_splits_kv_heads_when_they_divide():
    program, _ = split_tensor_parallel(_hf_program(_llama(kv_heads=2)), tp=2)
    shards = program.tp.params
    for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert shards[f"model.layers.0.self_attn.{proj}.weight" if "proj" in proj and proj[0] in "qkv"
                      else f"model.layers.0.mlp.{proj}.weight"].dim == 0
    assert shards["model.layers.0.mlp.down_proj.weight"].dim == 1
    assert _counts(program.gm)["scatter_to_tp"] == 0


def test_multi_query_attention_replicates_kv_and_slices_locally():
    program, report = split_tensor_parallel(_hf_program(_llama(kv_heads=1)), tp=2)
    shards = program.tp.params
    assert "model.layers.0.self_attn.k_proj.weight" not in shards
    assert shards["model.layers.0.self_attn.q_proj.weight"].dim == 0
    assert _counts(program.gm)["scatter_to_tp"] == 2 * 2      # repeated k and v, per layer
    assert {name for name, _ in report["replicated_linears"]}  # k, v projections named


def test_sequence_parallel_collectives():
    cfg = config("tiny,n_layer=2")
    program, _ = split_tensor_parallel(_program(GPT(cfg)), tp=2, sequence_parallel=True)
    counts = _counts(program.gm)
    plan = program.tp
    assert counts["reduce_from_tp"] == 0
    assert counts["reduce_scatter_tp"] == 2 * cfg.n_layer + 1     # + the embedding
    assert counts["gather_linear_sp"] == 2 * cfg.n_layer + 1      # + the head
    assert {"transformer.h.0.ln_1.weight", "transformer.ln_f.bias",
            "transformer.h.1.mlp.c_proj.bias"} <= plan.sp_grad_reduce


def test_heads_not_divisible_names_node_source_and_remedy():
    with pytest.raises(AutopartError) as err:
        split_tensor_parallel(_program(GPT(config("tiny,n_layer=1,n_head=2,n_embd=64"))), tp=4)
    text = str(err.value)
    assert "2 attention heads do not divide by tp=4" in text
    assert "examples/gpt.py" in text and "scaled_dot_product_attention" in text
    assert "use tp in [1, 2]" in text


def test_hidden_size_not_divisible_gives_padding_remedy():
    with pytest.raises(AutopartError) as err:
        split_tensor_parallel(_program(GPT(config("tiny,n_layer=1,vocab_size=250")), vocab=250), tp=4)
    text = str(err.value)
    assert "250 output features, not divisible by tp=4" in text and "250 -> 252" in text
    assert "lm_head" in text


class _NoRuleMLP(torch.nn.Module):
    """An MLP whose hidden activation goes through an op with no sharding rule (cumsum)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 128)
        self.down = torch.nn.Linear(128, 32)

    def forward(self, x):
        return self.down(torch.cumsum(self.up(x), dim=-1)).pow(2).mean()


def test_op_without_rule_fails_with_the_op_named_instead_of_replicating_everything():
    program = capture(_NoRuleMLP(), (torch.randn(2, 8, 32),))
    with pytest.raises(AutopartError) as err:
        split_tensor_parallel(program, tp=2)
    assert "cumsum" in str(err.value) and "more than 1.5/tp" in str(err.value)


@pytest.mark.parametrize("tp", [2, 4])
def test_parameter_share_per_rank(tp):
    model = GPT(config("tiny,n_layer=2"))
    program, _ = split_tensor_parallel(_program(model), tp=tp)
    shards = program.tp.params
    total = sum(p.numel() for p in model.parameters())
    local = sum(p.numel() // tp if n in shards else p.numel() for n, p in model.named_parameters())
    assert local / total <= 1.5 / tp


def test_shard_and_unshard_round_trip_with_sections():
    full = torch.arange(24.0).reshape(12, 2)
    shards = [shard_tensor(full, 0, (4, 4, 4), 2, r) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0.0, 2.0, 8.0, 10.0, 16.0, 18.0]   # rows 0,1 | 4,5 | 8,9
    assert torch.equal(unshard_tensor(shards, 0, (4, 4, 4)), full)


def test_unbound_program_refuses_to_run():
    comm = tp_ops.TPComm(2)
    with pytest.raises(RuntimeError, match="not bound"):
        tp_ops.reduce_from_tp(torch.ones(2), comm)


def test_meta_llama_complex_rotary_splits_every_linear():
    """Complex rotary embeddings (view_as_complex, complex mul, view_as_real, flatten), float
    round trips with export's _assert_tensor_metadata, repeat_kv by expand + reshape, RMSNorm by
    hand: every projection split, nothing sliced locally, nothing replicated."""
    from examples.llama_meta import Llama, config
    from examples.llama_meta import lm_loss as llama_loss
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 16))
    program = capture(Llama(config("tiny-gqa")), (x,), loss_fn=llama_loss, target=x)
    out, report = split_tensor_parallel(program, tp=2)
    assert report["replicated_linears"] == []
    counts = _counts(out.gm)
    assert counts["scatter_to_tp"] == 0 and counts["vocab_parallel_cross_entropy"] == 1
    assert out.tp.params["layers.0.attention.wk.weight"] == ParamShard(0, (32,))   # 2 kv heads
    assert "view_as_complex" in out.gm.code and ", 2, -1, 2])" in out.gm.code   # 2 local heads


class _Blocked(torch.nn.Module):
    """Two layers whose first linear feeds a cumsum (no rule), each small: warned, not fatal."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.ModuleList(torch.nn.Linear(32, 256) for _ in range(2))
        self.down = torch.nn.ModuleList(torch.nn.Linear(256, 32) for _ in range(2))
        self.small = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))

    def forward(self, x):
        for big, down, small in zip(self.big, self.down, self.small):
            x = x + down(torch.relu(big(x))) + torch.cumsum(small(x), -1)
        return x.pow(2).mean()


def test_replicated_linears_warn_once_grouped_by_the_op_that_stopped_them():
    program = capture(_Blocked(), (torch.randn(2, 8, 32),))
    with pytest.warns(UserWarning) as caught:
        split_tensor_parallel(program, tp=2)
    ours = [str(w.message) for w in caught if "replicated over tp" in str(w.message)]
    assert len(ours) == 1, ours
    text = ours[0]
    assert "2 linear(s) stay replicated over tp=2" in text and "and 1 more like it" in text
    assert "aten.cumsum.default" in text and "test_split_tensor_parallel.py" in text
    assert "% of the parameters" in text


class _MLPWrittenAs(torch.nn.Module):
    """The same up/down MLP with its linears written as `style` says; weights [out, in] unless
    the style reads them [in, out]."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        g = torch.Generator().manual_seed(0)
        up, down = torch.randn(64, 16, generator=g), torch.randn(16, 64, generator=g)
        if style in ("einsum-io", "matmul-io"):
            up, down = up.t().contiguous(), down.t().contiguous()
        self.up, self.down = torch.nn.Parameter(up), torch.nn.Parameter(down)

    def _linear(self, x, w):
        return {"linear": lambda: F.linear(x, w), "at-T": lambda: x @ w.T,
                "matmul-t": lambda: torch.matmul(x, w.t()),
                "transpose": lambda: x @ w.transpose(0, 1),
                "einsum": lambda: torch.einsum("bsi,oi->bso", x, w),
                "einsum-io": lambda: torch.einsum("bsi,io->bso", x, w),
                "matmul-io": lambda: x @ w}[self.style]()

    def forward(self, x):
        return self._linear(torch.relu(self._linear(x, self.up)), self.down).pow(2).mean()


@pytest.mark.parametrize("style", ["linear", "at-T", "matmul-t", "transpose", "einsum",
                                   "einsum-io", "matmul-io"])
def test_linears_by_dataflow_however_written(style):
    """x @ w.T, matmul(x, w.t()), einsum: the same column/row pair as F.linear, each weight
    split along its output (up) or input (down) features (tests/test_families.py runs
    Falcon's `x @ w.T` against the plain model)."""
    model = _MLPWrittenAs(style)
    x = torch.randn(2, 8, 16)
    program, report = split_tensor_parallel(capture(model, (x,)), tp=2)
    out_dim = 1 if style.endswith("-io") else 0
    assert program.tp.params == {"up": ParamShard(out_dim, (64,)),
                                 "down": ParamShard(1 - out_dim, (64,))}, report
    assert report["replicated_linears"] == []
    assert len(program.tp.column) == 1 and len(program.tp.row) == 1


def test_no_linear_found_names_the_op_reading_the_largest_weight():
    class Bmm(torch.nn.Module):     # a weight read by bmm (no linear): nothing to split
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(2, 16, 16))

        def forward(self, x):
            return torch.bmm(x, self.w).pow(2).mean()

    with pytest.raises(AutopartError) as err:
        split_tensor_parallel(capture(Bmm(), (torch.randn(2, 8, 16),)), tp=2)
    text = str(err.value)
    assert "no op reads a weight as a linear" in text and "w (2, 16, 16)" in text
    assert "node:   bmm" in text and "source:" in text, text


class _PerHeadNorms(torch.nn.Module):
    """StableLM's qk_layernorm written small: q split into single heads, one LayerNorm each,
    concatenated back; then the heads' output projection."""

    def __init__(self, bias: bool):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(4, bias=bias) for _ in range(4))
        for n in self.norms:
            torch.nn.init.normal_(n.weight)
        self.o = torch.nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        q = torch.cat([norm(h) for norm, h in zip(self.norms, torch.split(q, 1, dim=1))], dim=1)
        return self.o(q.transpose(1, 2).reshape(b, s, 16)).pow(2).mean()


@pytest.mark.parametrize("bias", [False, True])
def test_per_head_layer_norms_are_batched_and_split(bias):
    from autopart.passes.split_tensor_parallel import batch_per_piece_norms
    model = _PerHeadNorms(bias)
    x = torch.randn(2, 8, 16)
    program = capture(model, (x,))
    batched = batch_per_piece_norms(program)
    targets = Counter(n.target for n in batched.gm.graph.nodes)
    assert targets[torch.ops.aten.layer_norm.default] == 1 and targets[torch.ops.aten.cat.default] == 0
    assert targets[torch.ops.aten.stack.default] == (2 if bias else 1)
    with torch.no_grad():
        torch.testing.assert_close(batched.gm(x)[0], model(x), rtol=1e-6, atol=1e-7)
    out, report = split_tensor_parallel(program, tp=2)
    assert report["replicated_linears"] == [] and set(out.tp.params) >= {"q.weight", "o.weight"}


def _captured(name: str):
    from tests.workers.common import Case, build
    from tests.workers.tp_families import BUILDERS   # noqa: F401  (registers the builders)
    model, loss_fn, inputs, target = build(Case(name, model=name))
    return capture(model, inputs, loss_fn=loss_fn, target=target)


def test_interleaved_rotary_stack_splits_a_llama_at_tp8():
    """Rotary embeddings written `stack((a*cos - b*sin, a*sin + b*cos), -1).flatten(-2)` (an
    aten.stack of two head-sharded tensors): every linear of an 8-head Llama splits at tp=8,
    where before q and k stayed whole and tp=8 was refused."""
    out, report = split_tensor_parallel(_captured("llama-interleaved"), tp=8)
    assert report["replicated_linears"] == []
    assert out.tp.params["layers.0.attention.wq.weight"] == ParamShard(0, (64,))
    assert _counts(out.gm)["stack.default"] == 2 * 2 and _counts(out.gm)["scatter_to_tp"] == 0


def test_fused_qkv_view_groups_index_and_in_place_accumulator():
    """tests/workers/tp_families.Handwritten: a Wqkv viewed (.., 3, -1, d) splits per q|k|v
    section with the heads; a projection read per group by `[:, :, [0, 2]]` of its 4 groups
    (2 per rank) indexes each rank's block with [0]; `acc += up(h)` into a zeros accumulator
    writes into this rank's own copy of its slice."""
    out, report = split_tensor_parallel(_captured("handwritten"), tp=2)
    assert report["replicated_linears"] == []
    params = out.tp.params
    assert params["wqkv.weight"] == ParamShard(0, (32, 32, 32))
    assert params["wo.weight"] == ParamShard(1, (32,))
    assert params["grouped.weight"] == ParamShard(0, (64,)) and params["down.weight"].dim == 1
    assert params["up.weight"] == ParamShard(0, (64,)) and params["out.weight"].dim == 1
    code = out.gm.code
    assert "[None, None, slice_tensor]" in code, code     # the index's first 1/tp: [0]
    assert "clone.default(scatter_to_tp)" in code and "add_.Tensor(clone_default" in code
    view = next(n for n in out.gm.graph.nodes if n.target is torch.ops.aten.view.default
                and -1 in n.args[1])
    assert list(view.args[1][2:]) == [3, -1, 8]         # q|k|v, the local heads, head_dim


def test_sharded_dim_index_that_misses_a_rank_names_why():
    """An index that picks positions of the sharded dim some rank does not hold ([0, 1] of 4
    groups: both on rank 0): the projection stays whole, and the refusal names the index, the
    numbers and the source line."""
    class Picks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(16, 16)

        def forward(self, x):
            b, s, _ = x.shape
            y = self.up(x).view(b, s, 4, 8)[:, :, [0, 1]].reshape(b, s, 16)
            return self.down(y).pow(2).mean()

    with pytest.raises(AutopartError) as err:
        split_tensor_parallel(capture(Picks(), (torch.randn(2, 4, 16),)), tp=2)
    text = str(err.value)
    assert "the index [0, 1] of the sharded dim (4 positions) does not pick the same positions "\
        "of each rank's 2" in text, text
    assert "[:, :, [0, 1]]" in text and "remedy:" in text, text


class _ScaledFused(torch.nn.Module):
    """A fused projection times a replicated per-feature scale before its split into three
    (Falcon-H1's `in_proj(x) * mup_vector`)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.arange(48.0))

    def forward(self, x):
        a, b, c = (self.up(x) * self.scale).split([16, 16, 16], -1)
        return self.down(a * torch.sigmoid(b) + c).pow(2).mean()


def test_replicated_operand_of_a_fused_projection_before_its_cut_is_sliced_per_section():
    """Each rank holds 1/tp of each of the three sections, so the scale meeting the fused
    output is sliced the same way: rank r takes its 1/tp of each section (scale[0:8], [16:24],
    [32:40] on rank 0). Before, a contiguous half was sliced (silently wrong), then refused."""
    program = capture(_ScaledFused(), (torch.randn(2, 4, 16),))
    out, report = split_tensor_parallel(program, tp=2)
    assert report["replicated_linears"] == []
    assert out.tp.params["up.weight"] == ParamShard(0, (16, 16, 16))
    assert list(out.tp.scatter_sections.values()) == [(16, 16, 16)], out.tp.scatter_sections


class _NestedSplit(torch.nn.Module):
    """Mamba-2's in_proj: z | xBC | dt, xBC through a depthwise conv1d, then split x | B | C."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 8 + 16 + 4), torch.nn.Linear(8, 16)
        self.conv = torch.nn.Conv1d(16, 16, 3, groups=16, padding=2)

    def forward(self, x):
        z, xbc, dt = self.up(x).split([8, 16, 4], -1)
        xbc = self.conv(xbc.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        h, b, c = xbc.split([8, 4, 4], -1)
        y = h * torch.sigmoid(z) + (b * c + dt).repeat_interleave(2, -1)
        return self.down(y).pow(2).mean()


def test_a_split_of_a_section_cuts_the_projection_where_it_lies():
    """The split of xBC (features 8:24 of up) into x | B | C cuts up's weight at 8, 16, 20, 24,
    and the depthwise conv's filters and bias follow x | B | C per section (groups halved).
    (The section-following scatter they are sliced by is tested on _ScaledFused's buffer.)"""
    out, report = split_tensor_parallel(capture(_NestedSplit(), (torch.randn(2, 4, 16),)), tp=2)
    assert report["replicated_linears"] == []
    assert out.tp.params["up.weight"] == ParamShard(0, (8, 8, 4, 4, 4))
    # the filters and bias, read only per section, are split by the same sections
    assert out.tp.params["conv.weight"] == out.tp.params["conv.bias"] == ParamShard(0, (8, 4, 4))
    conv = next(n for n in out.gm.graph.nodes if n.target is torch.ops.aten.conv1d.default)
    assert conv.args[6] == 8


class _PerHead(torch.nn.Module):
    """Mamba-2's per-head parameters: A = -exp(A_log) and dt_bias meet the heads' dt, D is
    unsqueezed onto the heads, a norm weight viewed per group of heads; `scale` is also read
    whole (a sum over it), so it stays replicated."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 8), torch.nn.Linear(8, 16)
        for name in ("a_log", "dt_bias", "d", "scale"):
            setattr(self, name, torch.nn.Parameter(torch.rand(4)))
        self.norm = torch.nn.Parameter(torch.rand(8))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.up(x).view(b, s, 4, 2)
        dt = torch.nn.functional.softplus(h.sum(-1) + self.dt_bias) * -torch.exp(self.a_log)
        y = (h * dt[..., None] + self.d.unsqueeze(1) * h) * self.scale[:, None]
        y = y.view(b, s, 2, 4) * self.norm.view(2, 4)
        return self.down(y.reshape(b, s, 8)).pow(2).mean() + self.scale.sum()


def test_parameters_read_only_per_head_are_split_by_heads():
    """A_log, dt_bias, D and the norm weight are only read through their heads' slice: each
    rank holds its heads' share (no scatter left for them); `scale`, also summed whole, keeps
    its slice read through a scatter and stays whole."""
    out, _ = split_tensor_parallel(capture(_PerHead(), (torch.randn(2, 4, 16),)), tp=2)
    params = out.tp.params
    assert all(params[n] == ParamShard(0, (n_,)) for n, n_ in
               (("a_log", 4), ("dt_bias", 4), ("d", 4), ("norm", 8))), params
    assert "scale" not in params
    assert _counts(out.gm)["scatter_to_tp"] == 1, out.gm.code     # scale's slice only
    assert "torch.ops.aten.view.default(norm, [1, 4])" in out.gm.code, out.gm.code


def test_scatter_to_tp_with_sections_and_its_gradient(monkeypatch):
    """Rank r's 1/tp of each section, side by side; backward puts every rank's parts back."""
    class Comm:
        size, rank, moves_data = 2, 1, False

        def _check(self):
            pass
    x = torch.arange(12.0, requires_grad=True)
    y = tp_ops.scatter_to_tp(x, 0, Comm(), [4, 4, 4])
    assert y.tolist() == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    parts = [tp_ops._split(x.detach(), 0, type("C", (Comm,), {"rank": r})(), [4, 4, 4])
             for r in (0, 1)]
    monkeypatch.setattr(tp_ops, "_all_gather", lambda g, dim, comm: torch.cat(parts, dim))
    assert torch.equal(tp_ops._gather_sections(parts[1], 0, Comm(), [4, 4, 4]), x.detach())


class _ConcatConv(torch.nn.Module):
    """Gated DeltaNet's pattern: q, k, v concatenated along the features before a depthwise
    conv and split back, a norm over heads reshaped into rows (`reshape(-1, head_dim)`)."""

    def __init__(self, mix: bool = False):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(16, 8) for _ in range(3))
        self.conv = torch.nn.Conv1d(24, 24, 3, groups=24, padding=2)
        self.o, self.a, self.b = (torch.nn.Linear(*io) for io in ((8, 16), (16, 12), (16, 12)))
        self.mix = mix

    def forward(self, x):
        b, s, _ = x.shape
        qkv = torch.cat([self.q(x), self.k(x), self.v(x)], -1)
        if self.mix:          # meets a cat of other parts: a rank holds other features of it
            qkv = qkv * torch.cat([self.a(x), self.b(x)], -1)
        qkv = self.conv(qkv.transpose(1, 2))[..., :s].transpose(1, 2)
        q, k, v = qkv.split([8, 8, 8], -1)
        y = (q * k + v).view(b, s, 2, 4).reshape(-1, 4)     # 2 heads merged into the rows
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.o(y.reshape(b, s, 2, 4).reshape(b, s, 8)).pow(2).mean()


def test_a_concatenation_along_the_shard_and_heads_merged_into_rows():
    """The cat's parts are sections a rank holds 1/tp of each: the conv's filters follow them;
    the norm over rows merged from heads runs on each rank's heads, then splits them out."""
    out, report = split_tensor_parallel(capture(_ConcatConv(), (torch.randn(2, 4, 16),)), tp=2)
    assert report["replicated_linears"] == []
    assert out.tp.params["conv.weight"] == out.tp.params["conv.bias"] == ParamShard(0, (8, 8, 8))
    placements = out.tp.placements
    rows = next(n for n in placements if n.target is torch.ops.aten.mean.dim)
    assert placements[rows].dim == 0


def test_concatenations_along_the_shard_with_other_parts_are_not_mixed():
    """Rank 0 holds q[0:4] | k[0:4] | v[0:4] of one cat but features 0:6 and 12:18 of the
    other: multiplying them would mix different features; the projections stay whole and the
    warning says why."""
    with pytest.warns(UserWarning, match="laid out differently over the ranks|a cut inside a part"):
        split_tensor_parallel(capture(_ConcatConv(True), (torch.randn(2, 4, 16),)), tp=2)
