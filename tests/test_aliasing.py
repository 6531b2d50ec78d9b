"""autopart/aliasing.py: in-place writes and views read from the ops' schemas, and the two places
that keep a value's writers with it (the cut's input-derived set, the rank programs' replicated
nodes). The end-to-end check against the plain model is tests/test_view_writes.py."""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

import autopart
from autopart.aliasing import storage_root, writers_by_root, written_args
from tests.workers.common import Case
from tests.workers.view_writes import build

aten = torch.ops.aten


def _graph():
    """x -> ones_like -> slice -> slice <- copy_(., ne); split(y)[1] <- add_(., 1)."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    base = g.call_function(aten.ones_like.default, (x,))
    view = g.call_function(aten.slice.Tensor, (g.call_function(aten.slice.Tensor, (base, 0)), 1, 1))
    write = g.call_function(aten.copy_.default, (view, g.call_function(aten.ne.Scalar, (x, 0))))
    piece = g.call_function(operator.getitem, (g.call_function(aten.split.Tensor, (y, 2)), 1))
    bump = g.call_function(aten.add_.Tensor, (piece, 1))
    g.output((base, y))
    return g, base, view, write, y, piece, bump


def test_writes_and_views_come_from_the_schema():
    g, base, view, write, y, piece, bump = _graph()
    assert written_args(write) == [view] and written_args(bump) == [piece]
    assert written_args(base) == [] and written_args(view) == []
    assert storage_root(view) is base and storage_root(piece) is y and storage_root(base) is base
    assert writers_by_root(g) == {base: [write], y: [bump]}


@functools.lru_cache(maxsize=None)
def _compiled(pp: int):
    case = Case("aliasing", model="packed-docs", pp=pp, microbatches=2)
    model, loss_fn, inputs, target = build(case)
    return autopart.compile(model, autopart.Mesh(pp=pp), inputs, loss_fn=loss_fn, target=target,
                            microbatches=2)


def _code(chunk) -> str:
    return chunk.gm.code


def test_every_chunk_that_reads_a_written_input_tensor_writes_it_first():
    """The per-document positions are made from `doc` alone, so each chunk that reads them
    recomputes them, and must recompute the slice write too (before: dropped, no users)."""
    chunks = _compiled(pp=2).program.chunks
    readers = [c for c in chunks if "cummax" in _code(c)]
    assert readers, "no chunk recomputes the document positions"
    for c in readers:
        code = _code(c)
        write = code.find("copy_ = torch.ops.aten.copy_.default(slice_")
        assert 0 <= write < code.index("cummax"), code


def test_a_tensor_written_from_an_activation_is_not_recomputed_per_chunk():
    """`gate` is made from the inputs alone but written from an activation (a parameter's
    output): it is computed once, in the writer's chunk, and crosses the cut like an
    activation."""
    plan = _compiled(pp=2).program.stages
    writer = [n for n in plan.chunk_of if n.startswith("copy_")]
    assert writer, sorted(plan.chunk_of)
    replicated = set(plan.replicated)
    graph_nodes = {n.name: n for n in _compiled(pp=2).program.gm.graph.nodes}
    assert not any(n in replicated for n in writer)
    written_roots = {storage_root(a).name for w in writer for a in written_args(graph_nodes[w])}
    assert written_roots and not written_roots & replicated, (written_roots, replicated)
