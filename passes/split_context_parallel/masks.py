"""Proving an attention mask causal (or absent) by computing it.

A mask is built from positions and sizes (`arange(s)[:, None] >= arange(s)`, a `tril` buffer
sliced to s, HF's mask functions): the ops that make it are copied into a small graph, the
sequence size set to the captured length S and the batch to 1, and run. The values then say
what the mask is: every key visible (no mask), exactly the lower triangle (causal), exactly a
causal band of w keys (a sliding window: causal & i - j < w, checked again at length S - 1 so
that w does not depend on the length), or something the context-parallel kernels do not compute
(a prefix, a block mask, a bias such as ALiBi), which the caller refuses. A mask read from one
(batch, sequence) input is fed patterns of that input: it must then hide exactly the keys the
input marks as padding (a key mask), or exactly the keys of other documents, `doc[b, i] !=
doc[b, j]` (packed documents' ids). Proving by value, not by matching how the mask was
written, accepts every way of writing a causal mask (or window) and nothing else.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopart.errors import node_error
from autopart.localize import attribute

from .find import upstream

aten = torch.ops.aten


class NotProvable(Exception):
    """The mask depends on something other than positions and sizes."""


def visibility(mask: fx.Node, how: str, gm: fx.GraphModule, inputs: set[str], seq: int,
               feeds: dict | None = None, batch: int = 1) -> torch.Tensor:
    """The (batch, S, S) boolean matrices of which key each query may see, as `how` applies
    the mask: "bool" (True = visible), "fill" (masked_fill: True = hidden), "add" (additive:
    0 = visible, -inf = hidden; any other value is a bias, NotProvable). `feeds`: values for
    the inputs the mask reads (input name -> tensor of `batch` rows)."""
    value = _evaluate(mask, gm, inputs, seq, feeds or {}, batch)
    if value.device.type == "meta":
        raise NotProvable("it is built from a tensor on the meta device, whose values are unknown")
    value = value.broadcast_to(value.shape[:-2] + (seq, seq))
    while value.dim() < 4:                  # (batch or 1, heads or 1, ..., S, S)
        value = value.unsqueeze(0)
    if value.shape[0] not in (1, batch):
        raise NotProvable(f"its shape {tuple(value.shape)} does not broadcast over the batch")
    value = value.broadcast_to((batch,) + value.shape[1:]).reshape(batch, -1, seq, seq)
    if not bool((value == value[:, :1]).all()):
        raise NotProvable("it differs between heads")
    m = value[:, 0]
    if how == "bool":
        return m.bool()
    if how == "fill":
        return ~m.bool()
    # hidden: -inf, or the dtype's lowest value (Hugging Face's additive masks), which softmax
    # turns into the same exact 0 wherever a row sees any key
    finite = ~(torch.isneginf(m) | (m <= torch.finfo(m.dtype).min / 2))
    if bool((m[finite] != 0).any()):
        raise NotProvable("it adds values other than 0 and -inf (a position bias)")
    return finite


def _evaluate(mask: fx.Node, gm: fx.GraphModule, inputs: set[str], seq: int, feeds: dict,
              batch: int) -> torch.Tensor:
    needed = _ancestors(mask)
    g, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder" and node.name in feeds:
            env[node] = g.get_attr(f"_feed_{node.name}")
            continue
        if node.op == "placeholder":
            raise NotProvable(f"it is computed from the input {node.name!r} (a padding or "
                              "document mask)" if node.name in inputs else
                              f"it reads {node.name!r}, whose value compile does not have")
        if node.target == aten.sym_size.int and node.args[0].op == "placeholder":
            env[node] = batch if node.args[1] == 0 else seq if node.args[1] == 1 else \
                _static(node.args[0].meta["val"].shape[node.args[1]])
            continue
        env[node] = g.node_copy(node, lambda n: env[n])
    g.output(env[mask])
    try:
        root = {n.target: attribute(gm, n.target) for n in g.nodes
                if n.op == "get_attr" and not n.target.startswith("_feed_")}
        root.update({f"_feed_{name}": value for name, value in feeds.items()})
        out = fx.GraphModule(root, g)()
    except Exception as e:  # noqa: BLE001  (any failure: not provable, say which)
        raise NotProvable(f"computing it at the full sequence failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from e
    if not isinstance(out, torch.Tensor):
        raise NotProvable("it is not a tensor")
    return out


def _static(size) -> int:
    if isinstance(size, torch.SymInt):      # int() would fix it for the whole program
        raise NotProvable("it depends on a symbolic size other than the batch and sequence")
    return int(size)


def input_reads(node: fx.Node, inputs: set[str]) -> list[fx.Node]:
    """The user inputs `node` is computed from (their values, not only their sizes)."""
    return sorted((n for n in _ancestors(node) if n.op == "placeholder" and n.name in inputs),
                  key=lambda n: n.name)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    # a size of an input is set to its value: the input itself is not needed
    return upstream([node], lambda n: () if n.target == aten.sym_size.int else n.all_input_nodes)


def decide_causal(core, gm: fx.GraphModule, inputs: set[str], seq: int) -> bool:
    """Whether `core` is causal, setting core.window when its mask is a causal sliding window,
    core.key_mask when a mask also hides padded keys (or core.doc_ids when it hides other
    documents' keys); an error naming the core when its mask is none of these (or cannot be
    proved one)."""
    try:
        visible = _visible(core, gm, inputs, seq)
    except NotProvable as e:
        raise node_error(core.last, f"context parallelism replaces this attention, but {e}",
                         _REMEDY) from None
    if bool(visible.all()):
        return False
    if bool((visible == torch.ones_like(visible).tril()).all()):
        return True
    w = _window(visible, seq)
    if w is not None:
        core.window = _same_window_shorter(core, gm, inputs, seq, w)
        return True
    rows = [i for i in range(seq) if not bool((visible[i] == (torch.arange(seq) <= i)).all())]
    raise node_error(core.last, f"context parallelism replaces this attention, but its mask is "
                     f"neither causal, nor absent, nor a causal sliding window at the captured "
                     f"sequence length {seq} (query rows {rows[:4]}"
                     f"{'...' if len(rows) > 4 else ''} differ from causal: a prefix, a block "
                     "mask or a window that is not causal)", _REMEDY)


def _visible(core, gm: fx.GraphModule, inputs: set[str], seq: int) -> torch.Tensor:
    """The (S, S) visibility of `core`'s masks together (apart from padding and documents,
    which set core.key_mask / core.doc_ids); NotProvable naming the mask that is not."""
    visible = torch.ones(seq, seq, dtype=torch.bool)
    if core.is_causal_flag:
        visible = visible.tril()
    for mask, how in core.masks:
        try:
            reads = input_reads(mask, inputs)
            if not reads:
                visible = visible & visibility(mask, how, gm, inputs, seq)[0]
                continue
            visible = visible & _from_input(core, mask, how, reads, gm, inputs, seq)
        except NotProvable as e:
            raise NotProvable(f"its mask ({mask.name}) cannot be proved causal, absent or a "
                              f"causal sliding window: {e}") from None
    return visible


def _band(seq: int, w: int) -> torch.Tensor:
    """Causal & i - j < w: each query sees its last w keys."""
    return torch.ones(seq, seq, dtype=torch.bool).tril().triu(-(w - 1))


def _window(visible: torch.Tensor, seq: int) -> int | None:
    """w when `visible` is a causal sliding window of w keys (0 < w < seq), else None."""
    w = int(visible[-1].sum())
    return w if 0 < w < seq and bool((visible == _band(seq, w)).all()) else None


def _same_window_shorter(core, gm, inputs: set[str], seq: int, w: int) -> int:
    """w, once the mask is the same window at length seq - 1 too (a window computed from the
    length, such as seq // 4, would be another at the lengths train_step may be given)."""
    shorter = seq - 1
    try:
        again = _visible(core, gm, inputs, shorter)
    except NotProvable as e:
        raise node_error(core.last, f"context parallelism replaces this attention, whose mask is "
                         f"a sliding window of {w} keys at the captured sequence length {seq}, "
                         f"but at length {shorter} {e}", _REMEDY) from None
    if not bool((again == _band(shorter, w)).all()):
        raise node_error(core.last, f"context parallelism replaces this attention, whose mask is "
                         f"a sliding window of {w} keys at the captured sequence length {seq}, "
                         f"but not a window of {w} keys at length {shorter}: its width depends "
                         "on the sequence length", _REMEDY)
    return w


def _sequence_input(reads: list):
    """(name, dtype) of the one (batch, sequence) input a mask is read from."""
    val = reads[0].meta.get("val")
    # dim 1 symbolic: the sequence (only the batch and the sequence are captured symbolic)
    if len(reads) > 1 or val is None or val.dim() != 2 or \
            not isinstance(val.shape[1], torch.SymInt):
        names = ", ".join(repr(r.name) for r in reads)
        raise NotProvable(f"it is computed from the input(s) {names}, not from one (batch, "
                          "sequence) input (a padding mask, or packed documents' ids; packed "
                          "rows with padding: give the padding a document id of its own, e.g. "
                          "-1, and build the mask from the ids alone)")
    return reads[0].name, val.dtype


def _from_input(core, mask: fx.Node, how: str, reads: list, gm, inputs, seq: int):
    """The mask's visibility apart from its input: a key padding mask, else packed documents."""
    try:
        return _key_padding(core, mask, how, reads, gm, inputs, seq)
    except NotProvable as padding:
        try:
            return _documents(core, mask, how, reads, gm, inputs, seq)
        except NotProvable as documents:
            if str(documents) == str(padding):
                raise
            raise NotProvable(f"{padding}; nor as packed documents' ids: {documents}"
                              f"{_scanned_documents(mask, reads)}") from None


# the 4-D document mask Hugging Face passes through to SDPA, which cp proves and splits
HF_DOCUMENT_MASK = "attention_mask=(doc[:, :, None] == doc[:, None, :])[:, None] & causal"


def _scanned_documents(mask: fx.Node, reads: list) -> str:
    """Why, when the mask numbers documents by a running sum of its input along the row:
    Hugging Face's packed path finds a new document wherever position_ids is not the previous
    one + 1 and cumsums those starts, which a rank holding two chunks of the row cannot
    compute."""
    if not any(n.target == aten.cumsum.default and set(reads) & _ancestors(n)
               for n in _ancestors(mask)):
        return ""
    return ("; it numbers the documents by a cumsum along the row (as Hugging Face does from "
            "position_ids alone), which no chunk of the sequence can compute: give the document "
            f"ids as an input and pass {HF_DOCUMENT_MASK} (Hugging Face passes a 4-D mask "
            "through), with position_ids as the positions")


def _key_padding(core, mask: fx.Node, how: str, reads: list, gm, inputs, seq: int):
    """The mask's visibility apart from padding, when it is that visibility & keep[b, key] for
    an input `keep` of shape (batch, seq) (a padding mask from the data); core.key_mask set to
    that input. Checked by computing the mask for an all-kept input and for patterns of
    padding: it must hide exactly the padded keys of each row, in every query row."""
    name, dtype = _sequence_input(reads)
    patterns = _padding_patterns(seq)
    base = visibility(mask, how, gm, inputs, seq, {name: torch.ones(2, seq, dtype=dtype)}, 2)
    if not bool((base == base[:1]).all()):
        raise NotProvable(f"with no padding in {name!r} it differs between batch rows")
    for keep in patterns:
        got = visibility(mask, how, gm, inputs, seq, {name: keep.to(dtype)}, 2)
        if not bool((got == (base & keep[:, None, :])).all()):
            raise NotProvable(f"it depends on the input {name!r} other than by hiding the keys "
                              "it marks as padding (0)")
    core.key_mask = reads[0]
    return base[0]


def _documents(core, mask: fx.Node, how: str, reads: list, gm, inputs, seq: int):
    """The mask's visibility apart from documents, when it is that visibility & (doc[b, query]
    == doc[b, key]) for an input `doc` of shape (batch, seq); core.doc_ids set to that input.
    Checked by computing the mask for one document per row and for patterns of packed ids."""
    name, dtype = _sequence_input(reads)
    if dtype.is_floating_point or dtype == torch.bool:
        raise NotProvable(f"the input {name!r} is {dtype}, not integer document ids")
    base = visibility(mask, how, gm, inputs, seq, {name: torch.zeros(2, seq, dtype=dtype)}, 2)
    if not bool((base == base[:1]).all()):
        raise NotProvable(f"with one document per row in {name!r} it differs between batch rows")
    for doc in _document_patterns(seq):
        got = visibility(mask, how, gm, inputs, seq, {name: doc.to(dtype)}, 2)
        if not bool((got == (base & (doc[:, :, None] == doc[:, None, :]))).all()):
            raise NotProvable(f"it depends on the input {name!r} other than by hiding the keys "
                              "of other documents (doc[b, query] != doc[b, key])")
    core.doc_ids = reads[0]
    return base[0]


def _document_patterns(seq: int) -> list[torch.Tensor]:
    """Rows of document ids: packs of several lengths (ids large and small, padding -1 at the
    end), and ids drawn at random per token (equality, not order, decides)."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(seq)
    packs = torch.stack([pos // 3, (pos >= seq // 2).long() * 70000 + 7])
    padded = torch.stack([torch.where(pos < seq - 4, pos // 5, -1), (pos * 7) // seq])
    return [packs, padded, torch.randint(0, 50, (2, seq), generator=g)]


def _padding_patterns(seq: int) -> list[torch.Tensor]:
    """Rows of kept (True) and padded keys: right padding, left padding, a padded run, random."""
    g = torch.Generator().manual_seed(0)
    right = torch.arange(seq) < seq - seq // 3
    run = (torch.arange(seq) < seq // 4) | (torch.arange(seq) > seq // 2)
    rand = torch.rand(2, seq, generator=g) < 0.6
    return [torch.stack([right, right.flip(0)]), torch.stack([run, ~run]), rand]


_REMEDY = ("context parallelism computes causal or unmasked attention, or a causal sliding "
           "window of a fixed number of keys (causal & i - j < w), each optionally with padded "
           "keys (a (batch, sequence) input, 0 = padding) or packed documents (a (batch, "
           "sequence) input of document ids, mask doc[:, :, None] == doc[:, None, :]): write the "
           "mask as one of those, or drop the cp axis for this model (tp/sp and recompute also "
           "cut activation memory)")
