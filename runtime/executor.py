"""Execute one rank's action list for one training step.

F runs a chunk program on a microbatch; B runs autograd backward through what F recorded;
a run of consecutive SEND/RECV actions is one batch_isend_irecv, which is the communication model
the schedule validator proves deadlock-free. Its receives are waited on at once, its sends only at
the end of the step: nothing on this rank reads a sent tensor again and the peer's receive is what
orders the transfer, so a rank never idles until its peer has posted the matching receive.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx

_COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass
class StepContext:
    """What one step needs: this rank's chunks, how to reach peers, and the microbatches."""
    chunks: dict                    # chunk index -> ChunkProgram
    peer: callable                  # pipeline rank -> global rank (same dp and tp coordinates)
    microbatch: callable            # microbatch index -> {input name: tensor}
    batch: int                      # microbatch size
    seq: int | None
    device: torch.device
    loss_scale: float               # 1 / (microbatches * dp): the global-batch mean
    group: object = None            # the pipeline's process group: its timeout bounds every wait
    acts: dict = field(default_factory=dict)       # (chunk, mb) -> received forward inputs
    outs: dict = field(default_factory=dict)       # (chunk, mb) -> forward outputs
    grads_in: dict = field(default_factory=dict)   # (chunk, mb) -> grads received for outputs
    grads_out: dict = field(default_factory=dict)  # (chunk, mb) -> grads of inputs to send back
    losses: list = field(default_factory=list)
    stats: list = field(default_factory=list)      # per microbatch: the model's other outputs


def run_actions(actions, ctx: StepContext) -> list[torch.Tensor]:
    """Run `actions` (this rank's list from the schedule) in order; returns microbatch losses."""
    sends: list = []        # works of this step's sends, waited on at its end
    i = 0
    while i < len(actions):
        if actions[i].kind in _COMM:
            j = i
            while j < len(actions) and actions[j].kind in _COMM:
                j += 1
            sends += _communicate(actions[i:j], ctx)
            i = j
        else:
            (_forward if actions[i].kind == "F" else _backward)(actions[i], ctx)
            i += 1
    for work in sends:
        work.wait()
    return ctx.losses


def _communicate(batch, ctx: StepContext) -> list:
    """Post one batch; wait for its receives; return its sends' works, to be waited on later."""
    ops, landing = [], []
    for a in batch:
        key = (a.chunk, a.microbatch)
        chunk = ctx.chunks[a.chunk]
        if a.kind == "SEND_F":
            for spec, t in zip(chunk.sends, ctx.outs[key]):
                ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), ctx.peer(spec.peer_rank),
                                      ctx.group))
        elif a.kind == "SEND_B":
            for spec, g in zip(chunk.recvs, ctx.grads_out.pop(key)):
                if spec.differentiable:
                    ops.append(dist.P2POp(dist.isend, g.contiguous(), ctx.peer(spec.peer_rank),
                                          ctx.group))
        elif a.kind == "RECV_F":
            bufs = [_empty(spec, ctx) for spec in chunk.recvs]
            ops += [dist.P2POp(dist.irecv, b, ctx.peer(s.peer_rank), ctx.group)
                    for s, b in zip(chunk.recvs, bufs)]
            landing.append((ctx.acts, key, bufs))
        else:  # RECV_B: gradients of this chunk's outputs, from the next chunk
            specs = [s for s in chunk.sends if s.differentiable]
            bufs = [_empty(spec, ctx) for spec in specs]
            ops += [dist.P2POp(dist.irecv, b, ctx.peer(s.peer_rank), ctx.group)
                    for s, b in zip(specs, bufs)]
            landing.append((ctx.grads_in, key, bufs))
    sends = []
    if ops:
        for op, work in zip(ops, dist.batch_isend_irecv(ops)):
            if op.op is dist.isend:
                sends.append(work)      # the work holds the sent tensor until it completes
            else:
                work.wait()
    for store, key, bufs in landing:
        store[key] = bufs
    return sends


@functools.lru_cache(maxsize=4096)
def _shape(spec, batch: int, seq: int | None) -> tuple[int, ...]:
    return spec.concrete_shape(batch, seq)      # sympy substitution: ~0.1 ms, once per boundary


def _empty(spec, ctx: StepContext) -> torch.Tensor:
    return torch.empty(_shape(spec, ctx.batch, ctx.seq), dtype=spec.dtype, device=ctx.device)


def _forward(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    received = ctx.acts.get(key, [])
    received = [t.requires_grad_(True) if s.differentiable else t for s, t in zip(chunk.recvs, received)]
    ctx.acts[key] = received
    inputs = ctx.microbatch(action.microbatch)
    out = executable(chunk.gm)(*received, *(inputs[name] for name in chunk.inputs))
    if chunk.is_last:
        ctx.losses.append(out[0].detach())
        if len(out) > 1:
            ctx.stats.append(tuple(o.detach() for o in out[1:]))
        ctx.outs[key] = (out[0] * ctx.loss_scale,)
    else:
        ctx.outs[key] = tuple(out)


def _backward(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    outs = ctx.outs.pop(key)
    if chunk.is_last:
        torch.autograd.backward(outs[0])
    else:
        grads = iter(ctx.grads_in.pop(key))
        pairs = [(o, next(grads)) for s, o in zip(chunk.sends, outs) if s.differentiable]
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    received = ctx.acts.pop(key, [])
    if action.chunk > 0:
        ctx.grads_out[key] = [t.grad if t.grad is not None else torch.zeros_like(t)
                              for t in received]


# -- the program as run: the same graph, cheaper calls -----------------------------------------------
# Calling an ATen overload from Python (torch.ops.aten.linear.default) costs a few microseconds more
# than the Python binding of the same op, and `self.transformer.h.0.attn.c_attn.weight` is five
# nn.Module.__getattr__ calls: at microbatch size 1 that is a third of a chunk's forward. So each
# chunk runs a copy of its GraphModule whose parameters are flat attributes (the same Parameter
# objects, so gradients land where the printed program says) and whose ops listed in _BINDINGS call
# the binding with the same schema. `print(program.code)` still shows the emitted program.
_aten = torch.ops.aten
_BINDINGS = {   # overload -> Python binding taking the same arguments (checked in test_executor)
    _aten.linear.default: torch._C._nn.linear,
    _aten.layer_norm.default: torch.layer_norm,
    _aten.view.default: torch.Tensor.view,
    _aten.reshape.default: torch.reshape,
    _aten.transpose.int: torch.transpose,
    _aten.add.Tensor: torch.add,
    _aten.mul.Tensor: torch.mul,
    _aten.split.Tensor: torch._C._VariableFunctions.split,
    _aten.scaled_dot_product_attention.default: torch._C._nn.scaled_dot_product_attention,
    _aten.gelu.default: torch._C._nn.gelu,
    _aten.embedding.default: torch.embedding,
    _aten.dropout.default: torch.dropout,
    _aten.sym_size.int: torch.Tensor.size,
}
_EXECUTABLE: "weakref.WeakKeyDictionary[fx.GraphModule, fx.GraphModule]" = weakref.WeakKeyDictionary()


def executable(gm: fx.GraphModule) -> fx.GraphModule:
    """The copy of `gm` the executor runs (built on first use, once per GraphModule)."""
    fast = _EXECUTABLE.get(gm)
    if fast is None:
        fast = _EXECUTABLE[gm] = _fast_copy(gm)
    return fast


def _fast_copy(gm: fx.GraphModule) -> fx.GraphModule:
    root, graph, env, flat_of = torch.nn.Module(), fx.Graph(), {}, {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            flat = flat_of.get(node.target)
            if flat is None:
                flat = flat_of[node.target] = f"_{len(flat_of)}_" + node.target.replace(".", "_")
                owner, _, leaf = node.target.rpartition(".")
                value = getattr(gm.get_submodule(owner), leaf)
                if isinstance(value, torch.nn.Parameter):
                    root.register_parameter(flat, value)
                elif isinstance(value, torch.Tensor):
                    root.register_buffer(flat, value)
                elif isinstance(value, fx.GraphModule):   # a recomputed region: fast too
                    setattr(root, flat, _fast_copy(value))
                else:
                    setattr(root, flat, value)      # a submodule (higher-order op body)
            env[node] = graph.get_attr(flat)
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
            if node.op == "call_function" and node.target in _BINDINGS:
                env[node].target = _BINDINGS[node.target]
    graph.lint()
    return fx.GraphModule(root, graph, class_name=f"{type(gm).__name__}Executable")
