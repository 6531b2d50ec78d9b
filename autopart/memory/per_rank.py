"""Per rank: state bytes, the activation peak over the schedule's actions, the memory table."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
import torch
import torch.utils.checkpoint
from autopart.analysis import evaluate
from autopart.ir import REDUCED_DTYPES, Program

from .activations import ActivationCache, ChunkActivations
from .state import Held, state
from .units import KEYS

def state_bytes(program: Program, chunks, mesh, optimizer: str, precision: str = "fp32",
                zero: int = 0, local=None) -> dict[str, int]:
    """params / grads / master / optimizer bytes of one rank holding `chunks` (localized, or
    global with `local(name, tensor)` giving the tensor of this rank's shape, see _RankShapes):

        params     every parameter and buffer element at its dtype (fp32: 4 bytes)
        grads      every trainable element at its dtype (full-shaped .grad, also with zero=1);
                   zero=2, 3: this rank's slice only
        zero=0     master 0 (the parameters are the masters); optimizer 4 * states per element
        zero=1, 2  runtime/sharding.py cuts each trainable parameter into d chunks per replica
                   group (dense over dp, experts over dp/ep); this rank keeps an fp32 copy of
                   its ceil(n_i/d) elements of each (master 4 bytes each) and the optimizer's
                   state for them (4 * states bytes each)
    plus, for Adam, one 4-byte `step` per tensor stepped (each parameter, or each slice).
        zero=3     params: the trainable ones as this rank's slice (an fp32 slice is the master
                   itself, counted there) plus the most its program holds gathered at once
                   (the layer in use, the one prefetched, and a tied embedding read at both
                   ends of the forward: _gathered_bytes)
    Not counted: the buckets in flight (at most runtime/buckets.IN_FLIGHT of zero_bucket_size
    elements) and zero=2's full-shaped gradients of the chunk whose backward runs."""
    # precision changes no state byte (see the module docstring)
    held: dict = {}
    for c in chunks:
        for name, t in list(c.gm.named_parameters()) + list(c.gm.named_buffers()):
            if name.startswith("recompute_"):
                continue
            held.setdefault(name, t)
    if local is not None:
        held = {name: local(name, t) for name, t in held.items()}
    trainable = {n: t for n, t in held.items() if n in program.params and t.requires_grad}
    grads = sum(t.numel() * t.element_size() for t in trainable.values())
    slices = _zero_slices(trainable, program, mesh) if zero else \
        [(t, t.numel(), False) for t in trainable.values()]
    return state(Held(
        params=sum(t.numel() * t.element_size() for t in held.values()), trainable=grads,
        grads=grads, elements=sum(t.numel() for t in trainable.values()),
        slice=sum(c for _, c, _ in slices),
        slice_grads=sum(t.element_size() * c for t, c, _ in slices),
        slice_reduced=sum(t.element_size() * c for t, c, _ in slices if t.dtype != torch.float32),
        # Adam steps each parameter, or with ZeRO one flat slice per layout (dense, experts)
        stepped=len({experts for _, _, experts in slices}) if zero else len(trainable),
        gathered=_gathered_bytes(chunks, trainable) if zero == 3 else 0), optimizer, zero)


def _gathered_bytes(chunks, trainable: dict) -> int:
    """zero=3: the most parameter bytes a rank holds gathered at once, read off its chunks'
    programs (passes/gather_parameters.py): at each gather_params, the groups gathered and not
    yet released, plus the next group, whose all-gather that call posts (the prefetch). A group
    read at both ends of the forward (an embedding tied to the output layer) stays gathered in
    between. The backward gathers the same groups in reverse, one and its prefetch at a time,
    each freed once its gradients are in, so the forward's most is the rank's. A group the pass
    keeps (release_params(..., after="backward" | "step")) counts as held from its gather on."""
    from autopart.ops.zero import gather_params, release_params
    best = 0
    for c in chunks:
        groups = getattr(getattr(c.gm, "param_shards", None), "groups", None) or []
        sizes = [sum(trainable[n].numel() * trainable[n].element_size()
                     for n in names if n in trainable) for names in groups]
        held: set[int] = set()
        for node in c.gm.graph.nodes:
            if node.target is gather_params:
                g = node.args[1]
                held.add(g)
                ahead = sizes[g + 1] if g + 1 < len(sizes) and g + 1 not in held else 0
                best = max(best, sum(sizes[h] for h in held) + ahead)
            elif node.target is release_params and node.kwargs.get("after", "forward") == \
                    "forward":      # a kept group stays gathered into the backward
                held.discard(node.args[1])
    return best


def _zero_slices(trainable: dict, program: Program, mesh) -> list[tuple[torch.Tensor, int, bool]]:
    """(tensor, elements of this rank's chunk of it, an expert?) per trainable parameter, as
    runtime/sharding.ShardLayout cuts them: the dense parameters over the dp replicas, the
    experts over the dp/ep ranks holding them."""
    experts = program.ep.params if (program.ep is not None and mesh.ep > 1) else {}
    return [(t, -(-t.numel() // (mesh.dp // mesh.ep if n in experts else mesh.replicas)),
             n in experts)
            for n, t in trainable.items()]


def activation_peak(actions, acts: dict[int, ChunkActivations], b: int, s: int | None):
    """(peak saved bytes, in-flight counts per chunk at that peak) walking one rank's actions:
    a forward adds its chunk's saved bytes, a backward (W when split) drops them; while a
    backward reruns recomputed regions, that microbatch holds up to its `transient` instead."""
    at = {c: evaluate(a.saved, b, s) for c, a in acts.items()}
    rerun = {c: evaluate(a.transient, b, s) for c, a in acts.items()}
    # a microbatch's activations go at its B, or at its W when its backward is split (I keeps
    # what W reads); DualPipeV mixes both on one rank, as the C++ core's in_flight counts them
    alive, live, peak, where = {}, 0.0, 0.0, {}
    for a in actions:
        kind = str(a.kind)
        if kind == "F":
            alive[a.chunk] = alive.get(a.chunk, 0) + 1
            live += at[a.chunk]
            if live > peak:
                peak, where = live, dict(alive)
        elif kind in ("B", "I"):
            during = live - at[a.chunk] + max(at[a.chunk], rerun[a.chunk])
            if during > peak:
                peak, where = during, dict(alive)
        if kind in ("B", "W"):
            alive[a.chunk] -= 1
            live -= at[a.chunk]
    return peak, where


def buffer_bytes(acts: dict[int, ChunkActivations], in_flight: dict, b: int, s) -> float:
    held = sum(evaluate(acts[c].sends, b, s) * n for c, n in in_flight.items())
    return held + max((evaluate(a.sends, b, s) for a in acts.values()), default=0.0)


class MemoryTable(Mapping):
    """rank -> {params, grads, master, optimizer, activations, buffers, total} (ints, bytes),
    for any global rank, built on first access; ranks with the same programs share one entry."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.mesh = compiled.plan.mesh
        # what the compile's options say the rank keeps (autopart/config.py)
        self.optimizer = compiled.config.optimizer
        self.precision = compiled.config.precision
        self.zero = compiled.config.zero
        self._acts: dict = {}
        # the program checker's fake runs counted the saved tensors already (check_programs.py)
        self._runs = getattr(compiled, "activation_runs", None) or \
            ActivationCache(REDUCED_DTYPES[self.precision])
        self._cache: dict = {}

    def __getitem__(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.mesh.world_size:
            raise KeyError(rank)
        c = self.mesh.coords(rank)
        key = (c["pp"], c["tp"], self.mesh.ep_rank(rank))
        if key not in self._cache:
            self._cache[key] = self._rank(rank)
        return dict(self._cache[key])

    def __iter__(self):
        return iter(range(self.mesh.world_size))

    def __len__(self) -> int:
        return self.mesh.world_size

    def activations(self, rank: int) -> dict[int, ChunkActivations]:
        """chunk -> ChunkActivations for the chunks of `rank` (formulas in b and s)."""
        compiled = self.compiled
        out = {}
        pp, local = self.mesh.coords(rank)["pp"], local_shaper(compiled.program, self.mesh)
        for ch in compiled.program.chunks:
            if ch.rank != pp:
                continue
            if ch.chunk not in self._acts:     # tp/ep ranks of a chunk save the same sizes
                self._acts[ch.chunk] = self._runs.get(
                    ch, compiled.program, compiled.plan.microbatch_size, compiled.program.seq_len,
                    local)
            out[ch.chunk] = self._acts[ch.chunk]
        return out

    def _rank(self, rank: int) -> dict[str, int]:
        compiled = self.compiled
        plan, program = compiled.plan, compiled.program
        b, s = plan.microbatch_size, program.seq_len
        c = self.mesh.coords(rank)
        pp = c["pp"]
        # the global chunks with this rank's shard shapes: localizing every pipeline rank's
        # chunks (a GraphModule each) only to count bytes is most of a 3072-rank table's time
        chunks = [ch for ch in program.chunks if ch.rank == pp]
        local = _RankShapes(plan, c["tp"], self.mesh.ep_rank(rank),
                            {n: tuple(int(d) for d in i.shape) for n, i in program.params.items()})
        state = state_bytes(program, chunks, self.mesh, self.optimizer, self.precision,
                            self.zero, local=local)
        return with_activations(state, compiled.schedule.ranks[pp], self.activations(rank), b, s)


class _RankShapes:
    """name, full tensor -> a meta tensor of the shape, dtype and trainability one rank holds,
    cut as localize_module cuts it (experts, then tp sections); one per distinct case."""

    def __init__(self, plan, tp_rank: int, ep_rank: int, shapes: dict | None = None):
        self.plan, self.tp_rank, self.ep_rank = plan, tp_rank, ep_rank
        # name -> the captured (full) shape: under zero=3 a running model's parameter is its
        # rank's 1-D slice between steps, and the table counts the tensor it stands for
        self.shapes = shapes or {}
        self._seen: dict = {}

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        from autopart.localize import rank_cuts, shard_tensor
        cuts = rank_cuts(self.plan, name, self.tp_rank, self.ep_rank)
        shape = tuple(self.shapes.get(name, t.shape))
        if not cuts and shape == tuple(t.shape):
            return t
        key = (shape, t.dtype, t.requires_grad, repr(cuts))
        if key not in self._seen:
            local = torch.empty(shape, dtype=t.dtype, device="meta")
            for sh, size, rank in cuts:
                local = shard_tensor(local, sh.dim, sh.sections, size, rank)
            self._seen[key] = local.requires_grad_(t.requires_grad)
        return self._seen[key]


def local_shaper(program: Program, mesh):
    """param name, full shape -> the shape tp/ep rank 0 holds (every rank's is the same size)."""
    tp_shards = program.tp.params if (program.tp is not None and mesh.tp > 1) else {}
    ep_shards = program.ep.params if (program.ep is not None and mesh.ep > 1) else {}

    def local(name, shape):
        shape = list(shape)
        for shards, size in ((ep_shards, mesh.ep), (tp_shards, mesh.tp)):
            if name in shards:
                shape[shards[name].dim] //= size
        return tuple(shape)
    return local


def _rank_chunks_local(program, mesh, pp: int):
    """This pipeline rank's chunks as tp/ep rank 0 holds them (views, nothing copied)."""
    from autopart.localize import localize_module
    tp = program.tp.params if (program.tp is not None and mesh.tp > 1) else {}
    ep = program.ep.params if (program.ep is not None and mesh.ep > 1) else {}
    return [dataclasses.replace(ch, gm=localize_module(ch.gm, tp_shards=tp, tp=(mesh.tp, 0),
                                                       ep_shards=ep, ep=(mesh.ep, 0), copy=False))
            for ch in program.chunks if ch.rank == pp]


def with_activations(state: dict, actions, acts: dict, b: int, s) -> dict[str, int]:
    """`state` (state_bytes' dict) plus the activations and p2p buffers of a rank that runs
    `actions` with its chunks' `acts`, and the total: the memory table's row and the one
    choose_recompute weighs."""
    out = dict(state)
    peak, in_flight = activation_peak(actions, acts, b, s)
    out["activations"] = int(peak)
    out["buffers"] = int(buffer_bytes(acts, in_flight, b, s))
    out["total"] = sum(out[k] for k in KEYS[:-1])
    return out
