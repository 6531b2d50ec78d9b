"""capture and analysis: names, tied-weight aliases, errors at the user's line, batch 1,
symbolic FLOPs in b and s, repeated-layer detection."""
from __future__ import annotations

import inspect

import pytest
import sympy
import torch
import torch.nn as nn

import autopart
from autopart.analysis import analyze, detect_layers, evaluate
from autopart.capture import BATCH, SEQ, capture
from autopart.errors import AutopartError
from examples.gpt import GPT, config, lm_loss

aten = torch.ops.aten


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = GPT(config("tiny,n_layer=3"))
    x = torch.randint(0, 256, (2, 64))
    return model, capture(model, (x,), loss_fn=lm_loss, target=x)


def test_names_are_the_plain_models(tiny):
    model, program = tiny
    assert program.inputs == ["idx", "target"]          # forward()'s own argument names
    assert list(program.params) == [n for n, _ in model.named_parameters()]
    placeholders = [n.name for n in program.gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["idx", "target"]
    attrs = {n.target for n in program.gm.graph.nodes if n.op == "get_attr"}
    assert attrs == set(program.params)
    for name, info in program.params.items():
        assert info.shape == tuple(model.get_parameter(name).shape) and info.dtype == torch.float32
        assert program.gm.get_parameter(name) is model.get_parameter(name)  # shared, not copied
    assert program.batch_size == 2 and program.seq_len == 64 and program.dynamic


def test_tied_weights_have_one_name_and_an_alias(tiny):
    _, program = tiny
    assert program.params["transformer.wte.weight"].aliases == ("lm_head.weight",)
    assert "lm_head.weight" not in program.params
    assert all(not info.aliases for n, info in program.params.items() if n != "transformer.wte.weight")
    readers = [n for n in program.gm.graph.nodes if n.op == "get_attr" and n.target == "transformer.wte.weight"]
    users = {u.target for r in readers for u in r.users}
    assert users == {aten.embedding.default, aten.linear.default}   # the lookup and the head


def test_untied_weights_have_no_alias():
    program = capture(GPT(config("tiny,n_layer=1,tie_weights=false")), (torch.zeros(2, 8, dtype=torch.long),),
                      loss_fn=lm_loss, target=torch.zeros(2, 8, dtype=torch.long))
    assert "lm_head.weight" in program.params
    assert all(not info.aliases for info in program.params.values())


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:          # data-dependent Python control flow: not capturable
            return y.mean()
        return -y.mean()


def test_uncapturable_model_names_the_users_line():
    lines, start = inspect.getsourcelines(DataDependent.forward)
    line = start + next(i for i, text in enumerate(lines) if "if y.sum() > 0" in text)
    with pytest.raises(AutopartError) as e:
        capture(DataDependent(), (torch.randn(4, 8),))
    msg = str(e.value)
    assert f"{__file__}:{line} in forward" in msg
    assert "data-dependent" in msg and "torch.where" in msg and "remedy" in msg


def test_model_mutating_buffers_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(AutopartError, match="mutates buffers.*running_mean"):
        capture(model, (torch.randn(4, 4),), loss_fn=lambda out: out.sum())


def test_batch_size_one(tiny):
    model, _ = tiny
    x = torch.randint(0, 256, (1, 64))
    y = torch.randint(0, 256, (1, 64))
    program = capture(model, (x,), loss_fn=lm_loss, target=y)
    assert program.batch_size == 1 and not program.dynamic      # a size-1 dim cannot be symbolic
    torch.testing.assert_close(program.gm(x, y)[0], lm_loss(model(x), y))


def test_a_dynamic_capture_runs_at_batch_one(tiny):
    """compile() captures at >= 2 rows so b stays symbolic, then runs microbatches of 1."""
    model, program = tiny
    for b in (1, 3):
        x = torch.randint(0, 256, (b, 64))
        y = torch.randint(0, 256, (b, 64))
        torch.testing.assert_close(program.gm(x, y)[0], lm_loss(model(x), y))


@pytest.mark.parametrize("global_batch,dp,microbatches", [(1, 1, 1), (2, 1, 2), (4, 2, 2)])
def test_compile_with_microbatch_size_one(global_batch, dp, microbatches):
    model = GPT(config("tiny,n_layer=2"))
    x = torch.randint(0, 256, (global_batch, 64))
    compiled = autopart.compile(model, autopart.Mesh(pp=2, dp=dp), (x,), loss_fn=lm_loss, target=x,
                                microbatches=microbatches)
    assert compiled.plan.microbatch_size == 1 and compiled.plan.global_batch == global_batch
    assert compiled.program.dynamic
    # the received activation of a microbatch of one sequence: (1, 64, 64) float32
    recv = compiled.programs[dp].chunks[0].recvs[0]
    assert recv.concrete_shape(1, 64) == (1, 64, 64)
    assert compiled.to_json()["chunks"][1]["recv_bytes_per_microbatch"] == 64 * 64 * 4


def test_flops_are_symbolic_in_batch_and_sequence(tiny):
    """Per layer, the matmuls (four linears, attention's QK^T and AV) cost exactly the closed
    form 24*b*s*h^2 + 4*b*s^2*h (Narayanan et al. 2021, forward, without the causal halving)."""
    _, program = tiny
    costs = analyze(program)
    h = 64
    nodes = {n.name: n for n in program.gm.graph.nodes}
    matmuls = (aten.linear.default, aten.scaled_dot_product_attention.default)
    layers = detect_layers(program)
    b, s = BATCH, SEQ
    for layer in layers:
        flops = sum(costs[n].flops for n in layer.nodes if nodes[n].target in matmuls)
        assert sympy.expand(flops - (24 * b * s * h**2 + 4 * b * s**2 * h)) == 0, layer.path
        total = sum(costs[n].flops for n in layer.nodes)
        assert total.free_symbols == {b, s}
    # evaluated at the example's sizes
    one = sum(costs[n].flops for n in layers[0].nodes if nodes[n].target in matmuls)
    assert evaluate(one, 2, 64) == 24 * 2 * 64 * h**2 + 4 * 2 * 64**2 * h
    # the LM head (tied) is 2*b*s*h*V, the rest of the graph has no matmul
    head = [n for n in program.gm.graph.nodes if n.target is aten.linear.default
            and n.args[1].target == "transformer.wte.weight"]
    assert len(head) == 1 and sympy.expand(costs[head[0].name].flops - 2 * b * s * h * 256) == 0
    # activations: the residual add of a layer is b*s*h float32s
    adds = [n for n in layers[0].nodes if nodes[n].target is aten.add.Tensor]
    assert sympy.expand(costs[adds[-1]].out_bytes - 4 * b * s * h) == 0


def test_repeated_layers_have_equal_signatures(tiny):
    _, program = tiny
    layers = detect_layers(program)
    assert [layer.path for layer in layers] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert len({layer.signature for layer in layers}) == 1
    assert len({len(layer.nodes) for layer in layers}) == 1
    every = [n for layer in layers for n in layer.nodes]
    assert len(every) == len(set(every)), "no node in two layers"


class Mixed(nn.Module):
    """Three numbered blocks; the last uses a different activation."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), act) for act in
                                    (nn.ReLU(), nn.ReLU(), nn.GELU()))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


def test_different_layers_have_different_signatures():
    layers = detect_layers(capture(Mixed(), (torch.randn(2, 8),)))
    assert [layer.path for layer in layers] == ["blocks.0", "blocks.1", "blocks.2"]
    assert layers[0].signature == layers[1].signature != layers[2].signature


def test_hf_gpt2_names_and_aliases():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    x = torch.randint(0, 256, (2, 16))
    program = capture(model, (x,), loss_fn=lambda out, t: lm_loss(out.logits, t), target=x)
    assert program.inputs == ["input_ids", "target"]
    assert list(program.params) == [n for n, _ in model.named_parameters()]
    assert program.params["transformer.wte.weight"].aliases == ("lm_head.weight",)
    assert [layer.path for layer in detect_layers(program)] == ["transformer.h.0", "transformer.h.1"]
    assert program.dynamic
    torch.testing.assert_close(program.gm(x, x)[0], lm_loss(model(x).logits, x))
