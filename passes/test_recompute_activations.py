"""recompute_activations: the regions it finds, the program it emits, and bitwise equality with
the run without recomputation (spawned Gloo ranks, tests/workers/memory.py).

Fast tier: python -m pytest -m "not full" passes/test_recompute_activations.py
"""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

import autopart
from autopart.errors import AutopartError
from examples.gpt import GPT, GPTConfig, lm_loss
from tests.workers.memory import MemCase

CFG = GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=128, block_size=16)


def _compile(recompute="none", model=None, **kw):
    torch.manual_seed(0)
    x = torch.randint(0, 128, (8, 16))
    return autopart.compile(model or GPT(CFG), autopart.Mesh(pp=kw.pop("pp", 2)), (x,),
                            loss_fn=lm_loss, target=x, microbatches=4, recompute=recompute, **kw)


def _checkpoints(gm):
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.utils.checkpoint.checkpoint]


def test_full_moves_each_layer_into_a_checkpointed_submodule():
    c = _compile("full")
    chunk = c.programs[0].chunks[0]
    calls = _checkpoints(chunk.gm)
    assert [n.args[0].target for n in calls] == ["recompute_transformer_h_0",
                                                 "recompute_transformer_h_1"]
    assert all(n.kwargs == {"use_reentrant": False} for n in calls)
    assert "torch.utils.checkpoint.checkpoint(recompute_transformer_h_0" in chunk.code
    # parameters stay on the chunk under the plain model's names
    assert "transformer.h.0.attn.c_attn.weight" in dict(chunk.gm.named_parameters())
    sub = chunk.gm.get_submodule("recompute_transformer_h_0")
    assert not list(sub.parameters())
    plan = c.program.recompute
    assert plan.choices[(0, "transformer.h.0")] == "full"
    assert set(plan.regions[1]) == {"recompute_transformer_h_2", "recompute_transformer_h_3"}


def test_a_layer_no_module_names_owns_its_checkpoint_call():
    """Layers found by dataflow that no module names (tests.workers.layers.Unnamed: layer.0 ..
    layer.3) are recomputed each, and the checkpoint call carries its layer's mark, so
    analysis.layer_of (the memory table, ZeRO-3's gathers) sees the call as the layer's; by its
    module path alone (the root's) it was no layer's."""
    from autopart.analysis import layer_of
    from tests.workers.layers import Unnamed
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    c = autopart.compile(Unnamed(), autopart.Mesh(pp=1), (x,), recompute="full")
    chunk = c.programs[0].chunks[0]
    assert chunk.layers == tuple(f"layer.{i}" for i in range(4))
    assert [layer_of(n, set(chunk.layers)) for n in _checkpoints(chunk.gm)] == list(chunk.layers)


def test_selective_recomputes_only_the_attention_core():
    c = _compile("selective")
    chunk = c.programs[1].chunks[0]
    calls = _checkpoints(chunk.gm)
    assert len(calls) == 2
    sub = chunk.gm.get_submodule(calls[0].args[0].target)
    ops = [n.target for n in sub.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.scaled_dot_product_attention.default]


@pytest.mark.full
def test_selective_finds_matmul_softmax_matmul_by_dataflow():
    """HF GPT-2 with eager attention: matmul, scale, causal where, softmax, dropout, matmul."""
    transformers = pytest.importorskip("transformers")
    from tests.workers.common import hf_loss
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 16))
    c = autopart.compile(transformers.GPT2LMHeadModel(cfg), autopart.Mesh(), (x,),
                         loss_fn=hf_loss, target=x, recompute="selective")
    gm = c.programs[0].chunks[0].gm
    calls = _checkpoints(gm)
    assert len(calls) == 2, c.program.recompute.skipped
    sub = gm.get_submodule(calls[0].args[0].target)
    names = [getattr(n.target, "__name__", "") for n in sub.graph.nodes if n.op == "call_function"]
    assert names[0].startswith("matmul") and names[-1].startswith("matmul"), names
    assert any(n.startswith("softmax") for n in names), names
    assert not any(n.startswith("linear") or n.startswith("addmm") for n in names), names


def test_recomputed_chunk_is_bitwise_equal_in_process_with_dropout():
    """One chunk, none vs full vs selective, dropout 0.2: the same loss and grads, bit for bit."""
    from autopart.passes.recompute_activations import rewrite_chunk
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=128, block_size=16, dropout=0.2)
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 16))
    c = autopart.compile(GPT(cfg), autopart.Mesh(), (x,), loss_fn=lm_loss, target=x)
    chunk = c.programs[0].chunks[0]
    results = {}
    for mode in ("none", "selective", "full"):
        gm = rewrite_chunk(chunk, {layer: mode for layer in chunk.layers})[0].gm
        for p in gm.parameters():
            p.grad = None
        torch.manual_seed(7)
        loss = gm(x, x)[0]
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad.clone() for n, p in gm.named_parameters()})
    for mode in ("selective", "full"):
        assert torch.equal(results[mode][0], results["none"][0]), mode
        for n, g in results["none"][1].items():
            assert torch.equal(results[mode][1][n], g), (mode, n)


def test_auto_fits_the_budget_choosing_the_cheapest():
    none = _compile("none")
    full = _compile("full")
    lo, hi = max(full.memory[r]["total"] for r in range(2)), max(none.memory[r]["total"] for r in range(2))
    assert lo < hi
    c = _compile("auto", memory_budget=(lo + hi) // 2)
    kinds = set(c.program.recompute.choices.values())
    assert kinds - {"none"}, "auto recomputed nothing though none does not fit"
    assert kinds != {"full"}, "auto recomputed everything though less fits"
    assert all(c.memory[r]["total"] <= (lo + hi) // 2 for r in range(2))
    assert set(_compile("auto", memory_budget=hi * 2).program.recompute.choices.values()) == {"none"}


def test_the_budget_counts_zero1_state_and_bf16_activations():
    """The budget check counts what the memory table counts: ZeRO-1's 1/dp slices of optimizer
    state (a budget that zero=1 fits, zero=0 does not) and activations under bf16 autocast."""
    torch.manual_seed(0)
    x = torch.randint(0, 128, (8, 16))

    def compile_(budget=None, **kw):
        return autopart.compile(GPT(CFG), autopart.Mesh(pp=2, dp=2), (x,), loss_fn=lm_loss,
                                target=x, microbatches=2, memory_budget=budget, **kw)
    for kw in (dict(zero=1), dict(precision="bf16")):
        table = compile_(**kw).memory
        fits = max(table[r]["total"] for r in range(4))
        compile_(fits, **kw)                      # exactly the table's peak: fits
        with pytest.raises(AutopartError, match="pipeline rank 0"):
            compile_(fits)                        # zero=0 / fp32 needs more
        with pytest.raises(AutopartError, match="pipeline rank"):
            compile_(fits - 1, **kw)


def test_auto_that_cannot_fit_names_rank_bytes_budget_and_remedy():
    with pytest.raises(AutopartError) as e:
        _compile("auto", memory_budget="100KB")
    msg = str(e.value)
    assert "pipeline rank 0" in msg and "100000 bytes" in msg and "pp=4" in msg and "tp=2" in msg


def test_bad_options_are_clear_errors():
    with pytest.raises(AutopartError, match="not one of"):
        _compile("everything")
    with pytest.raises(AutopartError, match="memory budget"):
        _compile("auto")
    with pytest.raises(AutopartError, match="optimizer"):
        _compile("none", optimizer="lamb")
    with pytest.raises(AutopartError, match="not a size"):
        _compile("auto", memory_budget="lots")


# -- bitwise equality on spawned ranks ------------------------------------------------------------

M = dict(microbatches=4)
MODES = ("selective", "full")
FAST_2 = [(MemCase("gpt-pp2-1f1b-dropout", pp=2, dropout=0.1, **M), MODES),
          (MemCase("hf-pp2", model="hf", pp=2, batch=4, seq=32, microbatches=2), ("full",))]
FULL_2 = [(MemCase("gpt-pp2-interleaved", pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                   **M), MODES),
          (MemCase("gpt-tp2", tp=2, microbatches=2), MODES),
          (MemCase("hf-pp2-selective", model="hf", pp=2, batch=4, seq=32, microbatches=2),
           ("selective",)),
          (MemCase("gpt-dp2", dp=2, microbatches=2), MODES),
          (MemCase("gpt-tp2-sp", tp=2, sequence_parallel=True, microbatches=2), MODES),
          (MemCase("hf-eager-pp2", model="hf-eager", pp=2, batch=4, seq=32, microbatches=2,
                   dropout=0.1), MODES)]
FULL_4 = [(MemCase("gpt-pp2xdp2-interleaved", pp=2, dp=2, schedule="interleaved-1f1b",
                   virtual_stages=2, microbatches=2), MODES),
          (MemCase("gpt-pp2xtp2", pp=2, tp=2, **M), MODES),
          (MemCase("gpt-pp4-1f1b", pp=4, **M), ("full",))]
GROUPS = {("rc-fast", 2): FAST_2, ("rc-full", 2): FULL_2, ("rc-full", 4): FULL_4}


@pytest.fixture(scope="module")
def spawn_cache() -> dict:
    return {}


def _run(cache, key):
    from autopart.runtime.launch import spawn
    from tests.workers.memory import recompute_bitwise
    if key not in cache:
        try:
            cache[key] = spawn(recompute_bitwise, key[1], GROUPS[key], timeout=600)
        except Exception as e:  # noqa: BLE001
            cache[key] = e
    if isinstance(cache[key], Exception):
        raise cache[key]
    return [r for per_rank in cache[key] for r in per_rank]


def _params(key, full):
    return [pytest.param(key, case, id=case.name, marks=[pytest.mark.full] if full else [])
            for case, _ in GROUPS[key]]


@pytest.mark.parametrize("key,case", _params(("rc-fast", 2), False) + _params(("rc-full", 2), True)
                         + _params(("rc-full", 4), True))
def test_bitwise_equal_to_no_recomputation(key, case, spawn_cache):
    results = [r for r in _run(spawn_cache, key) if r["case"] == case.name]
    modes = dict(GROUPS[key])[case]
    assert len(results) == case.world * len(modes)
    problems = [f"{r['mode']} rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert all(r["regions"] > 0 for r in results), "no region was recomputed"


class _Accumulating(torch.nn.Module):
    """Each layer writes in place into a running summary made before it (`acc.mul_(.5).add_`)."""

    def __init__(self, width: int = 16, vocab: int = 32, n_layer: int = 4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n_layer))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x, y):
        h = self.emb(x)
        acc = torch.zeros(x.shape, dtype=h.dtype)
        for fc in self.fcs:
            h = h + torch.tanh(fc(h))
            acc.mul_(0.5).add_(h.mean(-1))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) + (acc * acc).mean()


def test_a_layer_writing_into_a_tensor_made_before_it_is_not_recomputed():
    """Recomputing it would write the summary a second time: before, backward crashed in torch
    ("modified by an inplace operation"). Now the layer is skipped, named, and the gradients are
    the plain model's."""
    from autopart.passes.recompute_activations import rewrite_chunk
    torch.manual_seed(0)
    model, x = _Accumulating(), torch.randint(0, 32, (4, 8))
    model(x, x).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    chunk = autopart.compile(model, autopart.Mesh(), (x, x)).programs[0].chunks[0]
    new, _, skipped = rewrite_chunk(chunk, {layer: "full" for layer in chunk.layers})
    assert skipped and all("writes in place into" in why for _, why in skipped), skipped
    for p in new.gm.parameters():
        p.grad = None
    new.gm(x, x)[0].backward()
    for n, p in new.gm.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6)
