"""What context parallelism refuses, each naming the node and a remedy.

A rank runs the model on its own sequence chunks. That is the plain model's computation when every
op outside the attention cores works position by position; an op that mixes positions (a
softmax, a cumulative sum or a reduction over the sequence, a matmul contracting it, a slice or a
concatenation along it, a convolution over it) would silently compute over the rank's chunks
only. Such ops are found from the symbolic sizes: a dim whose size involves the sequence symbol s.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopart.errors import AutopartError, node_error
from autopart.ir import SEQ, Program, sym_shape
from autopart.mesh import sequence_chunks
from autopart.ops import aten_groups as G

aten = torch.ops.aten

# op -> index of its dim argument (None: every dim); mixing along that dim
ALONG_DIM = {aten.softmax.int: 1, aten._softmax.default: 1, aten.log_softmax.int: 1,
             aten._log_softmax.default: 1, aten.cumsum.default: 1, aten.cumprod.default: 1,
             aten.sum.dim_IntList: 1, aten.mean.dim: 1, aten.amax.default: 1,
             aten.amin.default: 1, aten.max.dim: 1, aten.min.dim: 1, aten.var.correction: 1,
             aten.logsumexp.default: 1, aten.sort.default: 1, aten.topk.default: 2,
             aten.roll.default: 2, aten.flip.default: 1, aten.argmax.default: 1,
             aten.sum.default: None, aten.mean.default: None, aten.prod.default: None,
             aten.max.default: None, aten.min.default: None, aten.std.correction: 1}
# op -> index of its dim argument; moving rows along that dim by an index tensor (a gather, a
# scatter): values from other positions, or into them
INDEXED_AT = {aten.index_select.default: 1, aten.gather.default: 1, aten.scatter.src: 1,
              aten.scatter.value: 1, aten.scatter_add.default: 1, aten.scatter_reduce.two: 1,
              aten.index_add.default: 1, aten.index_copy.default: 1, aten.index_fill.int_Scalar: 1,
              aten.argsort.default: 1, aten.argsort.stable: 1}
# op -> index of its list of per-dim index tensors (None entries: dims taken whole)
INDEXED_BY_LIST = {aten.index.Tensor: 1, aten.index_put.default: 1, aten.index_put_.default: 1,
                   aten._unsafe_index.Tensor: 1, aten._unsafe_index_put.default: 1}
# counts over every element (a histogram of the batch's tokens)
COUNTS = {aten.histc.default, aten.bincount.default, aten.nonzero.default,
          aten.unique_consecutive.default, aten._unique2.default}
MATMULS = G.MATMULS
CONVS = G.CONVS


def check_sequence_length(program: Program, cp: int, tp: int, sequence_parallel: bool) -> int:
    """The captured sequence length S, checked: symbolic (the ranks run S/cp of it) and cut
    into 2*cp equal chunks (and S/cp into tp under sequence parallelism)."""
    seq = program.seq_len
    if seq is None or SEQ not in program.symbols.values():
        _refuse_a_recurrence(program, cp, seq)
        raise AutopartError(
            f"context parallelism (cp={cp}) runs each rank's program on its share of the "
            "sequence, but the model was captured with a fixed sequence length (the export "
            "could not keep dim 1 of the inputs symbolic: the model ties its shapes to the "
            f"example's {seq} positions).\n  remedy: let the model take any sequence length up "
            "to its maximum (no reshape to a fixed length), or drop the cp axis")
    n = sequence_chunks(cp)
    if seq % n:
        ok = [c for c in range(1, seq + 1) if seq % sequence_chunks(c) == 0 and c <= 64]
        raise AutopartError(
            f"context parallelism cuts the sequence into 2*cp = {n} equal chunks (causal "
            f"load balancing: rank i holds chunks i and {n - 1}-i), but the sequence is "
            f"{seq} tokens, not a multiple of {n}.\n  remedy: pad the sequence to a "
            f"multiple of {n} (labels of the padding -100), or cp in {ok}")
    if sequence_parallel and (seq // cp) % tp:
        raise AutopartError(
            f"sequence parallelism splits each cp rank's {seq // cp} tokens over tp={tp} ranks: "
            f"not divisible.\n  remedy: a sequence length that is a multiple of {cp * tp * 2}")
    return seq


RECURRENCES = CONVS | {aten.cumsum.default, aten.cumprod.default}


def _refuse_a_recurrence(program: Program, cp: int, seq: int | None) -> None:
    """A model whose export fixed the sequence length often does so because it carries state
    along the sequence (Mamba's causal conv1d and chunked scan, linear attention's recurrence):
    that, not the fixed length, is the reason cp cannot split it. Named when an op runs a
    convolution or a running sum along a dim of exactly the sequence's length."""
    weighted: set[fx.Node] = set()       # computed from parameters: the model's activations
    for node in program.gm.graph.nodes:
        if (node.op == "get_attr" and node.target in program.params) or \
                any(a in weighted for a in node.all_input_nodes):
            weighted.add(node)
        if node not in weighted or node.target not in RECURRENCES or seq is None:
            continue        # (a cumsum of the mask's positions is no recurrence of the model's)
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        dims = _mixed_dims(node, program.symbols) if val is not None else None
        if dims and any(int(val.shape[d]) == seq for d in dims if -val.dim() <= d < val.dim()):
            raise node_error(
                node, f"context parallelism (cp={cp}) gives each rank its own {seq // max(cp, 1)}"
                f"-token share of the {seq}-token sequence, but this {_name(node)} carries "
                "state along the sequence (a recurrent layer: a causal convolution or a scan "
                "over positions, as in Mamba or linear attention), so a rank's tokens depend on "
                "every earlier rank's; autopart does not pass that state between cp ranks",
                "drop the cp axis for this model (tp, pp and dp split it)")


def check_loss(program: Program, cp: int) -> None:
    """The loss must be a token mean the runtime weighs exactly (weigh_loss_by_tokens): a
    mean over each rank's chunks is not the mean over the sequence otherwise."""
    if program.loss_count is None:
        raise AutopartError(
            f"context parallelism (cp={cp}) computes the loss of each rank's tokens; the global "
            "loss is then exact only for a mean over tokens (cross_entropy / nll_loss with "
            "reduction='mean', or sum(l * mask) / mask.sum()), which weigh_loss_by_tokens did "
            f"not find in this model's loss ({program.loss_rule or 'no rule'}).\n  remedy: "
            "return a token-mean loss, or drop the cp axis")


def check_position_wise(program: Program, replaced: set[fx.Node], allowed: set[fx.Node]) -> None:
    """Refuse any op outside the replaced cores (and the loss and the proved islands,
    `allowed`) that mixes positions."""
    for node in mixing_nodes(program, replaced | allowed):
        raise node_error(node, f"context parallelism runs each rank on its own sequence "
                         f"chunks, and this {_name(node)} mixes positions along the "
                         "sequence outside an attention core the pass replaces (it would "
                         "see only the rank's chunks)", "keep ops across positions inside "
                         "attention (shift labels outside the model, for example), or drop "
                         "the cp axis")


def mixing_nodes(program: Program, skip: set[fx.Node]):
    """The ops not in `skip` that mix positions along the sequence, in graph order."""
    for node in program.gm.graph.nodes:
        if node.op != "call_function" or node in skip:
            continue
        dims = _mixed_dims(node, program.symbols)
        if dims is None:
            continue
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if src is None or "val" not in src.meta or not hasattr(src.meta["val"], "shape"):
            continue
        shape = sym_shape(src.meta["val"], program.symbols)
        if any(_has_seq(shape[d % len(shape)]) for d in dims if len(shape)):
            yield node


def _mixed_dims(node: fx.Node, symbols: dict) -> list[int] | None:
    if node.target in ALONG_DIM:
        i = ALONG_DIM[node.target]
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        rank = val.dim() if val is not None and hasattr(val, "dim") else 0
        default = -1 if node.target in (aten.sort.default, aten.topk.default) else None
        dim = None if i is None else (node.args[i] if len(node.args) > i else
                                      node.kwargs.get("dim", default))
        if dim is None:
            return list(range(rank))
        return list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if node.target in INDEXED_AT:
        i = INDEXED_AT[node.target]
        return [node.args[i] if len(node.args) > i else node.kwargs.get("dim", -1)]
    if node.target in INDEXED_BY_LIST:
        index = node.args[INDEXED_BY_LIST[node.target]]
        return [d for d, ix in enumerate(index) if ix is not None]
    if node.target in COUNTS:
        return None if node.args[0].meta.get("val") is None else \
            list(range(node.args[0].meta["val"].dim()))
    if node.target in MATMULS:
        return [-1]                         # the contracted dim of the first operand
    if node.target in CONVS:
        val = node.args[0].meta.get("val")
        return list(range(2, val.dim())) if val is not None else None
    if node.target == aten.slice.Tensor:
        return _cut(node, node.args[1] if len(node.args) > 1 else 0, symbols)
    if node.target == aten.cat.default:
        return _joined(node)
    if node.target in (aten.narrow.default, aten.select.int):
        return [node.args[1]]
    return None


def _cut(node: fx.Node, dim: int, symbols: dict) -> list[int] | None:
    """A slice that keeps the whole dim is no cut. Sizes compared as expressions: comparing
    the SymInts would add a guard that fixes the sequence length for the whole program."""
    src, val = node.args[0].meta.get("val"), node.meta.get("val")
    if src is None or val is None or \
            sym_shape(src, symbols)[dim] == sym_shape(val, symbols)[dim]:
        return None
    return [dim]


def _joined(node: fx.Node) -> list[int] | None:
    """A concatenation of one tensor with empty ones (HF's empty KV cache) joins nothing."""
    dim = node.args[1] if len(node.args) > 1 else 0
    parts = [p.meta.get("val") for p in node.args[0]]
    if any(p is None for p in parts):
        return None
    if sum(1 for p in parts if p.numel() > 0) <= 1:          # legacy empty (0,) parts too
        return None
    return [dim]


def _has_seq(size) -> bool:
    return bool(getattr(size, "free_symbols", None)) and SEQ in size.free_symbols


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]
