"""parallelize(compile=True): chunk programs through Inductor, one artifact per distinct layer.

Equivalence: every compiled case trains 3 steps against a deep copy of the plain model on the
same global batch (tests/workers/equivalence.equivalence: losses, first-step gradients, clipped
norm, parameters, full state dict) with the same tolerance as eager runs, rtol 1e-5 / atol 1e-6
(Adam parameters atol 1e-5). Inductor fuses kernels and so sums in another order than the plain
model, but the sums here are short (width 32, a few microbatches): measured errors stay below
5e-7, round-off of fp32 values up to ~1, the same size as the eager pipeline's own reordering.
A wrong artifact reused for a layer (wrong parameters, wrong shapes) is an O(1) error.

Fast tier (no Inductor compile): what would be compiled, counted from the graphs; the CLI flag;
bad arguments. Full tier: Inductor itself (a cold compile is tens of seconds per artifact on a
2-core machine).

    python -m pytest -q -m "not full" tests/test_inductor.py
    python -m pytest -q tests/test_inductor.py
"""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autopart
from autopart.errors import AutopartError
from examples.gpt import GPT, GPTConfig, lm_loss
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.workers.inductor import CompiledCase, compiled_cases
from tests.workers.layers import Unnamed

GPT_FILE = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"


def _gpt(n_layer: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=g)
    y = torch.randint(0, 64, (4, 16), generator=g)
    return model, x, y


# -- fast: what would be compiled ---------------------------------------------------------------

@pytest.mark.parametrize("mesh,per_layer", [(dict(pp=1), 1), (dict(tp=2), 5)])
def test_distinct_artifacts_do_not_grow_with_depth(mesh, per_layer):
    """A GPT block is one segment, the same code in every block; with tp=2 five (the
    collectives before and after attention and the MLP cut it, and the layer boundary cuts the
    norm before the first from the previous block's tail). So 2 and 8 layers compile the same
    artifacts, and only the calls grow: 6 more blocks, 6 * per_layer more calls."""
    from autopart.runtime.compiled import describe
    rows = {}
    for n in (2, 8):
        model, x, y = _gpt(n)
        compiled = autopart.compile(model, autopart.Mesh(**mesh), (x,), loss_fn=lm_loss, target=y)
        rows[n] = describe(compiled)[0]
        every_layer = [a for a in rows[n]["artifacts"]
                       if {f"transformer.h.{i}" for i in range(n)} <= set(a["labels"])]
        assert len(every_layer) == per_layer, rows[n]
    assert rows[8]["segments"] - rows[2]["segments"] == 6 * per_layer
    assert rows[2]["distinct"] == rows[8]["distinct"]
    if per_layer == 1:    # the embeddings, the block, the head with the loss
        assert (rows[2]["segments"], rows[2]["distinct"]) == (4, 3), rows[2]


UNNAMED = [f"layer.{i}" for i in range(4)]


@pytest.mark.parametrize("pp", [1, 2])
def test_layers_no_module_names_are_one_artifact_each(pp):
    """The segments follow the layers found by dataflow (the nodes' layer marks), not module
    paths: each of the 4 unnamed layers is one segment and all 4 share one artifact (matched
    by module path, no op was a layer's and each rank compiled its chunk as one segment)."""
    from autopart.runtime.compiled import describe
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    compiled = autopart.compile(Unnamed(), autopart.Mesh(pp=pp), (x,), microbatches=pp)
    assert compiled.plan.chunk_layers == tuple(tuple(UNNAMED[c * 4 // pp:(c + 1) * 4 // pp])
                                               for c in range(pp))
    rows = describe(compiled)
    for row, layers in zip(rows, compiled.plan.chunk_layers):
        shared = [a for a in row["artifacts"] if a["labels"] == list(layers)]
        assert len(shared) == 1 and shared[0]["uses"] == len(layers), row
    assert sum(row["segments"] for row in rows) == 6, rows      # + the input and the head


def _cli(argv, capsys):
    from autopart.cli.compile import add_compile_command, run_compile
    parser = argparse.ArgumentParser(prog="autopart")
    add_compile_command(parser.add_subparsers(dest="command"))
    code = run_compile(parser.parse_args(["compile", *argv]))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_compile_flag(capsys):
    base = [f"{GPT_FILE}:GPT", "--config", "tiny,n_layer=4", "--mesh", "pp=2", "--batch", "4"]
    code, out, err = _cli(base + ["--compile", "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)["inductor"]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:     # each pipeline rank: its 2 blocks share one artifact, plus its end part
        assert (r["segments"], r["distinct"]) == (3, 2), r
    code, out, err = _cli(base + ["--compile"], capsys)
    assert code == 0, err
    assert "rank 0: 3 segments, 2 distinct artifacts" in out
    assert "2 uses (transformer.h.0 .. transformer.h.1)" in out
    code, out, _ = _cli(base, capsys)
    assert "distinct artifacts" not in out


@pytest.mark.parametrize("kwargs,message", [
    (dict(compile="yes"), "compile='yes' is not one of False, True, 'cudagraphs'"),
])
def test_bad_compile_arguments(kwargs, message):
    model, x, y = _gpt(2)
    with pytest.raises(AutopartError, match=message.replace("(", r"\(").replace(")", r"\)")):
        autopart.parallelize(model, autopart.Mesh(pp=1), (x,), loss_fn=lm_loss, target=y, **kwargs)


# -- full: Inductor ---------------------------------------------------------------------------

C = CompiledCase
CASES_2 = [
    C("pp2-1f1b", model="gpt4", pp=2, microbatches=2, batch=4),
    C("pp2-gpipe", model="gpt4", pp=2, schedule="gpipe", microbatches=2, batch=4),
    C("pp2-interleaved", model="gpt4", pp=2, schedule="interleaved-1f1b", virtual_stages=2,
      microbatches=4),
    C("pp2-zb-h1", model="gpt4", pp=2, schedule="zb-h1", microbatches=4),        # I/W programs
    C("pp2-zb-v", model="gpt4", pp=2, schedule="zb-v", virtual_stages=2, microbatches=4),
    C("pp2-dualpipe-v", model="gpt4", pp=2, schedule="dualpipe-v", virtual_stages=2,
      microbatches=4),
    C("pp2-recompute-full", model="gpt4", pp=2, microbatches=2, recompute="full"),
    C("pp2-recompute-selective", model="gpt4", pp=2, microbatches=2, recompute="selective"),
    C("tp2", model="gpt4", tp=2, batch=4),
    C("dp2", model="gpt4", dp=2, batch=4, optim="adam"),
    C("switch-dp2-ep2", model="switch", dp=2, ep=2, microbatches=2),
]
CASES_4 = [
    C("pp2xtp2", model="gpt4", pp=2, tp=2, microbatches=2, batch=4),
    C("pp2xdp2-zb-h1", model="gpt4", pp=2, dp=2, schedule="zb-h1", microbatches=2),
    C("switch-dp2-ep2xpp2", model="switch", dp=2, ep=2, pp=2, microbatches=2),
]
SPAWN_S = 1800.0      # cold: each distinct artifact tens of seconds on a loaded 2-core machine


@pytest.mark.full
@pytest.mark.parametrize("case", CASES_2 + CASES_4, ids=lambda c: c.name)
def test_compiled_matches_plain_model(case, spawn_cache):
    cases = CASES_2 if case.world == 2 else CASES_4
    ranks = run_group(spawn_cache, ("inductor", case.world), cases, timeout=SPAWN_S,
                      rank_fn=compiled_cases)[case.name]
    assert_all_ranks_equal_plain(case, ranks)
    for r in ranks:
        assert r["artifacts"] >= 1 and not r["fallbacks"], r
        # torch's own count: one AOTAutograd compilation per artifact of ours, no recompiles
        assert r["aot_compiles"] == r["artifacts"], r
        assert "s compiling" in r["explain"]


@pytest.mark.full
def test_one_artifact_per_distinct_layer(single_process_group, tmp_path):
    """2 and 6 layers: the same three artifacts (embeddings, block, head and loss), counted by
    torch's AOTAutograd counter too; the 6-layer run compiles nothing new once the 2-layer
    one has (the block's artifact is keyed by its code, not its parameters): in an empty
    Inductor cache directory the 2-layer run lowers a forward and a backward graph per
    artifact and the 6-layer run loads all three from the cache (a warm start)."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    with temporary_cache_dir(str(tmp_path / "inductor")):
        for n, lowered, cached in ((2, 6, 0), (6, 0, 3)):
            model, x, y = _gpt(n)
            before = counters["aot_autograd"]["total"]
            pm = autopart.parallelize(model, autopart.Mesh(pp=1), (x,), loss_fn=lm_loss,
                                      target=y, compile=True)
            pm.train_step(x, target=y)
            pm.train_step(x, target=y)     # the second step compiles nothing
            report = pm.inductor.report
            assert (report.segments, report.artifacts) == (n + 2, 3), report
            assert (report.graphs, report.cached) == (lowered, cached), report
            assert counters["aot_autograd"]["total"] - before == 3
            assert (f"inductor (this rank): {n + 2} segments, 3 compiled artifacts ({lowered} "
                    f"forward/backward graphs lowered, {cached} artifacts from Inductor's "
                    "cache)") in pm.explain()


@pytest.mark.full
def test_unnamed_layers_compile_once(single_process_group):
    """Inductor compiles the 4 unnamed layers (ParameterLists, functional ops) once: 3
    artifacts (the input linear, the layer, the head with the loss) for 6 segment calls,
    AOTAutograd's own count agreeing; 2 steps equal to the plain model (losses, the accumulated gradients)."""
    import copy
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model, x = Unnamed(), torch.randn(4, 16)
    plain = copy.deepcopy(model)
    before = counters["aot_autograd"]["total"]
    pm = autopart.parallelize(model, autopart.Mesh(pp=1), (x,), compile=True)
    losses = [pm.train_step(x) for _ in range(2)]
    report = pm.inductor.report
    assert (report.segments, report.artifacts, report.fallbacks) == (6, 3, {}), report
    assert counters["aot_autograd"]["total"] - before == 3
    ref = plain(x)
    ref.backward()
    for loss in losses:
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(plain.named_parameters())
    for name, p in pm.named_parameters():     # two steps accumulated: twice the plain's
        torch.testing.assert_close(p.grad, 2 * grads[name].grad, rtol=1e-5, atol=1e-6)


@torch.library.custom_op("autopart_test::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@doubled.register_fake
def _(x):
    return torch.empty_like(x)


doubled.register_autograd(lambda ctx, g: g * 2)


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class _Odd(_Block):
    def forward(self, h):
        return h + doubled(self.lin(h))


class _WithOdd(nn.Module):
    """Four blocks, the third calling an op Inductor has no lowering for."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(width), _Block(width), _Odd(width), _Block(width)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


@pytest.mark.full
def test_uncompilable_layer_runs_eager_with_one_warning(single_process_group):
    import copy
    from torch._inductor.lowering import lowerings, register_lowering
    op = torch.ops.autopart_test.doubled.default

    def no_lowering(x):
        raise NotImplementedError("autopart_test::doubled has no Inductor lowering")

    register_lowering(op)(no_lowering)
    try:
        torch.manual_seed(0)
        model, x = _WithOdd(), torch.randn(4, 16)
        plain = copy.deepcopy(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = autopart.parallelize(model, autopart.Mesh(pp=1), (x,), compile=True)
            losses = [pm.train_step(x) for _ in range(2)]
    finally:
        lowerings.pop(op, None)
    ours = [str(w.message) for w in caught if "Inductor could not compile" in str(w.message)]
    assert len(ours) == 1, ours
    assert "blocks.2" in ours[0] and "runs eager" in ours[0] and "doubled" in ours[0]
    assert list(pm.inductor.report.fallbacks) == ["blocks.2"]
    ref = plain(x)
    ref.backward()
    torch.testing.assert_close(losses[0], ref.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(plain.named_parameters())
    for name, p in pm.named_parameters():     # two steps accumulated: twice the plain's
        torch.testing.assert_close(p.grad, 2 * grads[name].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.full
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", [True, "cudagraphs"])
def test_cuda_compiled_matches_plain(single_process_group, mode):
    import copy
    model, x, y = _gpt(2)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    plain = copy.deepcopy(model)
    pm = autopart.parallelize(model, autopart.Mesh(pp=1), (x,), loss_fn=lm_loss, target=y,
                              compile=mode)
    loss = pm.train_step(x, target=y)
    ref = lm_loss(plain(x), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.full
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graphs_over_steps_microbatches_and_layer_reuse(single_process_group, precision):
    """compile="cudagraphs" against the plain model over 4 steps (step 1 warms the CUDA graph
    trees up, step 2 records, 3 and 4 replay), 2 microbatches, 3 repeats of one block sharing
    one artifact, SGD stepping the weights in place between steps: every step's loss (all kept
    until the end: a replay must not overwrite a returned loss) and gradients, then two
    train_steps accumulated without zeroing (a replay must not overwrite the .grad kept from
    the step before)."""
    import copy
    model, x, y = _gpt(3)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    plain = copy.deepcopy(model)
    pm = autopart.parallelize(model, autopart.Mesh(pp=1), (x,), loss_fn=lm_loss, target=y,
                              microbatches=2, precision=precision, compile="cudagraphs")
    from autopart.runtime.compiled import describe
    assert 3 in {a["uses"] for a in describe(pm.compiled)[0]["artifacts"]}   # the 3 blocks' one
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    tol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
    plain_params = dict(plain.named_parameters())
    losses, refs = [], []
    for _ in range(4):
        losses.append(pm.train_step(x, target=y))
        with torch.autocast("cuda", torch.bfloat16, enabled=precision == "bf16"):
            ref = lm_loss(plain(x), y)
        ref.backward()
        refs.append(ref.detach().float())
        for name, p in pm.named_parameters():
            torch.testing.assert_close(p.grad, plain_params[name].grad, **tol)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    torch.testing.assert_close(torch.stack(losses), torch.stack(refs), **tol)
    pm.train_step(x, target=y)          # accumulated: two steps' gradients, no step between
    pm.train_step(x, target=y)
    with torch.autocast("cuda", torch.bfloat16, enabled=precision == "bf16"):
        ref = lm_loss(plain(x), y)
    ref.backward()
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, 2 * plain_params[name].grad, **tol)


def test_cudagraphs_marks_parameters_static():
    """compile="cudagraphs": a segment's parameter arguments reach Inductor's forward graph as
    static inputs (AOTAutograd's static_input_indices, which compile_fx hands on as
    static_input_idxs), so a CUDA graph replay reads the weights in place instead of copying
    them; a plain tensor argument is not static. Checked on the CPU through compile_fx's inner
    compile (what cudagraphify receives), not with a CUDA graph."""
    import torch.fx as fx
    from torch._inductor import compile_fx as inductor_compile_fx
    from autopart.runtime.compiled import (CompileReport, SegmentCompiler, _inductor,
                                           static_positions)

    class Block(nn.Module):
        def forward(self, x, w, b):
            return (torch.relu(x @ w + b) * 2).sum()

    SegmentCompiler(cudagraphs=True)
    x = torch.randn(4, 8, requires_grad=True)
    w, b = nn.Parameter(torch.randn(8, 8)), torch.randn(8)
    assert static_positions((2,), (x, w, b)) == (1, 2)    # w a Parameter, b the chunk's buffer
    seen, real = [], inductor_compile_fx.compile_fx_inner

    def record(gm, example_inputs, **kw):
        seen.append((kw.get("is_backward", False), list(kw["static_input_idxs"])))
        return real(gm, example_inputs, **kw)

    inductor_compile_fx.compile_fx_inner = record
    try:
        fn = _inductor(fx.symbolic_trace(Block()), [x, w, b], {}, CompileReport(), (1, 2))
    finally:
        inductor_compile_fx.compile_fx_inner = real
    forward = [idx for backward, idx in seen if not backward]
    assert forward == [[1, 2]], seen
    out = fn(x, w, b)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, Block()(x, w, b))


def test_cudagraphs_step_plumbing(single_process_group, monkeypatch):
    """compile="cudagraphs" without a GPU, Inductor replaced by the segment graph itself: each
    train_step marks the CUDA graph trees' step beginning once, before its first segment call;
    every block segment gets its parameters as static positions; the step leaves .grad (and the
    returned loss) in tensors of its own, cloned after the last backward; and the results are
    the plain model's over 3 steps of 2 microbatches plus an accumulated step."""
    import copy
    from autopart.runtime import compiled as compiled_mod

    calls, statics = [], []

    def eager(gm, args, options, report, static=()):
        assert options == {"triton.cudagraphs": True}
        statics.append((static, [isinstance(args[i], nn.Parameter) for i in static]))
        report.graphs += 1

        def run(*a):
            calls.append("segment")
            return gm(*a)
        return run

    monkeypatch.setattr(compiled_mod, "_inductor", eager)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin",
                        lambda: calls.append("mark"))
    model, x, y = _gpt(2)
    plain = copy.deepcopy(model)
    pm = autopart.parallelize(model, autopart.Mesh(pp=1), (x,), loss_fn=lm_loss, target=y,
                              microbatches=2, compile="cudagraphs")
    for step in range(3):
        calls.clear()
        loss = pm.train_step(x, target=y)
        assert calls[0] == "mark" and calls.count("mark") == 1, calls[:3]
        assert calls.count("segment") > 2
        ref = lm_loss(plain(x), y)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        grads = dict(plain.named_parameters())
        for name, p in pm.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6)
            p.grad = None
        plain.zero_grad()
    assert statics and all(all(is_param) for _, is_param in statics)
    assert any(len(static) >= 4 for static, _ in statics)     # a block: its weights static
    pm.train_step(x, target=y)
    pm.train_step(x, target=y)
    lm_loss(plain(x), y).backward()
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, 2 * dict(plain.named_parameters())[name].grad,
                                   rtol=1e-5, atol=1e-6)


def test_an_artifact_backward_runs_as_input_then_weight_gradients():
    """A zero-bubble schedule runs a chunk it could not split at compile time as two autograd
    calls: I (input gradients, retain_graph=True) then W (weight gradients). Inductor's donated
    buffers refused the second call (found by the composition matrix: zb-h1 with bf16, or with
    experts); both halves must equal eager autograd's."""
    import torch.fx as fx
    from autopart.runtime.compiled import SegmentCompiler, _inductor, CompileReport

    class Block(nn.Module):
        def forward(self, x, w):
            return (torch.relu(x @ w) * 2).sum()

    SegmentCompiler()            # what a compiled ParallelModel sets up in its process
    gm = fx.symbolic_trace(Block())
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    out = _inductor(gm, [x, w], {}, CompileReport())(x, w)
    out = out[0] if isinstance(out, (tuple, list)) else out
    gx, = torch.autograd.grad(out, [x], retain_graph=True)
    gw, = torch.autograd.grad(out, [w])
    ex, ew = torch.autograd.grad(Block()(x, w), [x, w])
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
