"""The compute actions of a step (runtime/executor.py runs the list): F, B, I and W of one
microbatch, by autograd or by a chunk's compile-time split programs (passes/split_backward.py);
two microbatches' F or B in one paired program, and a forward run segment by segment inside another
microbatch's backward (passes/overlap_experts.py). Each reads and fills the StepContext's stores:
acts (received inputs), outs, grads_in, grads_out, saved, for_weight, pending."""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopart.runtime.executable import executable

COMPILED = "autopart_compiled"      # gm.meta key: the chunk's graph runs Inductor artifacts


@dataclass
class StepContext:
    """What one step needs: this rank's chunks, how to reach peers, and the microbatches."""
    chunks: dict                    # chunk index -> ChunkProgram
    peer: callable                  # pipeline rank -> global rank (same dp and tp coordinates)
    microbatch: callable            # microbatch index -> {input name: tensor}
    batch: int                      # microbatch size
    seq: int | None
    device: torch.device
    loss_scale: float | torch.Tensor  # each microbatch loss's factor: 1 / (microbatches * dp), the
                                      # global-batch mean, or 1 / tokens (a 0-dim device tensor
                                      # where the count reads the labels: never read on the host)
    group: object = None            # the pipeline's process group: its timeout bounds every wait
    trace: object = None            # a runtime.trace.Recorder, or None
    step: int = 0                   # which train_step this is (errors name it)
    reduced: torch.dtype | None = None  # precision="bf16": the dtype of compute (autocast) and of
                                        # floating transfers; None for fp32
    acts: dict = field(default_factory=dict)       # (chunk, mb) -> received forward inputs
    outs: dict = field(default_factory=dict)       # (chunk, mb) -> forward outputs
    grads_in: dict = field(default_factory=dict)   # (chunk, mb) -> grads received for outputs
    grads_out: dict = field(default_factory=dict)  # (chunk, mb) -> grads of inputs to send back
    saved: dict = field(default_factory=dict)      # (chunk, mb) -> split forward's saved values
    for_weight: dict = field(default_factory=dict)  # (chunk, mb) -> what W reads, after I
    posted: list = field(default_factory=list)     # [(store, key, batch, op indices, action,
                                                   #   posted at, specs)]
    losses: list = field(default_factory=list)
    stats: list = field(default_factory=list)      # per microbatch: the model's other outputs
    batches: list = field(default_factory=list)    # every _Batch posted, in order: what a
                                                   # failure names (runtime/step_watch.py)
    watch: object = None    # runtime.step_watch.StepWatch: told after each action
    grads: object = None    # runtime.gradients.StepBuckets: gradient all-reduces posted as the
                            # backward finishes them (told before and after each compute)
    pending: dict = field(default_factory=dict)    # (chunk, mb) -> the all-to-alls (Pending) its
                                                   # segmented forward posted, until its B


def segmented(chunk) -> bool:
    return getattr(chunk, "segments", None) is not None and not chunk.gm.meta.get(COMPILED)


def forward_backward(f, b, ctx: StepContext) -> None:
    """F of one microbatch run segment by segment inside B of another: its first segment (up to
    its first post) before the backward, the next one each time the backward has posted a
    gradient's all-to-all (the Pending's `after_post`), so that each side's all-to-all moves
    while the other computes; what is left after the backward."""
    run = Segments(f, ctx)
    run.advance()
    posts = ctx.pending.pop((b.chunk, b.microbatch), [])
    for p in posts:
        p.after_post = run.advance
    try:
        backward(b, ctx)
    finally:
        for p in posts:
            p.after_post = None
    run.finish()


class Segments:
    """One forward run piece by piece (ChunkProgram.segments); `advance` runs the next piece,
    `finish` the rest and keeps the outputs as forward does."""

    def __init__(self, action, ctx: StepContext):
        self.action, self.ctx, self.k = action, ctx, 0
        key = (action.chunk, action.microbatch)
        chunk = self.chunk = ctx.chunks[action.chunk]
        names = [n.name for n in chunk.gm.graph.nodes if n.op == "placeholder"]
        self.env = dict(zip(names, _arguments(chunk, action, ctx)))
        self.posted = ctx.pending.setdefault(key, [])

    def advance(self) -> None:
        segments = self.chunk.segments
        if self.k >= len(segments):
            return
        seg, env = segments[self.k], self.env
        self.k += 1
        args = [env[n] for n in seg.inputs]
        for n in seg.drops:
            del env[n]
        # also when called from inside a backward: grad mode on, and bf16's autocast where the
        # backward runs on another thread (CUDA's device threads) without the step's
        with torch.enable_grad(), _step_autocast(self.ctx):
            out = executable(seg.gm, self.chunk.gm, autocast=self.ctx.reduced)(args)
            env.update(zip(seg.outputs, out))
            self.posted += [env[n] for n in seg.pending]
            if self.k == len(segments):     # (the loss scaled in grad mode too)
                _keep_outputs(self.chunk, (self.action.chunk, self.action.microbatch),
                              tuple(out), self.ctx)

    def finish(self) -> None:
        while self.k < len(self.chunk.segments):
            self.advance()


def _step_autocast(ctx: StepContext):
    device = ctx.device.type
    if ctx.reduced is None or torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=ctx.reduced)


@functools.lru_cache(maxsize=4096)
def concrete_shape(spec, batch: int, seq: int | None) -> tuple[int, ...]:
    return spec.concrete_shape(batch, seq)      # sympy substitution: ~0.1 ms, once per boundary


# -- fused backward, autograd -----------------------------------------------------------------------

def forward(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    if segmented(chunk):     # its backward then posts and waits apart (forward_backward)
        Segments(action, ctx).finish()
        return
    out = executable(chunk.gm, autocast=ctx.reduced)(*_arguments(chunk, action, ctx))
    _keep_outputs(chunk, key, out, ctx)


def _arguments(chunk, action, ctx: StepContext) -> list:
    """The forward's arguments: the received tensors (the differentiable ones made to require
    grad, so that B finds their gradients), then the microbatch's inputs this chunk reads."""
    key = (action.chunk, action.microbatch)
    received = [t.requires_grad_(True) if s.differentiable else t
                for s, t in zip(chunk.recvs, ctx.acts.get(key, []))]
    ctx.acts[key] = received
    inputs = ctx.microbatch(action.microbatch)
    return [*received, *(inputs[name] for name in chunk.inputs)]


def forward_pair(a, b, ctx: StepContext) -> None:
    """Both forwards by the chunk's paired program: a's arguments then b's, a's outputs then b's."""
    chunk = ctx.chunks[a.chunk]
    args = []
    for act in (a, b):
        args += _arguments(chunk, act, ctx)
    out = executable(chunk.paired, chunk.gm, autocast=ctx.reduced)(args)
    half = len(out) // 2
    for act, res in ((a, out[:half]), (b, out[half:])):
        _keep_outputs(chunk, (act.chunk, act.microbatch), res, ctx)


def _keep_outputs(chunk, key, out, ctx: StepContext) -> None:
    if chunk.is_last:
        ctx.losses.append(out[0].detach())
        if len(out) > 1:
            ctx.stats.append(tuple(o.detach() for o in out[1:]))
        ctx.outs[key] = (out[0] * ctx.loss_scale,)
    else:
        ctx.outs[key] = tuple(out)


def backward_pair(a, b, ctx: StepContext) -> None:
    """Both backwards in one autograd pass: autograd interleaves them as the forward did, each
    all-to-all's gradient posted by ep_wait's backward and waited on by its start's."""
    chunk = ctx.chunks[a.chunk]
    outputs, grads = [], []
    for act in (a, b):
        o, g = _output_pairs(chunk, (act.chunk, act.microbatch), ctx)
        outputs += o
        grads += g if g is not None else [None] * len(o)
    if outputs:
        torch.autograd.backward(outputs, grads if any(g is not None for g in grads) else None)
    for act in (a, b):
        _hand_back(act, ctx)


def backward(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    ctx.pending.pop(key, None)
    outputs, grads = _output_pairs(chunk, key, ctx)
    if outputs:
        torch.autograd.backward(outputs, grads)
    _hand_back(action, ctx)


def _hand_back(action, ctx: StepContext) -> None:
    """After a fused backward: the gradients of the received inputs, to send to the previous
    chunk (zeros for an input the outputs do not depend on, as the peer's receive needs one)."""
    key = (action.chunk, action.microbatch)
    received = ctx.acts.pop(key, [])
    if action.chunk > 0:
        ctx.grads_out[key] = [t.grad if t.grad is not None else torch.zeros_like(t)
                              for t in received]


# -- split backward, autograd (chunks whose joint graph could not be traced) -------------------------

def _output_pairs(chunk, key, ctx: StepContext) -> tuple[list, list | None]:
    """(outputs, their gradients) to differentiate: the scaled loss, or the differentiable sends
    that require grad with the gradients received for them."""
    outs = ctx.outs.pop(key)
    if chunk.is_last:
        return [outs[0]], None
    grads = iter(ctx.grads_in.pop(key))
    pairs = [(o, next(grads)) for s, o in zip(chunk.sends, outs) if s.differentiable]
    pairs = [(o, g) for o, g in pairs if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def input_grad_autograd(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    if chunk.gm.meta.get(COMPILED):
        # Through Inductor's artifacts a second backward over the same graph (W after I with
        # retain_graph) gave wrong gradients (measured by the composition matrix: bf16 and
        # expert dispatch chunks under zb-h1/zb-v, 2-17% off; cause not found). So I runs the
        # whole backward, exact as under 1F1B, and this chunk's W is empty.
        backward(action, ctx)
        ctx.for_weight[key] = None
        return
    outputs, grads = _output_pairs(chunk, key, ctx)
    received = ctx.acts.pop(key, [])
    wrt = [t for s, t in zip(chunk.recvs, received) if s.differentiable]
    found = iter(torch.autograd.grad(outputs, wrt, grads, retain_graph=True, allow_unused=True)
                 if outputs and wrt else [None] * len(wrt))
    if action.chunk > 0:
        ctx.grads_out[key] = [_or_zeros(next(found), t) if s.differentiable else None
                              for s, t in zip(chunk.recvs, received)]
    ctx.for_weight[key] = (outputs, grads)


def weight_grad_autograd(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    pair = ctx.for_weight.pop(key)
    if pair is None:            # a compiled chunk: I ran the whole backward
        return
    outputs, grads = pair
    params = _params(ctx.chunks[action.chunk])
    names = [n for n, p in params.items() if p.requires_grad]
    if not outputs or not names:
        return
    found = torch.autograd.grad(outputs, [params[n] for n in names], grads, allow_unused=True)
    _accumulate(params, names, found)


# -- split backward, compile-time programs ----------------------------------------------------------

def split_graphs(chunk, ctx: StepContext):
    """The chunk's SplitBackward if it has programs for this microbatch shape, else None."""
    sb = chunk.backward
    # The split programs are traced fp32 joint graphs: under autocast their backward halves
    # would mix bf16 saved values with fp32 weights and no casts. bf16 runs I and W by autograd.
    if sb is None or sb.fallback is not None or tuple(sb.shape) != (ctx.batch, ctx.seq) \
            or ctx.reduced is not None:
        return None
    return sb


def forward_split(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    sb = chunk.backward
    inputs = ctx.microbatch(action.microbatch)
    with torch.no_grad():
        res = executable(sb.forward, chunk.gm)([*ctx.acts.pop(key, []),
                                                *(inputs[name] for name in chunk.inputs)])
    outs, ctx.saved[key] = tuple(res[:sb.num_outputs]), res[sb.num_outputs:]
    if chunk.is_last:
        ctx.losses.append(outs[0])
        if len(outs) > 1:
            ctx.stats.append(outs[1:])
    ctx.outs[key] = outs


def input_grad_split(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    sb = chunk.backward
    outs = ctx.outs.pop(key)
    if chunk.is_last:   # d(loss * scale)/d(loss), as the fused path's multiply gives it
        # as_tensor: a device tensor stays where it is (torch.full would read it on the host)
        picked = [torch.as_tensor(ctx.loss_scale, dtype=outs[0].dtype,
                                  device=outs[0].device).reshape(())]
    else:
        diff = [i for i, s in enumerate(chunk.sends) if s.differentiable]
        got = dict(zip(diff, ctx.grads_in.pop(key)))
        picked = [got[i] for i in sb.grad_outputs]
    saved = ctx.saved.pop(key)
    for_weight = [saved[i] for i in sb.saved_for_weight]
    args = [saved[i] for i in sb.saved_for_input] + picked
    del saved, picked           # I frees what only it reads as it goes (the boxed call)
    with torch.no_grad():
        res = executable(sb.input_grad, chunk.gm)(args)
    n_in = sum(s.differentiable for s in chunk.recvs)
    found = iter(res[:n_in])
    if action.chunk > 0:
        ctx.grads_out[key] = [_or_zeros(next(found), None, s, ctx) if s.differentiable else None
                              for s in chunk.recvs]
    ctx.for_weight[key] = for_weight + list(res[n_in:])


def weight_grad_split(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    with torch.no_grad():   # the program adds each gradient into .grad as it is made
        executable(chunk.backward.weight_grad, chunk.gm,
                   accumulate=chunk.backward.params)(ctx.for_weight.pop(key))


def backward_split(action, ctx: StepContext) -> None:
    input_grad_split(action, ctx)
    weight_grad_split(action, ctx)


def _or_zeros(grad, like, spec=None, ctx=None):
    """A received tensor the outputs do not depend on gets a zero gradient, as with autograd."""
    if grad is not None:
        return grad
    return torch.zeros_like(like) if like is not None else \
        torch.zeros(concrete_shape(spec, ctx.batch, ctx.seq), dtype=spec.dtype, device=ctx.device)


_PARAMS: "weakref.WeakKeyDictionary[fx.GraphModule, dict]" = weakref.WeakKeyDictionary()


def _params(chunk) -> dict:
    params = _PARAMS.get(chunk.gm)
    if params is None:
        params = _PARAMS[chunk.gm] = {n: chunk.gm.get_parameter(n) for n in chunk.params}
    return params


def _accumulate(params: dict, names, grads) -> None:
    """Add gradients into .grad as autograd's AccumulateGrad does outside grad mode."""
    for name, g in zip(names, grads):
        if g is None:
            continue
        p = params[name]
        if p.grad is None:
            p.grad = g.detach()
        else:
            p.grad += g
