"""Models that do not fit in one process: built on the meta device, each rank allocating only its
share, initialized from scratch (equal to autopart.materialize of the same model and seed) or
loaded from a checkpoint of the plain model (each rank reading its slices), then trained 3 steps
equal to the plain model (fp32, tests/workers/common.py's tolerances). Each rank's bytes are
measured from the storages of the tensors its programs hold (tests/workers/meta.held_bytes), not
from autopart's accounting. Bad checkpoints: a missing key, an extra key, a wrong shape, a dtype that
cannot be cast, each an AutopartError naming the key and the file.

Fast tier: python -m pytest -m "not full" tests/test_memory_scale.py
Full:      python -m pytest tests/test_memory_scale.py
"""
from __future__ import annotations

import pytest
import torch

import autopart
from autopart.errors import AutopartError
from autopart.runtime.launch import spawn
from tests.workers.meta import MetaCase, batch, construct, plain, run_cases, save_checkpoint


def _run(tmp_path, cases: list[MetaCase], kinds: list[str], world: int) -> list:
    ready = []
    for case, kind in zip(cases, kinds):
        if kind:
            path = str(tmp_path / f"{case.name}.{kind}")
            save_checkpoint(case, path, kind)
            case = MetaCase(**{**case.__dict__, "source": path})
        ready.append(case)
    ranks = spawn(run_cases, world, ready, timeout=600)
    problems = [f"{r['case']} rank {rank}: {p}" for rank, results in enumerate(ranks)
                for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    return ranks


# -- no processes ---------------------------------------------------------------------------------

def test_materialize_is_per_module_and_order_free():
    """Each module's weights depend on (seed, its path) only: a real model re-materialized, a
    meta model and a different seed."""
    with torch.device("meta"):
        a, _ = construct(MetaCase("gpt"))
    autopart.materialize(a, seed=5)
    b = plain(MetaCase("gpt"))
    autopart.materialize(b, seed=5)            # real tensors: overwritten in place
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert a.lm_head.weight is a.transformer.wte.weight     # the tie survives
    autopart.materialize(b, seed=6)
    assert not torch.equal(a.transformer.h[0].mlp.c_fc.weight, b.transformer.h[0].mlp.c_fc.weight)
    # the same module type at two paths gets different weights
    assert not torch.equal(a.transformer.h[0].mlp.c_fc.weight, a.transformer.h[1].mlp.c_fc.weight)


def test_meta_device_skips_initialization_and_materializes_the_same():
    """Under autopart.meta_device() torch.nn.init does nothing (a meta tensor has no values) and is
    itself again afterwards; the model materializes to the same weights as one built under
    torch.device("meta"), a Hugging Face model (which calls torch.nn.init in _init_weights) too."""
    real_normal = torch.nn.init.normal_
    for case, init in ((MetaCase("gpt"), None), (MetaCase("llama", model="llama"), "_init_weights")):
        with autopart.meta_device():
            assert torch.nn.init.normal_ is not real_normal
            fast, _ = construct(case)
        assert torch.nn.init.normal_ is real_normal
        with torch.device("meta"):
            slow, _ = construct(case)
        assert all(p.is_meta for p in fast.parameters())
        for m in (fast, slow):
            autopart.materialize(m, seed=3, init_fn=getattr(m, init) if init else None)
        for (n, p), q in zip(fast.named_parameters(), slow.parameters()):
            assert torch.equal(p, q), n


def test_materialize_rebuilds_non_persistent_buffers():
    """A Hugging Face Llama's RoPE inv_freq (non-persistent, computed in __init__) is recomputed
    from the module's constructor, without user code."""
    with torch.device("meta"):
        meta, _ = construct(MetaCase("llama", model="llama"))
    autopart.materialize(meta, seed=0, init_fn=meta._init_weights)
    real = plain(MetaCase("llama", model="llama"))
    assert torch.equal(meta.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)


def test_materialize_without_reset_parameters_uses_the_constructor_or_warns():
    """A parameter no reset_parameters() or _init_weights sets: the values a fresh instance of
    its module's constructor gives (ones here), else normal(0, 0.02) with one warning naming it."""
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

    class Pos(torch.nn.Module):                  # a raw parameter beside a child with weights
        def __init__(self, n):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.pos = torch.nn.Parameter(torch.zeros(n, 4))
    with torch.device("meta"):
        m = torch.nn.Sequential(Scale(), Pos(500))
    with pytest.warns(UserWarning, match=r"normal\(0, 0\.02\): \['1\.pos'\]"):
        autopart.materialize(m)
    assert torch.equal(m[0].w, torch.ones(3))
    assert abs(m[1].pos.std().item() - 0.02) < 0.002 and not m[1].pos.isnan().any()


def test_bad_checkpoints_name_the_key_and_the_file(tmp_path, single_process_group):
    case = MetaCase("gpt")
    with torch.device("meta"):
        model, loss_fn = construct(case)
    inputs, target = batch(case)
    pm = autopart.parallelize(model, autopart.Mesh(), inputs, loss_fn=loss_fn, target=target)
    good = plain(case).state_dict()
    from safetensors.torch import save_file

    def write(sd, name):
        path = tmp_path / name
        save_file({k: v.clone() for k, v in sd.items()}, str(path))   # ties as copies
        return str(path)
    missing = {k: v for k, v in good.items() if k != "transformer.h.1.ln_2.bias"}
    with pytest.raises(AutopartError, match=r"missing\.safetensors has no key "
                                            r"'transformer\.h\.1\.ln_2\.bias'"):
        pm.load_pretrained(write(missing, "missing.safetensors"))
    with pytest.raises(AutopartError, match=r"key 'extra\.weight' in .*extra\.pt is not in"):
        path = tmp_path / "extra.pt"
        torch.save({**good, "extra.weight": torch.zeros(2)}, path)
        pm.load_pretrained(str(path))
    shape = {**good, "transformer.wpe.weight": torch.zeros(8, 32)}
    with pytest.raises(AutopartError, match=r"'transformer\.wpe\.weight' in .*shape\.safetensors "
                                            r"has shape \[8, 32\] but the model's is \[16, 32\]"):
        pm.load_pretrained(write(shape, "shape.safetensors"))
    dtype = {**good, "transformer.ln_f.weight": torch.ones(32, dtype=torch.complex64)}
    with pytest.raises(AutopartError, match=r"'transformer\.ln_f\.weight' in .*dtype\.safetensors "
                                            r"is torch\.complex64, which cannot be cast"):
        pm.load_pretrained(write(dtype, "dtype.safetensors"))
    # the tied pair stored under lm_head.weight only (either name is accepted); a plain dict
    tied = {k: v for k, v in good.items() if k != "transformer.wte.weight"}
    pm.load_pretrained(tied)
    assert torch.equal(dict(pm.named_parameters())["transformer.wte.weight"],
                       good["lm_head.weight"])


def test_full_state_dict_onto_a_rank_single_process(single_process_group):
    """One rank: rank=0 gathers the plain model's state dict (copies, not the live parameters);
    a rank outside the mesh is an AutopartError naming it and the valid range."""
    case = MetaCase("gpt")
    model = plain(case)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, target = batch(case)
    pm = autopart.parallelize(model, autopart.Mesh(), inputs, loss_fn=construct(case)[1],
                              target=target)
    full = pm.full_state_dict(rank=0)
    assert list(full) == list(expected)
    assert all(torch.equal(full[k], v) for k, v in expected.items())
    with torch.no_grad():
        next(pm.parameters()).add_(1.0)          # the gathered dict does not change with it
    assert all(torch.equal(full[k], v) for k, v in expected.items())
    with pytest.raises(AutopartError, match=r"(?s)rank=1 is not a rank of this 1-rank mesh.*"
                                            r"remedy: a global rank in 0\.\.0"):
        pm.full_state_dict(rank=1)


# -- spawned ranks --------------------------------------------------------------------------------

def test_meta_pp2_and_zero_dp2(tmp_path):
    """One 2-rank spawn. pp=2: from scratch equals materialize; load a safetensors file
    (save_model keeps one name of the tied pair); 3 SGD-momentum steps equal the plain model;
    bytes held = the share; full_state_dict(rank=1) and full_state_dict_iter(1) equal the plain
    model's state dict on rank 1 (the tie across stages under both keys), rank 0 allocates no full
    tensor doing it. dp=2 zero=1 with SGD momentum: 3 steps equal the plain optimizer,
    each rank's optimizer state is 1/2 of the plain one's, and a torch optimizer built over
    pm.parameters() fails at its first step."""
    ranks = _run(tmp_path, [MetaCase("gpt-pp2", pp=2, gather_to=1),
                            MetaCase("gpt-dp2-zero-sgd", dp=2, zero=1)],
                 ["safetensors", "torch"], 2)
    numel = sum(p.numel() for p in plain(MetaCase("gpt")).parameters())
    for results in ranks:
        pp2, zero = results
        assert pp2["held"] == pp2["expected"]
        assert pp2["held"] < 0.75 * numel * 4     # a pipeline half (+ the tied embedding)
        # full_state_dict(rank=1) / _iter(1) equal the plain model's (checked in the rank);
        # rank 0 only sends: it allocates less than the largest tensor (metadata only)
        if pp2 is ranks[0][0]:
            largest = max(pp2["full_bytes"].values())
            assert max(pp2["gather_alloc"], pp2["stream_alloc"]) < largest, pp2
        # one momentum buffer over this rank's half of the flat buffer
        assert zero["state_bytes"] == 4 * (-(-numel // 2)), (zero["state_bytes"], numel)


@pytest.mark.full
def test_zero_sgd_momentum_pp2xdp2_and_experts(tmp_path):
    """zero=1 with AdamW on pp=2 x dp=2 (GPT) and SGD momentum on dp=4 x ep=2 (Switch: experts shard
    over their own replica group, here of one rank, the dense part over dp)."""
    ranks = _run(tmp_path, [MetaCase("gpt-pp2xdp2-zero", pp=2, dp=2, zero=1, optim="adamw"),
                            MetaCase("switch-dp4xep2-zero", model="switch", dp=4, ep=2, zero=1)],
                 ["", ""], 4)
    for results in ranks:
        assert results[0]["state_bytes"] < 0.55 * 2 * results[0]["held"]   # two moments, 1/2


@pytest.mark.full
def test_meta_tp2_torch_file(tmp_path):
    _run(tmp_path, [MetaCase("gpt-tp2", tp=2)], ["torch"], 2)


@pytest.mark.full
def test_meta_hf_llama_directory(tmp_path):
    """save_pretrained of a random LlamaForCausalLM (sharded safetensors + index), pp=2."""
    _run(tmp_path, [MetaCase("llama-pp2", model="llama", pp=2)], ["hf"], 2)


@pytest.mark.full
def test_meta_four_ranks(tmp_path):
    """pp=2 x dp=2 (GPT) and dp=4 x ep=2 (Switch: each rank holds half the experts; both groups
    run on the same four ranks)."""
    _run(tmp_path, [MetaCase("gpt-pp2xdp2", pp=2, dp=2),
                    MetaCase("switch-dp4xep2", model="switch", dp=4, ep=2)],
         ["safetensors", "safetensors"], 4)


@pytest.mark.full
def test_gather_onto_one_rank_tp2_builds_no_full_sharded_tensor(tmp_path):
    """A meta-built tp=2 GPT whose weights outsize its activations, loaded from safetensors and
    trained 2 SGD-momentum steps: full_state_dict(rank=1) and full_state_dict_iter(1)
    equal the plain model's state dict on rank 1 and are empty on rank 0. The largest tensor any
    op allocated (tests/workers/meta.LargestAlloc, counted by the dispatcher): on rank 0 while
    gathering, less than the smallest tp-sharded weight's full size; on rank 1, one full tensor;
    during load_pretrained + train_step + optimizer step, less than the full size of the largest
    tp-sharded weight on both ranks (no rank ever builds one). From-scratch initialization in
    parallelize does build each module's full weights, one module at a time (docs/memory.md), which the
    printed numbers show."""
    ranks = _run(tmp_path, [MetaCase("gpt-wide-tp2", model="gpt-wide", tp=2, steps=2,
                                     gather_to=1, count_allocs=True)], ["safetensors"], 2)
    (r0,), (r1,) = ranks
    full = r0["full_bytes"]
    sharded = [full[n] for n in r0["tp_sharded"] if n in full]
    biggest = max(full.values())
    assert max(sharded) == biggest        # the case tests what it claims: sharded weights dominate
    for r in (r0, r1):
        assert r["largest_alloc"]["train"] < max(sharded), r["largest_alloc"]
    assert r0["gather_alloc"] < min(s for s in sharded if s >= 4096), r0
    assert r0["stream_alloc"] < min(s for s in sharded if s >= 4096), r0
    assert r1["largest_yielded"] == biggest
    assert r1["gather_alloc"] <= biggest and r1["stream_alloc"] <= biggest, r1
    print("largest allocation (bytes):", {r["case"] + f" rank {i}": {
        **r["largest_alloc"], "gather": r["gather_alloc"], "stream": r["stream_alloc"]}
        for i, r in enumerate((r0, r1))}, "largest full weight", biggest)
