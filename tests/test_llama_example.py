"""examples/llama.py, Llama 3 in today's style (grouped-query SDPA, half-split rotary
embeddings, nn.RMSNorm, SwiGLU, untied vocabulary): its published shapes, its numerics against
Hugging Face's LlamaForCausalLM, training on real ranks against the plain model, what each rank
holds, and the command line (`autopart compile`, `autopart plan` for Llama 3 405B).

Fast tier: python -m pytest -m "not full" tests/test_llama_example.py
Full matrix: python -m pytest tests/test_llama_example.py
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.shares import assert_rank_shares
from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain
from tests.workers.llama import build_llama, run_llama_group

ROOT = Path(__file__).resolve().parent.parent

FAST_2 = [Case("llama3-tp2", model="llama3", tp=2),
          Case("llama3-pp2", model="llama3", pp=2, microbatches=2)]
FULL_2 = [Case("llama3-dp2", model="llama3", dp=2, microbatches=2),
          Case("llama3-tp2-sp", model="llama3", tp=2, sequence_parallel=True),
          Case("llama3-mha-tp2", model="llama3-mha", tp=2)]
FULL_4 = [Case("llama3-tp2xpp2", model="llama3", tp=2, pp=2, microbatches=2),
          Case("llama3-tp2xdp2", model="llama3", tp=2, dp=2, microbatches=2)]
GROUPS = {("llama3", 2): FAST_2, ("llama3-full", 2): FULL_2, ("llama3-full", 4): FULL_4}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
CASES = [pytest.param(c, id=c.name) for c in FAST_2] + [
    pytest.param(c, id=c.name, marks=pytest.mark.full) for c in FULL_2 + FULL_4]

# Parameter counts of Meta's released checkpoints (the Hugging Face model cards of
# meta-llama/Llama-3.1-8B, -70B and -405B: the safetensors' element counts)
PUBLISHED = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
             "llama3-405b": 405_853_388_800}


def _results(case, spawn_cache) -> list[dict]:
    key = _GROUP_OF[case.name]
    return run_llama_group(spawn_cache, key, GROUPS[key])[case.name]


@pytest.mark.parametrize("case", CASES)
def test_matches_plain_model(case: Case, spawn_cache):
    assert_all_ranks_equal_plain(case, _results(case, spawn_cache))


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_only_its_share(case: Case, spawn_cache):
    assert_rank_shares(case, _results(case, spawn_cache))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_configs_have_the_published_parameter_counts(name):
    """Built on the meta device (nothing allocated), each named config has the parameters of
    Meta's checkpoint exactly, and n_params() says so too."""
    from examples.llama import Llama, config
    with torch.device("meta"):
        model = Llama(config(name))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert config(name).n_params() == PUBLISHED[name]
    assert model.lm_head.weight is not model.embed.weight          # untied


def _hf_copy(model):
    """Hugging Face's LlamaForCausalLM with the example's config and weights."""
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = model.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head, max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}))
    names = {"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn": "self_attn", "ffn": "mlp"}
    state = {}
    for key, value in model.state_dict().items():
        parts = [names.get(p, p) for p in key.split(".")]
        state[("model." if parts[0] == "layers" else "") + ".".join(parts)] = value
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize("spec", ["tiny", "tiny-mha"])
def test_logits_equal_hugging_face_llama(spec):
    """The same weights in Hugging Face's Llama (its rotate_half rotary embeddings, repeat_kv,
    eager softmax attention) give the same logits: the half-split rotation, the k/v head each
    query head reads and the norms are Llama's, not merely self-consistent."""
    from examples.llama import Llama, config
    torch.manual_seed(0)
    model = Llama(config(spec))
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        ours, theirs = model(tokens), _hf_copy(model)(input_ids=tokens).logits
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_tp2_splits_every_linear_and_no_rank_holds_over_60_percent():
    """At tp=2 no linear stays replicated (the k/v heads' repeat_interleave keeps their shard)
    and no rank's program holds more than 60% of the plain model's parameter elements."""
    import autopart
    model, loss_fn, inputs, target = build_llama(Case("llama3", model="llama3"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a replicated-linear warning fails the test
        compiled = autopart.compile(model, autopart.Mesh(tp=2), inputs, loss_fn=loss_fn,
                                    target=target)
    assert compiled.program.tp.skipped == []
    total = sum(p.numel() for p in model.parameters())
    for rank, program in compiled.programs.items():
        held = sum(t.numel() for t in program.parameters().values())
        assert held / total <= 0.6, (rank, held / total)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "autopart", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_compile_command_takes_the_example():
    out = _cli("compile", "examples/llama.py:Llama", "--config", "tiny", "--mesh", "tp=2,pp=2",
               "--microbatches", "2")
    assert out.returncode == 0, out.stderr
    assert "tp=2" in out.stdout and "stay replicated" not in out.stderr, out.stdout + out.stderr


@pytest.mark.full
def test_plan_llama3_405b_on_16384_h100():
    """The command of issue 50 runs on the example: the 405B shape at 8192 tokens on 16,384
    H100 is profiled at the model's own sizes and gives a layout that fits."""
    out = _cli("plan", "examples/llama.py:Llama", "--config", "llama3-405b", "--gpus", "16384",
               "--batch", "2048", "--seq", "8192", "--cluster", "h100-sxm")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("126 layers, hidden 16384, vocab 128256, sequence 8192; "
                                 "global batch 2048; h100-sxm"), out.stdout
    assert "\nbest: tp=" in out.stdout, out.stdout
