"""Models built on the meta device the way users build them: `parallelize` allocates each rank's
shards unfilled, and the values come from exactly one of pm.load_pretrained (safetensors, a
torch.save file, a sharded Hugging Face directory, a torchtitan/DCP directory), pm.load, or
pm.init_weights (the model's own initialization: reset_parameters, Hugging Face's
_init_weights, torchtitan's root init_weights, or a warned default). Each case trains 3 steps
equal to the plain model (fp32, tests/workers/common.py's tolerances); bytes allocated are counted
by the dispatcher (tests/workers/meta.LargestAlloc), not by autopart.

Fast tier: python -m pytest -m "not full" tests/test_deferred_init.py
Full:      python -m pytest tests/test_deferred_init.py
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import autopart
from autopart.errors import AutopartError
from autopart.runtime.launch import spawn
from tests.workers.deferred import (DCase, HandGPT, batch, logits_loss, run_cases,
                                   save_checkpoint, scratch_reference)

THREE_WAYS = r"pm\.load_pretrained\(path\).*pm\.load\(path\).*pm\.init_weights\(seed=0\)"


def _run(tmp_path, cases: list[DCase]) -> list:
    ready = []
    for case in cases:
        if case.fill == "load":
            path = str(tmp_path / f"{case.name}.{case.kind}")
            save_checkpoint(case, path)
            case = DCase(**{**case.__dict__, "source": path})
        ready.append(case)
    ranks = spawn(run_cases, ready[0].world, ready, timeout=600)
    problems = [f"{r['case']} rank {rank}: {p}" for rank, results in enumerate(ranks)
                for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for results in ranks:
        for r in results:
            # parallelize allocated the rank's share, the buffers the model's code computes and
            # at most one more full tensor: no from-scratch initialization of anything. zero=3:
            # its full-shaped parameters are allocated too (torch.empty, never written, then
            # freed: the dispatcher sees their bytes, the OS no page of them); its peak RSS is
            # bench/zero_vs_fsdp.py --memory's
            share = r["held"] + r["buffers"] + r["largest_full"]
            assert r["allocated"] <= share + (r["full_params"] if r["zero"] == 3 else 0), r
            assert r["largest_load"] <= r["largest_full"], r
    return ranks


# -- one process ---------------------------------------------------------------------------------

def test_unfilled_weights_refuse_until_init_weights(single_process_group):
    """train_step, optimizer, save and full_state_dict refuse weights never filled, naming the
    three ways; init_weights(seed) then gives exactly the model's own initialization under the
    documented seeds, made by plain torch (tests/workers/deferred.scratch_reference), the raw
    root parameter by the warned default; autopart.materialize(model, seed) the same."""
    with torch.device("meta"):
        model = HandGPT()
    inputs, target = batch()
    pm = autopart.parallelize(model, autopart.Mesh(), (inputs,), loss_fn=logits_loss,
                              target=target)
    for call in (lambda: pm.train_step(inputs, target=target),
                 lambda: pm.optimizer(torch.optim.SGD, lr=0.1), lambda: pm.save("unused"),
                 lambda: pm.full_state_dict()):
        with pytest.raises(AutopartError, match=r"(?s)hold no values yet \(.*" + THREE_WAYS):
            call()
    with pytest.warns(UserWarning, match=r"normal\(0, 0\.02\): \['pos'\]"):
        pm.init_weights(seed=3)
    ref, defaulted = scratch_reference(DCase("hand", "hand-gpt"), seed=3)
    assert defaulted == ["pos"]
    with torch.device("meta"):
        made = HandGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopart.materialize(made, seed=3)
    ref_params, made_params = dict(ref.named_parameters()), dict(made.named_parameters())
    for name, p in pm.named_parameters():
        assert torch.equal(p, ref_params[name]), name
        assert torch.equal(made_params[name], ref_params[name]), name
    assert 0.015 < ref.pos.std().item() < 0.025
    pm.train_step(inputs, target=target)      # filled: trains


def test_seed_given_to_parallelize_still_initializes_at_once(single_process_group):
    with torch.device("meta"):
        model = HandGPT()
    inputs, target = batch()
    with pytest.warns(UserWarning, match="pos"):
        pm = autopart.parallelize(model, autopart.Mesh(), (inputs,), loss_fn=logits_loss,
                                  target=target, seed=5)
    assert torch.isfinite(pm.train_step(inputs, target=target))


def test_init_weights_of_a_model_with_real_weights_is_refused(single_process_group):
    inputs, target = batch()
    pm = autopart.parallelize(HandGPT(), autopart.Mesh(), (inputs,), loss_fn=logits_loss,
                              target=target)
    with pytest.raises(AutopartError, match="(?s)already holds.*meta device"):
        pm.init_weights()


def test_torchtitan_root_init_weights_equals_the_real_models():
    """materialize runs a torchtitan model's own init_weights() as the real model runs it: the
    same numbers as plain torch's init_weights() on the model built for real, under the
    documented seed."""
    from tests.titan_llama import ModelArgs, Transformer
    ref, _ = scratch_reference(DCase("titan", "titan-llama"), seed=1)
    with torch.device("meta"):
        m = Transformer(ModelArgs())
    made = autopart.materialize(m, seed=1).state_dict()
    differ = [n for n, t in ref.state_dict().items() if not torch.equal(t, made[n])]
    assert not differ, differ


def test_torchtitan_root_init_weights_is_run_whole():
    """A torchtitan model's own init_weights(): the freqs_cis buffer it computes equals the real
    model's, the norms are ones, the output layer trunc-normal within its 3-sigma cutoff, and the
    same seed gives the same numbers."""
    from tests.titan_llama import ModelArgs, Transformer
    real = Transformer(ModelArgs())
    made = []
    for _ in range(2):
        with torch.device("meta"):
            m = Transformer(ModelArgs())
        made.append(autopart.materialize(m, seed=1))
    a, b = made
    assert torch.equal(a.freqs_cis, real.freqs_cis)
    assert torch.equal(a.layers["1"].ffn_norm.weight, torch.ones(32))
    cutoff = 3 * 32 ** -0.5
    assert a.output.weight.abs().max() <= cutoff and a.output.weight.std() > 0.05
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n


def test_root_init_weights_that_goes_back_to_a_tensor_is_refused():
    class Back(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def init_weights(self):
            for lin in (self.a, self.b, self.a):
                nn.init.normal_(lin.weight)
    with torch.device("meta"):
        m = Back()
    with pytest.raises(AutopartError, match=r"(?s)touched a\.weight again.*remedy: pass init_fn"):
        autopart.materialize(m)


def test_dcp_directory_reads_only_the_slice(tmp_path):
    import torch.distributed.checkpoint as dcp
    from autopart.runtime.pretrained import open_checkpoint
    sd = {"w": torch.arange(24.0).view(4, 6), "freqs": torch.ones(3, dtype=torch.complex64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
        ckpt = open_checkpoint(str(tmp_path))
        assert sorted(ckpt.keys()) == ["freqs", "w"]
        assert ckpt.info("w")[:2] == ((4, 6), torch.float32)
        assert torch.equal(ckpt.read("w", (slice(1, 3), slice(2, 5))), sd["w"][1:3, 2:5])
        assert torch.equal(ckpt.read("freqs", (slice(0, 3),)), sd["freqs"])


# -- spawned ranks --------------------------------------------------------------------------------

@pytest.mark.full     # the fast tier's 20 minutes: its single-process tests above cover the logic
def test_hf_llama_tp2_from_a_sharded_directory_and_hand_gpt_pp2_from_scratch(tmp_path):
    _run(tmp_path, [DCase("hf-llama-tp2-load", "hf-llama", {"tp": 2}, "load", "hf"),
                    DCase("hand-gpt-pp2-scratch", "hand-gpt", {"pp": 2}, "scratch")])


@pytest.mark.full
def test_two_ranks_the_other_ways(tmp_path):
    _run(tmp_path, [DCase("hf-llama-tp2-scratch", "hf-llama", {"tp": 2}, "scratch"),
                    DCase("hand-gpt-pp2-load", "hand-gpt", {"pp": 2}, "load", "safetensors")])


@pytest.mark.full
def test_hf_mixtral_dp2xep2(tmp_path):
    """Traced for the ranks' device (fake tensors), not the meta device's: HF's MoE code picks
    its CPU kernels (a float histc) as the ranks run them."""
    _run(tmp_path, [DCase("mixtral-load", "hf-mixtral", {"dp": 2, "ep": 2}, "load"),
                    DCase("mixtral-scratch", "hf-mixtral", {"dp": 2, "ep": 2}, "scratch")])


def test_zero3_fills_the_slices_from_a_file_and_from_scratch(tmp_path):
    """zero=3, dp=2: load_pretrained and init_weights write each parameter's slice into the
    rank's store through a SliceWriter (runtime/param_shards.py), never every parameter whole at
    once (they filled all of them full first: the whole rank share in memory); the slices equal
    the plain model's, and 3 AdamW steps train like it."""
    _run(tmp_path, [DCase("gpt2-z3-load", "hf-gpt2", {"dp": 2}, "load", "safetensors", "adamw",
                          zero=3),
                    DCase("gpt2-z3-scratch", "hf-gpt2", {"dp": 2}, "scratch", optim="adamw",
                          zero=3)])


@pytest.mark.full
def test_hf_gpt2_zero1_and_torchtitan_llama_pp2xdp2(tmp_path):
    """HF GPT-2 with AdamW and zero=1 from a torch.save file and from scratch; torchtitan's
    Llama from its DCP checkpoint and from its own init_weights (freqs_cis computed by it)."""
    _run(tmp_path, [
        DCase("gpt2-load", "hf-gpt2", {"pp": 2, "dp": 2}, "load", "torch", "adamw", zero=1),
        DCase("gpt2-scratch", "hf-gpt2", {"pp": 2, "dp": 2}, "scratch", optim="adamw", zero=1),
        DCase("titan-load", "titan-llama", {"pp": 2, "dp": 2}, "load", "dcp"),
        DCase("titan-scratch", "titan-llama", {"pp": 2, "dp": 2}, "scratch")])
