"""fp8_linears: which linears precision="fp8" turns into FP8 GEMMs (the documented rule, by
dataflow), how a tensor-parallel shard's op learns its split dims, the split backward of the
zero-bubble schedules, and what compile refuses. No processes; the numerics against the written-out
recipe are tests/test_fp8.py's."""
from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn

import autopart
from autopart.errors import AutopartError, module_path
from autopart.ops import fp8 as fp8_ops
from autopart.passes.test_split_backward import assert_bitwise
from examples.gpt import GPT, GPTConfig, lm_loss


def _gpt(n_embd=32):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=n_embd, vocab_size=128, block_size=16))


def _compile(model=None, mesh=None, microbatches=2, **kw):
    torch.manual_seed(1)
    tokens, targets = torch.randint(0, 128, (8, 16)), torch.randint(0, 128, (8, 16))
    c = autopart.compile(model or _gpt(), mesh or autopart.Mesh(), (tokens,), loss_fn=lm_loss,
                         target=targets, microbatches=microbatches, precision="fp8", **kw)
    mbs = 8 // microbatches
    return c, tokens[:mbs], targets[:mbs]


def _fp8_nodes(c, fn=None):
    return [n for ch in c.program.chunks for n in ch.gm.graph.nodes
            if n.op == "call_function" and n.target in ((fn,) if fn else
                                                        (fp8_ops.fp8_linear, fp8_ops.fp8_linear_tp))]


def _modules(c, names):
    nodes = {n.name: n for n in c.program.gm.graph.nodes}
    return sorted(module_path(nodes[n]) for n in names)


def test_auto_keeps_the_first_and_last_linear_in_bf16():
    """4 layers x 4 linears + the tied lm head: the first (block 0's c_attn: no linear upstream)
    and the last (the head: no linear downstream) stay bf16, the other 15 run FP8."""
    c, _, _ = _compile()
    plan = c.program.fp8
    assert _modules(c, plan.kept) == ["lm_head", "transformer.h.0.attn.c_attn"], plan.kept
    assert len(plan.converted) == 15 and len(_fp8_nodes(c, fp8_ops.fp8_linear)) == 15
    assert not any(n.target is torch.ops.aten.linear.default and n.name in plan.converted
                   for ch in c.program.chunks for n in ch.gm.graph.nodes)
    text = c.explain()
    assert "fp8 (tensorwise scaling, fp8_linears=auto): 15 of 17 linears" in text, text
    assert "bf16: lm_head (last: no linear downstream)" in text, text


def test_all_converts_every_linear_and_small_ones_stay_bf16():
    c, _, _ = _compile(config=autopart.Config(precision="fp8", fp8_linears="all"))
    assert len(c.program.fp8.converted) == 17 and not c.program.fp8.kept
    c, _, _ = _compile(_gpt(n_embd=24))      # 24 is no multiple of 16: every linear is "small"
    assert not c.program.fp8.converted
    assert all(why.startswith(("small", "first", "last")) for why in c.program.fp8.kept.values())
    assert sum(why.startswith("small") for why in c.program.fp8.kept.values()) == 15


class _MatmulT(nn.Module):
    """Linears written as x @ w.T and einsum (split_tensor_parallel/linears.py's forms)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 32)
        self.w1 = nn.Parameter(torch.randn(64, 32) / 8)
        self.w2 = nn.Parameter(torch.randn(64, 64) / 8)
        self.w3 = nn.Parameter(torch.randn(64, 128) / 8)

    def forward(self, idx):
        h = torch.relu(self.emb(idx) @ self.w1.T)
        h = torch.relu(torch.einsum("bsi,io->bso", h, self.w2))
        return h @ self.w3


def test_matmul_forms_are_linears_by_dataflow():
    c, _, _ = _compile(_MatmulT(), config=autopart.Config(precision="fp8", fp8_linears="all"))
    nodes = _fp8_nodes(c)
    assert len(nodes) == 3, c.program.chunks[0].code
    assert sorted(n.args[4] for n in nodes) == [0, 1, 1]    # w[N, K] once, w[K, N] twice


@pytest.fixture(scope="module")
def tp2():
    # overlap=False: the kept first linear stays copy_to_tp + linear, whose backward runs
    # outside autocast by hand here (copy_linears_tp's would need the executor's casts)
    return _compile(mesh=autopart.Mesh(tp=2), overlap=False)


def test_tensor_parallel_shards_reduce_the_amaxes_over_split_dims(tp2):
    """tp=2: the row-parallel linears (attention's and the MLP's c_proj) contract a split dim,
    the column-parallel ones (c_attn, c_fc) split their output features; explain counts the
    max all-reduces (tensorwise: the 15 weights' amaxes in one at the chunk's start, then x's
    per row-parallel linear in forward and the gradient's per column-parallel one in backward)."""
    c, _, _ = tp2
    nodes = _fp8_nodes(c, fp8_ops.fp8_linear_tp)
    assert len(nodes) == 15 and not _fp8_nodes(c, fp8_ops.fp8_linear)
    splits = sorted((n.args[5], n.args[6]) for n in nodes)
    assert splits == [(False, True)] * 7 + [(True, False)] * 8, splits
    rows = [r for r in c.to_json()["fp8"] if r["fp8"]]
    assert sum(r["amax_all_reduces"] for r in rows) == 8 + 7
    assert all(r["weight_amax_batched"] for r in rows)
    assert sum(r["amax_elements"] for r in rows) == 15 + 8 + 7
    assert "amax max-all-reduces over tp per microbatch: 16 (1 of the weights' 15 amaxes, one " \
           "per chunk at its start; 15 of activations; 30 fp32 elements" in c.explain()


class _Collectives:
    """torch.distributed's collectives as one tp rank sees them when the other holds the same
    tensors (no data moves), each max all-reduce counted: runs a rank's tp program alone."""

    def __init__(self, monkeypatch):
        import torch.distributed as dist
        from autopart.ops import tp
        self.max_sizes: list[int] = []
        self.max_op = dist.ReduceOp.MAX
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(tp, "_all_gather_into", lambda out, x, **kw: self._done(
            out.copy_(torch.cat([x] * (out.shape[0] // x.shape[0]))), kw))
        monkeypatch.setattr(tp, "_reduce_scatter_into", lambda out, x, **kw: self._done(
            out.copy_(x[:out.shape[0]]), kw))

    def all_reduce(self, t, op=None, group=None, async_op=False):
        if op == self.max_op:
            self.max_sizes.append(t.numel())
        return self._done(t, dict(async_op=async_op))

    @staticmethod
    def _done(_, kw):
        return type("Work", (), {"wait": lambda self: None})() if kw.get("async_op") else None


def _run_rank0(chunk, tokens, targets):
    """Rank 0's chunk forward and backward (as the runtime runs it: under bf16 autocast);
    (loss, {parameter: gradient})."""
    from autopart.ops.tp import TPComm
    for m in chunk.gm.modules():
        if isinstance(m, TPComm):
            m.bind(object(), 0)
    feed = {"idx": tokens, "target": targets}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunk.gm(*(feed[n] for n in chunk.inputs))[0]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in chunk.gm.named_parameters()}


def _unbatched(chunk):
    """`chunk` with every FP8 linear reducing its own weight's amax (the op's w_amax left out),
    as before batch_weight_amaxes."""
    import dataclasses
    gm = copy.deepcopy(chunk.gm)
    for n in list(gm.graph.nodes):
        if n.target is fp8_ops.fp8_linear_tp:
            n.args = n.args[:8]
    for n in reversed(list(gm.graph.nodes)):
        if n.op == "call_function" and not n.users and n.target in (
                operator.getitem, fp8_ops.fp8_weight_amaxes_tp):
            gm.graph.erase_node(n)
    gm.recompile()
    return dataclasses.replace(chunk, gm=gm)


def test_the_weights_amaxes_are_one_all_reduce_per_chunk(tp2, monkeypatch):
    """Rank 0 of tp=2 run alone (collectives stubbed, counted): one forward and backward does
    16 max all-reduces (1 batch of the 15 weights' amaxes, 8 row-parallel inputs', 7
    column-parallel gradients'), explain's count, where each linear reducing its own weight's
    amax did 22 (15 + 7 in forward, 7 in backward); loss and gradients bitwise the same."""
    c, tokens, targets = tp2
    chunk = c.programs.instantiate(0).chunks[0]
    counted = _Collectives(monkeypatch)
    batched = _run_rank0(chunk, tokens, targets)
    loss_peak = tokens.numel()      # the vocab-parallel cross-entropy's max over tp, once
    assert counted.max_sizes == [15] + [1] * 8 + [loss_peak] + [1] * 7, counted.max_sizes
    counted.max_sizes.clear()
    before = _run_rank0(_unbatched(c.programs.instantiate(0).chunks[0]), tokens, targets)
    assert len(counted.max_sizes) == 22 + 1, counted.max_sizes
    assert torch.equal(batched[0], before[0])
    assert batched[1].keys() == before[1].keys()
    for name, g in batched[1].items():
        assert g is not None and torch.equal(g, before[1][name]), name


def test_sequence_parallel_gathers_the_column_inputs_in_fp8():
    """tp=2 with sequence parallelism: the column-parallel linears read a sequence shard, which
    fp8_gather_linear_sp casts to e4m3 (x's amax reduced over tp) and gathers as FP8; the two
    kept bf16 (block 0's c_attn, the head) stay gather_linear_sp. Explain counts the x amaxes
    too. Its numerics: tests/workers/fp8.py's tp_linear_problems."""
    from autopart.ops.tp import gather_linear_sp
    c, _, _ = _compile(mesh=autopart.Mesh(tp=2), sequence_parallel=True)
    assert len(_fp8_nodes(c, fp8_ops.fp8_gather_linear_sp)) == 7
    assert len(_fp8_nodes(c, fp8_ops.fp8_linear_tp)) == 8
    kept = _fp8_nodes(c, gather_linear_sp)
    assert _modules(c, [n.name for n in kept]) == ["lm_head", "transformer.h.0.attn.c_attn"]
    assert "amax max-all-reduces over tp per microbatch: 23 (1 of the weights' 15 amaxes, one " \
           "per chunk at its start; 22 of activations" in c.explain(), c.explain()


def test_zero_bubble_splits_the_fp8_backward_bitwise():
    """zb-h1 (tp=1): the FP8 linears trace into the I and W programs (_scaled_mm in each),
    which give bitwise the fused backward's gradients."""
    # microbatch 2: the shape test_split_backward's helpers feed
    c, tokens, targets = _compile(mesh=autopart.Mesh(pp=2), schedule="zb-h1", microbatches=4)
    assert c.program.split_backward == {0: "graphs", 1: "graphs"}
    first, second = c.program.chunks     # chunk 0 receives nothing: its I program is empty
    assert "_scaled_mm" in second.backward.input_grad.code
    for chunk in (first, second):
        assert "_scaled_mm" in chunk.backward.weight_grad.code
        assert_bitwise(chunk, tokens, targets)


@pytest.mark.parametrize("kw, named", [
    (dict(mesh=autopart.Mesh(cp=2)), "cp=2"),
    (dict(config=autopart.Config(precision="fp8", fp8_scaling="rowwise", zero=3),
          mesh=autopart.Mesh(dp=2)), "zero=3 with fp8_scaling='rowwise'"),
    (dict(config=autopart.Config(precision="fp8", fp8_scaling="rowwise",
                                 sequence_parallel=True), mesh=autopart.Mesh(tp=2)),
     "sequence_parallel=True with fp8_scaling='rowwise'"),
    (dict(config=autopart.Config(precision="fp8", compile=True)), "compile=True"),
])
def test_untested_combinations_are_refused_by_name(kw, named):
    with pytest.raises(AutopartError, match=rf"precision='fp8' is not supported with .*"
                                            rf"{named.replace('(', '[(]')}.*\n  remedy"):
        _compile(**kw)
