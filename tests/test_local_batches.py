"""Local batches (runtime/batches.py, pm.batch_shard, pm.local_batch, train_step given each rank's
share): every rank fed only pm.local_batch(...) of the global batch trains what the plain model
trains on the whole batch (losses, step-1 gradients, clipped norm and parameters after 3 SGD
steps: tests/workers/equivalence.py), with labels -100 spread unevenly over the rows and
positions, so the shares count different numbers of tokens and the token-weighted loss is right
only with the counts summed over the ranks. A middle or first pipeline stage is fed what it reads
only: the first stage no target, the last no tokens, a middle stage nothing.

Bad local batches: a share one row short is refused on every rank, naming the rank, its rows and
the remedy, and nothing moves; tp peers given different shares are refused on the next checked
step (batch_check_every), naming both ranks.
"""
from __future__ import annotations

import pytest

import autopart
from autopart.runtime.batches import batch_shard
from autopart.runtime.launch import spawn
from tests.workers.common import Case
from tests.workers.equivalence import SPAWN_TIMEOUT, PG_TIMEOUT, assert_all_ranks_equal_plain
from tests.workers.local_batches import local_cases

M = dict(model="gpt4", microbatches=2, ignored="uneven")
FAST = [Case("local-pp2xdp2", pp=2, dp=2, **M), Case("local-tp2xdp2", tp=2, dp=2, **M),
        Case("local-cp2xdp2", cp=2, dp=2, **M)]
FULL = [Case("local-pp4-empty", pp=4, model="gpt4", microbatches=2, ignored="empty"),
        Case("local-pp2xdp2-zb", pp=2, dp=2, schedule="zb-v", virtual_stages=2, **M),
        Case("local-cp2xdp2-allgather", cp=2, dp=2, cp_attention="allgather", **M),
        Case("local-cp2-said", cp=2, **M)]


@pytest.fixture(scope="module")
def fast():
    return spawn(local_cases, 4, FAST, True, timeout=SPAWN_TIMEOUT, pg_timeout=PG_TIMEOUT)


def _ranks(results, name: str) -> list[dict]:
    return [r for per_rank in results for r in per_rank if r["case"] == name]


@pytest.mark.parametrize("case", FAST, ids=[c.name for c in FAST])
def test_each_rank_fed_its_share_trains_the_plain_model(fast, case):
    assert_all_ranks_equal_plain(case, _ranks(fast, case.name))


def test_pipeline_stages_are_fed_what_they_read_only(fast):
    for r in _ranks(fast, "local-pp2xdp2"):
        shard, shapes = r["fed"]["shard"], r["fed"]["shapes"]
        dp = r["rank"] % 2          # rank = (pp * dp + dp_i) for pp2 x dp2
        assert shard["rows"] == tuple(4 * dp + i for i in range(4)), shard
        if r["rank"] < 2:       # the first stage: tokens, no target
            assert shapes == [(4, 16), None], shapes
            assert shard["needs_inputs"] and not shard["needs_targets"]
        else:                   # the last stage: the target only (tokens' shape is enough)
            assert shapes == [None, (4, 16)], shapes
            assert shard["needs_targets"] and not shard["needs_inputs"]


def test_context_parallel_ranks_are_fed_their_two_chunks(fast):
    for r in _ranks(fast, "local-cp2xdp2"):
        shard = r["fed"]["shard"]
        c = r["rank"] % 2
        assert tuple(shard["seq_chunks"]) == (c, 3 - c) and shard["seq_chunks_total"] == 4
        assert r["fed"]["shapes"] == [(4, 8), (4, 8)], r["fed"]["shapes"]


def test_a_short_share_and_disagreeing_tp_peers_are_refused_naming_the_ranks(fast):
    bad = _ranks(fast, "bad")
    assert len(bad) == 4
    for r in bad:
        assert r["steps_after_refusal"] == 0, "the refused step moved nothing"
        if r["rank"] == 3:
            assert "input 'idx' has batch 3, but the model was compiled for the global batch 8"\
                in r["short"], r["short"]
            assert "rank 3's share is 4 rows (rows 4..7)" in r["short"]
            assert "remedy: pass the global batch, or pm.local_batch(...) of it" in r["short"]
        else:
            assert "rank(s) [3] refused the tensors they were given" in r["short"], r["short"]
        assert r["unchecked"] == "", "step 2 is not a checked step (batch_check_every=3)"
        assert "the ranks of data-parallel replica 0, context-parallel rank 0" in r["checked"]
        assert "ranks [0] hold" in r["checked"] and "ranks [1] hold" in r["checked"]
        assert "'idx'" in r["checked"] and "pm.local_batch" in r["checked"], r["checked"]
    assert len({r["first"] for r in bad}) == 1


@pytest.mark.full
@pytest.mark.parametrize("case", FULL, ids=[c.name for c in FULL])
def test_full_each_rank_fed_its_share_trains_the_plain_model(case, spawn_cache):
    key = ("local-full", case.world)
    if key not in spawn_cache:
        cases = [c for c in FULL if c.world == case.world]
        spawn_cache[key] = spawn(local_cases, case.world, cases, timeout=SPAWN_TIMEOUT,
                                 pg_timeout=PG_TIMEOUT)
    ranks = _ranks(spawn_cache[key], case.name)
    assert_all_ranks_equal_plain(case, ranks)
    if case.cp == 2 and case.dp == 1:   # fed local=True; without it the batch check refuses
        for r in _ranks(spawn_cache[key], "unsaid"):
            assert "different global batches on different ranks" in r["error"], r["error"]
            assert "pass train_step(..., local=True)" in r["error"], r["error"]
    if case.pp == 4:        # the middle stages were fed nothing at all
        for r in ranks:
            want = {0: [(8, 16), None], 1: [None, None], 2: [None, None], 3: [None, (8, 16)]}
            assert r["fed"]["shapes"] == want[r["rank"]], (r["rank"], r["fed"]["shapes"])


def test_batch_shard_of_each_rank():
    """Without processes: the rows, sequence chunks and reads of every rank of compiled
    layouts, written out."""
    import torch
    from examples.gpt import GPT, lm_loss
    from tests.workers.common import gpt_config
    x = torch.zeros(8, 16, dtype=torch.long)
    c = autopart.compile(GPT(gpt_config(2)), autopart.Mesh(dp=2, cp=2), (x,), loss_fn=lm_loss,
                         target=x)
    s = batch_shard(c, 3)       # dp 1, cp 1
    assert (s.rows, s.seq_chunks, s.seq_chunks_total) == ((4, 5, 6, 7), (1, 2), 4)
    assert s.positions(16) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert s.cut(torch.arange(8 * 16).reshape(8, 16), True)[0].tolist() == \
        [64 + p for p in s.positions(16)]
    assert s.needs_inputs and s.needs_targets
    p = autopart.compile(GPT(gpt_config(2)), autopart.Mesh(pp=2), (x,), loss_fn=lm_loss, target=x)
    first, last = batch_shard(p, 0), batch_shard(p, 1)
    assert (first.reads, last.reads) == (("idx",), ("target",))
    assert "BatchShard(rank=1, rows=(0, 1, 2, 3, 4, 5, 6, 7)" in repr(last)


def test_a_count_through_a_slice_is_not_summed_over_sequence_chunks():
    """Under cp each rank counts its chunks' tokens only when the count is elementwise; a count
    through a slice of the sequence (labels shifted in the loss) is counted by cp rank 0 over
    the whole sequence (parallel_model._count), which needs the global batch there."""
    import torch
    import torch.fx as fx
    from autopart.runtime.batches import count_not_elementwise, share_count
    from passes.weigh_loss_by_tokens import TokenCount
    aten = torch.ops.aten

    def program(shift: bool):
        g = fx.Graph()
        t = g.placeholder("target")
        if shift:
            t = g.call_function(aten.slice.Tensor, (t, 1, 1))
        ne = g.call_function(aten.ne.Scalar, (g.call_function(aten.reshape.default, (t, [-1])),
                                              -100))
        g.output(g.call_function(aten.sum.default, (ne,)))
        return TokenCount(fx.GraphModule(torch.nn.Module(), g), ("target",), "")
    target = torch.tensor([[1, 2, -100, 3], [-100, -100, 4, 5]])
    plain, shifted = program(False), program(True)
    assert count_not_elementwise(plain) is None
    assert count_not_elementwise(shifted).target is aten.slice.Tensor
    assert int(share_count(plain, {"target": target}, 1)) == 5
    assert int(share_count(shifted, {"target": target}, 1)) == 4
