"""The parallel run equals the plain model: every step's loss, the first step's gradients, the
clipped gradient norm and every parameter after 3 optimizer steps, fp32 (tests/workers/common.py
holds the tolerances and why), against a deep copy of the unmodified model taken before parallelize
and trained on the same global batch. Also: full_state_dict() has exactly model.state_dict()'s keys
and full shapes, and a rank holds exactly the parameters its chunks read, at the plain model's
size (or its tp share).

Models: examples.gpt.GPT (8 layers, tied embeddings), an unmodified Hugging Face GPT2LMHeadModel
built from a config (tied embeddings, loss on `.logits`), tests.workers.common.Toy (int64 and bool
tensors crossing pipeline cuts, a second user input needed by later chunks, loss_fn=None) and
tests.workers.common.Extras (a frozen layer, buffers, a parameter forward never reads).

Fast tier: python -m pytest -m "not full" tests/test_equivalence.py
Full matrix: python -m pytest tests/test_equivalence.py
"""
from __future__ import annotations

import pytest
import torch

from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, equivalence, run_group
from tests.shares import assert_rank_shares

M = dict(microbatches=4)

# -- fast tier: one 2-rank spawn, one 4-rank spawn, pp=1 in this process -------------------------
FAST_2 = [
    Case("gpt-pp2-gpipe", pp=2, schedule="gpipe", **M),
    Case("gpt-pp2-1f1b", pp=2, schedule="1f1b", **M),
    Case("gpt-pp2-interleaved-v2", pp=2, schedule="interleaved-1f1b", virtual_stages=2, **M),
    Case("gpt-pp2-mbs1", pp=2, batch=4, **M),
    Case("gpt-pp2-adam", pp=2, optim="adam", **M),
    Case("gpt-pp2-accumulate2", pp=2, accumulate=2, **M),     # tied grads summed once per call
    Case("gpt-dp2", dp=2),
    Case("gpt-dp2-accumulate2", dp=2, microbatches=2, accumulate=2),
    Case("hf-pp2-1f1b", model="hf", pp=2, batch=4, seq=32, microbatches=2),
    Case("toy-pp2", model="toy", pp=2, **M),
    Case("toy-pp2-mbs1", model="toy", pp=2, batch=4, **M),
    Case("extras-pp2", model="extras", pp=2, microbatches=2),   # frozen, buffers, unused param
]
FAST_4 = [
    Case("gpt-pp2xdp2-1f1b", pp=2, dp=2, microbatches=2),
    Case("gpt-pp2xdp2-interleaved-v2-accumulate2", pp=2, dp=2, schedule="interleaved-1f1b",
         virtual_stages=2, microbatches=2, accumulate=2),
]
FAST_1 = [   # pp=1, microbatches > 1: gradient accumulation inside train_step
    Case("gpt-pp1-m4", **M),
    Case("toy-pp1-m4-mbs1", model="toy", batch=4, **M),
]

# -- full matrix ---------------------------------------------------------------------------------
FULL_2 = [
    Case("gpt-pp2-1f1b-m8", pp=2, microbatches=8),
    Case("gpt-pp2-interleaved-v2-mbs1", pp=2, schedule="interleaved-1f1b", virtual_stages=2,
         batch=4, **M),
    Case("gpt-pp2-interleaved-v4", pp=2, schedule="interleaved-1f1b", virtual_stages=4, **M),
    Case("gpt-dp2-mbs1", dp=2, batch=4, microbatches=2),
    Case("hf-pp2-gpipe", model="hf", pp=2, schedule="gpipe", batch=4, seq=32, microbatches=2),
    Case("hf-pp2-interleaved-v2", model="hf", pp=2, schedule="interleaved-1f1b",
         virtual_stages=2, batch=4, seq=32, microbatches=2),
    Case("hf-pp2-mbs1", model="hf", pp=2, batch=4, seq=32, **M),
    Case("hf-dp2", model="hf", dp=2, batch=4, seq=32),
    Case("hf-pp2-adam", model="hf", pp=2, optim="adam", batch=4, seq=32, microbatches=2),
    Case("toy-pp2-interleaved-v2", model="toy", pp=2, schedule="interleaved-1f1b",
         virtual_stages=2, **M),
    Case("toy-dp2", model="toy", dp=2, microbatches=2),
]
FULL_4 = [
    Case("gpt-pp4-gpipe", pp=4, schedule="gpipe", **M),
    Case("gpt-pp4-1f1b", pp=4, schedule="1f1b", **M),
    Case("gpt-pp4-interleaved-v2", pp=4, schedule="interleaved-1f1b", virtual_stages=2, **M),
    Case("gpt-pp4-1f1b-m8-mbs1", pp=4, batch=8, microbatches=8),
    Case("gpt-pp4-adam", pp=4, optim="adam", **M),
    Case("gpt-dp4", dp=4),
    Case("hf-pp4-1f1b", model="hf", pp=4, batch=4, seq=32, **M),
    Case("hf-pp2xdp2", model="hf", pp=2, dp=2, batch=4, seq=32, microbatches=2),
    Case("toy-pp4", model="toy", pp=4, **M),
]
FULL_8 = [
    Case("gpt-pp4xdp2-interleaved-v2", pp=4, dp=2, schedule="interleaved-1f1b", virtual_stages=2,
         batch=16, **M),
    Case("gpt-pp2xdp4-1f1b", pp=2, dp=4, batch=16, microbatches=2),
    Case("gpt-pp8-1f1b", pp=8, batch=8, microbatches=8),
]
FULL_1 = [
    Case("hf-pp1-m2", model="hf", batch=4, seq=32, microbatches=2),
    Case("gpt-pp1-m4-adam", optim="adam", **M),
]

GROUPS = {("fast", 2): FAST_2, ("fast", 4): FAST_4, ("full", 2): FULL_2, ("full", 4): FULL_4,
          ("full", 8): FULL_8}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}


def _params(cases, full: bool):
    return [pytest.param(c, id=c.name, marks=[pytest.mark.full] if full else []) for c in cases]


SPAWNED = _params(FAST_2 + FAST_4, False) + _params(FULL_2 + FULL_4 + FULL_8, True)
IN_PROCESS = _params(FAST_1, False) + _params(FULL_1, True)


def _assert_equal_to_plain(case: Case, ranks: list[dict]) -> None:
    assert_all_ranks_equal_plain(case, ranks)
    held = set().union(*(r["held"] for r in ranks))
    plain = set(ranks[0]["plain_names"])
    assert held == plain, (f"{case.name}: parameters held by no rank {sorted(plain - held)}, "
                           f"unknown {sorted(held - plain)}")


@pytest.mark.parametrize("case", SPAWNED)
def test_matches_plain_model(case: Case, spawn_cache):
    results = run_group(spawn_cache, _GROUP_OF[case.name], GROUPS[_GROUP_OF[case.name]])
    _assert_equal_to_plain(case, results[case.name])


@pytest.mark.parametrize("case", IN_PROCESS)
def test_matches_plain_model_pp1(case: Case, single_process_group):
    _assert_equal_to_plain(case, [equivalence(case, 0)])


SHARED = [p for p in SPAWNED if p.values[0].pp > 1]


@pytest.mark.parametrize("case", SHARED)
def test_each_rank_holds_only_its_share(case: Case, spawn_cache):
    """A rank holds exactly the parameters the graphs of its chunks read (by get_attr name),
    each at the plain model's size (1/tp of it for a tensor-parallel shard, 1/ep for experts),
    so its share is computed from the plain model's parameter sizes, not taken from the run; each
    parameter is held by one pipeline stage (tied ones by the stages that read them), so with
    pp > 1 no rank holds everything; and ranks hold chunks r, r+pp, ...

    No fixed fraction bounds the share: the memory-aware cut gives the last stages of a 1F1B
    pipeline more layers (they keep fewer microbatches in flight)."""
    results = run_group(spawn_cache, _GROUP_OF[case.name], GROUPS[_GROUP_OF[case.name]])
    assert_rank_shares(case, results[case.name])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (runs on NCCL)")
def test_matches_plain_model_on_nccl(spawn_cache):
    cases = [Case("gpt-pp2-1f1b-cuda", pp=2, device="cuda", **M),
             Case("gpt-pp2-interleaved-v2-cuda", pp=2, schedule="interleaved-1f1b",
                  virtual_stages=2, device="cuda", **M)]
    results = run_group(spawn_cache, ("cuda", 2), cases)
    for case in cases:
        _assert_equal_to_plain(case, results[case.name])
