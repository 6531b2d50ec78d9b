"""Finding what context parallelism rewrites: attention cores, and the sources of positions.

An attention core is `scaled_dot_product_attention`, or the pattern written out by hand:

    scores = q @ k^T  [* c | / c]  [masked_fill(m, -inf) | + additive mask | where(m, ., -inf)]
    p = softmax(scores, -1)  [dropout(p=0) | dtype casts]
    out = p @ v

found by ops and dataflow. A core's mask is proved causal (or absent) by evaluating the ops that
build it at the captured sequence length (masks.py); anything else is refused by the caller.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopart.errors import node_error
from autopart.ir import SEQ, Program, sym_shape
from autopart.ops import aten_groups as G

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default
MATMULS = G.MATMULS_BATCHED
SOFTMAX = G.SOFTMAXES
CASTS = G.CASTS | G.COPIES | {aten.alias.default}
# score ops: (op, index of the scores argument) -> what the other argument is
SCALES = G.SCALES
MASKS = {aten.masked_fill.Scalar: "fill", aten.masked_fill.Tensor: "fill",
         aten.add.Tensor: "add", aten.where.self: "where", aten.where.ScalarOther: "where"}


@dataclass
class Core:
    """One attention core: the nodes it replaces (`last` is its output), q/k/v as the core
    reads them, the softmax scale, and its masks as (mask node, how it applies)."""
    last: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float | None
    masks: list
    k_transposed: bool = False      # k is k^T (hand-written core): the rewrite transposes it
    is_causal_flag: bool = False    # SDPA's is_causal=True
    causal: bool = False            # decided by masks.py
    key_mask: fx.Node | None = None   # a (batch, seq) input of padded keys (masks.py)
    doc_ids: fx.Node | None = None    # a (batch, seq) input of packed documents' ids (masks.py)
    window: int | None = None         # a causal sliding window of this many keys (masks.py)


def find_cores(program: Program) -> list[Core]:
    cores = _find(program)
    for core in cores:          # GQA: the ring passes each K/V head once, not repeated
        core.k, core.v = _unrepeated(core.k), _unrepeated(core.v)
    return cores


def _unrepeated(node: fx.Node) -> fx.Node:
    """x when `node` is Hugging Face's repeat_kv of x: reshape(expand(x[:, :, None], (b, kv,
    rep, s, d)), (b, kv * rep, s, d)), which repeats each K/V head rep times in a row, as the
    context-parallel kernels read a K/V head for rep query heads; else `node`."""
    if node.target not in G.RESHAPES:
        return node
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target != aten.expand.default:
        return node
    unsq = expand.args[0]
    if not isinstance(unsq, fx.Node) or unsq.target != aten.unsqueeze.default or \
            unsq.args[1] not in (2, -3) or len(expand.users) != 1:
        return node
    x, big, out = _val(unsq.args[0]), _val(expand), _val(node)
    if x is None or big is None or out is None or x.dim() != 4 or big.dim() != 5:
        return node
    # sizes as expressions: comparing SymInts would add guards fixing the sequence length
    (b, kv, s, d), big, out = (tuple(_shape(t)) for t in (x, big, out))
    if out != (b, kv * big[2], s, d) or big[:2] != (b, kv):
        return node
    return unsq.args[0]


def _shape(val) -> tuple:
    return tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in val.shape)


def _find(program: Program) -> list[Core]:
    cores = []
    for node in program.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == SDPA:
            cores.append(_sdpa_core(node))
        elif node.target in SOFTMAX:
            core = _written_core(node, program)
            if core is not None:
                cores.append(core)
    return cores


def _arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _sdpa_core(node: fx.Node) -> Core:
    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask")
    if _arg(node, 4, "dropout_p", 0.0):
        raise node_error(node, f"context parallelism replaces this attention, which has "
                         f"dropout_p={_arg(node, 4, 'dropout_p')}: attention dropout is not "
                         "done by the context-parallel kernels", "attention dropout 0 (dropout "
                         "elsewhere in the model is fine), or drop the cp axis")
    masks = [(mask, "bool" if _val(mask).dtype == torch.bool else "add")] if mask is not None else []
    return Core(node, q, k, v, _arg(node, 6, "scale"), masks,
                is_causal_flag=bool(_arg(node, 5, "is_causal", False)))


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _written_core(softmax: fx.Node, program: Program) -> Core | None:
    """The hand-written core around `softmax`, or None when it is not one (a router's softmax:
    no matmul of two activations on either side)."""
    if _arg(softmax, 1, "dim") not in (-1, _val(softmax).dim() - 1):
        return None
    scale, masks, node = 1.0, [], softmax.args[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target not in MATMULS:
        if node.target in CASTS:
            node = node.args[0]
        elif node.target in SCALES and not isinstance(node.args[1], fx.Node):
            c = float(node.args[1])
            scale *= c if node.target in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / c
            node = node.args[0]
        elif node.target in MASKS:
            node, mask = _scores_and_mask(node)
            if node is None:
                return None
            masks.append(mask)
        else:
            return None
    if not isinstance(node, fx.Node) or node.target not in MATMULS:
        return None
    first = node
    q, kt = first.args[:2]
    if not _has_seq(kt, -1, program) or not _has_seq(q, -2, program):
        return None         # not scores over the sequence (a router, a per-token product)
    out = _single_user_chain(softmax)
    if out is None or out.target not in MATMULS or out.args[0] is not _chain_end(softmax, out):
        return None
    k, transposed = _untransposed(kt)
    return Core(out, q, k, out.args[1], scale, masks, k_transposed=transposed)


def _scores_and_mask(node: fx.Node):
    """(scores input, (mask node, how)) of a masking op, or (None, None)."""
    how = MASKS[node.target]
    if how == "fill":
        fill = node.args[2]
        if isinstance(fill, fx.Node) or not math.isinf(float(fill)) or float(fill) > 0:
            return None, None
        return node.args[0], (node.args[1], "fill")
    if how == "where":
        other = node.args[2]
        if isinstance(other, fx.Node) or not math.isinf(float(other)) or float(other) > 0:
            return None, None
        return node.args[1], (node.args[0], "bool")
    a, b = node.args[:2]                 # add: the scores are the matmul side
    if not isinstance(b, fx.Node) or not isinstance(a, fx.Node):
        return None, None
    scores, mask = (a, b) if _from_matmul(a) else (b, a)
    return scores, (mask, "add")


def _from_matmul(node: fx.Node) -> bool:
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in MATMULS:
            return True
        if node.target not in CASTS | SCALES | set(MASKS):
            return False
        node = node.args[0]
    return False


def _single_user_chain(node: fx.Node) -> fx.Node | None:
    """The first op after `node` that is not a cast or a no-op dropout, along single users
    (a dtype check that export adds after a cast, `_assert_tensor_metadata`, reads nothing on)."""
    while len(users := _data_users(node)) == 1:
        (user,) = users
        if user.target in CASTS or (user.target == aten.dropout.default
                                    and (not user.args[1] or not user.args[2])):
            node = user
            continue
        return user
    return None


def _data_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target not in G.CHECKS]


def _chain_end(softmax: fx.Node, out: fx.Node) -> fx.Node:
    node = softmax
    while node not in out.args:
        (node,) = _data_users(node)
    return node


def _untransposed(kt: fx.Node) -> tuple[fx.Node, bool]:
    """k from k^T: the transpose's input when k^T is one (of the last two dims), else k^T
    itself, marked for the rewrite to transpose."""
    if kt.target == aten.transpose.int and {a % _val(kt).dim() for a in kt.args[1:3]} == \
            {_val(kt).dim() - 1, _val(kt).dim() - 2}:
        return kt.args[0], False
    return kt, True


def _has_seq(node, dim: int, program: Program) -> bool:
    val = _val(node)
    if val is None or val.dim() < 2:
        return False
    size = sym_shape(val, program.symbols)[dim]
    return getattr(size, "has", lambda s: False)(SEQ)


def upstream(starts, inputs_of=lambda n: n.all_input_nodes) -> set[fx.Node]:
    """The nodes reached from `starts` through `inputs_of` (each node's, once), the starts
    included: the one walk the pass's analyses share."""
    seen, todo = set(), list(starts)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(inputs_of(n))
    return seen


# -- positions ----------------------------------------------------------------------------------

ARANGES = G.ARANGES


def position_sources(program: Program) -> tuple[list[fx.Node], list[fx.Node]]:
    """(aranges over the sequence, slices of tables to the sequence length): the nodes whose
    values are sequence positions 0..s-1, or rows 0..s-1 of a table indexed by position."""
    aranges, slices = [], []
    for node in program.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in ARANGES:
            val = node.meta.get("val")
            if val is not None and val.dim() == 1 and sym_shape(val, program.symbols)[0] == SEQ:
                aranges.append(node)
        elif node.target == aten.slice.Tensor and _table_slice(node, program):
            slices.append(node)
    return aranges, slices


def _table_slice(node: fx.Node, program: Program) -> bool:
    """A slice [0:s] of a fixed-size dim (a table of max positions) giving s rows."""
    src, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else 0
    val, sval = node.meta.get("val"), _val(src)
    if val is None or sval is None or start not in (0, None):
        return False
    dim %= val.dim()
    out, full = sym_shape(val, program.symbols)[dim], sym_shape(sval, program.symbols)[dim]
    return out == SEQ and not getattr(full, "free_symbols", None)


__all__ = ["Core", "find_cores", "position_sources"]
