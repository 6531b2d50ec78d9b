"""The model-config changes a rehearsal makes (`autopart verify`, autopart/cli/verify.py): the
width, heads and layers a mesh needs to divide, and with --shrink a small model of the same shape
(few layers, narrow, a short sequence and vocabulary), found by field role in the spellings of
autopart's examples and of Hugging Face configs.
"""
from __future__ import annotations

import copy
import re
from typing import Any

from autopart.errors import AutopartError
from autopart.mesh import Mesh


# Config fields by role, in the spellings of examples/gpt.py, examples/switch.py,
# examples/llama_meta.py and Hugging Face configs; the first one a config has is used.
WIDTH = ("n_embd", "hidden_size", "d_model", "dim")
HEADS = ("n_head", "num_attention_heads", "n_heads", "encoder_attention_heads")
DECODER_HEADS = ("decoder_attention_heads",)
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
HEAD_DIM = ("head_dim",)
LAYERS = ("n_layer", "num_hidden_layers", "n_layers", "num_layers", "encoder_layers")
DECODER_LAYERS = ("decoder_layers",)
FFN = ("d_ff", "intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
       "moe_intermediate_size", "shared_expert_intermediate_size")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K = ("top_k", "num_experts_per_tok")
VOCAB = ("vocab_size",)
POSITIONS = ("block_size", "n_positions", "max_position_embeddings", "seq_len", "max_seq_len")
GROUP = ("group_size",)
DROPOUT = re.compile(r"(dropout|pdrop|drop_prob|dropout_prob|dropout_rate)$")

SHRUNK_HEAD_DIM = 16
SHRUNK_SEQ = 32
SHRUNK_VOCAB = 256


def _fields(cfg) -> dict[str, Any]:
    import dataclasses
    if dataclasses.is_dataclass(cfg):
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if hasattr(cfg, "to_dict"):        # a Hugging Face PretrainedConfig
        out = dict(cfg.to_dict())
        for alias in getattr(cfg, "attribute_map", {}):
            out.setdefault(alias, getattr(cfg, alias, None))
        return out
    return dict(vars(cfg)) if hasattr(cfg, "__dict__") else {}


def _first(fields: dict, names: tuple) -> str | None:
    return next((n for n in names if isinstance(fields.get(n), int)
                 and not isinstance(fields.get(n), bool)), None)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def config_changes(cfg, mesh: Mesh, virtual_stages: int = 1, shrink: bool = True
                   ) -> dict[str, tuple[Any, Any]]:
    """{field: (old, new)}: dropout fields to 0 (always), and with `shrink` the width and depth
    made small while the layout keeps its structure: heads and k/v heads divisible by tp where
    they were, at least pp * virtual_stages layers, experts divisible by ep, the vocabulary
    divisible by tp. A config the full layout cannot take (heads not divisible by tp, fewer
    layers than chunks, ...) is an error here, not hidden by the smaller sizes."""
    f = _fields(cfg)
    changes: dict[str, tuple[Any, Any]] = {}
    for name, value in f.items():
        if DROPOUT.search(name) and isinstance(value, float) and value > 0:
            changes[name] = (value, 0.0)
    if not shrink:
        return changes
    tp, ep, chunks = mesh.tp, mesh.ep, mesh.pp * virtual_stages

    def need(ok: bool, what: str):
        if not ok:
            raise AutopartError(f"--shrink: {what}; the full layout cannot take this config "
                                f"either, so there is nothing to rehearse: fix it first")

    def put(name: str | None, new):
        if name is not None and new != f[name]:
            changes[name] = (f[name], new)

    width, heads = _first(f, WIDTH), _first(f, HEADS)
    kv = _first(f, KV_HEADS)
    if width is None or heads is None:
        raise AutopartError(f"--shrink: the config ({type(cfg).__name__}) has no width and head "
                            f"count fields among {', '.join(WIDTH)} / {', '.join(HEADS)}")
    h, w = f[heads], f[width]
    need(h % tp == 0, f"{heads}={h} is not divisible by tp={tp}")
    k = f[kv] if kv is not None else h
    if k == h:                            # multi-head attention
        new_h = _round_up(min(h, 4), tp)
        new_k = new_h
    else:                                 # grouped/multi-query: keep whether kv divides by tp
        new_k = _round_up(min(k, 2), tp) if k % tp == 0 else k
        group = h // k
        r = min(group, 2)
        while (new_k * r) % tp:
            r += 1
        new_h = new_k * r
    hd = min(w // h, SHRUNK_HEAD_DIM)
    hd += hd % 2                          # rotary embeddings need an even head size
    new_w = new_h * hd
    put(heads, new_h)
    put(_first(f, DECODER_HEADS), new_h)
    put(kv, new_k if kv is not None else None)
    put(width, new_w)
    if _first(f, HEAD_DIM) is not None:
        put("head_dim", hd)
    for name in FFN:
        if _first(f, (name,)) is not None:
            put(name, _round_up(max(1, round(f[name] * new_w / w)), tp))
    for names in (LAYERS, DECODER_LAYERS):
        layers = _first(f, names)
        if layers is not None:
            need(names is DECODER_LAYERS or f[layers] >= chunks,
                 f"{layers}={f[layers]} is fewer than pp*virtual_stages={chunks} chunks")
            put(layers, max(min(f[layers], 2), chunks))
    experts = _first(f, EXPERTS)
    if experts is not None:
        e = f[experts]
        need(e % ep == 0, f"{experts}={e} is not divisible by ep={ep}")
        top = _first(f, TOP_K)
        put(experts, _round_up(max(min(e, 4), f[top] if top else 1), ep))
    vocab = _first(f, VOCAB)
    if vocab is not None:
        v = f[vocab]
        need(v % tp == 0, f"{vocab}={v} is not divisible by tp={tp} (pad it to a multiple, "
                          f"as Megatron does)")
        put(vocab, _round_up(min(v, SHRUNK_VOCAB), tp))
    seq = _first(f, POSITIONS)
    if seq is not None:
        put(seq, min(f[seq], SHRUNK_SEQ))
        new_seq = min(f[seq], SHRUNK_SEQ)
        group_field = _first(f, GROUP)
        if group_field is not None and f[group_field] > new_seq:
            put(group_field, new_seq)
    return changes


def apply_changes(cfg, changes: dict[str, tuple[Any, Any]]):
    """A copy of `cfg` (a dataclass or a Hugging Face config) with the changes made."""
    import dataclasses
    new = {k: v for k, (_, v) in changes.items()}
    if dataclasses.is_dataclass(cfg):
        return dataclasses.replace(cfg, **new)
    out = copy.deepcopy(cfg)
    for k, v in new.items():
        setattr(out, k, v)
    return out


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {old}->{new}" for k, (old, new) in changes.items())


__all__ = ["DROPOUT", "apply_changes", "config_changes", "describe_changes"]
