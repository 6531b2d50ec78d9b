"""The planner and context parallelism (cp): searched for long sequences, priced (1/cp of the
tokens per rank, the ring's K/V exchange), explained by `autopart plan`.

The long-sequence model is GPT-shaped at Llama-70B's size (80 layers, hidden 8192, 64 heads; one
layer captured on the meta device), planned at 131072 tokens on 1024 A100s.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopart.planner.cluster import PRESETS
from autopart.planner.cost import CostModel, Layout
from autopart.planner.profile import load_profile
from autopart.planner.search import CP_MIN_SEQ, cp_choice, cp_degrees, search

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py") + ":GPT"
SIZE_70B = "gpt3-175b,n_layer=80,n_embd=8192,n_head=64"
SELENE = PRESETS["a100-80gb-selene"]
LONG, GPUS, BATCH = 131072, 1024, 64


@pytest.fixture(scope="module")
def long_model():
    return CostModel(load_profile(GPT, SIZE_70B, LONG), SELENE, BATCH)


@pytest.fixture(scope="module")
def long_ranked(long_model):
    return search(long_model, GPUS)


def test_128k_tokens_on_1024_gpus_chooses_cp(long_model, long_ranked):
    assert long_model.profile.seq == LONG and long_model.profile.vocab == 50304
    best = next(e for e in long_ranked if e.fits)
    lay = best.layout
    assert lay.cp > 1 and lay.tp * lay.pp * lay.dp * lay.cp == GPUS
    assert f",cp={lay.cp}" in lay.mesh and best.row()["cp"] == lay.cp
    assert LONG % (2 * lay.cp) == 0
    # without cp nothing is as fast (the sequence's activations force small dp or deep recompute)
    no_cp = [e for e in long_ranked if e.fits and e.layout.cp == 1]
    assert all(e.step_time > best.step_time for e in no_cp)
    why = cp_choice(long_model, best, long_ranked)
    assert why.startswith(f"cp={lay.cp}: at {LONG} tokens") and "ring's K/V exchange" in why


def test_activations_divide_by_cp(long_model, long_ranked):
    """Rows with cp > 1 keep 1/cp of the activations of the same layout with cp = 1, checked
    by hand: pp = 1, full recomputation, one microbatch in flight: every layer's input (counted
    from the shape here), the rerun layer's kept tensors, the embedding's and the head's (the
    captured profile's), at bf16 (half the fp32 capture's bytes); the state from the parameter
    count of the config (gpt_params_per_rank), not from the planner's."""
    parts = long_model.profile.parts
    rows = [e for e in long_ranked if e.layout.cp > 1 and e.layout.pp == 1 and e.layout.recompute == "full"
            and not e.layout.recompute_layers]
    assert rows
    for e in rows[:20]:
        lay = e.layout
        p, b = parts[(lay.tp, lay.ep)], lay.microbatch_size
        layer_input = b * LONG * 8192 * 4         # fp32 (B, T, hidden), whole on every tp rank
        whole = (80 * layer_input + p["layer"].kept_bytes(b) + p["first"].kept_bytes(b)
                 + p["last"].kept_bytes(b)) * 0.5        # what autograd keeps (planner/saves.py)
        assert e.memory["activations"] == pytest.approx(whole / lay.cp, rel=1e-9)
        same = long_model.estimate(Layout(lay.tp, 1, lay.dp, b, 1, lay.schedule, "full", lay.ep, lay.zero),
                                   simulate=False)
        assert same.memory["activations"] == pytest.approx(whole, rel=1e-9)
    # parameters, gradients and optimizer state are not divided by cp (ZeRO: over dp * cp):
    # without ZeRO, per element: bf16 parameter, fp32 gradient, fp32 master, two fp32 Adam
    # moments (docs/memory.md's table; its 4 bytes of `step` per tensor are within rel 1e-6)
    plain = [e for e in long_ranked if e.layout.cp > 1 and e.layout.pp == 1 and e.layout.zero == 0]
    assert plain, "no cp > 1 row without ZeRO: the state is not checked"
    for e in plain[:20]:
        state = gpt_params_per_rank(e.layout.tp) * (2 + 4 + 4 + 8)
        assert sum(e.memory[k] for k in ("params", "grads", "master", "optimizer")) \
            == pytest.approx(state, rel=1e-6), (e.layout, e.memory)


def gpt_params_per_rank(tp: int, h: int = 8192, layers: int = 80, vocab: int = 50304,
                        positions: int = LONG) -> int:
    """Elements a tp rank of the example GPT (pp = 1) holds, counted from its config: per layer
    the fused qkv (3h x h + 3h), the attention output (h x h), the MLP's up (4h x h + 4h) and
    down (4h x h) weights split over tp, the two norms and the two output biases (6h) whole;
    the token and position embeddings (vocabulary-parallel; positions up to the profiled
    sequence) split over tp, the lm_head tied to the token embedding; the final norm (2h)."""
    split = 12 * h * h + 7 * h
    return layers * (split // tp + 6 * h) + (vocab + positions) * h // tp + 2 * h


def test_ring_is_priced_and_grows_with_cp(long_model):
    """The ring sends K and V, 1/cp of the sequence and 1/tp of the heads, to the next rank: one
    message is 2 * s/cp * hidden/tp * 2 bytes (bf16, GPT: as many kv heads as heads)."""
    layer = long_model.parts(Layout(8, 1, 1, 1))["layer"]
    for cp in (2, 8, 32):
        expected = 2 * LONG / cp * 8192 / 8 * 2
        t = long_model.ring_transfer(layer, 8, 1, cp)
        link = SELENE.inter_bw * SELENE.inter_efficiency           # 8 * cp > a node's 8 GPUs
        assert t == pytest.approx(SELENE.latency_s + expected / link, rel=1e-9)
    f, b = long_model.ring_times(layer, 8, 1, 64)
    assert b == pytest.approx(2 * f) and f >= 0
    assert long_model.ring_times(layer, 8, 1, 1) == (0.0, 0.0)


def test_4k_sequence_keeps_cp_1():
    model = CostModel(load_profile(GPT, SIZE_70B, 4096), SELENE, BATCH)
    assert model.profile.seq == 4096 < CP_MIN_SEQ
    ranked = search(model, GPUS)
    best = next(e for e in ranked if e.fits)
    assert best.layout.cp == 1 and all(e.layout.cp == 1 for e in ranked)
    assert cp_choice(model, best, ranked).startswith("cp=1: at 4096 tokens")


def test_cp_whose_chunks_do_not_divide_the_sequence_is_not_proposed():
    """8200 = 8 * 1025 tokens: 2*cp divides it for cp = 2 and 4 only."""
    model = CostModel(load_profile(GPT, "tiny", 8200), SELENE, 8)
    assert cp_degrees(model, 32) == [2, 4]
    ranked = search(model, 32, tp=1)
    assert {e.layout.cp for e in ranked} == {1, 2, 4}
    why = model.check(Layout(1, 1, 8, 1, cp=8))
    assert why is not None and "do not divide its 8200 tokens" in why


def test_cli_128k_prints_cp_and_why():
    out = subprocess.run([sys.executable, "-m", "autopart", "plan", GPT, "--config", SIZE_70B, "--seq", str(LONG),
                          "--gpus", str(GPUS), "--batch", str(BATCH), "--top", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = next(line for line in lines if line.startswith("mesh"))
    assert head.split()[:2] == ["mesh", "cp"]
    best = next(line for line in lines if line.startswith("best: "))
    why = next(line for line in lines if line.startswith("CP: "))
    cp = int(why.split("=")[1].split(":")[0])
    assert cp > 1 and f",cp={cp}," in best and f"at {LONG} tokens" in why and "of the step" in why
    js = subprocess.run([sys.executable, "-m", "autopart", "plan", GPT, "--config", SIZE_70B, "--seq", str(LONG),
                         "--gpus", str(GPUS), "--batch", str(BATCH), "--mesh", f"cp={cp}", "--json"],
                        capture_output=True, text=True, cwd=ROOT, timeout=600)
    data = json.loads(js.stdout)
    assert data["best"]["cp"] == cp and data["cp_choice"].startswith(f"cp={cp}: ")
    assert {r["cp"] for r in data["layouts"]} == {cp}


def test_mesh_takes_cp():
    from autopart.cli.plan import parse_mesh
    assert parse_mesh("tp=8,cp=4", 1024) == {"tp": 8, "cp": 4}
    from autopart.errors import AutopartError
    with pytest.raises(AutopartError, match="does not equal --gpus 1024"):
        parse_mesh("tp=8,pp=4,dp=8,cp=2", 1024)


LLAMA = str(ROOT / "examples" / "llama_meta.py") + ":Llama"
# Llama-2-70B's shape: 80 layers, dim 8192, 64 heads over 8 K/V heads, a SwiGLU of 24576
LLAMA_70B = "llama-7b,dim=8192,n_layers=80,n_heads=64,n_kv_heads=8,multiple_of=4096"


def test_llama_70b_at_128k_chooses_cp_and_tensor_parallelism_within_the_peak():
    model = CostModel(load_profile(LLAMA, LLAMA_70B, LONG), SELENE, BATCH)
    ranked = search(model, GPUS)
    best = next(e for e in ranked if e.fits)
    # its weights (and vocabulary) split over tp, or sharded by ZeRO-3, whose gathers hide behind
    # the layers' 128K-token compute now that the planner overlaps them as the runtime does
    assert best.layout.cp > 1 and (best.layout.tp >= 4 or best.layout.zero == 3), best.layout
    assert "ring's K/V exchange" in cp_choice(model, best, ranked)
    # a device never beats its peak: the rate the costs give is model FLOPs over time
    assert all(0 < e.tflops_per_device * 1e12 < SELENE.peak_flops for e in ranked if e.fits)


def test_profile_costs_grow_with_the_microbatch_at_every_tp():
    # int() of a SymInt in the profile once fixed the batch for every tp after the first
    profile = load_profile(LLAMA, "tiny,n_kv_heads=2,dim=256,n_heads=8", 128)
    assert {tp for tp, _ in profile.parts} >= {1, 2, 4}
    for key, parts in profile.parts.items():
        layer = parts["layer"]
        assert layer.gemms[0][0](2) == 2 * layer.gemms[0][0](1), key
        assert layer.kv_bytes(2) == 2 * layer.kv_bytes(1) > 0, key
