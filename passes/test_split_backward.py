"""split_backward: the forward / input-gradient / weight-gradient programs of every chunk give
bitwise the outputs and gradients of the chunk's forward plus one autograd backward (today's
fused B), on the example GPT and Hugging Face GPT-2 (random weights, from a config)."""
from __future__ import annotations

import pytest
import torch

import autopart
from autopart.passes.split_backward import untraceable
from examples.gpt import GPT, GPTConfig, lm_loss

SCALE = 0.125     # the runtime's loss scale, 1 / (microbatches * dp)


def _gpt(dropout: float = 0.0):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=128, block_size=16,
                         dropout=dropout))


def _compile(model, schedule="zb-h1", v=1, pp=2, loss_fn=lm_loss, vocab=128, **kw):
    torch.manual_seed(1)
    tokens, targets = torch.randint(0, vocab, (8, 16)), torch.randint(0, vocab, (8, 16))
    c = autopart.compile(model, autopart.Mesh(pp=pp), (tokens,), loss_fn=loss_fn, target=targets,
                         microbatches=4, schedule=schedule, virtual_stages=v, **kw)
    return c, tokens[:2], targets[:2]


def _chunk_args(chunk, tokens, targets, seed):
    g = torch.Generator().manual_seed(seed)
    recvs = [torch.randn(r.concrete_shape(2, 16), generator=g) for r in chunk.recvs]
    feed = {"idx": tokens, "input_ids": tokens, "target": targets}
    grads = [] if chunk.is_last else [torch.randn(s.concrete_shape(2, 16), generator=g)
                                      for s in chunk.sends if s.differentiable]
    return recvs, [feed[n] for n in chunk.inputs], grads


def fused(chunk, recvs, inputs, grads, seed=0):
    """Today's path: the chunk's forward under autograd, then one backward."""
    params = dict(chunk.gm.named_parameters())
    for p in params.values():
        p.grad = None
    recvs = [r.clone().requires_grad_() for r in recvs]
    torch.manual_seed(seed)
    outs = tuple(chunk.gm(*recvs, *inputs))
    if chunk.is_last:
        torch.autograd.backward(outs[0] * SCALE)
    else:
        diff = [o for s, o in zip(chunk.sends, outs) if s.differentiable]
        torch.autograd.backward(diff, grads)
    return ([o.detach() for o in outs], [r.grad for r in recvs],
            {n: p.grad for n, p in params.items() if p.grad is not None})


def split(chunk, recvs, inputs, grads, seed=0):
    """The split path: forward program, then I, then W."""
    sb = chunk.backward
    torch.manual_seed(seed)
    with torch.no_grad():
        res = sb.forward(*recvs, *inputs)
        outs, saved = res[:sb.num_outputs], res[sb.num_outputs:]
        gouts = [torch.full((), SCALE)] if chunk.is_last else grads
        diff = [i for i, s in enumerate(chunk.sends) if s.differentiable]
        picked = gouts if chunk.is_last else [gouts[diff.index(i)] for i in sb.grad_outputs]
        i_out = sb.input_grad(*(saved[i] for i in sb.saved_for_input), *picked)
        n_in = sum(r.differentiable for r in chunk.recvs)
        in_grads, shared = i_out[:n_in], i_out[n_in:]
        p_grads = sb.weight_grad(*(saved[i] for i in sb.saved_for_weight), *shared)
    return list(outs), list(in_grads), dict(zip(sb.params, p_grads))


def assert_bitwise(chunk, tokens, targets, seed=0):
    args = _chunk_args(chunk, tokens, targets, seed)
    f_outs, f_in, f_params = fused(chunk, *args, seed=seed)
    s_outs, s_in, s_params = split(chunk, *args, seed=seed)
    where = f"chunk {chunk.chunk}"
    assert len(f_outs) == len(s_outs)
    for a, b in zip(f_outs, s_outs):
        assert torch.equal(a, b), f"{where}: forward output differs"
    for a, b in zip(f_in, s_in):
        if a is not None:
            assert torch.equal(a, b), f"{where}: input gradient differs (max {(a - b).abs().max()})"
    assert set(f_params) == set(s_params), f"{where}: {set(f_params) ^ set(s_params)}"
    for name, g in f_params.items():
        assert torch.equal(g, s_params[name]), f"{where}: {name} gradient differs"


@pytest.fixture(scope="module")
def zb_h1(tmp_path_factory):
    """The example GPT compiled for zb-h1 on pp=2, dumped."""
    dump = tmp_path_factory.mktemp("dump")
    c, tokens, targets = _compile(_gpt(), dump_dir=str(dump))
    return c, tokens, targets, dump


def test_gpt_split_is_bitwise_the_fused_backward(zb_h1):
    c, tokens, targets, _ = zb_h1
    assert c.program.split_backward == {0: "graphs", 1: "graphs"}
    for chunk in c.program.chunks:
        assert_bitwise(chunk, tokens, targets)


def test_gpt_v_placement_and_dropout_masks_are_bitwise_the_fused():
    """zb-v: chunks 0 and 3 on rank 0; with dropout the forward program draws the same masks."""
    c, tokens, targets = _compile(_gpt(dropout=0.1), "zb-v", 2)
    assert c.program.split_backward == {k: "graphs" for k in range(4)}
    for chunk in c.program.chunks:
        assert_bitwise(chunk, tokens, targets, seed=3)


def test_hf_gpt2_split_is_bitwise_the_fused_backward():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    from tests.workers.common import hf_loss
    c, tokens, targets = _compile(transformers.GPT2LMHeadModel(cfg), loss_fn=hf_loss, vocab=256)
    assert set(c.program.split_backward.values()) == {"graphs"}
    for chunk in c.program.chunks:
        assert_bitwise(chunk, tokens, targets)


def test_w_reads_only_what_it_needs_and_shares_with_i(zb_h1):
    c = zb_h1[0]
    sb = c.program.chunks[1].backward
    saved = len(sb.forward.graph.output_node().args[0]) - sb.num_outputs
    # W needs the inputs of the linears, not e.g. attention outputs or layer-norm statistics
    assert 0 < len(sb.saved_for_weight) < len(sb.saved_for_input) <= saved
    w_ops = {n.target for n in sb.weight_grad.graph.nodes if n.op == "call_function"}
    i_ops = {n.target for n in sb.input_grad.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.mm.default in w_ops
    # a layer norm's backward makes its input, weight and bias gradients in one op: I runs it
    # once and hands W the weight and bias gradients, instead of W running it again
    ln_bwd = torch.ops.aten.native_layer_norm_backward.default
    assert ln_bwd in i_ops and ln_bwd not in w_ops
    w_inputs = [n.name for n in sb.weight_grad.graph.nodes if n.op == "placeholder"]
    assert any(name.startswith("native_layer_norm_backward") for name in w_inputs)
    # the first chunk receives nothing: all of its backward is W
    first = c.program.chunks[0].backward
    assert not [n for n in first.input_grad.graph.nodes if n.op == "call_function"]


def test_programs_are_printed_and_dumped(zb_h1):
    c, dump = zb_h1[0], zb_h1[3]
    code = c.programs[1].chunks[0].code
    assert "input gradient (I)" in code and "weight gradient (W)" in code
    dumped = sorted(dump.glob("*split_backward/rank1_chunk1.py"))
    assert dumped and "weight gradient (W)" in dumped[0].read_text()


def test_no_split_without_zero_bubble_schedule():
    c, _, _ = _compile(_gpt(), "1f1b")
    assert c.program.split_backward is None
    assert all(ch.backward is None for ch in c.program.chunks)


def test_collectives_fall_back_to_autograd_with_the_reason():
    torch.manual_seed(1)
    tokens, targets = torch.randint(0, 128, (8, 16)), torch.randint(0, 128, (8, 16))
    c = autopart.compile(_gpt(), autopart.Mesh(pp=2, tp=2), (tokens,), loss_fn=lm_loss,
                         target=targets, microbatches=4, schedule="zb-h1")
    for chunk in c.program.chunks:
        assert chunk.backward.fallback and "tp collective" in chunk.backward.fallback
        assert untraceable(chunk.gm) == chunk.backward.fallback
