"""Model families against the plain model: Meta-Llama style (complex rotary embeddings), a
GPT-NeoX/BLOOM-style decoder (parallel blocks, interleaved fused qkv, ALiBi), Hugging Face BERT
(encoder-only, masked LM), BART (encoder-decoder: the encoder output rides the pipeline cuts to
the decoder stages) and ViT (conv patch embedding, class token), each on pp=2, tp=2 and
tp=2 x pp=2 x dp=2: 3 SGD steps in fp32, every loss, the first gradients, the clipped norm and
every parameter against the unmodified single-process model (tests/_workers.equivalence).

Fast tier: python -m pytest -m "not full" tests/test_families.py
Full matrix: python -m pytest tests/test_families.py
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests._workers import Case, assert_all_ranks_equal_plain
from tests.family_workers import FAMILIES, build_family, run_family_group

NAMES = ["llama-meta", "neox", "bert", "bart", "vit"]
FAST_2 = [Case(f"{n}-pp2", model=n, pp=2, microbatches=2) for n in NAMES] + \
         [Case(f"{n}-tp2", model=n, tp=2) for n in NAMES]
FULL_2 = [Case(f"{n}-tp2-sp", model=n, tp=2, sequence_parallel=True)
          for n in ["llama-meta", "llama-gqa", "neox", "bert", "bart"]]    # vit: 17 tokens
FULL_8 = [Case(f"{n}-tp2xpp2xdp2", model=n, tp=2, pp=2, dp=2, microbatches=2) for n in NAMES]
GROUPS = {("families", 2): FAST_2, ("families-full", 2): FULL_2, ("families-full", 8): FULL_8}
_GROUP_OF = {c.name: key for key, cases in GROUPS.items() for c in cases}
CASES = [pytest.param(c, id=c.name) for c in FAST_2] + [
    pytest.param(c, id=c.name, marks=pytest.mark.full) for c in FULL_2 + FULL_8]

# Linears the README's families table says stay replicated over tp, by family: BERT's masked-LM
# head transform (dense -> gelu -> LayerNorm over its output features, then the tied decoder).
REPLICATED_OK = {"bert": 1}


@pytest.mark.parametrize("case", CASES)
def test_matches_plain_model(case: Case, spawn_cache):
    key = _GROUP_OF[case.name]
    assert_all_ranks_equal_plain(case, run_family_group(spawn_cache, key, GROUPS[key])[case.name])


@pytest.mark.parametrize("name", sorted(FAMILIES) + ["gpt4", "hf", "renamed"])
def test_no_replicated_linear_warnings_beyond_the_table(name):
    """Compiling each family (and the suite's other dense models) for tp=2 warns only about the
    replicated linears the README's families table lists, in one grouped warning."""
    import autopart
    from tests._workers import build
    model, loss_fn, inputs, target = build(Case(name, model=name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = autopart.compile(model, autopart.Mesh(tp=2), inputs, loss_fn=loss_fn,
                                    target=target)
    replicated = compiled.program.tp.skipped
    assert len(replicated) == REPLICATED_OK.get(name, 0), replicated
    ours = [w for w in caught if "stay replicated over tp" in str(w.message)
            or "stays replicated over tp" in str(w.message)]
    assert len(ours) == (1 if replicated else 0), [str(w.message) for w in ours]


def test_vit_sequence_parallel_names_the_real_sequence():
    """ViT's 16 patches + class token = 17 tokens: the error gives 17, not the 3 channels."""
    import autopart
    model, loss_fn, inputs, target = build_family(Case("vit", model="vit"))
    with pytest.raises(autopart.AutopartError, match=r"17 tokens"):
        autopart.compile(model, autopart.Mesh(tp=2), inputs, loss_fn=loss_fn, target=target,
                         sequence_parallel=True)
