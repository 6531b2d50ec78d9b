"""Layer reuse (autopart/layer_reuse.py): compiling with two layers traced and the rest spliced
gives the same rank programs (code and digest) as tracing every layer (AUTOPART_LAYER_REUSE=0),
and a model whose layers differ falls back to the full trace.

    python -m pytest -q tests/test_layer_reuse.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopart
from autopart import layer_reuse
from autopart.capture import capture
from tests.workers.family import logits_loss


def _gpt():
    from examples.gpt import GPT, config, lm_loss
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    return GPT(config("tiny,n_layer=4")), lm_loss, (x,), x


def _llama():
    from examples.llama_meta import Llama, config
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    return Llama(config("tiny,vocab_size=128,dim=32,n_layers=4")), logits_loss, (x,), x


def _bert():
    import transformers as tf
    tf.logging.set_verbosity_error()
    cfg = tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    return tf.BertForMaskedLM(cfg), logits_loss, (x,), x


def _neox():
    from examples.neox import NeoX, config
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    return NeoX(config("tiny,vocab_size=128")), logits_loss, (x,), x


def _compile(build, mesh, reuse: bool, monkeypatch):
    torch.manual_seed(0)
    model, loss_fn, inputs, target = build()
    monkeypatch.setenv(layer_reuse.ENV, "1" if reuse else "0")
    return autopart.compile(model, mesh, inputs, loss_fn=loss_fn, target=target, microbatches=2)


def _programs(c) -> list:
    return [ch.code for ch in c.program.chunks]


_FULL = pytest.mark.full     # two compiles each: the fast tier keeps one
CASES = [pytest.param("gpt", _gpt, autopart.Mesh(pp=2), id="gpt-pp2"),
         pytest.param("gpt", _gpt, autopart.Mesh(tp=2, pp=2), id="gpt-tp2xpp2", marks=_FULL),
         pytest.param("llama-meta", _llama, autopart.Mesh(pp=2), id="llama-meta-pp2", marks=_FULL),
         pytest.param("hf-bert", _bert, autopart.Mesh(tp=2, pp=2), id="hf-bert-tp2xpp2", marks=_FULL)]


@pytest.mark.parametrize("name,build,mesh", CASES)
def test_reuse_compiles_the_programs_of_the_full_trace(name, build, mesh, monkeypatch):
    full = _compile(build, mesh, False, monkeypatch)
    reused = _compile(build, mesh, True, monkeypatch)
    assert _programs(reused) == _programs(full)
    assert reused.digest() == full.digest()
    assert list(reused.program.params) == list(full.program.params)


@pytest.mark.parametrize("build", [pytest.param(_gpt, id="gpt"),
                                   pytest.param(_llama, id="llama-meta", marks=_FULL),
                                   pytest.param(_bert, id="hf-bert", marks=_FULL),
                                   pytest.param(_neox, id="neox", marks=_FULL)])
def test_reuse_really_splices(build):
    # the layers are traced twice, not four times: the splice is what is compared above
    model, loss_fn, inputs, target = build()
    calls = []
    real = layer_reuse.splice

    def spy(small, *a):
        calls.append(sum(1 for n in small.gm.graph.nodes if n.op == "call_function"))
        return real(small, *a)

    layer_reuse.splice, saved = spy, real
    try:
        program = capture(model, tuple(t[:2] for t in inputs), loss_fn=loss_fn, target=target[:2])
    finally:
        layer_reuse.splice = saved
    assert len(calls) == 1
    assert sum(1 for n in program.gm.graph.nodes if n.op == "call_function") > calls[0]


class _Block(nn.Module):
    def __init__(self, width: int, extra: bool = False):
        super().__init__()
        self.fc, self.extra = nn.Linear(width, width), extra

    def forward(self, x):
        y = torch.relu(self.fc(x))
        return y * 2 if self.extra else y


class _Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("blocks", [
    lambda: [_Block(8), _Block(8), _Block(8, extra=True), _Block(8)],   # one layer has an extra op
    lambda: [_Block(8, extra=True), _Block(8), _Block(8), _Block(8)],
], ids=["layer-2-extra-op", "layer-0-extra-op"])
def test_layers_that_differ_fall_back_to_the_full_trace(blocks):
    torch.manual_seed(0)
    model = _Stack(blocks())
    x = torch.randn(4, 8)
    assert layer_reuse.find_repeat(model) is not None     # same parameters: only behaviour differs
    reused = capture(model, (x,), layer_reuse=True)
    full = capture(model, (x,), layer_reuse=False)
    assert reused.gm.code == full.gm.code
    muls = [n for n in full.gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert len(muls) == 1
    with torch.no_grad():
        out = reused.gm(x)
        assert torch.equal(out[0] if isinstance(out, (tuple, list)) else out, model(x))


def test_different_widths_or_types_are_not_repeats():
    assert layer_reuse.find_repeat(_Stack([_Block(8), _Block(8), _Block(4), _Block(8)])) is None
    assert layer_reuse.find_repeat(_Stack([_Block(8), _Block(8), nn.Sequential(nn.Linear(8, 8)),
                                           _Block(8)])) is None
