"""The compile-time program checker: every distinct rank program runs forward and backward on
fake tensors before `compile` returns, so a program that cannot run fails at compile time, naming
the node, the user's source line, the pass that produced it and the shapes, instead of crashing
in the user's first training step.

Fake tensors (`FakeTensorMode`) carry shapes, dtypes and devices and allocate nothing, so the
check costs one pass over each graph's ops, on the meta device as well. Each program's comm
modules are replaced by shape-only copies: collectives make outputs of the shapes the real ones
would (all-gather multiplies a dim by the group size, reduce-scatter divides it) and move no data.
Chunk graphs that are equal on several ranks (the tensor-parallel ranks of one pipeline rank) are
checked once.

    >>> import torch, autopart
    >>> from examples.gpt import GPT, lm_loss
    >>> x = torch.zeros(4, 16, dtype=torch.long)
    >>> c = autopart.compile(GPT("tiny"), autopart.Mesh(pp=2, tp=2), (x,), loss_fn=lm_loss, target=x)
    >>> check_rank_programs(c)["checked"]        # one chunk graph per pipeline rank
    2
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopart.errors import AutopartError, node_error
from autopart.ir import META_TP, Boundary, ChunkProgram, sym_shape
from autopart.localize import attribute
from autopart.ops import registry
from autopart.ops.comm import GroupComm
from autopart.ops import ep as ep_ops
from autopart.placement import Shard

# Their output sizes depend on routing decisions (the number of rows each rank sends), which a
# fake tensor does not have: a chunk reaching one is checked up to it, and the report says so.
DATA_DEPENDENT = {ep_ops.sorted_layout, ep_ops.dispatch_rows, ep_ops.combine_rows}


class _DataDependent(Exception):
    def __init__(self, node: fx.Node):
        super().__init__(node.name)
        self.node = node


def check_rank_programs(compiled) -> dict:
    """Run each distinct rank program forward and backward on fake tensors.

    The tensor- and expert-parallel ranks of one pipeline rank run the same chunk graphs on
    shards of equal shapes, so each chunk graph is run once with this rank's local parameter
    shapes (nothing is localized), and chunks with the same structure (the middle stages of a
    uniform stack) once in all. Returns {"checked": chunk graphs run, "skipped": [(chunk, node,
    reason)], "seconds": ...}; raises AutopartError on the first chunk that does not run."""
    import time
    start = time.perf_counter()
    plan, program = compiled.plan, compiled.program
    b, s = plan.microbatch_size, program.seq_len
    local = _local_shapes(plan)
    seen: set = set()
    skipped: list = []
    for chunk in program.chunks:
        key = _structure(chunk, plan)
        if key in seen:
            continue
        seen.add(key)
        reason = check_chunk(chunk, program, b, s, local)
        if reason:
            skipped.append((chunk.chunk, *reason))
    return {"checked": len(seen), "skipped": skipped, "seconds": time.perf_counter() - start}


def _local_shapes(plan):
    """name, full shape -> the shape one rank holds (its tp shard of each section, its experts)."""
    mesh = plan.mesh
    tp_shards = plan.tp_shards if mesh.tp > 1 else {}
    ep_shards = plan.ep_shards if mesh.ep > 1 else {}

    def shape(name: str, full: tuple) -> tuple:
        out = list(full)
        if name in ep_shards:
            out[0] //= mesh.ep
        if name in tp_shards:
            out[tp_shards[name].dim] //= mesh.tp
        return tuple(out)
    return shape


def _structure(chunk: ChunkProgram, plan) -> tuple:
    """What the check depends on, without names: ops, dataflow, constant arguments, attribute
    shapes and shards, boundary shapes."""
    index: dict = {}
    items = []
    for i, n in enumerate(chunk.gm.graph.nodes):
        index[n] = i
        if n.op == "get_attr":
            v = attribute(chunk.gm, n.target)
            sig = (tuple(v.shape), v.dtype, plan.tp_shards.get(n.target),
                   plan.ep_shards.get(n.target)) if isinstance(v, torch.Tensor) else type(v).__name__
        else:
            sig = n.target if n.op == "call_function" else n.op
        args = (n.args, {} if registry.is_autopart_op(n.target, kind="p2p") else n.kwargs)
        items.append((sig, str(fx.map_arg(args, lambda a: index[a]))))   # p2p peers aside
    edges = tuple((r.shape, r.dtype) for r in chunk.recvs + chunk.sends)
    return tuple(items), edges, chunk.is_last


def check_chunk(chunk: ChunkProgram, program, b: int, s: int | None, local_shape):
    """Forward and backward of one chunk on fake tensors, parameters of the shapes
    `local_shape(name, full shape)` gives; None, or (node, reason) if a data-dependent op
    stopped the check part way."""
    where = f"pipeline rank {chunk.rank}, chunk {chunk.chunk}"
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        runner = _FakeRunner(chunk.gm, mode, local_shape)
        runner.where = where
        args = [_fake_recv(r, b, s, ph) for r, ph in zip(chunk.recvs, runner.placeholders)]
        args += [_fake_input(ph, program, b, s) for ph in runner.placeholders[len(chunk.recvs):]]
        try:
            outs = runner.run(*args)
        except _DataDependent as e:
            return (e.node.name, f"{e.node.target.__name__} has data-dependent output sizes")
        except AutopartError as e:       # fx's Interpreter appends its own trace: keep ours
            raise AutopartError(str(e).split("\n\nWhile executing")[0]) from None
        _check_sends(chunk, outs, b, s, where)
        _backward(chunk, runner, outs, args, where)
    return None


class _FakeRunner(fx.Interpreter):
    """Runs a chunk with its parameters as fake tensors and shape-only comm modules; an
    exception inside a node becomes an AutopartError naming it."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, local_shape):
        super().__init__(gm, garbage_collect_values=False)
        self.mode, self.local_shape = mode, local_shape
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.attrs: dict = {}
        self.params: list = []
        self.where = ""

    def fetch_attr(self, target: str):
        if target not in self.attrs:
            value = super().fetch_attr(target)
            if isinstance(value, GroupComm):
                value = type(value)(value.size, value.rank, shape_only=True)
            elif isinstance(value, torch.Tensor):    # made fake from its shape: no copy
                fake = torch.empty(self.local_shape(target, tuple(value.shape)),
                                   dtype=value.dtype, device=value.device)
                if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                    fake.requires_grad_(True)
                    self.params.append(fake)
                value = fake
            self.attrs[target] = value
        return self.attrs[target]

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and n.target in DATA_DEPENDENT:
            comm = self.env.get(n.args[-1]) if isinstance(n.args[-1], fx.Node) else n.args[-1]
            if isinstance(comm, GroupComm) and comm.size > 1:
                raise _DataDependent(n)
        try:
            return super().run_node(n)
        except (AutopartError, _DataDependent):
            raise
        except Exception as e:  # noqa: BLE001  (any failure of the op is the program's)
            raise _node_failure(n, self.env, e, self.where) from e


def _node_failure(n: fx.Node, env: dict, e: Exception, where: str) -> AutopartError:
    shapes = ", ".join(f"{a.name}: {_describe(env.get(a))}" for a in n.all_input_nodes)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return node_error(
        n, f"the program emitted for {where} does not run: {n.name} ({n.target}) fails on "
        f"inputs {{{shapes}}}: {type(e).__name__}: {first}\n  produced by: {_producing_pass(n)}",
        "this is a bug in the pass named above (please report it with this message); meanwhile "
        "a mesh without the axis that pass serves (e.g. tp=1) avoids it")


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    return repr(v) if v is not None else "?"


def _producing_pass(n: fx.Node) -> str:
    """The pass whose rewrite made this node what it is: tensor-parallel collectives and nodes
    on a tensor-parallel shard come from split_tensor_parallel, expert ops from shard_experts,
    the rest were copied into the chunk by emit_rank_programs."""
    info = registry.op_info(n.target)
    if info is not None and info.axis == "tp":
        return "split_tensor_parallel (a tensor-parallel collective)"
    if info is not None and info.axis == "ep":
        return "shard_experts (an expert-parallel collective)"
    placement = n.meta.get(META_TP)
    if isinstance(placement, (Shard, tuple)):
        return f"split_tensor_parallel (the node runs on a tensor-parallel shard {placement})"
    return "emit_rank_programs (the node as copied into this chunk)"


def _concrete(shape: tuple, b: int, s: int | None) -> tuple:
    return Boundary("", shape, torch.float32, 0, 0).concrete_shape(b, s)


def _fake_recv(r: Boundary, b: int, s: int | None, ph: fx.Node) -> torch.Tensor:
    val = ph.meta.get("val")
    device = val.device if isinstance(val, torch.Tensor) else "cpu"
    t = torch.empty(r.concrete_shape(b, s), dtype=r.dtype, device=device)
    return t.requires_grad_(True) if r.differentiable else t


def _fake_input(ph: fx.Node, program, b: int, s: int | None) -> torch.Tensor:
    val = ph.meta["val"]
    shape = _concrete(sym_shape(val, program.symbols), b, s) if program.dynamic else tuple(val.shape)
    if val.dtype.is_floating_point or val.dtype.is_complex:
        return torch.empty(shape, dtype=val.dtype, device=val.device)
    return torch.zeros(shape, dtype=val.dtype, device=val.device)


def _check_sends(chunk: ChunkProgram, outs, b: int, s: int | None, where: str) -> None:
    """What a chunk sends must have the shape and dtype its receiver expects."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    for boundary, out in zip(chunk.sends, outs):
        want = boundary.concrete_shape(b, s)
        if tuple(out.shape) != want or out.dtype != boundary.dtype:
            node = next((n for n in chunk.gm.graph.nodes if n.name == boundary.name), None)
            raise node_error(node, f"the program emitted for {where} sends {boundary.name} as "
                             f"{_describe(out)}, but chunk {boundary.peer_chunk} expects "
                             f"{str(boundary.dtype).replace('torch.', '')}{list(want)}\n"
                             "  produced by: emit_rank_programs / cut_pipeline_stages",
                             "this is a bug in the pass named above (please report it)")


def _backward(chunk: ChunkProgram, runner: _FakeRunner, outs, args, where: str) -> None:
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    if chunk.is_last:
        pairs = [(outs[0], torch.ones_like(outs[0]))] if outs and outs[0].requires_grad else []
    else:
        pairs = [(o, torch.empty_like(o)) for o in outs
                 if isinstance(o, torch.Tensor) and o.requires_grad]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + runner.params
    if not pairs or not leaves:
        return
    try:
        torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                            allow_unused=True)
    except Exception as e:  # noqa: BLE001  (a backward that cannot run is the program's fault)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AutopartError(f"the program emitted for {where} runs forward but not backward: "
                            f"{type(e).__name__}: {first}\n  remedy: this is a bug in the pass "
                            "that produced the program (please report it with this message)")


__all__ = ["check_rank_programs", "check_chunk"]
