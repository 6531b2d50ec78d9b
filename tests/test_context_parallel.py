"""Context parallelism (a cp mesh axis) trains as the plain model does: the loss of every step,
the first step's gradients, the clipped norm and the parameters after 3 optimizer steps, fp32,
against the unmodified model on the same global batch (tests/_workers.py equivalence), with
ring and all-gather attention; and what it refuses, it refuses at compile time naming the node.

Models: the example GPT (SDPA, learned positions), an unmodified Hugging Face Llama from a config
(RoPE, GQA, HF's own causal mask as a tensor), and a model with attention written by hand
(q @ k^T, a tril buffer with masked_fill, softmax, @ v), ignored labels included.

Fast tier: python -m pytest -m "not full" tests/test_context_parallel.py
"""
from __future__ import annotations

import pytest
import torch

import autopart
from autopart.errors import AutopartError
from tests._workers import Case, assert_all_ranks_equal_plain, run_group
from tests.cp_workers import run_cp_cases

SEQ = dict(batch=4, seq=32)
GPT = dict(model="gpt4", batch=4, seq=16)      # the test GPT's block_size is 16


# -- equivalence ---------------------------------------------------------------------------------

FAST_2 = [
    Case("gpt-cp2-ring", cp=2, optim="adam", **GPT),
    Case("gpt-cp2-allgather", cp=2, cp_attention="allgather", **GPT),
    Case("llama-cp2-ring-ignored", model="cp-llama", cp=2, optim="adamw", ignored="uneven", **SEQ),
    Case("hand-cp2-allgather", model="cp-hand", cp=2, cp_attention="allgather", **SEQ),
]
FAST_4 = [
    Case("gpt-cp2xdp2-ring", cp=2, dp=2, optim="adam", **GPT),
    Case("gpt-cp2xtp2-sp-ring", cp=2, tp=2, sequence_parallel=True, **GPT),
    Case("gpt-cp2xpp2-1f1b", cp=2, pp=2, microbatches=2, **GPT),
    Case("llama-cp4-ring", model="cp-llama", cp=4, ignored="uneven", **SEQ),
]
FULL_2 = [
    Case("llama-cp2-allgather", model="cp-llama", cp=2, cp_attention="allgather", **SEQ),
    Case("hand-cp2-ring-ignored", model="cp-hand", cp=2, ignored="empty", **SEQ),
]
FULL_4 = [
    Case("gpt-cp4-allgather", cp=4, cp_attention="allgather", **GPT),
    Case("hand-cp4-ring", model="cp-hand", cp=4, **SEQ),
    Case("llama-cp2xtp2-allgather", model="cp-llama", cp=2, tp=2, cp_attention="allgather", **SEQ),
    Case("llama-cp2xpp2-interleaved", model="cp-llama", cp=2, pp=2, schedule="interleaved-1f1b",
         virtual_stages=1, microbatches=2, **SEQ),
    Case("gpt-cp2xdp2-zb-h1", cp=2, pp=2, schedule="zb-h1", microbatches=2, **GPT),
]
GROUPS = {("cp", 2): FAST_2, ("cp", 4): FAST_4, ("cp-full", 2): FULL_2, ("cp-full", 4): FULL_4}
_GROUP_OF = {c.name: k for k, cases in GROUPS.items() for c in cases}


def _param(case: Case):
    return pytest.param(case, id=case.name,
                        marks=[pytest.mark.full] if _GROUP_OF[case.name][0] == "cp-full" else [])


@pytest.mark.parametrize("case", [_param(c) for cases in GROUPS.values() for c in cases])
def test_matches_plain_model(case: Case, spawn_cache):
    results = run_group(spawn_cache, _GROUP_OF[case.name], GROUPS[_GROUP_OF[case.name]],
                        rank_fn=run_cp_cases)
    assert_all_ranks_equal_plain(case, results[case.name])
