"""split_backward: each chunk's backward as an input-gradient (I) and a weight-gradient (W) program.

Zero-bubble schedules (Qi et al. 2024) run the part of a backward the previous chunk waits for
(I: gradients of the tensors the chunk received) at once, and the rest (W: parameter gradients)
later, in what would be idle time. torch.distributed.pipelining splits at run time with autograd
hooks; here the split is made at compile time, so a reader sees the three programs:

  1. the joint graph: `make_fx` traces, on fake tensors at the microbatch shape, the chunk's
     forward followed by `torch.autograd.grad` of its outputs w.r.t. its received tensors and its
     parameters. It holds the very ATen ops (and accumulation order) that eager autograd runs, so
     the split gradients are bitwise those of today's single backward (test_split_backward.py);
  2. the partition, by dataflow alone: forward = ancestors of the chunk's outputs; I = the rest
     of the ancestors of the input gradients; W = the rest of the ancestors of the parameter
     gradients. What I and W both need is computed once, in I, and handed to W ("shared"); W reads
     only the saved forward values it uses, so after I a microbatch keeps only those;
  3. three GraphModules whose parameters are attributes under the plain model's names.

A chunk that calls autopart's collectives (tensor- or expert-parallel autograd functions whose
process group exists only at run time) or a recomputation checkpoint cannot be traced this way;
it gets `fallback` = the reason, and the runtime splits its backward by autograd instead.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from autopart.ir import BATCH, SEQ, ChunkProgram, Program, SplitBackward, sym_shape
from autopart.localize import attribute
from autopart.ops import op_info


def split_backward(program: Program, *, microbatch_size: int):
    """Return (program with every chunk's .backward set and .split_backward, report)."""
    b, s = microbatch_size, program.seq_len
    chunks, paths = [], {}
    for c in program.chunks:
        split = split_chunk(c, _example_inputs(program, c, b, s), (b, s))
        chunks.append(_with_backward(c, split))
        paths[c.chunk] = "graphs" if split.fallback is None else f"autograd: {split.fallback}"
    return program.replace(chunks=tuple(chunks), split_backward=paths), {"chunks": paths}


def _with_backward(chunk: ChunkProgram, split: SplitBackward) -> ChunkProgram:
    return dataclasses.replace(chunk, backward=split)


def split_chunk(chunk: ChunkProgram, example: tuple, shape: tuple) -> SplitBackward:
    """The SplitBackward of `chunk`, traced with `example` = (received..., user inputs...)."""
    reason = untraceable(chunk.gm)
    if reason:
        return SplitBackward(shape=shape, fallback=reason)
    try:
        joint, layout = trace_joint(chunk, example, shape)
    except Exception as e:      # a data-dependent op, an op without a fake kernel, ...
        return SplitBackward(shape=shape, fallback=f"tracing the joint graph failed: "
                                                   f"{type(e).__name__}: {str(e)[:200]}")
    return partition(joint, layout, chunk, shape)


def untraceable(gm: fx.GraphModule) -> str | None:
    """Why `gm` cannot be traced into a joint graph at compile time, or None."""
    for node in gm.graph.nodes:     # the collective by name first: the clearest reason
        info = op_info(node.target) if node.op == "call_function" else None
        if info is not None and info.communicates and info.kind != "p2p":
            return f"{node.name} is the {info.axis} collective {info.name}"
    for node in gm.graph.nodes:
        if node.op == "get_attr" and not isinstance(attribute(gm, node.target), torch.Tensor):
            return f"{node.name} reads {type(attribute(gm, node.target)).__name__} " \
                   f"{node.target!r} (a process group or a checkpointed region)"
        if node.op == "call_module":
            return f"{node.name} calls submodule {node.target}"
    return None


# -- 1. the joint graph ----------------------------------------------------------------------------

class _Layout:
    """Where each joint-graph placeholder and output came from."""

    def __init__(self, state: list[str], n_recv: int, n_input: int, diff_recv: list[int]):
        self.state, self.n_recv, self.n_input, self.diff_recv = state, n_recv, n_input, diff_recv
        self.grad_outputs: list[int] = []      # outputs that get a gradient, known after tracing
        self.grad_params: list[str] = []
        self.n_outputs = 0


def trace_joint(chunk: ChunkProgram, example: tuple, shape: tuple) -> tuple[fx.GraphModule, _Layout]:
    """make_fx of forward + autograd.grad, on fake tensors. Placeholders: state (parameters and
    buffers, by name), received, user inputs, output gradients; outputs: (outputs..., input
    grads..., param grads...)."""
    gm = chunk.gm
    state = _state_names(gm)
    values = [attribute(gm, n) for n in state]
    trainable = [n for n, v in zip(state, values) if isinstance(v, torch.nn.Parameter) and v.requires_grad]
    n_recv = len(chunk.recvs)
    diff_recv = [i for i, r in enumerate(chunk.recvs) if r.differentiable]
    layout = _Layout(state, n_recv, len(example) - n_recv, diff_recv)
    out_grads = _output_grad_examples(chunk, example, shape)

    def joint(*flat):
        st = dict(zip(state, flat[:len(state)]))
        args = flat[len(state):len(state) + len(example)]
        gouts = flat[len(state) + len(example):]
        outs = torch.func.functional_call(gm, st, tuple(args), strict=False)
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        pairs = [(i, outs[i], g) for i, g in zip(_differentiable_outputs(chunk, outs), gouts)
                 if outs[i].requires_grad]
        layout.grad_outputs = [i for i, _, _ in pairs]
        layout.n_outputs = len(outs)
        wrt = [args[i] for i in diff_recv] + [st[n] for n in trainable]
        layout.grad_params = trainable
        grads = torch.autograd.grad([o for _, o, _ in pairs], wrt, [g for _, _, g in pairs],
                                    allow_unused=True) if pairs else [None] * len(wrt)
        return (*outs, *grads)

    flat = [_leaf(v) for v in values] + [_leaf(t) if i in diff_recv else t
                                         for i, t in enumerate(example)] + out_grads
    return make_fx(joint, tracing_mode="fake")(*flat), layout


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.dtype.is_floating_point or t.dtype.is_complex)


def _state_names(gm: fx.GraphModule) -> list[str]:
    seen = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in seen:
            seen.append(node.target)
    return seen


def _differentiable_outputs(chunk: ChunkProgram, outs) -> list[int]:
    """Indices of the outputs a gradient comes back for: every differentiable send, or the loss."""
    if chunk.is_last:
        return [0]
    return [i for i, s in enumerate(chunk.sends) if s.differentiable]


def _output_grad_examples(chunk: ChunkProgram, example: tuple, shape: tuple) -> list[torch.Tensor]:
    device = _device(chunk.gm)
    if chunk.is_last:
        return [torch.ones((), device=device)]
    b, s = shape
    return [torch.ones(x.concrete_shape(b, s), dtype=x.dtype, device=device)
            for x in chunk.sends if x.differentiable]


def _example_inputs(program: Program, chunk: ChunkProgram, b: int, s: int | None) -> tuple:
    """Tensors of the microbatch's shapes for the chunk's placeholders (values never read: the
    trace runs on fake tensors)."""
    device = _device(chunk.gm)
    placeholders = {n.name: n for n in program.gm.graph.nodes if n.op == "placeholder"}
    subs = {BATCH: b, SEQ: s or 1}
    out = [torch.zeros(r.concrete_shape(b, s), dtype=r.dtype, device=device) for r in chunk.recvs]
    for name in chunk.inputs:
        val = placeholders[name].meta["val"]
        shape = tuple(int(d.subs(subs)) for d in sym_shape(val, program.symbols))
        out.append(torch.zeros(shape, dtype=val.dtype, device=device))
    return tuple(out)


def _device(gm: fx.GraphModule) -> torch.device:
    for t in list(gm.parameters()) + list(gm.buffers()):
        return t.device
    return torch.device("cpu")


# -- 2. the partition ------------------------------------------------------------------------------

def partition(joint: fx.GraphModule, layout: _Layout, chunk: ChunkProgram,
              shape: tuple) -> SplitBackward:
    """Cut the joint graph into forward, I and W programs (see the module docstring)."""
    nodes = list(joint.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    n_state = len(layout.state)
    state_ph = dict(zip(placeholders[:n_state], layout.state))
    args_ph = placeholders[n_state:n_state + layout.n_recv + layout.n_input]
    gout_ph = placeholders[n_state + layout.n_recv + layout.n_input:]
    outputs = list(next(n for n in nodes if n.op == "output").args[0])
    n_out, n_in = layout.n_outputs, len(layout.diff_recv)
    fwd_outs, in_grads, p_grads = outputs[:n_out], outputs[n_out:n_out + n_in], outputs[n_out + n_in:]

    fwd = _ancestors(fwd_outs)
    i_set = _ancestors(in_grads) - fwd
    w_set = _ancestors(p_grads) - fwd - i_set
    computed_fwd = fwd | set(args_ph)

    def external(group, results):
        """Values `group` (and its `results`) read but does not compute, in graph order."""
        used = {a for n in group for a in n.all_input_nodes} | {r for r in results if isinstance(r, fx.Node)}
        return [n for n in nodes if n in used and n not in group and n not in state_ph]

    i_ext, w_ext = external(i_set, in_grads), external(w_set, p_grads)
    saved = [n for n in nodes if n in computed_fwd and (n in i_ext or n in w_ext)]
    shared = [n for n in w_ext if n not in computed_fwd]          # made by I (or an output grad)
    attrs = {name: attribute(chunk.gm, name) for name in layout.state}
    forward = _emit(nodes, fwd, args_ph, state_ph, (*fwd_outs, *saved), attrs, f"Chunk{chunk.chunk}Forward")
    i_inputs = [n for n in saved if n in i_ext] + list(gout_ph)
    input_grad = _emit(nodes, i_set, i_inputs, state_ph, (*in_grads, *shared), attrs,
                       f"Chunk{chunk.chunk}InputGrad", keep_unused=True)
    w_inputs = [n for n in saved if n in w_ext] + shared
    weight_grad = _emit(nodes, w_set, w_inputs, state_ph, tuple(p_grads), attrs,
                        f"Chunk{chunk.chunk}WeightGrad")
    position = {n: i for i, n in enumerate(saved)}
    return SplitBackward(
        forward=forward, input_grad=input_grad, weight_grad=weight_grad, num_outputs=n_out,
        saved_for_input=tuple(position[n] for n in saved if n in i_ext),
        saved_for_weight=tuple(position[n] for n in saved if n in w_ext),
        grad_outputs=tuple(layout.grad_outputs),
        params=tuple(p for p, g in zip(layout.grad_params, p_grads) if g is not None),
        shape=shape)


def _ancestors(roots) -> set:
    seen: set = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


# -- 3. the programs -------------------------------------------------------------------------------

def _emit(nodes, group: set, inputs: list, state_ph: dict, results: tuple, attrs: dict,
          name: str, keep_unused: bool = False) -> fx.GraphModule:
    """A GraphModule computing `results` from `inputs` with the nodes of `group`, in joint-graph
    order; state placeholders become get_attrs of the plain model's names."""
    g, env, used_attrs = fx.Graph(), {}, {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)

    def lookup(n):
        if n not in env and n in state_ph:
            target = state_ph[n]
            used_attrs[target] = attrs[target]
            env[n] = g.get_attr(target)
            env[n].meta = dict(n.meta)
        return env[n]

    for n in nodes:
        if n in group:
            env[n] = g.node_copy(n, lookup)
    g.output(tuple(lookup(r) if isinstance(r, fx.Node) else r for r in results))
    if not keep_unused:
        g.eliminate_dead_code()
    g.lint()
    gm = fx.GraphModule(used_attrs, g, class_name=name)
    gm.recompile()
    return gm


__all__ = ["split_backward", "split_chunk", "trace_joint", "partition", "untraceable"]
