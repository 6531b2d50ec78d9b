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
from autopart.passes.split_context_parallel import split_context_parallel
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
        elif self.mask == "window":       # causal with a window of 4: not supported
            keep = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4)
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


@pytest.mark.parametrize("mask, causal", [("is_causal", True), ("compare", True),
                                          ("hand", True)])
def test_cores_are_found_and_their_masks_proved_by_value(mask, causal):
    program = _program(mask)
    cores = find_cores(program)
    assert len(cores) == 1
    assert decide_causal(cores[0], program.gm, set(program.inputs), 32) is causal


def test_a_sliding_window_is_refused_naming_the_core():
    program = _program("window")
    core = find_cores(program)[0]
    with pytest.raises(AutopartError, match="neither causal nor absent(.|\n)*node:(.|\n)*remedy"):
        decide_causal(core, program.gm, set(program.inputs), 32)


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
