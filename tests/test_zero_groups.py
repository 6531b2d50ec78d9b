"""zero=1's gradient reduce-scatters per layer group, posted during the backward
(runtime/gradients.py reduce_groups, runtime/buckets.py): at the default zero_bucket_size (40M
elements: the whole test GPT in one bucket, as before this change), a rank posts one
reduce-scatter per layer group, each as soon as the last microbatch's backward has finished that
group's gradients, and waits on at most IN_FLIGHT of them at a time, the rest before the step
returns (before the optimizer).

- dp=2, 2 microbatches, 2 AdamW steps: losses and parameters equal the plain model's;
- the groups are the model's layers as its modules say (cut here from the plain model's
  parameter names, not read from autopart's layout): the final norm, each block, the position
  and the token embeddings, in the order the backward finishes them;
- the runtime's trace: each step, one reduce-scatter per group, every one posted after the last
  microbatch's backward began and before it ended (before this change: one reduce-scatter, the
  whole slice, posted when the embedding's gradient landed).
pp=2 x dp=2 with 4 microbatches: tests/test_zero.py (Gloo) and tests/test_nccl_contract.py (the
NCCL contract), full tier.
"""
from __future__ import annotations

import pytest

from autopart.runtime.launch import spawn


def expected_groups() -> list[set[str]]:
    """The test GPT's layer groups, in the order its backward finishes them."""
    from tests.test_zero_buckets import build
    model, _, _ = build()
    names = [n for n, _ in model.named_parameters()]       # the tied lm_head counted once
    blocks = sorted({n.split(".")[2] for n in names if n.startswith("transformer.h.")},
                    key=int, reverse=True)
    return [{n for n in names if n.startswith("transformer.ln_f.")}] + \
        [{n for n in names if n.startswith(f"transformer.h.{b}.")} for b in blocks] + \
        [{"transformer.wpe.weight"}, {"transformer.wte.weight"}]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.workers.zero_groups import trained
    return spawn(trained, 2, str(tmp_path_factory.mktemp("zero1")), timeout=300)


def test_zero1_per_group_reduce_scatters_equal_the_plain_model(ranks):
    want = expected_groups()
    for r in ranks:
        assert not r["problems"], "\n".join(r["problems"])
        assert [set(g) for g in r["groups"]] == want, r["groups"]


def test_zero1_reduce_scatters_are_posted_during_the_last_backward(ranks):
    from tests.workers.zero_groups import MICROBATCHES, STEPS
    events = next(r for r in ranks if r["rank"] == 0)["events"]
    groups = len(expected_groups())
    for rank in range(2):
        for step in range(STEPS):
            mine = [e for e in events if e["ph"] == "X" and e["pid"] == rank and
                    e["args"]["step"] == step]
            backwards = sorted((e for e in mine if e["args"]["kind"] == "B"),
                               key=lambda e: e["ts"])
            posts = sorted(e["args"]["posted_us"] for e in mine if e["args"]["kind"] == "REDUCE")
            assert len(backwards) == MICROBATCHES, backwards
            last = backwards[-1]
            assert len(posts) == groups, (rank, step, posts)
            assert all(last["ts"] <= t < last["ts"] + last["dur"] for t in posts), \
                (rank, step, posts, last["ts"], last["dur"])


def test_explain_shows_where_each_reduce_scatter_is_posted_and_waited():
    """No processes: pp=2 x dp=2, 4 microbatches, zero=1. Per pipeline rank, explain() and
    --json list its reduce-scatters in posting order, each in the last microbatch's B (1F1B:
    microbatch 3), its layer groups as the plain model's modules say (stage 0: the blocks
    backwards then the position embedding; stage 1: the final norm, then its blocks), and the
    tied token embedding, summed over pp first, at the step's end."""
    import torch
    import autopart
    from examples.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=128, block_size=16))
    x = torch.randint(0, 128, (8, 16))
    c = autopart.compile(model, autopart.Mesh(pp=2, dp=2), (x,), loss_fn=lm_loss, target=x,
                         microbatches=4, zero=1)
    rows = c.to_json()["reduce_scatters"]
    first = [g["group"] for g in rows[0]["groups"]]
    assert first == ["transformer.h.1", "transformer.h.0", "transformer.wpe.weight"], rows
    assert [g["group"] for g in rows[1]["groups"]] == \
        ["transformer.ln_f.weight, transformer.ln_f.bias", "transformer.h.3", "transformer.h.2"]
    assert {g["posted_in"] for r in rows for g in r["groups"]} == {"B3"}
    assert all(r["at_step_end"] == ["transformer.wte.weight"] for r in rows), rows
    text = c.explain()
    assert "zero=1 gradient reduce-scatters (one per layer group, posted once per step" in text
    assert "all waited before the step returns, before the optimizer" in text
    assert "pp rank 0: 3 posted in this order: transformer.h.1 (12 params) in B3" in text
