"""Attention the kernels do not compute, refused as attention (not as a stray mixing op).

A softmax over scores q @ k^T of the sequence that find.py did not take as a core has something
between the scores and the softmax that the ring and all-gather kernels do not compute: a tanh
(logit soft-capping, Gemma 2), other logits concatenated to the scores (attention sinks,
GPT-OSS), a bias. Refused here, before the position check would name the softmax as an op
that mixes positions: the error names the scores, what stands between them and the softmax,
and the mask as proved by value (a sliding window of w keys, causal, ...), so a model that is
refused for its soft-capping is not mistaken for one refused for its sliding window.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopart.errors import node_error
from autopart.ir import SEQ, Program, sym_shape
from autopart.ops import aten_groups as G

from .check import _has_seq
from .find import CASTS, MASKS, SCALES, upstream
from .masks import HF_DOCUMENT_MASK, NotProvable, _window, input_reads, visibility

aten = torch.ops.aten

WHAT = {aten.tanh.default: "soft-caps them (tanh: logit soft-capping)",
        aten.cat.default: "joins other logits to them (attention sinks)"}
PASSING = CASTS | SCALES | set(MASKS) | G.RESHAPES | G.TRANSPOSES | G.UNSQUEEZES | \
    G.ALIASES | {aten.expand.default, aten.sub.Tensor, aten.amax.default, aten.max.dim,
                 operator.getitem}      # (subtracting the row's max before the softmax)


def refuse_unrecognised_attention(program: Program, cores, seq: int) -> None:
    """An error naming the first softmax over scores of the sequence that is no core."""
    done = {c.last for c in cores} | {n for c in cores for n in _between(c)}
    for node in program.gm.graph.nodes:
        if node.target not in G.SOFTMAXES or node in done or not _over_keys(node, program):
            continue
        region = upstream([node.args[0]], lambda n: [] if n.target in G.MATMULS_BATCHED
                          else n.all_input_nodes)
        scores = [n for n in region if n.target in G.MATMULS_BATCHED and _square(n, program)]
        if not scores:
            continue
        extra = sorted({WHAT.get(n.target, f"applies {_name(n)}") for n in region
                        if n.op == "call_function" and n.target not in PASSING
                        and n.target not in G.MATMULS_BATCHED and _on_scores(n, set(scores))})
        mask = _mask_kind(region, set(scores), program, seq)
        raise node_error(
            node, f"context parallelism replaces attention with its ring or all-gather kernels, "
            f"which compute softmax(q @ k^T * scale + mask) @ v; this attention (scores "
            f"{scores[0].name}{mask}) is not that: between the scores and this softmax it "
            f"{', '.join(extra) or 'computes ops the pass does not follow'}",
            "an attention whose scores reach the softmax only scaled and masked (a sliding "
            "window, padding and packed documents are computed; score soft-capping and "
            "attention sinks are not: a config without them, if the model allows), or drop "
            "the cp axis for this model (tp, pp and dp split it)")


FLEX = torch.ops.higher_order.flex_attention


def refuse_flex_attention(program: Program, cp: int) -> None:
    """An error naming the first flex_attention: its BlockMask and mask_mod are computed over
    the whole sequence (Hugging Face's from position_ids: a cumsum over the row), which the
    ring and all-gather kernels do not read per block."""
    node = next((n for n in program.gm.graph.nodes if n.target is FLEX), None)
    if node is None:
        return
    raise node_error(
        node, f"context parallelism (cp={cp}) does not split flex_attention "
        "(torch.ops.higher_order.flex_attention, e.g. Hugging Face's attn_implementation="
        "\"flex_attention\"): its BlockMask and mask_mod are built over the whole sequence, and "
        "the ring and all-gather kernels compute SDPA's masks only",
        "attn_implementation=\"sdpa\" with packed documents given as a (batch, sequence) input "
        f"of document ids and the mask {HF_DOCUMENT_MASK} (proved and applied per block under "
        "cp; HF's own mask from position_ids alone is a cumsum over the row, not provable per "
        "chunk), or drop the cp axis: tp, pp and dp split flex_attention")


def _between(core) -> set[fx.Node]:
    return upstream([core.last], lambda n: [] if n in (core.q, core.k, core.v)
                    else n.all_input_nodes)


def _over_keys(node: fx.Node, program: Program) -> bool:
    """A softmax along a dim of the sequence's size (s, or s + 1 with a sink's logit)."""
    val = node.meta.get("val")
    return val is not None and val.dim() >= 2 and \
        _has_seq(sym_shape(val, program.symbols)[-1])


def _square(node: fx.Node, program: Program) -> bool:
    """Scores of the sequence against itself: (..., s, s)."""
    val = node.meta.get("val")
    if val is None or val.dim() < 2:
        return False
    shape = sym_shape(val, program.symbols)
    return shape[-1] == SEQ and shape[-2] == SEQ


def _on_scores(node: fx.Node, scores: set) -> bool:
    """Whether the scores flow into `node` (not an op that only builds a mask)."""
    return bool(upstream([node], lambda n: [] if n in scores else n.all_input_nodes) & scores)


def _mask_kind(region: set, scores: set, program: Program, seq: int) -> str:
    """', its mask a causal sliding window of w keys' (or causal), proved by value; '' when
    there is none or it cannot be computed alone."""
    for node in region:
        found = _mask_of(node, scores) if node.target in MASKS and _on_scores(node, scores) \
            else None
        if found is None or input_reads(found[0], set(program.inputs)):
            continue
        mask, how = found
        try:
            seen = visibility(mask, how, program.gm, set(program.inputs), seq)[0]
        except (NotProvable, RuntimeError):     # only a description: without it, none
            continue
        w = _window(seen, seq)
        if w is not None:
            return f", its mask a causal sliding window of {w} keys (node {mask.name})"
        if bool((seen == torch.ones_like(seen).tril()).all()):
            return f", its mask causal (node {mask.name})"
    return ""


def _mask_of(node: fx.Node, scores: set):
    """(mask node, how it applies) of a masking op on the scores' path, or None."""
    how = MASKS[node.target]
    if how in ("fill", "where"):
        mask = node.args[1] if how == "fill" else node.args[0]
        return (mask, "fill" if how == "fill" else "bool") if isinstance(mask, fx.Node) else None
    off = [a for a in node.args[:2] if isinstance(a, fx.Node) and not _on_scores(a, scores)]
    return (off[0], "add") if len(off) == 1 else None


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]
