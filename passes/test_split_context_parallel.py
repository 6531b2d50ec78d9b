"""split_context_parallel as a pure function of a captured program: what it finds (attention
cores, their masks, position sources), what it rewrites, and what it refuses. Training against
the plain model is tests/test_context_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopart.capture import capture
from autopart.errors import AutopartError
from autopart.ir import sym_shape
from autopart.passes.split_context_parallel import prove_token_islands, split_context_parallel
from autopart.passes.split_context_parallel.find import find_cores, position_sources
from autopart.passes.split_context_parallel.masks import decide_causal
from autopart.passes.weigh_loss_by_tokens import weigh_loss_by_tokens


def _loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


class Attn(nn.Module):
    """One attention layer; `mask` picks how its mask is written."""

    def __init__(self, mask: str):
        super().__init__()
        self.mask, self.emb, self.head = mask, nn.Embedding(64, 16), nn.Linear(16, 64)
        self.register_buffer("tril", torch.ones(64, 64).tril())

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx).view(b, t, 2, 8).transpose(1, 2)
        pos = torch.arange(t)
        if self.mask == "is_causal":
            y = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        elif self.mask == "compare":      # causal, written as a comparison of positions
            y = F.scaled_dot_product_attention(x, x, x, attn_mask=pos[None, :] <= pos[:, None])
        elif self.mask == "window":       # causal with a window of 4: each query its last 4 keys
            keep = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4)
            y = F.scaled_dot_product_attention(x, x, x, attn_mask=keep)
        elif self.mask == "prefix":       # a prefix LM: the first 4 positions see each other
            keep = (pos[None, :] <= pos[:, None]) | (pos[None, :] < 4)
            y = F.scaled_dot_product_attention(x, x, x, attn_mask=keep)
        else:                             # by hand: a tril buffer sliced to the sequence
            s = (x @ x.transpose(-2, -1)) * 0.5
            s = s.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
            y = s.softmax(-1) @ x
        return self.head(y.transpose(1, 2).reshape(b, t, 16))


def _program(mask: str, seq: int = 32):
    x = torch.randint(0, 64, (2, seq))
    program = capture(Attn(mask), (x,), loss_fn=_loss, target=x)
    program, _ = weigh_loss_by_tokens(program, splits=2)
    return program


@pytest.mark.parametrize("mask, causal, window", [("is_causal", True, None),
                                                  ("compare", True, None), ("hand", True, None),
                                                  ("window", True, 4)])
def test_cores_are_found_and_their_masks_proved_by_value(mask, causal, window):
    program = _program(mask)
    cores = find_cores(program)
    assert len(cores) == 1
    assert decide_causal(cores[0], program.gm, set(program.inputs), 32) is causal
    assert cores[0].window == window


@pytest.mark.parametrize("mask, says", [
    ("prefix", "neither causal, nor absent, nor a causal sliding window"),
])
def test_a_prefix_is_refused_naming_the_core(mask, says):
    program = _program(mask)
    core = find_cores(program)[0]
    with pytest.raises(AutopartError, match=f"{says}(.|\n)*node:(.|\n)*remedy"):
        decide_causal(core, program.gm, set(program.inputs), 32)


class DocAttn(nn.Module):
    """A hand-written core masked by packed documents, written unlike PackedLM's SDPA mask:
    unsqueezes compared, and the causal part as a separate masked_fill of a tril buffer (a
    band of `window` keys when given: a sliding window within each document)."""

    def __init__(self, window: int | None = None):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
        tril = torch.ones(64, 64).tril()
        self.register_buffer("tril", tril.triu(-(window - 1)) if window else tril)

    def forward(self, idx, doc):
        b, t = idx.shape
        x = self.emb(idx).view(b, t, 2, 8).transpose(1, 2)
        s = (x @ x.transpose(-2, -1)) * 0.5
        s = s.masked_fill(doc.unsqueeze(1).unsqueeze(1) != doc.unsqueeze(1).unsqueeze(-1),
                          float("-inf"))
        s = s.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        return self.head((s.softmax(-1) @ x).transpose(1, 2).reshape(b, t, 16))


@pytest.mark.parametrize("window, mask, call", [
    (None, "causal", "cp_comm, True, 0.5, None, doc)"),
    # a window composes with documents: both masks, per block
    (5, "window 5", "cp_comm, True, 0.5, None, doc, window = 5)"),
])
def test_a_document_mask_is_proved_by_value_and_handed_to_the_kernel(window, mask, call):
    x = torch.randint(0, 64, (2, 32))
    doc = torch.arange(32).div(8, rounding_mode="floor").expand(2, 32).contiguous()
    program = capture(DocAttn(window), (x, doc), loss_fn=_loss, target=x)
    program, _ = weigh_loss_by_tokens(program, splits=2)
    out, report = split_context_parallel(program, cp=2)
    assert report["cores"] == [["matmul_1", mask]] and report["documents"] == ["doc"]
    assert call in out.gm.code, out.gm.code


def test_the_rewrite_replaces_the_core_and_makes_positions_the_ranks():
    program = _program("compare")
    assert [n.name for n in position_sources(program)[0]] == ["arange"]
    out, report = split_context_parallel(program, cp=2, attention="allgather")
    code = out.gm.code
    assert "autopart_cp_ops_allgather_kv_attention(" in code
    assert "scaled_dot_product_attention" not in code and "arange" not in code
    assert report["cores"] == [["scaled_dot_product_attention", "causal"]]
    assert (out.seq_len, out.cp.local_seq_len, out.cp.seq_len) == (16, 16, 32)
    assert program.gm.code.count("scaled_dot_product_attention.default(") == 1   # untouched


def test_a_table_sliced_to_the_sequence_is_indexed_at_the_positions():
    out, report = split_context_parallel(_program("hand"), cp=2)
    assert "tril" not in out.gm.code          # the mask's slice is dead once the core is gone
    assert report["cores"] == [["matmul_1", "causal"]]


def test_cp1_leaves_the_program_as_it_is():
    program = _program("hand")
    out, report = split_context_parallel(program, cp=1)
    assert out.gm is program.gm and report == {"cp": 1}


def test_a_sequence_not_cut_into_2cp_chunks_is_refused():
    with pytest.raises(AutopartError, match=r"2\*cp = 8 equal chunks(.|\n)*20 tokens"):
        split_context_parallel(_program("hand", seq=20), cp=4)


# -- token islands: layers that mix positions inside and are per-token as a whole ----------------

class SortedExperts(nn.Module):
    """Top-1 experts behind a token dispatcher in Megatron-LM's style: the batch's tokens sorted
    by expert, each row multiplied by its expert's weight, the rows put back in token order.
    `rank_scale`: each row is also scaled by its place in the sorted order, which depends on
    every other token (not per-token: context parallelism must refuse it)."""

    def __init__(self, rank_scale: bool = False, d: int = 16, experts: int = 4):
        super().__init__()
        self.rank_scale = rank_scale
        self.emb, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.router = nn.Linear(d, experts)
        self.w = nn.Parameter(torch.randn(experts, d, d) * 0.1)

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        q = x.view(b, t, 2, 8).transpose(1, 2)
        x = x + F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2) \
            .reshape(b, t, 16)
        flat = x.flatten(0, 1)
        expert = self.router(flat).argmax(-1)
        order = expert.argsort()
        rows = torch.bmm(flat[order][:, None, :], self.w[expert[order]]).squeeze(1)
        if self.rank_scale:
            rows = rows * torch.arange(rows.shape[0])[:, None] / rows.shape[0]
        out = torch.zeros_like(flat).index_add(0, order, rows)
        return self.head(x + out.view(b, t, 16))


def _moe_program(rank_scale: bool = False):
    x = torch.randint(0, 64, (2, 32))
    program = capture(SortedExperts(rank_scale), (x,), loss_fn=_loss, target=x)
    return weigh_loss_by_tokens(program, splits=2)[0]


def test_a_sort_gather_scatter_layer_is_an_island_proved_by_running_it():
    program, report = prove_token_islands(_moe_program(), cp=2)
    [island] = report["islands"]
    shapes = {n.name: str(sym_shape(n.meta["val"], program.symbols))
              for n in program.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    # the layer's input, and the ids whose sizes its reshape reads
    assert sorted(shapes[n] for n in island["entries"]) == ["(b, s)", "(b, s, 16)"]
    assert shapes[island["exits"][0]] == "(b, s, 16)" and len(island["exits"]) == 1
    out, report = split_context_parallel(program, cp=2)
    assert {"argsort", "index", "index_add"} <= {n.rstrip("_0123456789") for n in
                                                 report["islands"]}
    assert out.cp.islands == tuple(report["islands"])


def test_without_the_proof_the_sort_and_the_gathers_are_refused():
    # the op-by-op check alone must refuse each of them: the island is what admits them
    with pytest.raises(AutopartError, match="this argsort mixes positions(.|\n)*remedy"):
        split_context_parallel(_moe_program(), cp=2)


def test_a_layer_that_is_not_per_token_is_refused_with_the_numbers():
    with pytest.raises(AutopartError) as err:
        prove_token_islands(_moe_program(rank_scale=True), cp=2)
    text = str(err.value)
    for says in ("argsort", "not position-wise", "rank 0's chunks of a 32-token sequence (cp=2)",
                 "max difference", "test_split_context_parallel.py", "remedy:"):
        assert says in text, text


def test_an_op_reordering_the_sequence_is_refused_with_the_numbers():
    class Shifted(SortedExperts):           # each position reads its left neighbour's value
        def forward(self, idx):
            t = idx.shape[1]
            x = self.emb(idx)
            q = x.view(x.shape[0], t, 2, 8).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2)
            x = x + y.reshape(x.shape)
            return self.head(x.roll(1, 1))
    x = torch.randint(0, 64, (2, 32))
    program = weigh_loss_by_tokens(capture(Shifted(), (x,), loss_fn=_loss, target=x),
                                   splits=2)[0]
    with pytest.raises(AutopartError, match="this roll mixes(.|\n)*differs from the "
                                            "whole sequence's(.|\n)*remedy"):
        prove_token_islands(program, cp=2)
