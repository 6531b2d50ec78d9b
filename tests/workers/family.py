"""Model families for tests/test_families.py and bench/families.py: small models in the styles
people train, each built from its own config with random weights (no downloads), with its loss
and one global batch. tests/workers/equivalence.py runs them against the unmodified model.

    llama-meta   examples/llama_meta.py: Meta's Llama style (complex-number rotary embeddings,
                 hand-written RMSNorm, repeat_kv by expand + reshape, SwiGLU)
    llama-gqa    the same with 2 k/v heads for 4 query heads
    neox         examples/neox.py: parallel attention + MLP blocks, fused qkv with interleaved
                 heads, ALiBi, dtype round trips
    bert         Hugging Face BertForMaskedLM (encoder-only, masked-LM loss)
    bart         Hugging Face BartForConditionalGeneration (encoder-decoder)
    vit          Hugging Face ViTForImageClassification (conv patch embedding, class token)
    qwen3        Hugging Face Qwen3ForCausalLM (per-head RMSNorm on q and k: a replicated
                 weight applied to every head, so its gradient is partial under tp)
    falcon       Hugging Face FalconForCausalLM (linears written `x @ w.T`, a fused qkv)
    phi3         Hugging Face Phi3ForCausalLM (fused qkv cut by slices, fused gate/up by chunk)
    stablelm     Hugging Face StableLmForCausalLM, qk_layernorm=True (per-head LayerNorms
                 after a split into heads)
    deepseek-v3  Hugging Face DeepseekV3ForCausalLM, dense layers (multi-head latent attention)
    qwen3-moe    Hugging Face Qwen3MoeForCausalLM (per-head norms, mixture of experts)
    gpt-oss      Hugging Face GptOssForCausalLM (attention sinks, mixture of experts)
    gemma3       Hugging Face Gemma3ForCausalLM (per-head norms with a (1 + weight) scale,
                 sliding and full attention whose rotary tables the model builds looping over a
                 Python set: the traced op order depends on the process's hash seed)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.workers import common
from tests.workers.equivalence import run_cases, run_group

VOCAB = 128


def _quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def logits_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a model output's logits (a tensor or a Hugging Face output's .logits)."""
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _tokens(case, g, vocab=VOCAB):
    return torch.randint(0, vocab, (case.batch, case.seq), generator=g)


def llama_meta(case, g, spec="tiny"):
    from examples.llama_meta import Llama, config
    model = Llama(config(f"{spec},vocab_size={VOCAB},dim=32,n_layers=4"))
    return model, logits_loss, (_tokens(case, g),), _tokens(case, g)


def neox(case, g):
    from examples.neox import NeoX, config
    model = NeoX(config(f"tiny,vocab_size={VOCAB}"))
    return model, logits_loss, (_tokens(case, g),), _tokens(case, g)


def bert(case, g):
    tf = _quiet_transformers()
    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tf.BertForMaskedLM(cfg), logits_loss, (_tokens(case, g),), _tokens(case, g)


def bart(case, g):
    """Encoder and decoder inputs of the same length; the loss is the decoder's."""
    tf = _quiet_transformers()
    cfg = tf.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=2, forced_eos_token_id=None)
    model = _Seq2Seq(tf.BartForConditionalGeneration(cfg))
    return model, logits_loss, (_tokens(case, g), _tokens(case, g)), _tokens(case, g)


class _Seq2Seq(torch.nn.Module):
    """An encoder-decoder called with (encoder tokens, decoder tokens): BART's own forward takes
    an attention mask second."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits




def vit(case, g):
    tf = _quiet_transformers()
    cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10)
    model = _Logits(tf.ViTForImageClassification(cfg), "pixel_values")
    pixels = torch.randn(case.batch, 3, 16, 16, generator=g)
    labels = torch.randint(0, 10, (case.batch,), generator=g)
    return model, logits_loss, (pixels,), labels


def _causal_lm(model, case, g):
    """A Hugging Face causal LM called with tokens, its logits scored by logits_loss."""
    return _Logits(model), logits_loss, (_tokens(case, g),), _tokens(case, g)


class _Logits(torch.nn.Module):
    """A Hugging Face model called with one input (tokens, or a ViT's pixel values) as the
    keyword `key`; returns its logits."""

    def __init__(self, model, key: str = "input_ids"):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(**{self.key: x}).logits


def qwen3(case, g):
    tf = _quiet_transformers()
    cfg = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=64, attn_implementation="eager")
    return _causal_lm(tf.Qwen3ForCausalLM(cfg), case, g)


def gemma3(case, g):
    tf = _quiet_transformers()
    cfg = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, max_position_embeddings=64, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"] * 2,
                              attn_implementation="eager")
    return _causal_lm(tf.Gemma3ForCausalLM(cfg), case, g)


def falcon(case, g):
    """FalconLinear computes `input @ self.weight.T`: linears written as matmuls."""
    tf = _quiet_transformers()
    cfg = tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                          num_attention_heads=4, new_decoder_architecture=False,
                          multi_query=False, parallel_attn=True, bias=False,
                          attn_implementation="eager")
    return _causal_lm(tf.FalconForCausalLM(cfg), case, g)


def phi3(case, g):
    """Fused qkv_proj cut by slices (`qkv[..., :query_pos]`), fused gate_up_proj by chunk."""
    tf = _quiet_transformers()
    cfg = tf.Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, pad_token_id=0,
                        attn_implementation="eager")
    return _causal_lm(tf.Phi3ForCausalLM(cfg), case, g)


def stablelm(case, g):
    """qk_layernorm=True: per-head LayerNorms applied after a torch.split into heads."""
    tf = _quiet_transformers()
    cfg = tf.StableLmConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                            max_position_embeddings=64, qk_layernorm=True,
                            attn_implementation="eager")
    return _causal_lm(tf.StableLmForCausalLM(cfg), case, g)


def deepseek_v3(case, g):
    """Multi-head latent attention (q/kv low-rank projections, a rope part and a no-rope part
    of each head), dense MLPs (first_k_dense_replace = every layer)."""
    tf = _quiet_transformers()
    cfg = tf.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                              moe_intermediate_size=16, num_hidden_layers=4,
                              first_k_dense_replace=4, num_attention_heads=4,
                              num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                              qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                              topk_group=1, max_position_embeddings=64,
                              attn_implementation="eager")
    return _causal_lm(tf.DeepseekV3ForCausalLM(cfg), case, g)


def gpt_oss(case, g):
    """Attention sinks (a learned per-head logit in the softmax), sliding and full attention,
    a mixture of experts with stacked expert weights."""
    tf = _quiet_transformers()
    cfg = tf.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=8, max_position_embeddings=64,
                          layer_types=["sliding_attention", "full_attention"],
                          attn_implementation="eager")
    return _causal_lm(tf.GptOssForCausalLM(cfg), case, g)


def qwen3_moe(case, g):
    """Per-head q/k norms and a mixture of experts (tp splits attention, ep the experts)."""
    tf = _quiet_transformers()
    cfg = tf.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                            max_position_embeddings=64, attn_implementation="eager")
    return _causal_lm(tf.Qwen3MoeForCausalLM(cfg), case, g)


FAMILIES = {"llama-meta": llama_meta, "llama-gqa": lambda c, g: llama_meta(c, g, "tiny-gqa"),
            "neox": neox, "bert": bert, "bart": bart, "vit": vit,
            "qwen3": qwen3, "gemma3": gemma3, "falcon": falcon,
            "phi3": phi3, "stablelm": stablelm, "deepseek-v3": deepseek_v3,
            "gpt-oss": gpt_oss, "qwen3-moe": qwen3_moe}


def build_with(builders: dict):
    """A build function (case, seed, device) over `builders` {name: fn(case, generator)}."""
    def build(case, seed: int = 0, device: str = "cpu"):
        """(model, loss_fn, inputs, target) of a family case, identical in every process."""
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed + 1)
        model, loss_fn, inputs, target = builders[case.model](case, g)
        return model.to(device), loss_fn, tuple(t.to(device) for t in inputs), target.to(device)
    return build


build_family = build_with(FAMILIES)


common.FAMILIES.update({name: build_family for name in FAMILIES})


WITHOUT_PARTIAL_SUM = "-no-partial-grad-sum"


def run_family_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: tests.workers.equivalence.run_cases with the families registered in this
    process; a case named ...-no-partial-grad-sum compiles with split_tensor_parallel finding no
    replicated parameter whose gradient is partial over tp (a per-head q/k norm's weight), so
    nothing sums their gradients over tp: it must differ from the plain model in those weights."""
    normal = [c for c in cases if not c.name.endswith(WITHOUT_PARTIAL_SUM)]
    out = run_cases(rank, world, normal)
    broken = [c for c in cases if c.name.endswith(WITHOUT_PARTIAL_SUM)]
    if broken:
        import importlib
        find = importlib.import_module("autopart.passes.split_tensor_parallel.find")
        real = find._plan_partial_grads
        find._plan_partial_grads = lambda gm, plan, activations: None
        try:
            out += run_cases(rank, world, broken)
        finally:
            find._plan_partial_grads = real
    return out


def run_family_group(cache: dict, key, cases: list) -> dict:
    """tests.workers.equivalence.run_group for family cases: one spawn per world size, once
    per session."""
    return run_group(cache, key, cases, rank_fn=run_family_cases)
