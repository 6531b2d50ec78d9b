"""Execute one rank's action list for one training step.

F runs a chunk program on a microbatch; B runs autograd backward through what F recorded;
a run of consecutive SEND/RECV actions is one batch_isend_irecv, waited on as a whole, which is
the communication model the schedule validator proves deadlock-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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
    i = 0
    while i < len(actions):
        if actions[i].kind in _COMM:
            j = i
            while j < len(actions) and actions[j].kind in _COMM:
                j += 1
            _communicate(actions[i:j], ctx)
            i = j
        else:
            (_forward if actions[i].kind == "F" else _backward)(actions[i], ctx)
            i += 1
    return ctx.losses


def _communicate(batch, ctx: StepContext) -> None:
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
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for store, key, bufs in landing:
        store[key] = bufs


def _empty(spec, ctx: StepContext) -> torch.Tensor:
    return torch.empty(spec.concrete_shape(ctx.batch, ctx.seq), dtype=spec.dtype, device=ctx.device)


def _forward(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    received = ctx.acts.get(key, [])
    received = [t.requires_grad_(True) if s.differentiable else t for s, t in zip(chunk.recvs, received)]
    ctx.acts[key] = received
    inputs = ctx.microbatch(action.microbatch)
    out = chunk.gm(*received, *(inputs[name] for name in chunk.inputs))
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
