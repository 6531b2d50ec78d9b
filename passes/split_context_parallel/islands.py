"""Regions that mix positions inside and still compute each token from that token alone, proved
so by running them: token islands.

A mixture-of-experts layer sorts a batch's tokens by expert, gathers them, runs each expert on
its rows and scatters the rows back (Hugging Face Mixtral's grouped experts); a Switch layer
decides capacity and drops per routing group of consecutive tokens. The op-by-op check
(check.py) must refuse the sort, the gathers and the scatters: each alone mixes positions. Around
such ops the pass cuts an *island*: the ops between the nearest tensors laid out (batch,
sequence, ...) above them (its entries) and below them (its exits). The island is run on random
entries at the captured length S and again on each rank's chunks of them (i and 2cp-1-i); a
rank's exits must be the whole run's exits at its positions. An island that fails (capacity
groups across a chunk boundary, a statistic over every token) is refused, naming its first mixing
op and the numbers. Like the masks (masks.py), proving by value accepts every way of writing a
per-token layer and nothing else.

The proof runs on the plain model, before shard_experts puts all-to-alls into it, as the pass
`prove_token_islands`; split_context_parallel then accepts the mixing ops of proved islands.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autopart.errors import node_error
from autopart.ir import BATCH, SEQ, Program, sym_shape
from autopart.localize import attribute
from autopart.ops.cp import shard_sequence

from .check import _name, mixing_nodes
from .find import position_sources, upstream
from .masks import NotProvable

TRIALS = 2            # random entries per island
PROOF_BATCH = 2       # rows of the entries (a symbolic batch)


@dataclass
class Island:
    first: fx.Node                # its first op that mixes positions (named in errors)
    entries: list[fx.Node]        # (batch, sequence, ...) tensors it reads
    exits: list[fx.Node]          # (batch, sequence, ...) tensors it makes
    body: set[fx.Node]            # every node it computes, exits included


def prove_islands(program: Program, skip: set[fx.Node], cp: int) -> list[Island]:
    """The islands around the mixing ops not in `skip`, each proved position-wise for every
    cp rank; an error naming the op of the first island that is not."""
    aranges, slices = position_sources(program)
    order = {n: i for i, n in enumerate(program.gm.graph.nodes)}
    islands: list[Island] = []
    covered: set[fx.Node] = set()
    for node in mixing_nodes(program, skip):
        if node in covered:
            continue
        try:
            island = _island(node, program, order)
            if island.body & set(aranges + slices):
                raise NotProvable("it computes sequence positions, which the pass rewrites")
            _prove(island, program, cp)
        except NotProvable as e:
            raise node_error(node, f"context parallelism runs each rank on its own sequence "
                             f"chunks, and this {_name(node)} mixes positions along the sequence "
                             f"outside attention; the region around it is not position-wise: {e}",
                             "keep ops across positions inside attention (routing groups within "
                             f"one of the {2 * cp} sequence chunks, no statistic over every "
                             "token), or drop the cp axis") from None
        islands.append(island)
        covered |= island.body
    return islands


def _seq_layout(node: fx.Node, symbols: dict) -> bool:
    """A (batch, sequence, ...) tensor: what the ranks hold in chunks along dim 1."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return False
    shape = sym_shape(val, symbols)
    return shape[1] == SEQ and SEQ not in getattr(shape[0], "free_symbols", ())


def _island(node: fx.Node, program: Program, order: dict) -> Island:
    symbols = program.symbols
    # an op whose own output is (batch, sequence, ...) (a flip or a gather along the sequence)
    # is its island's exit
    exits, seen, todo = ([node], set(), []) if _seq_layout(node, symbols) else ([], set(), [node])
    while todo:                            # down to the (batch, sequence) tensors it makes
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.op == "output":
                raise NotProvable("its values reach the model's outputs without coming back to "
                                  "a (batch, sequence) layout (a statistic over every token)")
            (exits if _seq_layout(u, symbols) else todo).append(u)
    entries: set[fx.Node] = set()

    def inputs_of(n):
        if n not in exits and _seq_layout(n, symbols):
            entries.add(n)
            return ()
        if n.op == "placeholder":
            raise NotProvable(f"it reads the input {n.name!r}, which is not laid out (batch, "
                              "sequence, ...)")
        return n.all_input_nodes
    body = upstream(exits, inputs_of) - entries
    return Island(node, sorted(entries, key=order.get), sorted(exits, key=order.get), body)


def _prove(island: Island, program: Program, cp: int) -> None:
    seq = program.seq_len
    run, device = _runner(island, program.gm)
    g = torch.Generator().manual_seed(0)
    for _ in range(TRIALS):
        feeds = [_random(e, program.symbols, seq, g).to(device) for e in island.entries]
        whole = run(feeds)
        for rank in range(cp):
            part = run([shard_sequence(v, 1, cp, rank) for v in feeds])
            for x, got, full in zip(island.exits, part, whole):
                want = shard_sequence(full, 1, cp, rank)
                if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4,
                                                                 atol=1e-5, equal_nan=False):
                    err = (got - want).abs().max().item() if got.shape == want.shape else \
                        f"shape {tuple(got.shape)}, not {tuple(want.shape)}"
                    raise NotProvable(
                        f"run on rank {rank}'s chunks of a {seq}-token sequence (cp={cp}), its "
                        f"output {x.name} differs from the whole sequence's at those positions "
                        f"(max difference {err})")


def _runner(island: Island, gm: fx.GraphModule):
    g, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in island.entries:
            env[node] = g.placeholder(node.name)
        elif node in island.body:
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output([env[x] for x in island.exits])
    root = {n.target: attribute(gm, n.target) for n in g.nodes if n.op == "get_attr"}
    if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in root.values()):
        raise NotProvable("its weights are on the meta device, whose values are unknown "
                          "(materialize the model before compiling with cp)")
    module = fx.GraphModule(root, g)
    device = next((v.device for v in root.values() if isinstance(v, torch.Tensor)),
                  torch.device("cpu"))     # the weights' (a model compiled on its GPU)

    def run(feeds):
        try:
            with torch.no_grad():
                return module(*feeds)
        except Exception as e:  # noqa: BLE001  (any failure: not provable, say which)
            raise NotProvable(f"running it failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})") from e
    return run, device


def _random(node: fx.Node, symbols: dict, seq: int, g: torch.Generator) -> torch.Tensor:
    val = node.meta["val"]
    sizes = {BATCH: PROOF_BATCH, SEQ: seq}
    dims = [sympy.sympify(d) for d in sym_shape(val, symbols)]
    if any(d.free_symbols - set(sizes) for d in dims):
        raise NotProvable(f"{node.name} has a size other than the batch and the sequence")
    shape = [int(d.subs(sizes)) for d in dims]
    if val.dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(val.dtype)
    if val.dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    return torch.randint(0, 2, shape, generator=g).to(val.dtype)

