"""Families whose tensor-parallel split needs the rules of issue 49 (tests/test_tp_families.py):

    llama-interleaved  examples/llama_meta.py's Llama with rotary embeddings in the interleaved
                       pair form Meta's reference and many hand-written models use:
                       `torch.stack((a*cos - b*sin, a*sin + b*cos), -1).flatten(-2)`
    falcon-new         Hugging Face FalconForCausalLM, new_decoder_architecture=True (a fused
                       qkv per kv group cut by `qkv[:, :, :, [-2]]`, an aten.index.Tensor, and
                       `mlp_output += attention_output`)
    modernbert         Hugging Face ModernBertForMaskedLM (a fused Wqkv viewed (.., 3, -1, d))
    handwritten        the four rules in one small decoder (Handwritten)
    falcon-h1          Hugging Face FalconH1ForCausalLM: attention and a Mamba-2 mixer in every
                       layer, split by heads (2 groups of B and C, gated RMSNorm per group)
    qwen3-next         Hugging Face Qwen3NextForCausalLM: a gated DeltaNet layer (cat((q, k, v))
                       before its conv, a gated norm over heads reshaped into rows) and a gated
                       attention layer, dense MLPs

Each is built from a tiny config with random weights (no download) and registered in
tests.workers.common.FAMILIES, so the equivalence harness (tests/workers/equivalence.py) trains
it against the plain model.
"""
from __future__ import annotations

import torch

from tests.workers import common
from tests.workers.equivalence import run_cases
from tests.workers.family import (VOCAB, _causal_lm, _quiet_transformers, _tokens, build_with,
                                  logits_loss)


def rotate_interleaved(x, cos, sin):
    """Rotate the pairs (x[..., 2i], x[..., 2i+1]) of x [B, T, H, D] by cos, sin [T, D/2]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2).type_as(x)


def _interleaved_attention():
    """examples/llama_meta.Attention with the rotation written by torch.stack."""
    from examples.llama_meta import Attention, repeat_kv

    class InterleavedAttention(Attention):
        def forward(self, x, freqs_cis):
            b, t, _ = x.shape
            xq = self.wq(x).view(b, t, self.n_heads, self.head_dim)
            xk = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
            xv = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
            cos, sin = freqs_cis.real, freqs_cis.imag
            xq, xk = rotate_interleaved(xq, cos, sin), rotate_interleaved(xk, cos, sin)
            rep = self.n_heads // self.n_kv_heads
            q, k, v = (y.transpose(1, 2) for y in (xq, repeat_kv(xk, rep), repeat_kv(xv, rep)))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))
    return InterleavedAttention


def llama_interleaved(case, g, spec="tiny,n_heads=8,n_kv_heads=8"):
    from examples.llama_meta import Llama, config
    model = Llama(config(f"{spec},vocab_size={VOCAB},dim=64,n_layers=2"))
    cls = _interleaved_attention()
    for layer in model.layers:
        layer.attention.__class__ = cls
    return model, logits_loss, (_tokens(case, g),), _tokens(case, g)


def falcon_new(case, g):
    tf = _quiet_transformers()
    cfg = tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                          parallel_attn=True, bias=False, attn_implementation="eager")
    return _causal_lm(tf.FalconForCausalLM(cfg), case, g)


def modernbert(case, g):
    tf = _quiet_transformers()
    cfg = tf.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=64, local_attention=8,
                              global_attn_every_n_layers=2, pad_token_id=0,
                              attn_implementation="eager")
    return _causal_lm(tf.ModernBertForMaskedLM(cfg), case, g)


def falcon_h1(case, g):
    """Mamba-2 heads in 2 groups (B and C per group; a group's heads and their gated-norm
    group on one rank at tp=2), muP multipliers per section of the fused in_proj."""
    tf = _quiet_transformers()
    cfg = tf.FalconH1Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=64, mamba_d_ssm=32, mamba_n_heads=4,
                            mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                            mamba_chunk_size=8, mamba_rms_norm=True,
                            ssm_multipliers=[1.0, 0.5, 2.0, 0.25, 1.5],
                            max_position_embeddings=64, attn_implementation="eager")
    return _causal_lm(tf.FalconH1ForCausalLM(cfg), case, g)


def qwen3_next(case, g):
    """A gated DeltaNet layer (2 k heads, 4 v heads) and a gated full-attention layer, dense
    MLPs."""
    tf = _quiet_transformers()
    cfg = tf.Qwen3NextConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             intermediate_size=64, linear_conv_kernel_dim=4,
                             linear_key_head_dim=8, linear_value_head_dim=8,
                             linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0,
                             layer_types=["linear_attention", "full_attention"],
                             max_position_embeddings=64, attn_implementation="eager")
    return _causal_lm(tf.Qwen3NextForCausalLM(cfg), case, g)


class Handwritten(torch.nn.Module):
    """Issue 49's four rules in one small decoder, written as people write them: a fused Wqkv
    viewed (.., 3, -1, d) and unbound (the 3 is q|k|v), rotary embeddings by torch.stack of
    interleaved pairs, a fused projection read per group by a constant index of its sharded
    dim (groups 0 and 2 of 4: the first of each rank's two) and a column-parallel output added
    in place into a zeros accumulator."""

    def __init__(self, d: int = 32, heads: int = 4, seq: int = 64):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.wqkv, self.wo = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.grouped, self.down = torch.nn.Linear(d, 4 * 2 * 8), torch.nn.Linear(2 * 2 * 8, d)
        self.up, self.out = torch.nn.Linear(d, 64), torch.nn.Linear(64, d)
        self.head = torch.nn.Linear(d, VOCAB)
        angles = torch.outer(torch.arange(seq).float(), 0.5 ** torch.arange(self.hd // 2).float())
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        b, s, _ = h.shape
        q, k, v = self.wqkv(h).view(b, s, 3, -1, self.hd).unbind(2)
        q, k = (rotate_interleaved(t, self.cos[:s], self.sin[:s]) for t in (q, k))
        y = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.wo(y.transpose(1, 2).reshape(b, s, -1))
        picked = self.grouped(h).view(b, s, 4, 2, 8)[:, :, [0, 2]]
        h = h + self.down(torch.tanh(picked).reshape(b, s, -1))
        acc = torch.zeros(b, s, 64)
        acc += self.up(h)
        h = h + self.out(torch.relu(acc))
        return self.head(h)


def handwritten(case, g):
    return Handwritten(), logits_loss, (_tokens(case, g),), _tokens(case, g)


BUILDERS = {"llama-interleaved": llama_interleaved, "falcon-new": falcon_new,
            "modernbert": modernbert, "handwritten": handwritten, "falcon-h1": falcon_h1,
            "qwen3-next": qwen3_next}


build_tp_family = build_with(BUILDERS)


common.FAMILIES.update({name: build_tp_family for name in BUILDERS})


def run_tp_family_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: run_cases with these families registered in the rank process."""
    return run_cases(rank, world, cases)
