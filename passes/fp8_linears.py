"""fp8_linears: precision="fp8" runs the model's linears as FP8 GEMMs with dynamic scaling.

Runs on the emitted chunks (after emit_rank_programs, before split_backward traces them), so the
cut, the costs and the layer structure are those of the bf16 program: FP8 changes how a linear
multiplies, not what it computes or where it runs. The rest of the step is bf16, as under
precision="bf16" (the runtime's autocast); the master weights and gradients stay fp32.

Which matmuls: the linears found by dataflow (an activation times a 2-D trainable parameter:
aten.linear, addmm, mm, matmul, and x @ w.T / einsum forms: autopart/linear_forms.py),
except, under fp8_linears="auto" (the default), these, which stay bf16:
  first   a linear with no linear upstream of it (the model's input enters through it)
  last    a linear with no linear downstream of it (the output head, whose logits the loss reads)
  small   a weight with a side under MIN_FEATURES or not a multiple of 16 (the FP8 tensor-core
          GEMM's alignment); decided on the whole weight, so every mesh converts the same ones
fp8_linears="all" converts every linear found. The recipe (tensorwise or rowwise scaling) is
autopart/ops/fp8.py's; under tensor parallelism each linear learns from the tp plan which of its
dims is split, to reduce those amaxes over tp; the weights' amaxes of a whole chunk are reduced
in one all-reduce at its start (batch_weight_amaxes), the activations' per linear (each comes
from the linear before it: no two exist at once). Under zero=3 a weight exists whole only once
gathered, so there is no batch: a weight read only by FP8 linears is cast to e4m3 before its
all-gather, its amax reduced by the gather (runtime/param_shards.py, autopart/ops/fp8.py).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopart.ir import ChunkProgram, Fp8Plan, Program, copied_graph, graph_module
from autopart.linear_forms import linear_form
from autopart.localize import attribute
from autopart.ops import fp8 as fp8_ops
from autopart.ops import tp as tp_ops
from autopart.ops.tp import TPComm
from autopart.placement import ndim

aten = torch.ops.aten
MIN_FEATURES = 32       # a smaller GEMM is launch-bound: the casts cost more than FP8 saves
ALIGN = 16              # torch._scaled_mm on CUDA needs both weight sides a multiple of 16


def fp8_linears(program: Program, *, scaling: str = "tensorwise", layers: str = "auto",
                zero: int = 0):
    """Return (program with every chunk's chosen linears as FP8 ops and .fp8, report). Under
    zero=3 the weights' amaxes are not batched at a chunk's start (their values exist only
    gathered): the runtime's gather reduces them (runtime/param_shards.py), else each linear."""
    found = {n.name: ops for n in program.gm.graph.nodes
             if (ops := operands(n, program.params)) is not None}
    kept = kept_in_bf16(program, found) if layers == "auto" else {}
    tp = program.tp
    plan = Fp8Plan(scaling, layers, kept=kept)
    for name in found:
        if name not in kept:
            plan.converted[name] = (tp is not None and name in tp.row,
                                    tp is not None and name in tp.column)
    chunks = tuple(_rewrite_chunk(c, plan, program.params, batch=zero != 3)
                   for c in program.chunks)
    report = {"scaling": scaling, "layers": layers, "fp8": sorted(plan.converted),
              "bf16": dict(sorted(kept.items()))}
    return program.replace(chunks=chunks, fp8=plan), report


def operands(node: fx.Node, params) -> tuple | None:
    """(x, w, bias, w_out_dim) of a linear by dataflow (w a 2-D trainable parameter's get_attr;
    w_out_dim 0: w[N, K] as aten.linear takes it, 1: w[K, N]), or None. Sequence
    parallelism's gather_linear_sp is one too (its x a sequence shard it gathers first)."""
    if node.op != "call_function":
        return None
    a = node.args

    def param(v):
        return isinstance(v, fx.Node) and v.op == "get_attr" and v.target in params and ndim(v) == 2

    if node.target in (aten.linear.default, tp_ops.gather_linear_sp) and param(a[1]) \
            and not param(a[0]):     # sequence parallelism's gather-then-linear: F.linear's
        return a[0], a[1], a[2] if len(a) > 2 else None, 0
    if node.target is aten.addmm.default and param(a[2]) and not param(a[1]):
        return a[1], a[2], a[0], 1
    if node.target in (aten.mm.default, aten.matmul.default) and param(a[1]) and not param(a[0]):
        return a[0], a[1], None, 1
    form = linear_form(node, params)        # x @ w.T, einsum (autopart/linear_forms.py)
    if form is not None:
        target, x, w = form
        return x, w, None, 0 if target is aten.linear.default else 1
    return None


def kept_in_bf16(program: Program, found: dict) -> dict[str, str]:
    """Linear node -> why it stays bf16 under fp8_linears="auto" (the module docstring's rule)."""
    gm = program.gm
    first = _without_linear(list(gm.graph.nodes), found, lambda n: n.all_input_nodes)
    last = _without_linear(list(reversed(gm.graph.nodes)), found, lambda n: n.users)
    kept = {}
    for name, (_, w, _, out_dim) in found.items():
        shape = tuple(int(d) for d in program.params[w.target].shape)
        n_out, k_in = shape[out_dim], shape[1 - out_dim]
        if name in first:
            kept[name] = "first: no linear upstream"
        elif name in last:
            kept[name] = "last: no linear downstream"
        elif min(k_in, n_out) < MIN_FEATURES or k_in % ALIGN or n_out % ALIGN:
            kept[name] = f"small: weight {n_out}x{k_in} (FP8 needs sides >= {MIN_FEATURES}, " \
                         f"multiples of {ALIGN})"
    return kept


def _without_linear(order: list, found: dict, neighbours) -> set[str]:
    """The linears with no other linear before them in `order`'s direction of dataflow."""
    reached: set = set()            # nodes a linear flows into (in this direction)
    out = set()
    for n in order:
        behind = any(a in reached for a in neighbours(n))
        if n.name in found and not behind:
            out.add(n.name)
        if n.name in found or behind:
            reached.add(n)
    return out


def _rewrite_chunk(chunk: ChunkProgram, plan: Fp8Plan, params, batch: bool) -> ChunkProgram:
    mine = [n for n in chunk.gm.graph.nodes if n.name in plan.converted]
    if not mine:
        return chunk
    graph, env = copied_graph(chunk.gm)
    comm = next((env[n] for n in chunk.gm.graph.nodes      # the tp group split_tensor_parallel
                 if n.op == "get_attr"                      # gave the program, if any
                 and isinstance(attribute(chunk.gm, n.target), TPComm)), None)
    split = []                                  # the tensor-parallel FP8 linears (new nodes)
    for old in mine:
        node = env[old]
        x, w, b, out_dim = operands(node, params)
        k_split, n_split = plan.converted[old.name]
        kwargs = {}
        if node.target is tp_ops.gather_linear_sp:      # x a sequence shard, gathered in FP8
            fn, kwargs = fp8_ops.fp8_gather_linear_sp, {"seq_dim": node.args[3]}
        else:
            fn = fp8_ops.fp8_linear_tp if k_split or n_split else fp8_ops.fp8_linear
        args = (x, w, b, plan.scaling, out_dim) + \
            ((k_split, n_split, comm) if k_split or n_split else ())
        with graph.inserting_before(node):
            new = graph.call_function(fn, args, kwargs)
        new.meta = dict(node.meta)
        dropped = [a for a in node.all_input_nodes if a.op == "call_function"]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for a in dropped:              # the transpose of x @ w.T nothing reads now
            if not a.users:
                graph.erase_node(a)
        if k_split or n_split:
            split.append(new)
    if split and batch:
        batch_weight_amaxes(graph, split, plan.scaling, comm)
    graph.lint()
    return dataclasses.replace(chunk, gm=graph_module(chunk.gm, graph,
                                                      class_name=type(chunk.gm).__name__))


def batch_weight_amaxes(graph: fx.Graph, linears: list, scaling: str, comm) -> fx.Node:
    """One fp8_weight_amaxes_tp at the chunk's start for every weight amax `linears` (the
    chunk's fp8_linear_tp nodes) reduce over tp, each linear then reading its own as w_amax:
    one all-reduce per chunk instead of one per linear. A weight read by several linears the
    same way is reduced once. The weights' get_attrs move before the first op (they compute
    nothing), so the batch can run before any activation exists."""
    start = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    keys: dict = {}                     # (weight, out_dim, dim) -> index in the batch
    for node in linears:
        w, out_dim, (k_split, n_split) = node.args[1], node.args[4], node.args[5:7]
        _, dim = fp8_ops.weight_amax_over_tp(scaling, k_split, n_split)
        keys.setdefault((w, out_dim, dim), len(keys))
    for held in [comm, *(w for w, _, _ in keys)]:
        if _after(held, start):
            start.prepend(held)
    weights, out_dims, dims = (list(t) for t in zip(*keys))
    with graph.inserting_before(start):
        batch = graph.call_function(fp8_ops.fp8_weight_amaxes_tp,
                                    (weights, out_dims, dims, comm))
        amax = [graph.call_function(operator.getitem, (batch, i)) for i in range(len(keys))]
    for node in linears:
        w, out_dim, (k_split, n_split) = node.args[1], node.args[4], node.args[5:7]
        _, dim = fp8_ops.weight_amax_over_tp(scaling, k_split, n_split)
        node.args = (*node.args[:8], amax[keys[(w, out_dim, dim)]])
    return batch


def _after(node: fx.Node, anchor: fx.Node) -> bool:
    """Whether `node` comes after `anchor` in their graph's order."""
    n = anchor.next
    while n.op != "root":
        if n is node:
            return True
        n = n.next
    return False
