"""The planner against published H100 runs (autopart/planner/data/published_h100_runs_given.json:
Megatron-LM's README scaling table, GPT 1.7B-462B on 48-6144 H100; Llama 3 405B on 8192 H100):
each row's own layout predicted within 10% by h100-sxm (fitted on them), and, the honest check,
the held-out half within 10% by constants fitted on the other half only. The measured side is
each row's figure and Megatron-LM's FLOPs count written out from the row's shape
(published.megatron_flops), never the planner's. Run with -s for the tables
(`python -m bench.published` prints the same).
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from autopart.planner import published as P
from autopart.planner.cluster import H100_HALF_FIT, PRESETS
from autopart.planner.cost import Layout
from autopart.planner.search import search

H100 = PRESETS["h100-sxm"]
TOLERANCE = 0.10


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # tp=16's replication warnings (GQA's 8 kv heads)
        yield


def _check(cluster, rows, what: str):
    from bench.published import table
    text, errors = table(cluster, rows, what)
    print("\n" + text)
    failures = [f"{r['model']}: {err:+.1%}" for r, err in zip(rows, errors) if not abs(err) <= TOLERANCE]
    assert not failures, f"past {TOLERANCE:.0%}:\n" + "\n".join(failures)    # a NaN fails too


def test_every_published_row_within_10_percent():
    _check(H100, P.rows(), "h100-sxm, each published layout:")


def test_half_fit_predicts_the_held_out_half_within_10_percent():
    fit, held = P.half_split(P.rows())
    assert len(fit) == len(held) == 5 and not {r["model"] for r in fit} & {r["model"] for r in held}
    half = dataclasses.replace(H100, **H100_HALF_FIT)
    _check(half, fit, "constants fitted on this half:")
    _check(half, held, "the held-out half:")


def test_the_flops_count_read_from_the_graph_is_megatrons():
    """plan's model TFLOP/s (CostModel.counted_flops, from the captured graph) counts what
    Megatron-LM's formula does, for the GPT rows and the GQA + SwiGLU Llama row."""
    for r in (P.rows()[0], P.rows()[-1]):
        model = P.model_for(r, H100)
        assert model.counted_flops() == pytest.approx(P.megatron_flops(r), rel=2e-3), r["model"]


def test_fused_sdpa_keeps_o_s_and_hand_written_attention_its_scores():
    """The model decides: a Llama with F.scaled_dot_product_attention keeps activations linear
    in the sequence on h100-sxm; a GPT-NeoX writing matmul-softmax-matmul (examples/neox.py)
    keeps its s^2 scores, on the same cluster."""
    import torch
    import torch.nn.functional as F
    from autopart.model_files import load_target
    from autopart.planner.cost import CostModel
    from autopart.planner.profile import profile_model

    def loss(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    kept = {}
    for name, target in (("sdpa", f"{P.ROOT}/examples/llama.py:Llama"), ("by hand", f"{P.ROOT}/examples/neox.py:NeoX")):
        module, cls = load_target(target)
        for s in (128, 256):
            cfg = module.config("tiny")
            cfg = dataclasses.replace(cfg, **{k: s for k in ("block_size", "max_seq_len") if hasattr(cfg, k)})
            tokens = torch.zeros(2, s, dtype=torch.long)
            profile = profile_model(getattr(module, cls)(cfg), (tokens,), loss, tokens)
            model = CostModel(profile, H100, 8, runtime="megatron")
            kept[name, s] = model.kept_per_layer(Layout(1, 1, 8, 1, 1, "1f1b", "none"))[0]
    assert kept["sdpa", 256] / kept["sdpa", 128] == pytest.approx(2.0, rel=0.02), kept
    assert kept["by hand", 256] / kept["by hand", 128] > 2.5, kept


def test_causal_sdpa_halves_the_fused_kernel_and_not_the_2021_one():
    from autopart.planner.cost import CostModel
    from autopart.planner.profile import load_profile
    profile = load_profile(P.GPT, "tiny")
    assert any(g[4] and g[5] for g in profile.parts[(1, 1)]["layer"].gemms), "GPT's is_causal SDPA not seen"
    for cluster, ratio in ((H100, 0.5), (PRESETS["a100-80gb-selene"], 1.0)):
        model = CostModel(profile, cluster, 8)
        causal, whole = (model.attention_time(1e12, 2048, 2048, 128, c) for c in (True, False))
        assert causal[0] / whole[0] == pytest.approx(ratio) and causal[1] / whole[1] == pytest.approx(ratio)
    fused = CostModel(profile, H100, 8).attention_time(1e12, 2048, 2048, 128, True)
    assert fused[1] == pytest.approx(2.5 * fused[0])          # the backward recomputes the scores


def test_data_parallel_traffic_hides_behind_compute_as_each_runtime_overlaps():
    from autopart.planner.overlap import data_parallel_terms
    args = dict(allreduce=1.0, grad_bytes=4e9, param_ratio=0.5, microbatches=4, layers=10)
    short, _ = data_parallel_terms(0, fwd_window=2.0, bwd_window=4.0, runtime="autopart", **args)
    assert short["dp_allreduce"] == pytest.approx(1.0 * 25 * 2 ** 20 / 4e9)    # the last bucket only
    long, _ = data_parallel_terms(0, fwd_window=0.1, bwd_window=0.2, runtime="autopart", **args)
    assert long["dp_allreduce"] == pytest.approx(0.8)
    ours, notes = data_parallel_terms(1, fwd_window=2.0, bwd_window=4.0, runtime="autopart", **args)
    theirs, _ = data_parallel_terms(1, fwd_window=2.0, bwd_window=4.0, runtime="megatron", **args)
    assert ours["dp_param_allgather"] == pytest.approx(0.25) and "not overlapped" in notes["dp_param_allgather"]
    assert theirs["dp_param_allgather"] == pytest.approx(0.25 * 40e6 * 4 / 2e9)   # its last bucket
    old, _ = data_parallel_terms(2, fwd_window=2.0, bwd_window=4.0, runtime="megatron-2021", **args)
    assert old["dp_allreduce"] == pytest.approx(2.5)                   # (m + 1) / 2 all-reduces, exposed
    three, _ = data_parallel_terms(3, fwd_window=2.0, bwd_window=4.0, runtime="autopart", **args)
    assert sum(three.values()) == pytest.approx(4 * (0.25 + 0.75) / 10)   # the first layer's gathers


def test_sharded_parameters_train_near_the_unsharded_speed():
    """ZeRO-2 and ZeRO-3 on the 70B row's layout (microbatches of 4): their gathers and
    reduce-scatters behind the compute cost about 1%, where counting them exposed (the 2021
    runtime's pricing) made zero=3 +40%."""
    r = next(r for r in P.rows() if r["model"].startswith("GPT 70B"))
    base = Layout(8, 2, 48, 4, 7, "interleaved-1f1b", "none", zero=1)
    times = {}
    for runtime in ("megatron", "megatron-2021"):
        model = P.model_for(r, H100, runtime=runtime)
        times[runtime] = {z: model.estimate(dataclasses.replace(base, zero=z)).step_time for z in (1, 2, 3)}
    now, then = times["megatron"], times["megatron-2021"]
    assert now[2] / now[1] < 1.03 and now[3] / now[1] < 1.03, times
    assert then[3] / then[1] > 1.3, times


def _own_choice(model, gpus: int):
    return next(e for e in search(model, gpus) if e.fits)


@pytest.mark.full
def test_the_planners_own_choice_is_no_slower_than_each_published_layout():
    """Every row with the layout left free (same model, GPUs, batch, runtime): the planner's choice
    is predicted no slower than the published layout, and fits. ~1 min."""
    lines = []
    for r in P.rows():
        model = P.model_for(r, H100)
        published = P.predict(r, H100)
        own = _own_choice(model, r["gpus"])
        lines.append(f"{r['model'][:22]:22} published {published.layout.mesh} {published.step_time:.2f} s | "
                     f"own {own.layout.mesh} b={own.layout.microbatch_size} v={own.layout.virtual_stages} "
                     f"{own.layout.recompute} zero={own.layout.zero}: {own.step_time:.2f} s")
        assert own.fits and own.step_time <= published.step_time * (1 + 1e-9), lines[-1]
    print("\n" + "\n".join(lines))


LLAMA_405B_16K = dict(gpus=16384, batch=2048)     # Llama 3's 16K-GPU stage: 16M tokens of 8K


@pytest.mark.full
def test_llama3_405b_on_16384_h100_picks_metas_layout_class_or_a_faster_one():
    """Meta ran tp=8, pp=16, cp=1 (dp=128) at 8K tokens. The planner's pick is that class, or a
    layout predicted faster than Meta's own under the same cost model. ~1 min (34k layouts)."""
    r = dict(next(r for r in P.rows() if r["model"].startswith("Llama")), gpus=16384, dp=128)
    model = P.model_for(r, H100, runtime="autopart")
    best = _own_choice(model, LLAMA_405B_16K["gpus"])
    metas = min((e for e in search(model, 16384, tp=8, pp=16, dp=128, cp=1) if e.fits),
                key=lambda e: e.step_time)
    lay = best.layout
    print(f"\nchosen {lay.mesh} v={lay.virtual_stages} b={lay.microbatch_size} {lay.recompute} "
          f"zero={lay.zero}: {best.step_time:.2f} s; Meta's class best {metas.layout.mesh}: {metas.step_time:.2f} s")
    assert (lay.tp == 8 and lay.pp <= 16 and lay.cp == 1) or best.step_time < metas.step_time
    assert best.step_time <= metas.step_time * (1 + 1e-9)


def test_explain_cost_versus_a_published_layout_term_by_term():
    """`--explain-cost --versus MESH` sets the chosen layout against the fastest of MESH, each
    term with both figures and their difference, which add up to the step times' difference."""
    import re
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "autopart", "plan", "examples/gpt.py:GPT", "--config",
                          "megatron-1.7b", "--gpus", "32", "--batch", "512", "--cluster", "h100-sxm",
                          "--explain-cost", "--versus", "tp=2,pp=1,dp=16", "--top", "2"],
                         capture_output=True, text=True, cwd=P.ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    head = re.search(r"versus (tp=2,pp=1,dp=16 .*): ([\d.]+) s a step against ([\d.]+) s", out.stdout)
    assert head, out.stdout
    terms = re.findall(r"^    (\w+): ([\d.]+), ([\d.]+), ([-+][\d.]+)$", out.stdout, re.M)
    assert {"pipeline", "optimizer"} <= {t[0] for t in terms}
    for _, a, b, d in terms:
        assert float(d) == pytest.approx(float(b) - float(a), abs=2e-4)
    parts = [t for t in terms if t[0] not in ("compute_rank0", "bubble_and_p2p", "message")]
    assert sum(float(t[3]) for t in parts) == pytest.approx(float(head[2]) - float(head[3]), abs=2e-3)
