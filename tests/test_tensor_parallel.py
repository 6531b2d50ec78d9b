"""Tensor (and sequence) parallelism on real ranks equals the plain model: every step's loss, the
first step's gradients (each rank's shard against the same shard of the plain gradient), the
clipped gradient norm, every parameter after 3 SGD steps, and full_state_dict() with full shapes.
Composed with pipeline and data parallelism (tp innermost in rank order), on the example GPT, an
unmodified Hugging Face GPT-2 and a copy of the example GPT with every name changed.

Fast tier: python -m pytest -m "not full" tests/test_tensor_parallel.py
Full matrix: python -m pytest tests/test_tensor_parallel.py
"""
from __future__ import annotations

import pytest

from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.shares import assert_rank_shares

FAST_2 = [
    Case("gpt-tp2", model="gpt4", tp=2, microbatches=2),
    Case("gpt-tp2-sp", model="gpt4", tp=2, sequence_parallel=True, microbatches=2),
    Case("hf-tp2", model="hf", tp=2, batch=4, seq=32),
    Case("renamed-tp2", model="renamed", tp=2, microbatches=2),
]
FAST_4 = [
    Case("gpt-tp2xpp2", model="gpt4", tp=2, pp=2, microbatches=2),
    Case("gpt-tp4", model="gpt4", tp=4, microbatches=2),
    # a V schedule puts the first and the last chunk on one rank: the tied embedding's vocab
    # shard must stay one Parameter there (each chunk's copy got half the gradient, silently)
    Case("gpt-tp2xpp2-zbv-tied", model="gpt4", tp=2, pp=2, schedule="zb-v", virtual_stages=2,
         microbatches=4),
]
FULL_4 = [
    Case("hf-tp2xpp2-zbv-tied", model="hf", tp=2, pp=2, schedule="zb-v", virtual_stages=2,
         batch=4, seq=32, microbatches=4),
    Case("gpt-tp2xpp2-dualpipev-tied", model="gpt4", tp=2, pp=2, schedule="dualpipe-v",
         virtual_stages=2, microbatches=4),
    Case("gpt-tp4-sp", model="gpt4", tp=4, sequence_parallel=True),
    Case("gpt-tp2xpp2-interleaved-sp", tp=2, pp=2, schedule="interleaved-1f1b",
         virtual_stages=2, sequence_parallel=True, microbatches=2),
    Case("gpt-tp2xdp2", model="gpt4", tp=2, dp=2, microbatches=2),
    Case("hf-tp4", model="hf", tp=4, batch=4, seq=32),
    Case("hf-tp2-sp", model="hf", tp=2, sequence_parallel=True, batch=4, seq=32, dp=2),
    Case("renamed-tp2xpp2", model="renamed", tp=2, pp=2, microbatches=2),
]
FULL_8 = [
    Case("gpt-tp2xpp2xdp2", model="gpt4", tp=2, pp=2, dp=2, microbatches=2),
    Case("hf-tp2xpp2xdp2-sp", model="hf", tp=2, pp=2, dp=2, sequence_parallel=True, batch=4,
         seq=32, microbatches=2),
]
GROUPS = {("tp-fast", 2): FAST_2, ("tp-fast", 4): FAST_4, ("tp-full", 4): FULL_4,
          ("tp-full", 8): FULL_8}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
CASES = [pytest.param(c, id=c.name) for c in FAST_2 + FAST_4] + [
    pytest.param(c, id=c.name, marks=pytest.mark.full) for c in FULL_4 + FULL_8]


def _results(case, spawn_cache) -> list[dict]:
    key = _GROUP_OF[case.name]
    return run_group(spawn_cache, key, GROUPS[key])[case.name]


@pytest.mark.parametrize("case", CASES)
def test_matches_plain_model(case: Case, spawn_cache):
    assert_all_ranks_equal_plain(case, _results(case, spawn_cache))


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_only_its_share(case: Case, spawn_cache):
    """A rank holds exactly the parameters its chunks read, tp shards at 1/tp of the plain
    model's size (tests/shares.py), instead of a fraction of the total that the cut's imbalance
    has to be allowed for."""
    assert_rank_shares(case, _results(case, spawn_cache))


def test_sequence_parallel_divides_activation_memory(spawn_cache):
    """Sequence parallelism shards what tensor parallelism leaves whole (norms, residuals,
    dropout) and re-gathers linear inputs in backward instead of keeping them: the activations a
    rank saves for backward drop to about 1/tp of the plain model's."""
    from autopart.runtime.launch import spawn
    from tests.workers.equivalence import activation_bytes
    if "act" not in spawn_cache:
        spawn_cache["act"] = spawn(activation_bytes, 2, timeout=300)
    for r in spawn_cache["act"]:
        plain, tp, sp = r["plain"], r["tp"], r["tp+sp"]
        assert sp < tp < plain, r
        assert sp <= 0.6 * plain, f"tp=2 with sequence parallelism saves {sp / plain:.2f} of plain"
