"""examples/switch.py: routing semantics, auxiliary losses, group independence, capture, configs.

Routing is checked against a plain loop over choices and tokens (`reference_route`) and on
hand-made routers whose outcome is written out: capacity binds, an expert gets no tokens, first
choices of all tokens come before any second choice.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from examples.switch import (CONFIGS, MoE, SwitchConfig, SwitchGPT, balance_loss, config,
                             example_inputs, summarize, z_loss)


def reference_route(probs: torch.Tensor, k: int, capacity: int):
    """Per group: choice 1 of every token in token order, then choice 2, ...; an expert's next
    free slot, or dropped. Returns {(g, s, choice): (expert, slot or None)}."""
    G, S, E = probs.shape
    out = {}
    for g in range(G):
        order = probs[g].argsort(dim=-1, descending=True, stable=True)
        used = [0] * E
        for c in range(k):
            for s in range(S):
                e = int(order[s, c])
                slot = used[e] if used[e] < capacity else None
                used[e] += 1
                out[(g, s, c)] = (e, slot)
    return out


def _moe(**kw) -> MoE:
    base = dict(n_embd=8, n_head=2, d_ff=16, group_size=6, num_experts=3, top_k=1,
                capacity_factor=1.0)
    return MoE(SwitchConfig(**{**base, **kw}))


def _logits(choices, E: int) -> torch.Tensor:
    """Logits (1, S, E) ranking the experts of each token in the given order."""
    S = len(choices)
    logits = torch.zeros(1, S, E)
    for s, ranked in enumerate(choices):
        for rank, e in enumerate(ranked):
            logits[0, s, e] = 10.0 - 3.0 * rank
    return logits


def test_capacity_binds_and_an_expert_gets_no_tokens():
    moe = _moe()                                   # capacity = floor(1.0 * 1 * 6 / 3) = 2
    assert moe.cfg.capacity == 2
    first = [0, 0, 0, 1, 0, 1]                     # expert 0 asked 4 times, expert 2 never
    _, dispatch, combine, masks, kept = moe.route(_logits([[e] for e in first], 3))
    d = dispatch[0]                                # (S, E, cap)
    assert d[0, 0, 0] == 1 and d[1, 0, 1] == 1     # tokens 0, 1 fill expert 0
    assert d[3, 1, 0] == 1 and d[5, 1, 1] == 1     # tokens 3, 5 fill expert 1
    assert d[2].sum() == 0 and d[4].sum() == 0     # tokens 2, 4 dropped
    assert d[:, 2].sum() == 0                      # expert 2 idle
    assert combine[0, 2].abs().sum() == 0 and combine[0, 4].abs().sum() == 0
    assert kept[0].sum(dim=(0, 1)).tolist() == [2, 2, 0]
    assert masks[0].sum(dim=(0, 1)).tolist() == [4, 2, 0]


def test_first_choices_of_all_tokens_before_any_second_choice():
    moe = _moe(top_k=2, group_size=4, capacity_factor=0.75)   # floor(0.75 * 2 * 4 / 3) = 2
    assert moe.cfg.capacity == 2
    # token 0 prefers 0 then 1; tokens 1, 2, 3 prefer 1. Token 0's second choice (expert 1) comes
    # before tokens 1-3 in token order, but after their first choices: it is dropped, and so is
    # token 3's first choice (expert 1 full after tokens 1 and 2).
    choices = [[0, 1, 2], [1, 2, 0], [1, 0, 2], [1, 2, 0]]
    probs, dispatch, combine, masks, kept = moe.route(_logits(choices, 3))
    d = dispatch[0]
    assert d[0, 0, 0] == 1 and d[0, 1].sum() == 0            # token 0: expert 0 slot 0; 1 dropped
    assert d[1, 1, 0] == 1 and d[2, 1, 1] == 1 and d[3, 1].sum() == 0
    assert d[1, 2, 0] == 1 and d[3, 2, 1] == 1               # second choices fill expert 2
    assert d[2, 0, 1] == 1                                   # token 2's second choice: expert 0
    ref = reference_route(probs, 2, 2)
    for (g, s, c), (e, slot) in ref.items():
        if slot is None:
            assert d[s, e].sum() == 0
        else:
            assert d[s, e, slot] == 1
    # GShard gates: the two chosen probabilities renormalised to sum to 1
    p = probs[0]
    g1, g2 = p[2, 1], p[2, 0]
    assert torch.allclose(combine[0, 2, 1, 1], g1 / (g1 + g2))
    assert torch.allclose(combine[0, 2, 0, 1], g2 / (g1 + g2))


@pytest.mark.parametrize("k,factor", [(1, 1.0), (1, 0.5), (2, 1.25), (2, 0.5), (2, None)])
def test_routing_matches_the_reference_loop(k, factor):
    torch.manual_seed(k)
    moe = _moe(top_k=k, num_experts=4, group_size=8, capacity_factor=factor)
    logits = torch.randn(3, 8, 4) * 2
    logits[1, :, 2] += 5                                      # group 1 skewed to expert 2
    probs, dispatch, combine, masks, kept = moe.route(logits)
    cap = moe.cfg.capacity
    expected = torch.zeros_like(dispatch)
    for (g, s, c), (e, slot) in reference_route(probs, k, cap).items():
        if slot is not None:
            expected[g, s, e, slot] = 1
    assert torch.equal(dispatch, expected)
    assert dispatch.sum(dim=1).max() <= 1                     # one token per slot
    if factor is None:
        assert cap == 8 and int(dispatch.sum()) == 3 * 8 * k  # dropless


def test_capacity_formula():
    assert SwitchConfig(group_size=16, num_experts=4, capacity_factor=1.25).capacity == 5
    assert SwitchConfig(group_size=16, num_experts=4, top_k=2, capacity_factor=1.0).capacity == 8
    assert SwitchConfig(group_size=4, num_experts=64, capacity_factor=1.0).capacity == 1  # >= 1
    assert SwitchConfig(group_size=16, capacity_factor=None).capacity == 16


def test_aux_losses_against_the_formulas():
    torch.manual_seed(0)
    moe = _moe(num_experts=4, group_size=8, top_k=2)
    x = torch.randn(2, 16, 8)
    _, aux, stats = moe(x)
    logits = (x.reshape(-1, 8, 8) @ moe.router.weight.detach().t()).double()   # (G, S, E)
    G, S, E = logits.shape
    balance = 0.0
    for g in range(G):
        p = logits[g].softmax(-1)
        first = p.argmax(-1)
        f = [float((first == i).double().mean()) for i in range(E)]
        P = [float(p[:, i].mean()) for i in range(E)]
        balance += E * sum(fi * Pi for fi, Pi in zip(f, P)) / G
    z = float((torch.logsumexp(logits, -1) ** 2).mean())
    assert math.isclose(float(aux.detach()), 0.01 * balance + 1e-3 * z, rel_tol=1e-5)
    probs = logits.float().softmax(-1)
    assert math.isclose(float(balance_loss(probs, F.one_hot(probs.argmax(-1), E))), balance,
                        rel_tol=1e-5)
    assert math.isclose(float(z_loss(logits.float())), z, rel_tol=1e-5)
    # perfectly balanced routing gives balance loss 1
    uniform = torch.full((1, 4, 4), 0.25)
    assert float(balance_loss(uniform, F.one_hot(torch.arange(4), 4)[None])) == pytest.approx(1.0)


def test_training_loss_is_lm_loss_plus_every_moe_layers_aux():
    torch.manual_seed(0)
    cfg = config("tiny,n_layer=4,moe_every=1,top_k=2")
    model = SwitchGPT(cfg)
    idx, tgt = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    auxes = []
    hooks = [b.mlp.register_forward_hook(lambda m, i, o: auxes.append(o[1]))
             for b in model.transformer.h]
    loss = model(idx, tgt)
    for h in hooks:
        h.remove()
    logits = model(idx)
    lm = F.cross_entropy(logits.reshape(-1, 256), tgt.reshape(-1))
    assert len(auxes) == 4
    assert torch.allclose(loss, lm + sum(auxes), rtol=1e-6)


def test_loss_and_counts_of_a_batch_equal_those_of_its_whole_group_splits():
    torch.manual_seed(0)
    cfg = config("tiny,top_k=2,capacity_factor=0.5")       # capacity binds: drops in each group
    model = SwitchGPT(cfg)
    idx, tgt = torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64))
    loss, stats = model(idx, tgt, True)
    assert int(stats["dropped_tokens"].sum()) > 0
    for parts in (2, 4):
        outs = [model(i, t, True) for i, t in zip(idx.chunk(parts), tgt.chunk(parts))]
        mean = sum(o[0] for o in outs) / parts
        assert torch.allclose(loss, mean, rtol=1e-5, atol=1e-6)
        for key in stats:
            assert torch.equal(stats[key], sum(o[1][key] for o in outs)), key


def test_stats_and_summary():
    torch.manual_seed(0)
    cfg = config("tiny,capacity_factor=0.5")
    model = SwitchGPT(cfg)
    idx = torch.randint(0, 256, (2, 64))
    _, stats = model(idx, idx, True)
    L, E = cfg.n_moe_layers, cfg.num_experts
    assert stats["routed"].shape == stats["processed"].shape == (L, E)
    assert stats["routed"].sum(-1).tolist() == [128] * L
    assert (stats["processed"] <= cfg.capacity * 128 // cfg.group_size).all()
    assert torch.equal(stats["dropped_tokens"], 128 - stats["processed"].sum(-1))   # top-1
    s = summarize(stats, cfg.top_k)
    assert all(abs(sum(row) - 1) < 1e-9 for row in s["load"])
    assert s["dropped"] == pytest.approx([d / 128 for d in stats["dropped_tokens"].tolist()])


def test_bad_configs_fail_clearly():
    with pytest.raises(ValueError, match="num_experts=0"):
        SwitchConfig(num_experts=0)
    with pytest.raises(ValueError, match="top_k=3 with num_experts=2"):
        SwitchConfig(num_experts=2, top_k=3)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="capacity_factor"):
            SwitchConfig(capacity_factor=bad)
    with pytest.raises(ValueError, match="group_size=16"):
        SwitchGPT(config("tiny,n_layer=2"))(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(KeyError, match="no field"):
        config("tiny,experts=4")
    assert config("tiny,capacity_factor=none").capacity_factor is None


def test_named_configs_and_parameter_counts():
    tiny = SwitchGPT(config("tiny"))
    assert sum(p.numel() for p in tiny.parameters()) == config("tiny").n_params()
    assert tiny.config.n_moe_layers == 2 and tiny.config.num_experts == 4
    c = CONFIGS["switch-c"]
    assert c.num_experts == 2048 and c.n_embd == 2080 and c.d_ff == 6144 and c.moe_every == 1
    assert 1.55e12 < c.n_params() < 1.6e12          # Switch-C: 1571B
    base = CONFIGS["switch-base"]
    assert base.num_experts == 128 and base.n_moe_layers == 6
    with torch.device("meta"):
        model = SwitchGPT(config("switch-c,n_layer=2"))
    assert sum(p.numel() for p in model.parameters()) == config("switch-c,n_layer=2").n_params()


def test_capture_with_a_dynamic_batch():
    from autopart.capture import capture
    torch.manual_seed(0)
    cfg = config("tiny,n_layer=2,top_k=2")
    model = SwitchGPT(cfg)
    program = capture(model, example_inputs(cfg, 2))
    assert program.dynamic and program.inputs == ["idx", "targets"]
    idx, tgt = torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64))
    out = program.gm(idx, tgt)
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert torch.allclose(out, model(idx, tgt), rtol=1e-6)
