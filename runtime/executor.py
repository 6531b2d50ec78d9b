"""Execute one rank's action list for one training step.

F runs a chunk program on a microbatch; B runs its backward; I and W (zero-bubble schedules) run
the two halves of B: the input gradient, which the previous chunk waits for, and the weight
gradient. A chunk with compile-time split programs (split_backward) runs F as its forward program
(no autograd graph: it returns what I and W read), I and W as their programs, and B as I then W;
a chunk whose backward could not be traced (collectives inside) runs I as autograd.grad w.r.t.
its received tensors, keeping the graph, and W as autograd.grad w.r.t. its parameters.

A run of consecutive SEND/RECV actions is one batch_isend_irecv, which is the communication model
the schedule validator proves deadlock-free. Its receives are waited on only when a compute needs
them (in the order they were posted: a pair's messages match in posting order), its sends only at
the end of the step: nothing on this rank reads a sent tensor again and the peer's receive is what
orders the transfer, so a rank never idles until its peer has posted the matching receive. With
NCCL a wait only orders the compute stream after the transfer, so the host never blocks; with
Gloo it blocks until the data is there. NCCL also returns one work for a whole batch where Gloo
returns one per op (_Batch): a receive is waited on through whichever work covers it.
The lists it runs are lowered first by autopart/schedule_lowering.py `hoist_receives`: receives
posted earlier, before the computes that precede their use (for NCCL where the validator proves
it safe; for Gloo, whose posts never wait, right after the compute reading the receive two
before).

With data parallelism, `ctx.grads` (runtime/gradients.py StepBuckets) is told before and after
each compute, so that gradient buckets are all-reduced as soon as the backward finishes them;
they are waited on at the end of the list, after the sends.
"""
from __future__ import annotations

import collections
import time

import torch
import torch.distributed as dist

from autopart.runtime import compute
from autopart.runtime.compute import StepContext
from autopart.runtime.step_watch import PeerFailure

_COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")

# How this process's compute actions ran: ("split" | "autograd", "F" | "B" | "I" | "W") -> count.
# "split": the chunk's compile-time programs (split_backward); "autograd": the fused forward and
# autograd's backward, or I/W by autograd.grad (the fallback, e.g. collectives in the chunk, bf16).
# Nothing reads it at run time; tests clear and read it to see that the programs they expect ran
# (the fallback is silent otherwise). One dict increment per action.
PATHS: "collections.Counter[tuple[str, str]]" = collections.Counter()


def posts_never_wait(device: torch.device) -> bool:
    """Whether point-to-point transfers of tensors on `device` keep Gloo's contract: one work per
    operation and posts that never wait, so the lists may post receives well ahead of their use
    (autopart/schedule_lowering.py hoist_receives(independent_posts=True)). CPU tensors go
    through Gloo; NCCL coalesces a batch into one work that runs in posting order on the group's
    stream, where an early receive holds back every later batch. A batch_isend_irecv that keeps NCCL's contract
    on CPU says so (`keeps_nccl_contract = True`: tests/nccl_contract.py), and then NCCL's lowering
    runs: the code path of the GPUs, tested without them."""
    return device.type == "cpu" and not getattr(dist.batch_isend_irecv, "keeps_nccl_contract",
                                                False)


def run_actions(actions, ctx: StepContext) -> list[torch.Tensor]:
    """Run `actions` (this rank's list from the schedule) in order; returns microbatch losses."""
    sends: list = []        # (batch, indices of its sends): waited on at the step's end
    if ctx.grads is not None:   # a failed bucket names the step and what it waited for
        ctx.grads.bind(lambda work, what: _wait(work, what, ctx), lambda: _now(ctx))
    pairs = paired_computes(actions, ctx)
    combined = combined_computes(actions, ctx)
    i = 0
    while i < len(actions):
        if i in pairs:      # two microbatches in one program (passes/overlap_experts.py)
            i = _run_pair(actions, i, pairs[i], ctx, sends)
            continue
        if i in combined:   # a forward beside another microbatch's backward
            i = _run_combined(actions, i, combined[i], ctx, sends)
            continue
        if actions[i].kind in _COMM:
            j = i
            while j < len(actions) and actions[j].kind in _COMM:
                j += 1
            sends += _communicate(actions[i:j], ctx)
            i = j
            if ctx.watch is not None:
                ctx.watch.progress()
        else:
            if ctx.grads is not None:
                ctx.grads.before(i)
            if ctx.watch is not None:
                ctx.watch.begin(actions[i])
            try:
                _compute(actions[i], ctx)
            except PeerFailure:
                raise
            except RuntimeError as e:     # a collective inside the chunk (tp, ep) timed out
                raise PeerFailure(f"rank {dist.get_rank()} failed in {actions[i]} at step "
                                  f"{ctx.step}: {e}") from e
            if ctx.grads is not None:
                ctx.grads.after(i)
            if ctx.watch is not None:
                ctx.watch.progress()
            i += 1
    _wait_received(ctx, None)
    for batch, indices in sends:
        batch.wait(indices, ctx)
    if ctx.grads is not None:   # the gradient buckets, before anything reads .grad
        ctx.grads.finish()
    return ctx.losses


def paired_computes(actions, ctx: StepContext) -> dict[int, int]:
    """{i: j} for each compute i whose chunk has a paired program (passes/overlap_experts.py)
    and whose next compute j is the same kind (F or B) of the same chunk, with only receives
    between (posted before the pair: a post never waits). Not under zero=2's per-backward
    windows, nor where a gradient bucket is final after i (the pair's backward is one), nor B
    under bf16 (below), nor for a chunk run by Inductor (compile=True: its segments are
    compiled for one microbatch each)."""
    pairs, layout = {}, getattr(ctx.grads, "layout", None)
    if all(getattr(c, "paired", None) is None for c in ctx.chunks.values()):
        return pairs        # the common case: no scan of the step's actions
    computes = [i for i, a in enumerate(actions) if a.kind not in _COMM]
    for i, j in zip(computes, computes[1:]):
        a, b = actions[i], actions[j]
        chunk = ctx.chunks[a.chunk]
        if a.kind not in ("F", "B") or (a.kind, a.chunk) != (b.kind, b.chunk) \
                or getattr(chunk, "paired", None) is None or chunk.gm.meta.get(compute.COMPILED) \
                or i in pairs.values():
            continue
        if any(actions[k].kind not in ("RECV_F", "RECV_B") for k in range(i + 1, j)):
            continue
        if a.kind == "B" and ctx.reduced is not None:
            # bf16: both microbatches read autocast's one bf16 copy of each weight, so one
            # backward would sum their weight gradients in bf16 before the fp32 .grad (measured:
            # 1.5e-3 off the recipe); each backward alone accumulates in fp32, as unpaired
            continue
        if layout is not None and (i in layout.final_after or i in layout.window_after
                                   or j in layout.window_after):
            continue
        pairs[i] = j
    return pairs


def combined_computes(actions, ctx: StepContext) -> dict[int, int]:
    """{i: j} for the computes run together (autopart/compiler.py combines_forward_backward:
    the interleaved 1F1B's slots): an F and a B of other microbatches, next to each other but
    for receives (posted before the pair: a post never waits), both chunks' forwards segmented
    (passes/overlap_experts.py), and no gradient bucket final or windowed between them (both
    finish as one action)."""
    if all(getattr(c, "segments", None) is None for c in ctx.chunks.values()):
        return {}
    layout, out = getattr(ctx.grads, "layout", None), {}
    computes = [i for i, a in enumerate(actions) if a.kind not in _COMM]
    for i, j in zip(computes, computes[1:]):
        a, b = actions[i], actions[j]
        if {str(a.kind), str(b.kind)} != {"F", "B"} or a.microbatch == b.microbatch \
                or i in out.values() \
                or not all(compute.segmented(ctx.chunks[x.chunk]) for x in (a, b)):
            continue
        if any(actions[k].kind not in ("RECV_F", "RECV_B") for k in range(i + 1, j)):
            continue
        if layout is not None and (i in layout.final_after or i in layout.window_after
                                   or j in layout.window_after):
            continue
        out[i] = j
    return out


def _run_combined(actions, i: int, j: int, ctx: StepContext, sends: list) -> int:
    """Run computes i and j (one F, one B) as one action; returns j + 1."""
    pair = (actions[i], actions[j])
    f, b = pair if str(pair[0].kind) == "F" else pair[::-1]
    return _run_two(actions, i, j, ctx, sends, "combined",
                    lambda: compute.forward_backward(f, b, ctx))


def _run_pair(actions, i: int, j: int, ctx: StepContext, sends: list) -> int:
    """Run computes i and j as one paired program; returns the index after j."""
    a, b = actions[i], actions[j]
    run = compute.forward_pair if str(a.kind) == "F" else compute.backward_pair
    return _run_two(actions, i, j, ctx, sends, "paired", lambda: run(a, b, ctx))


def _run_two(actions, i: int, j: int, ctx: StepContext, sends: list, how: str, run) -> int:
    """Computes i and j as one action, `run()` ("paired" or "combined": PATHS counts each
    compute so): the receives between them posted first, both computes' inputs waited for;
    a gradient bucket may be final only after j (paired_computes, combined_computes). A paired
    action's trace gives each compute half the time, a combined one's both the whole."""
    if j > i + 1:
        sends += _communicate(actions[i + 1:j], ctx)
    two = (actions[i], actions[j])
    for act in two:
        _wait_received(ctx, (ctx.acts if str(act.kind) == "F" else ctx.grads_in,
                             (act.chunk, act.microbatch)))
    if ctx.grads is not None:
        ctx.grads.before(j)
    if ctx.watch is not None:
        ctx.watch.begin(two[0])
    start = _now(ctx)
    for act in two:
        PATHS[how, str(act.kind)] += 1
    try:
        run()
    except PeerFailure:
        raise
    except RuntimeError as e:     # an all-to-all inside a chunk timed out
        raise PeerFailure(f"rank {dist.get_rank()} failed in {two[0]} and {two[1]} at step "
                          f"{ctx.step}: {e}") from e
    if ctx.trace is not None:
        end = _now(ctx)
        mid = (start + end) / 2 if how == "paired" else end
        ctx.trace.record(two[0], start, mid)
        ctx.trace.record(two[1], mid if how == "paired" else start, end)
    for act in two:
        _hand_over(act, str(act.kind), ctx)
    if ctx.grads is not None:
        ctx.grads.after(j)
    if ctx.watch is not None:
        ctx.watch.progress()
    return j + 1


def _wait(work, what: str, ctx: StepContext) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise PeerFailure(f"rank {dist.get_rank()} {what} at step {ctx.step}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else e}") from e


_SPLIT = {"F": compute.forward_split, "I": compute.input_grad_split,
          "W": compute.weight_grad_split, "B": compute.backward_split}
_AUTOGRAD = {"F": compute.forward, "I": compute.input_grad_autograd,
             "W": compute.weight_grad_autograd, "B": compute.backward}


def _compute(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    kind = str(action.kind)
    _wait_received(ctx, (ctx.acts if kind == "F" else ctx.grads_in, key))
    start = _now(ctx)
    chunk = ctx.chunks[action.chunk]
    graphs = compute.split_graphs(chunk, ctx)
    PATHS["split" if graphs else "autograd", kind] += 1
    (_SPLIT if graphs else _AUTOGRAD)[kind](action, ctx)
    if ctx.trace is not None:
        ctx.trace.record(action, start, _now(ctx))
    _hand_over(action, kind, ctx)


def _hand_over(action, kind: str, ctx: StepContext) -> None:
    """Neighbouring chunks on the same rank (the V placement's turn: zb-v, dualpipe-v) exchange
    activations and gradients here, with no SEND/RECV in the schedule: the next chunk gets the
    output as a fresh leaf, as if received, and the previous one the input gradients."""
    c, m = action.chunk, action.microbatch
    if kind == "F" and c + 1 in ctx.chunks and not ctx.chunks[c].is_last:
        ctx.acts[(c + 1, m)] = [o.detach() for o in ctx.outs[(c, m)]]
    elif kind in ("I", "B") and c - 1 in ctx.chunks and (c, m) in ctx.grads_out:
        grads = ctx.grads_out.pop((c, m))
        ctx.grads_in[(c - 1, m)] = [g for s, g in zip(ctx.chunks[c].recvs, grads)
                                    if s.differentiable]


def _now(ctx: StepContext) -> float:
    if ctx.trace is None:
        return 0.0
    if ctx.device.type == "cuda":       # a measured timeline needs the work done, not queued
        torch.cuda.synchronize(ctx.device)
    return time.perf_counter()


class _Batch:
    """One batch_isend_irecv. Gloo returns a work per op; NCCL coalesces the batch and returns ONE
    work for all its ops (torch's batch_isend_irecv, `supports_coalescing` branch), and a receive
    buffer holds its data only after that work was waited on. So an op is complete when its own
    work was waited on, or the batch's one work: `wait` takes the indices of the ops needed and
    waits on whichever works cover them, each once. The batch keeps its ops, which hold the sent
    tensors, until the step's end (NCCL reads a sent tensor whenever its kernel runs)."""

    __slots__ = ("ops", "what", "works", "pending")

    def __init__(self, ops: list, what: list[str]):
        self.ops, self.what = ops, what          # what[i]: what a failed wait for op i means
        self.works = dist.batch_isend_irecv(ops)
        self.pending = set(range(len(self.works)))

    def wait(self, indices, ctx: StepContext) -> None:
        coalesced = len(self.works) != len(self.ops)
        for i in (range(len(self.works)) if coalesced else indices):
            if i in self.pending:
                # formatted only if the wait fails (str of the _What, or of the batch)
                _wait(self.works[i], self.what[i] if not coalesced else self, ctx)
                self.pending.discard(i)

    def __str__(self) -> str:
        return "was waiting for the batch [" + "; ".join(map(str, self.what)) + "]"


class _What:
    """What a failed wait for one transfer means ("was waiting for 1RECV_F0 from rank 0"),
    formatted only when a failure reads it: never in the step's hot path."""

    __slots__ = ("verb", "action", "preposition", "peer")

    def __init__(self, verb: str, action, preposition: str, peer: int):
        self.verb, self.action, self.preposition, self.peer = verb, action, preposition, peer

    def __str__(self) -> str:
        return f"{self.verb} {self.action} {self.preposition} rank {self.peer}"


def _communicate(batch, ctx: StepContext) -> list:
    """Post one batch; return [(the _Batch, indices of its sends)], to be waited on at the end
    of the step. Its receives are waited on when a compute first needs one of them
    (_wait_received)."""
    ops, landing, what = [], [], []
    start = _now(ctx)
    for a in batch:
        key = (a.chunk, a.microbatch)
        chunk = ctx.chunks[a.chunk]
        if a.kind in ("SEND_F", "SEND_B"):
            if a.kind == "SEND_F":
                pairs = [(spec, t.detach()) for spec, t in zip(chunk.sends, ctx.outs[key])]
            else:
                pairs = [(spec, g) for spec, g in zip(chunk.recvs, ctx.grads_out.pop(key))
                         if spec.differentiable]
            for spec, t in pairs:
                peer = ctx.peer(spec.peer_rank)
                ops.append(dist.P2POp(dist.isend, _on_wire(t, ctx).contiguous(), peer, ctx.group))
                what.append(_What("could not deliver", a, "to", peer))
        else:
            if a.kind == "RECV_F":
                store, specs = ctx.acts, chunk.recvs
            else:   # RECV_B: gradients of this chunk's outputs, from the next chunk
                store, specs = ctx.grads_in, [s for s in chunk.sends if s.differentiable]
            bufs = [_empty(spec, ctx, wire=True) for spec in specs]
            landing.append((store, key, bufs, a, range(len(ops), len(ops) + len(bufs)), specs))
            for s, b in zip(specs, bufs):
                peer = ctx.peer(s.peer_rank)
                ops.append(dist.P2POp(dist.irecv, b, peer, ctx.group))
                what.append(_What("was waiting for", a, "from", peer))
    if not ops:
        return []
    posted = _Batch(ops, what)
    ctx.batches.append(posted)
    for store, key, bufs, a, indices, specs in landing:
        store[key] = bufs
        ctx.posted.append((store, key, posted, indices, a, start, specs))
    if ctx.trace is not None:
        end = _now(ctx)
        for a in batch:
            if a.kind in ("SEND_F", "SEND_B"):
                ctx.trace.record(a, start, end)
    return [(posted, [i for i, op in enumerate(ops) if op.op is dist.isend])]


def _wait_received(ctx: StepContext, needed) -> None:
    """Wait for the posted receives up to the one that fills `needed` = (store, key), in posting
    order (all of them for None). Nothing to wait for when `needed` was never posted."""
    if needed is not None and not any(s is needed[0] and k == needed[1]
                                      for s, k, *_ in ctx.posted):
        return
    while ctx.posted:
        store, key, batch, indices, action, posted, specs = ctx.posted.pop(0)
        start = _now(ctx)
        batch.wait(indices, ctx)
        if ctx.reduced is not None:    # back to the dtype the receiving program was compiled for
            store[key] = [b.to(s.dtype) for b, s in zip(store[key], specs)]
        if ctx.trace is not None:   # the slice is the time this rank waited for the data
            ctx.trace.record(action, start, _now(ctx), posted=posted)
        if needed is not None and store is needed[0] and key == needed[1]:
            return


def _empty(spec, ctx: StepContext, wire: bool = False) -> torch.Tensor:
    dtype = ctx.reduced if wire and ctx.reduced is not None and spec.dtype.is_floating_point \
        else spec.dtype
    shape = compute.concrete_shape(spec, ctx.batch, ctx.seq)
    return torch.empty(shape, dtype=dtype, device=ctx.device)


def _on_wire(t: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """A tensor to send, in the wire dtype if it is floating (integer and bool ones as they are:
    indices and masks must not be rounded)."""
    return t.to(ctx.reduced) if ctx.reduced is not None and t.is_floating_point() else t

