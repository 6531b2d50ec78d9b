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
import contextlib
import functools
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx

from autopart.runtime.executable import executable
from autopart.runtime.step_watch import PeerFailure

_COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPILED = "autopart_compiled"      # gm.meta key: the chunk's graph runs Inductor artifacts

# How this process's compute actions ran: ("split" | "autograd", "F" | "B" | "I" | "W") -> count.
# "split": the chunk's compile-time programs (split_backward); "autograd": the fused forward and
# autograd's backward, or I/W by autograd.grad (the fallback, e.g. collectives in the chunk, bf16).
# Nothing reads it at run time; tests clear and read it to see that the programs they expect ran
# (the fallback is silent otherwise). One dict increment per action.
PATHS: "collections.Counter[tuple[str, str]]" = collections.Counter()


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
                or getattr(chunk, "paired", None) is None or chunk.gm.meta.get(COMPILED) \
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
                or i in out.values() or not all(_segmented(ctx.chunks[x.chunk]) for x in (a, b)):
            continue
        if any(actions[k].kind not in ("RECV_F", "RECV_B") for k in range(i + 1, j)):
            continue
        if layout is not None and (i in layout.final_after or i in layout.window_after
                                   or j in layout.window_after):
            continue
        out[i] = j
    return out


def _segmented(chunk) -> bool:
    return getattr(chunk, "segments", None) is not None and not chunk.gm.meta.get(COMPILED)


def _run_combined(actions, i: int, j: int, ctx: StepContext, sends: list) -> int:
    """Run computes i and j (one F, one B) as one action; returns j + 1."""
    pair = (actions[i], actions[j])
    f, b = pair if str(pair[0].kind) == "F" else pair[::-1]
    return _run_two(actions, i, j, ctx, sends, "combined", lambda: _forward_backward(f, b, ctx))


def _forward_backward(f, b, ctx: StepContext) -> None:
    """F of one microbatch run segment by segment inside B of another: its first segment (up to
    its first post) before the backward, the next one each time the backward has posted a
    gradient's all-to-all (the Pending's `after_post`), so that each side's all-to-all moves
    while the other computes; what is left after the backward."""
    run = _Segments(f, ctx)
    run.advance()
    posts = ctx.pending.pop((b.chunk, b.microbatch), [])
    for p in posts:
        p.after_post = run.advance
    try:
        _backward(b, ctx)
    finally:
        for p in posts:
            p.after_post = None
    run.finish()


class _Segments:
    """One forward run piece by piece (ChunkProgram.segments); `advance` runs the next piece,
    `finish` the rest and keeps the outputs as _forward does."""

    def __init__(self, action, ctx: StepContext):
        self.action, self.ctx, self.k = action, ctx, 0
        key = (action.chunk, action.microbatch)
        chunk = self.chunk = ctx.chunks[action.chunk]
        received = [t.requires_grad_(True) if s.differentiable else t
                    for s, t in zip(chunk.recvs, ctx.acts.get(key, []))]
        ctx.acts[key] = received
        inputs = ctx.microbatch(action.microbatch)
        names = [n.name for n in chunk.gm.graph.nodes if n.op == "placeholder"]
        self.env = dict(zip(names, [*received, *(inputs[name] for name in chunk.inputs)]))
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


def _run_pair(actions, i: int, j: int, ctx: StepContext, sends: list) -> int:
    """Run computes i and j as one paired program; returns the index after j."""
    a, b = actions[i], actions[j]
    run = _forward_pair if str(a.kind) == "F" else _backward_pair
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


def _compute(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    kind = str(action.kind)
    _wait_received(ctx, (ctx.acts if kind == "F" else ctx.grads_in, key))
    start = _now(ctx)
    chunk = ctx.chunks[action.chunk]
    graphs = _split_graphs(chunk, ctx)
    PATHS["split" if graphs else "autograd", kind] += 1
    if kind == "F":
        (_forward_split if graphs else _forward)(action, ctx)
    elif graphs:
        {"I": _input_grad_split, "W": _weight_grad_split, "B": _backward_split}[kind](action, ctx)
    else:
        {"I": _input_grad_autograd, "W": _weight_grad_autograd, "B": _backward}[kind](action, ctx)
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


@functools.lru_cache(maxsize=4096)
def _shape(spec, batch: int, seq: int | None) -> tuple[int, ...]:
    return spec.concrete_shape(batch, seq)      # sympy substitution: ~0.1 ms, once per boundary


def _empty(spec, ctx: StepContext, wire: bool = False) -> torch.Tensor:
    dtype = ctx.reduced if wire and ctx.reduced is not None and spec.dtype.is_floating_point \
        else spec.dtype
    return torch.empty(_shape(spec, ctx.batch, ctx.seq), dtype=dtype, device=ctx.device)


def _on_wire(t: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """A tensor to send, in the wire dtype if it is floating (integer and bool ones as they are:
    indices and masks must not be rounded)."""
    return t.to(ctx.reduced) if ctx.reduced is not None and t.is_floating_point() else t


# -- fused backward, autograd -----------------------------------------------------------------------

def _forward(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    if _segmented(chunk):     # its backward then posts and waits apart (_forward_backward)
        _Segments(action, ctx).finish()
        return
    received = ctx.acts.get(key, [])
    received = [t.requires_grad_(True) if s.differentiable else t for s, t in zip(chunk.recvs, received)]
    ctx.acts[key] = received
    inputs = ctx.microbatch(action.microbatch)
    out = executable(chunk.gm, autocast=ctx.reduced)(
        *received, *(inputs[name] for name in chunk.inputs))
    _keep_outputs(chunk, key, out, ctx)


def _forward_pair(a, b, ctx: StepContext) -> None:
    """Both forwards by the chunk's paired program: a's arguments then b's, a's outputs then b's."""
    chunk = ctx.chunks[a.chunk]
    args = []
    for act in (a, b):
        key = (act.chunk, act.microbatch)
        received = [t.requires_grad_(True) if s.differentiable else t
                    for s, t in zip(chunk.recvs, ctx.acts.get(key, []))]
        ctx.acts[key] = received
        inputs = ctx.microbatch(act.microbatch)
        args += [*received, *(inputs[name] for name in chunk.inputs)]
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


def _backward_pair(a, b, ctx: StepContext) -> None:
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
        key = (act.chunk, act.microbatch)
        received = ctx.acts.pop(key, [])
        if act.chunk > 0:
            ctx.grads_out[key] = [t.grad if t.grad is not None else torch.zeros_like(t)
                                  for t in received]


def _backward(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    ctx.pending.pop(key, None)
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


def _input_grad_autograd(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    if chunk.gm.meta.get(COMPILED):
        # Through Inductor's artifacts a second backward over the same graph (W after I with
        # retain_graph) gave wrong gradients (measured by the composition matrix: bf16 and
        # expert dispatch chunks under zb-h1/zb-v, 2-17% off; cause not found). So I runs the
        # whole backward, exact as under 1F1B, and this chunk's W is empty.
        _backward(action, ctx)
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


def _weight_grad_autograd(action, ctx: StepContext) -> None:
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

def _split_graphs(chunk, ctx: StepContext):
    """The chunk's SplitBackward if it has programs for this microbatch shape, else None."""
    sb = chunk.backward
    # The split programs are traced fp32 joint graphs: under autocast their backward halves
    # would mix bf16 saved values with fp32 weights and no casts. bf16 runs I and W by autograd.
    if sb is None or sb.fallback is not None or tuple(sb.shape) != (ctx.batch, ctx.seq) \
            or ctx.reduced is not None:
        return None
    return sb


def _forward_split(action, ctx: StepContext) -> None:
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


def _input_grad_split(action, ctx: StepContext) -> None:
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


def _weight_grad_split(action, ctx: StepContext) -> None:
    key = (action.chunk, action.microbatch)
    chunk = ctx.chunks[action.chunk]
    with torch.no_grad():   # the program adds each gradient into .grad as it is made
        executable(chunk.backward.weight_grad, chunk.gm,
                   accumulate=chunk.backward.params)(ctx.for_weight.pop(key))


def _backward_split(action, ctx: StepContext) -> None:
    _input_grad_split(action, ctx)
    _weight_grad_split(action, ctx)


def _or_zeros(grad, like, spec=None, ctx=None):
    """A received tensor the outputs do not depend on gets a zero gradient, as with autograd."""
    if grad is not None:
        return grad
    return torch.zeros_like(like) if like is not None else \
        torch.zeros(_shape(spec, ctx.batch, ctx.seq), dtype=spec.dtype, device=ctx.device)


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
