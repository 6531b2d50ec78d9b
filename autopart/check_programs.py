"""The compile-time program checker: every distinct rank program runs forward and backward on
fake tensors before `compile` returns, so a program that cannot run fails at compile time, naming
the node, the user's source line, the pass that produced it and the shapes, instead of crashing
in the user's first training step.

Fake tensors (`FakeTensorMode`) carry shapes, dtypes and devices and allocate nothing, so the
check costs one pass over each graph's ops, on the meta device as well. Each program's comm
modules are replaced by shape-only copies: collectives make outputs of the shapes the real ones
would (all-gather multiplies a dim by the group size, reduce-scatter divides it) and move no data.
Chunk graphs that are equal on several ranks (the tensor-parallel ranks of one pipeline rank) are
checked once. The forward also counts what autograd saves (memory.SavedCounter), so the memory
table needs no fake run of its own.

    >>> import torch, autopart
    >>> from examples.gpt import GPT, lm_loss
    >>> x = torch.zeros(4, 16, dtype=torch.long)
    >>> c = autopart.compile(GPT("tiny"), autopart.Mesh(pp=2, tp=2), (x,), loss_fn=lm_loss, target=x)
    >>> check_rank_programs(c)["checked"]        # one chunk graph per pipeline rank
    2
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                          DynamicOutputShapeException, FakeTensorMode)

from autopart.errors import AutopartError, node_error
from autopart.ir import META_TP, REDUCED_DTYPES, ChunkProgram
from autopart.memory import (ActivationCache, ChunkActivations, SavedCounter, boundary_bytes,
                             chunk_inputs, local_shaper, storage_key)
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


def check_rank_programs(compiled, runs: ActivationCache | None = None) -> dict:
    """Run each distinct rank program forward and backward on fake tensors.

    The tensor- and expert-parallel ranks of one pipeline rank run the same chunk graphs on
    shards of equal shapes, so each chunk graph is run once with this rank's local parameter
    shapes (nothing is localized), and chunks with the same program up to names (the middle
    stages of a uniform stack: memory.chunk_signature) once in all. Each forward also counts
    what autograd saves, into `runs`, which the memory table then reads instead of running the
    chunk again. Returns {"checked": chunk graphs run, "skipped": [(chunk, node, reason)],
    "seconds": ...}; raises AutopartError on the first chunk that does not run."""
    import time
    start = time.perf_counter()
    plan, program = compiled.plan, compiled.program
    b, s = plan.microbatch_size, program.seq_len
    local = local_shaper(program, plan.mesh)
    runs = ActivationCache(REDUCED_DTYPES[plan.config.precision]) if runs is None else runs
    seen: set = set()
    skipped: list = []
    for chunk in program.chunks:
        sig = runs.signature(chunk, local)
        if sig in seen:
            continue
        seen.add(sig)
        reason, acts = check_chunk(chunk, program, b, s, local, runs.reduced)
        if reason:
            skipped.append((chunk.chunk, *reason))
        if acts is not None:
            runs.put(sig, chunk, acts)
    return {"checked": len(seen), "skipped": skipped, "seconds": time.perf_counter() - start}


def check_chunk(chunk: ChunkProgram, program, b: int, s: int | None, local_shape,
                reduced: torch.dtype | None = None):
    """Forward and backward of one chunk on fake tensors, parameters of the shapes
    `local_shape(name, full shape)` gives. Returns (None, what its forward saved for backward),
    or ((node, reason), None) if a data-dependent op stopped the check part way. `reduced`
    (bf16) runs it under autocast to that dtype, as the runtime runs it.

    A program built on the meta device runs on its inputs' device, the CPU when they are meta
    too (_FakeRunner._device): a meta model fed CUDA inputs materializes on the GPU, and its
    meta weights met the CUDA inputs in the first op. One that runs only on meta (its graph
    asserts the meta device, as HF's rotary embedding does) is checked there and its bytes left
    to the memory table."""
    runner = _FakeRunner(chunk, program, b, s, local_shape, materialize=True, reduced=reduced)
    try:
        return runner.check()
    except AutopartError:
        if not runner.moved:
            raise
    return _FakeRunner(chunk, program, b, s, local_shape, materialize=False,
                       reduced=reduced).check()[0], None


class _FakeRunner(SavedCounter):
    """Runs a chunk with its parameters as fake tensors and shape-only comm modules, counting
    the storages autograd saves (memory.SavedCounter); an exception inside a node becomes an
    AutopartError naming it. With `materialize`, meta tensors and devices are made real ones: the
    inputs' device (`home`), the CPU when the inputs are meta too."""

    def __init__(self, chunk: ChunkProgram, program, b: int, s: int | None, local_shape,
                 materialize: bool, reduced: torch.dtype | None = None):
        super().__init__(chunk.gm, FakeTensorMode(allow_non_fake_inputs=True), program.symbols,
                         b, s or 1, local_shape, set(chunk.layers), reduced=reduced)
        self.chunk, self.program, self.b_s = chunk, program, (b, s)
        self.materialize, self.moved = materialize, False   # moved: meta made real
        vals = [ph.meta.get("val") for ph in self.placeholders]
        first = next((v for v in vals if isinstance(v, torch.Tensor)), None)
        # where the meta tensors go: where the inputs are (the rank's device), else the CPU
        self.home = first.device if first is not None and first.device.type != "meta" \
            else torch.device("cpu")
        self.device_type = self._device(first).type     # where autocast applies
        self.params: list = []
        self.where = f"pipeline rank {chunk.rank}, chunk {chunk.chunk}"

    def check(self):
        """(None, saved bytes) or ((node, reason), None); raises AutopartError."""
        chunk, (b, s) = self.chunk, self.b_s
        with self.mode:
            args = chunk_inputs(chunk, self.placeholders, self.program, b, s, self._device)
            try:
                outs = self.count(*args)
            except _DataDependent as e:
                return (e.node.name, f"{e.node.target.__name__} has data-dependent output "
                        "sizes"), None
            except AutopartError as e:       # fx's Interpreter appends its own trace: keep ours
                raise AutopartError(str(e).split("\n\nWhile executing")[0]) from None
            _check_sends(chunk, outs, b, s, self.where)
            _backward(chunk, self, outs, args, self.where)
        sends = sum((boundary_bytes(x) for x in chunk.sends), sympy.Integer(0))
        return None, ChunkActivations(self.total(), self.per_layer(), self.transient, sends)

    def _device(self, like) -> torch.device:
        """`like`'s device (a tensor's or a device), CPU if none; with `materialize`, the inputs'
        (`home`) for meta. Ops choose kernels by device (meta's attention is the unfused math
        one, which saves the score matrix), and the saved bytes must be those of a device that
        trains."""
        device = like if isinstance(like, torch.device) else \
            like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
        if self.materialize and device.type == "meta":
            self.moved = True
            return self.home
        return device

    def call_function(self, target, args, kwargs):
        # constants the graph makes on the meta device are made where the fakes are
        if any(isinstance(v, torch.device) for v in kwargs.values()):
            kwargs = {k: self._device(v) if isinstance(v, torch.device) else v
                      for k, v in kwargs.items()}
        return super().call_function(target, args, kwargs)

    def fetch_attr(self, target: str):
        if target not in self.attrs:
            value = fx.Interpreter.fetch_attr(self, target)
            if isinstance(value, GroupComm):
                value = type(value)(value.size, value.rank, shape_only=True)
            elif isinstance(value, torch.Tensor):    # made fake from its shape: no copy
                fake = torch.empty(self.local_shape(target, tuple(value.shape)),
                                   dtype=value.dtype, device=self._device(value))
                if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                    fake.requires_grad_(True)
                    self.params.append(fake)
                self.weights.add(storage_key(fake))
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
        except (DataDependentOutputException, DynamicOutputShapeException):
            # an expert dispatch inside a node that holds a region (a recomputed layer calls its
            # ops through checkpoint): the same stop as a dispatch at top level
            raise _DataDependent(n) from None
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
