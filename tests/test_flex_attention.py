"""Hugging Face's attn_implementation="flex_attention", unmodified, with packed documents
(token ids and position_ids restarting per document, as HF's packed-sequence path takes them):
captured by torch.export (torch.ops.higher_order.flex_attention with its score_mod and mask_mod
subgraphs and the BlockMask create_block_mask builds in forward) and trained under tp=2, pp=2
and dp=2 as the plain model trains: the loss of every step, the first step's gradients and the
parameters after 3 optimizer steps, fp32 (tests/workers/equivalence.py). The plain model is the
same model and weights with attn_implementation="sdpa" (tests/workers/flex.py PackedHF.
plain_twin: torch refuses flex_attention's backward on the CPU in eager mode), whose mask HF
builds from the same position_ids. Context parallelism refuses flex_attention by name; the
remedy it names (attn_implementation="sdpa", the documents' mask from an id input passed as a
4-D attention_mask) trains at cp=2 as the plain model does.

Fast tier (the capture of a hand-written flex model, its loss and gradients against SDPA's; the
tp=2 training case, ~110 s, is in the full tier): python -m pytest -m "not full" tests/test_flex_attention.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopart
from autopart.errors import AutopartError
from tests.workers.common import ATOL, RTOL, Case
from tests.workers.equivalence import assert_all_ranks_equal_plain, run_group
from tests.workers.flex import _packed_flex, run_flex_cases

SEQ = dict(model="hf-flex-packed", batch=4, seq=32)
GROUPS = {
    ("flex-tp-full", 2): [Case("flex-packed-tp2", tp=2, optim="adamw", ignored="uneven", **SEQ)],
    ("flex-full", 2): [Case("flex-packed-pp2", pp=2, microbatches=2, **SEQ),
                       Case("flex-packed-dp2", dp=2, optim="adam", **SEQ)],
    # the remedy cp's refusal names: HF's SDPA with the documents' mask from an id input
    ("hf-doc-mask-full", 2): [Case("hf-sdpa-doc-mask-cp2-ring", cp=2, model="hf-sdpa-doc-mask",
                                   batch=4, seq=32)],
}
_GROUP_OF = {c.name: k for k, cases in GROUPS.items() for c in cases}


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.name, marks=[pytest.mark.full] if k[0].endswith("full") else [])
    for k, cases in GROUPS.items() for c in cases])
def test_matches_plain_model(case: Case, spawn_cache):
    results = run_group(spawn_cache, _GROUP_OF[case.name], GROUPS[_GROUP_OF[case.name]],
                        rank_fn=run_flex_cases)
    assert_all_ranks_equal_plain(case, results[case.name])
    if case.tp > 1:      # the heads split: every rank holds half of each attention projection
        assert all(any("q_proj" in n for n in r["tp_sharded"]) for r in results[case.name])


def _flex_nodes(program):
    return [n for n in program.gm.graph.nodes
            if n.target is torch.ops.higher_order.flex_attention]


@pytest.mark.full      # two captures of the model, ~30 s each on 2 busy cores
def test_the_document_mask_decides_the_loss_and_reaches_every_flex_attention():
    """What the equivalence cases would miss if the document mask were dropped: the plain
    model's loss with its packed documents differs from the same rows seen whole (causal
    only), and every captured flex_attention reads its mask_mod's buffers from position_ids."""
    model, loss_fn, (x, pos), y = _packed_flex(Case("c", **SEQ), 0, "cpu")
    plain = model.plain_twin()
    with torch.no_grad():
        packed = loss_fn(plain(x, pos), y)
        whole = loss_fn(plain.model(input_ids=x, position_ids=pos, use_cache=False,
                                    attention_mask=torch.ones_like(x)).logits, y)
    # the loss tolerance is RTOL * |loss| + ATOL, about 5e-5 here: the mask moves it 50 times that
    assert abs(float(packed) - float(whole)) > 50 * (RTOL * float(packed) + ATOL), \
        (float(packed), float(whole))
    c = autopart.compile(model, autopart.Mesh(tp=2), (x, pos), loss_fn=loss_fn, target=y)
    nodes = _flex_nodes(c.program)
    assert len(nodes) == 2
    for n in nodes:
        buffers = n.args[8]                                  # mask_mod_other_buffers
        seen, todo = set(), [b for b in buffers if isinstance(b, torch.fx.Node)]
        while todo:
            a = todo.pop()
            seen.add(a.name)
            todo.extend(a.all_input_nodes)
        assert "pos" in seen, n.format_node()
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= \
        {k.split(".")[-2] for k in c.plan.tp_shards}        # heads split, not replicated


@pytest.mark.full      # a capture of the model, ~30 s
def test_context_parallelism_refuses_flex_attention_by_name():
    model, loss_fn, (x, pos), y = _packed_flex(Case("c", **SEQ), 0, "cpu")
    with pytest.raises(AutopartError) as e:
        autopart.compile(model, autopart.Mesh(cp=2), (x, pos), loss_fn=loss_fn, target=y)
    text = str(e.value)
    for s in ["does not split flex_attention", "node:   flex_attention (", "modeling_llama.py",
              'attn_implementation="sdpa"', "doc[:, :, None] == doc[:, None, :]",
              "drop the cp axis"]:
        assert s in text, (s, text)


def test_context_parallelism_refuses_hf_sdpa_packed_by_position_ids_alone():
    """HF's SDPA path finds packed documents from position_ids with a cumsum over the row: no
    chunk can compute it, so cp refuses it, naming the cumsum and the 4-D mask remedy (the
    remedy itself trains at cp=2: the case hf-sdpa-doc-mask-cp2-ring)."""
    model, loss_fn, (x, pos), y = _packed_flex(Case("c", **SEQ), 0, "cpu")
    model.model.set_attn_implementation("sdpa")
    with pytest.raises(AutopartError) as e:
        autopart.compile(model, autopart.Mesh(cp=2), (x, pos), loss_fn=loss_fn, target=y)
    text = str(e.value)
    for s in ["depends on the input 'pos'", "numbers the documents by a cumsum along the row",
              "node:   scaled_dot_product_attention (", "modeling_llama.py",
              "doc[:, :, None] == doc[:, None, :]", "remedy:"]:
        assert s in text, (s, text)


class _FlexDocs(torch.nn.Module):
    """flex_attention written directly: a BlockMask built in forward from a document-id input
    (create_block_mask vmaps the mask_mod), heads from one linear; `sdpa` the same function
    with SDPA and a boolean mask."""

    def __init__(self, sdpa: bool = False):
        super().__init__()
        self.qkv, self.sdpa = torch.nn.Linear(16, 48), sdpa

    def forward(self, x, doc):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        if self.sdpa:
            mask = (doc[:, :, None] == doc[:, None, :])[:, None] & \
                torch.ones(t, t, dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()
        def same_doc(bi, h, i, j):
            return (i >= j) & (doc[bi, i] == doc[bi, j])
        block = create_block_mask(same_doc, b, None, t, t, device=x.device)
        return flex_attention(q, k, v, block_mask=block).sum()


# fast tier: 13 s (35 s on 2 busy cores): four exports (the CPU refusal, the sizes)
def test_capture_folds_the_block_masks_vmap_and_trains_on_the_cpu():
    """The vmap create_block_mask traces inline becomes one node (no functorch level call
    left for a pass to drop), the parameters' CPU backward refusal is passed, and the captured
    program's loss and gradients are SDPA's with the same document mask."""
    from autopart.capture import capture
    from autopart.vmap_regions import run_vmap_region
    torch.manual_seed(0)
    model, x = _FlexDocs(), torch.randn(2, 16, 16)
    doc = torch.tensor([[0] * 5 + [1] * 11, [2] * 16])
    program = capture(model, (x, doc))
    targets = [n.target for n in program.gm.graph.nodes]
    assert run_vmap_region in targets and torch.ops.higher_order.flex_attention in targets
    assert not [t for t in targets if "vmap" in getattr(t, "__name__", "") and
                t is not run_vmap_region]
    loss = program.gm(x, doc)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    loss.backward()
    plain = _FlexDocs(sdpa=True)
    plain.load_state_dict(model.state_dict())
    ref = plain(x, doc)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)

