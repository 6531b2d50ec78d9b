"""Real batches: padded sequences and ignored labels give the plain model's loss and gradients
on every mesh (passes/weigh_loss_by_tokens.py). Each case trains 3 steps against the unmodified
single-process model on the same global batch (tests/workers/equivalence.equivalence: every loss,
the first gradients, the clipped norm and every parameter), with labels set to -100 unevenly over
the rows ("uneven": half the rows lose their second half; "empty": also one microbatch wholly
ignored), for cross_entropy(ignore_index), a Hugging Face model's own `labels` loss and a
masked-sum loss. Before the pass, the first case's loss was off by 8e-3 and its gradients by
up to 147%.

Fast tier: python -m pytest -m "not full" tests/test_token_loss.py
"""
from __future__ import annotations

import pytest

from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.workers.token_loss import run_token_cases

FAST_2 = [
    Case("gpt-pp2-1f1b-uneven", model="gpt4", pp=2, microbatches=4, ignored="uneven"),
    Case("gpt-pp2-zbv-empty", model="gpt4", pp=2, schedule="zb-v", virtual_stages=2,
         microbatches=4, ignored="empty"),
    Case("gpt-dp2-adamw-uneven", model="gpt4", dp=2, microbatches=2, optim="adamw",
         ignored="uneven"),
    Case("hf-labels-pp2-adamw-empty", model="hf-labels", pp=2, microbatches=4, optim="adamw",
         ignored="empty"),
    Case("masked-sum-dp2-uneven", model="masked-sum", dp=2, microbatches=2, ignored="uneven"),
]
FULL_4 = [
    Case("gpt-tp2xpp2-adamw-empty", model="gpt4", tp=2, pp=2, microbatches=4, optim="adamw",
         ignored="empty"),
    Case("hf-labels-tp2xdp2-uneven", model="hf-labels", tp=2, dp=2, microbatches=2,
         ignored="uneven"),
    Case("masked-sum-pp2xdp2-empty", model="masked-sum", pp=2, dp=2, microbatches=2,
         ignored="empty"),
]
FULL_2 = [Case("mixtral-dp2-ep2-uneven", model="mixtral", dp=2, ep=2, microbatches=2,
               ignored="uneven")]
FULL_8 = [Case("gpt-pp2xdp2xtp2-adamw-uneven", model="gpt4", pp=2, dp=2, tp=2,
               microbatches=2, optim="adamw", ignored="uneven")]
GROUPS = {("tokens", 2): FAST_2, ("tokens-full", 2): FULL_2, ("tokens-full", 4): FULL_4,
          ("tokens-full", 8): FULL_8}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
CASES = [pytest.param(c, id=c.name) for c in FAST_2] + [
    pytest.param(c, id=c.name, marks=pytest.mark.full) for c in FULL_2 + FULL_4 + FULL_8]


@pytest.mark.parametrize("case", CASES)
def test_ignored_labels_match_the_plain_model(case: Case, spawn_cache):
    key = _GROUP_OF[case.name]
    results = run_group(spawn_cache, key, GROUPS[key], rank_fn=run_token_cases)
    assert_all_ranks_equal_plain(case, results[case.name])


# -- the hot path: what a steady step reads on the host (runtime/state.py step_results) ---------

def _count_program(kind: str):
    """A TokenCount over `target`: "ne" counts target != -100 (its values), "ones" sums a
    ones_like(target) mask (its shape alone)."""
    import torch
    import torch.fx as fx
    from passes.weigh_loss_by_tokens import TokenCount
    aten = torch.ops.aten
    g = fx.Graph()
    t = g.placeholder("target")
    mask = g.call_function(aten.ne.Scalar, (t, -100)) if kind == "ne" else \
        g.call_function(aten.ones_like.default, (t,))
    g.output(g.call_function(aten.sum.default, (mask,)))
    return TokenCount(fx.GraphModule(torch.nn.Module(), g), ("target",), kind)


def test_a_count_of_shapes_alone_is_counted_once_per_shape():
    """A count that is a function of its inputs' shapes (by dataflow: no value reaches the
    output) runs once per batch shape; one of the labels' values runs every step. On the old
    share_count both ran every call (4 runs, not 2)."""
    import torch
    from autopart.runtime.batches import counts_values, share_count
    runs = []
    counters = {k: _count_program(k) for k in ("ne", "ones")}
    for kind, c in counters.items():
        c.gm.register_forward_hook(lambda *_, k=kind: runs.append(k))
    assert counts_values(counters["ne"].gm) and not counts_values(counters["ones"].gm)
    target = torch.tensor([[1, -100, 3, 4], [-100, -100, 4, 5]])
    for t, expected in ((target, (5, 8)), (target.flip(0), (5, 8)), (target[:, :2], (1, 4))):
        got = tuple(int(share_count(counters[k], {"target": t}, 1)) for k in ("ne", "ones"))
        assert got == expected
    # per microbatch (2 rows, microbatch 1: 2 runs a call); "ones" only for the 2 shapes
    assert runs.count("ne") == 6 and runs.count("ones") == 4, runs


# the ranks' agreement before the step: host values (refusals, the sequence length, a count of
# shapes alone) in a CPU tensor over the CPU group, runtime/batches.py host_sum: no device value
HOST_AGREEMENT = "tolist at batches.py (host_sum)"
# the step's one read of a device value: the reduced [loss, non-finite flags, ids out of range]
STEP_READ = "tolist at state.py (step_results)"


def test_a_steady_step_reads_one_device_value_after_it_runs(single_process_group):
    """The second train_step of a token-weighted GPT (2 microbatches, labels counted by their
    values) reads one device value on the host: the reduced [loss, flags, ids out of range]
    after it ran, under the default nonfinite="raise" and under "ignore" alike (its input
    indexes an embedding: the ids' range must be read before the optimizer steps). Before the
    step only host values are agreed on (host_sum). The token count stays on the device (the
    loss scale is a device tensor). The old code read twice: agree's all-reduce of [refused,
    count, length, ...] before the step, and the [loss, flags] after it."""
    from tests.workers.common import Case
    from tests.workers.overlap import counted_syncs
    case = Case("syncs-gpt4", model="gpt4", microbatches=2)
    where = {key: [s.split(":")[0] + " " + s.split(" ")[-1] for s in
                   counted_syncs(case, 0, options)]
             for key, options in (("ignore", {"nonfinite": "ignore"}), ("default", {}))}
    assert sorted(where["ignore"]) == [HOST_AGREEMENT, STEP_READ], where
    assert sorted(where["default"]) == [HOST_AGREEMENT, STEP_READ], where


def test_ids_past_the_table_are_refused_with_nothing_moved(single_process_group):
    """The range check moved into the step's one read still refuses with nothing moved (the
    step ran on the ids clamped into the table, then its gradients were dropped), naming the
    input, the ids and the table."""
    import autopart
    import torch
    from autopart.errors import AutopartError
    from examples.gpt import GPT, config, lm_loss
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    pm = autopart.parallelize(GPT(config("tiny,n_layer=2,block_size=16")), autopart.Mesh(),
                              (x,), loss_fn=lm_loss, target=x, microbatches=2)
    pm.train_step(x, target=x)
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    with pytest.raises(AutopartError, match=r"'idx' holds ids from -1 to 300, but it indexes "
                                            r"the embedding table transformer.wte.weight"):
        pm.train_step(torch.where(x > 128, 300, -1), target=x)
    assert pm.steps == 1 and all(torch.equal(p.grad, grads[n]) for n, p in pm.named_parameters())
