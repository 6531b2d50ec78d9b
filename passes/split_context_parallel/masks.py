"""Proving an attention mask causal (or absent) by computing it.

A mask is built from positions and sizes (`arange(s)[:, None] >= arange(s)`, a `tril` buffer
sliced to s, HF's mask functions): the ops that make it are copied into a small graph, the
sequence size set to the captured length S and the batch to 1, and run. The values then say
what the mask is: every key visible (no mask), exactly the lower triangle (causal), or something
the context-parallel kernels do not compute (a sliding window, a padding mask from the inputs,
a bias such as ALiBi), which the caller refuses. Proving by value, not by matching how the mask
was written, accepts every way of writing a causal mask and nothing else.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopart.errors import node_error

aten = torch.ops.aten


class NotProvable(Exception):
    """The mask depends on something other than positions and sizes."""


def visibility(mask: fx.Node, how: str, gm: fx.GraphModule, inputs: set[str], seq: int
               ) -> torch.Tensor:
    """The (S, S) boolean matrix of which key each query may see, as `how` applies the mask:
    "bool" (True = visible), "fill" (masked_fill: True = hidden), "add" (additive: 0 = visible,
    -inf = hidden; any other value is a bias, NotProvable)."""
    value = _evaluate(mask, gm, inputs, seq)
    if value.device.type == "meta":
        raise NotProvable("it is built from a tensor on the meta device, whose values are unknown")
    value = value.broadcast_to(value.shape[:-2] + (seq, seq)).reshape(-1, seq, seq)
    if not bool((value == value[:1]).all()):
        raise NotProvable("it differs between batch rows or heads")
    m = value[0]
    if how == "bool":
        return m.bool()
    if how == "fill":
        return ~m.bool()
    finite = torch.isfinite(m)
    if bool((m[finite] != 0).any()) or bool((m[~finite] > 0).any()):
        raise NotProvable("it adds values other than 0 and -inf (a position bias)")
    return finite


def _evaluate(mask: fx.Node, gm: fx.GraphModule, inputs: set[str], seq: int) -> torch.Tensor:
    needed = _ancestors(mask)
    g, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            raise NotProvable(f"it is computed from the input {node.name!r} (a padding or "
                              "document mask)" if node.name in inputs else
                              f"it reads {node.name!r}, whose value compile does not have")
        if node.target == aten.sym_size.int and node.args[0].op == "placeholder":
            env[node] = 1 if node.args[1] == 0 else seq if node.args[1] == 1 else \
                int(node.args[0].meta["val"].shape[node.args[1]])
            continue
        env[node] = g.node_copy(node, lambda n: env[n])
    g.output(env[mask])
    try:
        out = fx.GraphModule(gm, g)()
    except Exception as e:  # noqa: BLE001  (any failure: not provable, say which)
        raise NotProvable(f"computing it at the full sequence failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from e
    if not isinstance(out, torch.Tensor):
        raise NotProvable("it is not a tensor")
    return out


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target == aten.sym_size.int:
            continue            # a size of an input: set to its value, the input not needed
        todo.extend(n.all_input_nodes)
    return seen


def decide_causal(core, gm: fx.GraphModule, inputs: set[str], seq: int) -> bool:
    """Whether `core` is causal; an error naming the core when its mask is neither causal nor
    absent (or cannot be proved either)."""
    visible = torch.ones(seq, seq, dtype=torch.bool)
    if core.is_causal_flag:
        visible = visible.tril()
    for mask, how in core.masks:
        try:
            visible = visible & visibility(mask, how, gm, inputs, seq)
        except NotProvable as e:
            raise node_error(core.last, f"context parallelism replaces this attention, but its "
                             f"mask ({mask.name}) cannot be proved causal or absent: {e}",
                             _REMEDY) from None
    if bool(visible.all()):
        return False
    if bool((visible == torch.ones_like(visible).tril()).all()):
        return True
    rows = [i for i in range(seq) if not bool((visible[i] == (torch.arange(seq) <= i)).all())]
    raise node_error(core.last, f"context parallelism replaces this attention, but its mask is "
                     f"neither causal nor absent at the captured sequence length {seq} (query "
                     f"rows {rows[:4]}{'...' if len(rows) > 4 else ''} differ from causal: a "
                     "sliding window, a prefix or a block mask)", _REMEDY)


_REMEDY = ("context parallelism supports causal and unmasked attention only: drop the cp axis "
           "for this model (tp/sp and recompute also cut activation memory), or use a causal "
           "mask (no padding mask: pack documents and set ignored labels to -100)")
