"""The cost model: one training step of one layout, in seconds, on a cluster.

Per microbatch and chunk, on one device:
    forward   GEMMs at flops / (peak * efficiency(M, N, K)) + memory-bound ops at bytes / HBM
              + tensor-parallel all-reduces over the node's links (Megatron does not overlap them)
    backward  twice the forward's GEMMs and memory-bound ops + its tp all-reduces
              + with full recomputation, the layer's forward once more
The pipeline (1F1B or interleaved) is the C++ simulator (autopart._C, what autopart.schedule.simulate
runs) with those per-chunk costs and a p2p message time: a microbatch's hidden state cut in tp
slices, each over its own InfiniBand link, then all-gathered over NVLink (the paper's scatter/gather).
After it: the data-parallel ring all-reduce of the gradients (not overlapped: autopart's runtime
reduces after the last backward), the tied-embedding all-reduce between first and last stage, and
the optimizer step (memory-bound). Context parallelism (cp) splits each sequence over cp ranks
(ring attention, causal load balancing: rank i holds chunks i and 2cp-1-i, so every rank does 1/cp
of the attention's work): every per-token cost, FLOPs, memory traffic, activations, tp and expert
messages, divides by cp, and each attention core passes its K and V around the ring (see
`ring_times`); the parameters are replicated over cp, so gradients are reduced, and ZeRO shards,
over dp * cp ranks. The efficiency of a GEMM is a smooth function of its dimensions,
``gemm_efficiency * prod(d / (d + gemm_half_dim))``: small dimensions (a head's 64-160, a thin
tp shard) run further from peak. Its two constants and the memory and link efficiencies are the
cluster's, global; nothing here is per model.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autopart.memory.state import Held, state
from autopart.planner.cluster import Cluster
from autopart.planner.profile import Part, Profile

SCHEDULE_NAMES = ("1f1b", "interleaved-1f1b")
# precision -> (param bytes, grad bytes, master bytes, activation bytes, gradient all-reduce bytes).
# Megatron keeps fp32 main gradients; with fp16 (the paper) it all-reduces them in fp16, with bf16
# in fp32 (accumulate_allreduce_grads_in_fp32), so bf16 moves twice the bytes.
PRECISIONS = {"bf16": (2, 4, 4, 2, 4), "fp16": (2, 2, 4, 2, 2), "fp32": (4, 4, 0, 4, 4)}
# bytes an optimizer step reads and writes per parameter: grad, master, states (read + write), param
STEP_BYTES = {"adam": 4 + 8 + 16 + 2, "sgd-momentum": 4 + 8 + 8 + 2, "sgd": 4 + 8 + 2}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    microbatch_size: int
    virtual_stages: int = 1
    schedule: str = "1f1b"
    recompute: str = "full"
    ep: int = 1                 # experts sharded over ep of the dp ranks (adds no ranks)
    zero: int = 0               # ZeRO level (runtime/optimizer.py): 1 shards the optimizer
                                # state and master weights over dp * cp, 2 the gradients too
    cp: int = 1                 # context parallelism: each sequence split over cp ranks (adds ranks)

    @property
    def mesh(self) -> str:
        return (f"tp={self.tp},pp={self.pp},dp={self.dp}" + (f",ep={self.ep}" if self.ep > 1 else "")
                + (f",cp={self.cp}" if self.cp > 1 else ""))

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, reducing their gradients together: dp * cp."""
        return self.dp * self.cp

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


@dataclass
class Estimate:
    """One layout's prediction. Times in seconds, memory in bytes (the fullest rank)."""
    layout: Layout
    step_time: float
    tflops_per_device: float
    memory: dict
    fits: bool
    rejected_because: str | None
    breakdown: dict
    simulated: bool = True

    def row(self) -> dict:
        lay = self.layout
        return {"mesh": lay.mesh, "cp": lay.cp, "microbatch_size": lay.microbatch_size, "virtual_stages": lay.virtual_stages,
                "schedule": lay.schedule, "recompute": lay.recompute, "zero": lay.zero,
                "step_time_s": round(self.step_time, 4),
                "tflops_per_device": round(self.tflops_per_device, 1),
                "memory_per_rank_gb": round(self.memory["total"] / 1e9, 2), "fits": self.fits,
                "rejected_because": self.rejected_because}


class CostModel:
    """Predicts layouts of one model (its profile) for one global batch on one cluster."""

    def __init__(self, profile: Profile, cluster: Cluster, batch: int, *, precision: str = "bf16",
                 optimizer: str = "adam"):
        self.profile, self.cluster, self.batch = profile, cluster, batch
        self.precision, self.optimizer = precision, optimizer
        self.bytes = PRECISIONS[precision]
        self._act_scale = self.bytes[3] / 4          # the profile was captured in fp32

    # -- pieces ---------------------------------------------------------------------------------

    def gemm_time(self, flops: float, m: float, n: float, k: float) -> float:
        c = self.cluster
        d0 = c.gemm_half_dim
        eff = c.gemm_efficiency * (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))
        return flops / (c.peak_flops * eff)

    def allreduce_time(self, nbytes: float, ranks: int, intra: bool) -> float:
        """Ring all-reduce: 2(n-1)/n of the bytes over each link, 2(n-1) steps of latency."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        c = self.cluster
        return 2 * (ranks - 1) / ranks * nbytes / self.link(intra) + 2 * (ranks - 1) * c.latency_s

    def link(self, intra: bool) -> float:
        """Bytes/s one device reaches over a link in one direction."""
        c = self.cluster
        return c.intra_bw * c.intra_efficiency if intra else c.inter_bw * c.inter_efficiency

    def attention_scores_time(self, flops: float, head_dim: float) -> float:
        """Memory-bound work on materialized scores: flops = 4 * scores * head_dim."""
        c = self.cluster
        scores = flops / (4 * head_dim)
        return scores * c.attention_score_bytes * self._act_scale * 2 / (c.hbm_bw * c.memory_efficiency)

    def alltoall_time(self, nbytes: float, ranks: int, intra: bool) -> float:
        """Each rank keeps 1/n of its rows and sends the rest, one message to each other rank."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return (ranks - 1) / ranks * nbytes / self.link(intra) + (ranks - 1) * self.cluster.latency_s

    def part_times(self, part: Part, tp: int, b: int, ep: int = 1, cp: int = 1) -> tuple[float, float, float]:
        """(forward, backward, communication) of one part for one microbatch; with cp > 1 on one
        context-parallel rank: 1/cp of the tokens, plus the ring's exposed time."""
        c = self.cluster
        # a linear's M (tokens) is 1/cp; an attention core runs cp blocks of s/cp queries by
        # s/cp keys, together 1/cp of its FLOPs (the causal load balancing evens them out)
        gemm = sum(self.gemm_time(f(b) / cp, mm(b) / cp, n / cp if att else n, k)
                   for f, mm, n, k, att in part.gemms)
        # the score_bytes constant is per fp16 element; _act_scale*2 turns it back for fp32 runs
        gemm += sum(self.attention_scores_time(f(b) / cp, k) for f, _, _, k, att in part.gemms if att)
        mem = part.elementwise_bytes(b) / cp * self._act_scale / (c.hbm_bw * c.memory_efficiency)
        mem += part.ops * c.op_overhead_s
        ar_f = self.allreduce_time(part.allreduce_fwd(b) / cp * self._act_scale, tp, True)
        ar_b = self.allreduce_time(part.allreduce_bwd(b) / cp * self._act_scale, tp, True)
        # expert all-to-alls: ep ranks are dp ranks, tp * cp apart; the backward mirrors the forward's
        a2a = self.alltoall_time(part.alltoall(b) / cp * self._act_scale, ep, tp * cp * ep <= c.gpus_per_node)
        ring_f, ring_b = self.ring_times(part, tp, b, cp)
        return (gemm + mem + ar_f + a2a + ring_f, 2 * (gemm + mem) + ar_b + a2a + ring_b,
                ar_f + ar_b + 2 * a2a + ring_f + ring_b)

    def ring_transfer(self, part: Part, tp: int, b: int, cp: int) -> float:
        """Seconds one ring step's message takes: a K and V chunk (1/cp of the sequence, this
        rank's 1/tp of the kv heads) to the next cp rank (over NVLink when tp * cp fit a node)."""
        if cp <= 1 or part.kv_bytes(b) <= 0:
            return 0.0
        intra = tp * cp <= self.cluster.gpus_per_node
        return self.cluster.latency_s + part.kv_bytes(b) / cp * self._act_scale / self.link(intra)

    def ring_times(self, part: Part, tp: int, b: int, cp: int) -> tuple[float, float]:
        """(forward, backward) seconds the context-parallel ring adds to a part beyond its compute.

        The rule: per attention core the forward runs cp steps; in each but the last a rank
        computes one block (its queries against the K/V chunk it holds: 1/cp of its attention
        work) while that chunk travels on to the next rank, so a step costs max(block, transfer):
        the transfer adds max(0, transfer - block) per step over cp - 1 steps (the blocks are in
        the part's compute already). The backward sends K/V and their gradients dK/dV (twice the
        bytes) while computing blocks of twice the forward's work: max(0, 2 transfer - 2 block)."""
        if cp <= 1 or part.kv_bytes(b) <= 0:
            return 0.0, 0.0
        block = sum(self.gemm_time(f(b) / cp, mm(b) / cp, n / cp, k) + self.attention_scores_time(f(b) / cp, k)
                    for f, mm, n, k, att in part.gemms if att) / cp
        step = self.ring_transfer(part, tp, b, cp)
        return (cp - 1) * max(0.0, step - block), (cp - 1) * max(0.0, 2 * step - 2 * block)

    def chunk_costs(self, lay: Layout) -> tuple[list[float], list[float], list[int]]:
        """Per chunk (model order): forward, backward (with recomputation) and layer counts."""
        parts = self.parts(lay)
        b = lay.microbatch_size
        lf, lb, _ = self.part_times(parts["layer"], lay.tp, b, lay.ep, lay.cp)
        if lay.recompute == "full":
            lb += lf                      # the layer's forward once more before its backward
        elif lay.recompute == "selective":   # its attention core's (and its ring's, with cp)
            lb += self.part_times(parts["core"], lay.tp, b, lay.ep, lay.cp)[0]
        ff, fb, _ = self.part_times(parts["first"], lay.tp, b, lay.ep, lay.cp)
        tf, tb, _ = self.part_times(parts["last"], lay.tp, b, lay.ep, lay.cp)
        counts = chunk_layers(self.profile.layers, lay.pp * lay.virtual_stages)
        fwd = [n * lf for n in counts]
        bwd = [n * lb for n in counts]
        fwd[0] += ff
        bwd[0] += fb
        fwd[-1] += tf
        bwd[-1] += tb
        return fwd, bwd, counts

    def parts(self, lay: Layout) -> dict:
        return self.profile.parts[(lay.tp, lay.ep)]

    def message_time(self, lay: Layout) -> float:
        """One microbatch's activation (or gradient) between neighbouring stages."""
        if lay.pp == 1:
            return 0.0
        c = self.cluster
        nbytes = self.parts(lay)["layer"].out_bytes(lay.microbatch_size) / lay.cp * self._act_scale
        if lay.tp * lay.cp * lay.dp < c.gpus_per_node:   # neighbours in one node (tp, cp, dp, then pp)
            return c.latency_s + nbytes / self.link(True)
        # scatter/gather: each of the tp ranks sends 1/tp over its own link, then an all-gather
        gather = (lay.tp - 1) / lay.tp * nbytes / self.link(True) if lay.tp > 1 else 0.0
        return 2 * c.latency_s + nbytes / lay.tp / self.link(False) + gather

    def microbatches(self, lay: Layout) -> int:
        """Per dp replica; cp splits each sequence, not the batch."""
        return self.batch // (lay.dp * lay.microbatch_size)

    def params_on(self, lay: Layout, rank: int, experts_only: bool = False) -> float:
        """Trainable elements held by pipeline rank `rank` (first/last parts on the end ranks)."""
        parts = self.parts(lay)
        count = (lambda part: part.expert_params) if experts_only else (lambda part: part.params)
        counts = chunk_layers(self.profile.layers, lay.pp * lay.virtual_stages)
        layers = sum(n for k, n in enumerate(counts) if k % lay.pp == rank)
        total = layers * count(parts["layer"])
        if rank == 0:
            total += count(parts["first"])
        if rank == lay.pp - 1:
            total += count(parts["last"])
            if lay.pp == 1 and not experts_only:
                total -= parts.get("shared_params", 0.0)
        return total

    def after_pipeline(self, lay: Layout) -> dict:
        """Gradient all-reduce over dp * cp, tied-embedding all-reduce, optimizer step (seconds)."""
        c = self.cluster
        params = max(self.params_on(lay, 0), self.params_on(lay, lay.pp - 1))
        experts = max(self.params_on(lay, 0, True), self.params_on(lay, lay.pp - 1, True))
        intra = lay.tp * lay.cp * lay.dp <= c.gpus_per_node
        # expert weights are reduced only over the dp / ep (times cp) ranks holding the same experts
        grads = (self.allreduce_time((params - experts) * self.bytes[4], lay.replicas, intra)
                 + self.allreduce_time(experts * self.bytes[4], lay.dp // lay.ep * lay.cp, intra))
        if lay.zero == 2:
            # a reduce-scatter (half an all-reduce's traffic) per microbatch, one all-gather
            grads *= (self.microbatches(lay) + 1) / 2
        elif lay.zero == 3:
            # per microbatch a reduce-scatter and two parameter all-gathers (forward, backward;
            # passes/gather_parameters.py), each half an all-reduce's traffic; the gathers are
            # prefetched a layer ahead, but counted here as exposed (an upper bound)
            grads *= 3 * self.microbatches(lay) / 2
        shared = self.parts(lay).get("shared_params", 0.0)
        tied = self.allreduce_time(shared * self.bytes[4], 2, False) if lay.pp > 1 else 0.0
        stepped = self.sharded(lay, params, experts) if lay.zero else params
        step = stepped * STEP_BYTES[self.optimizer] / (c.hbm_bw * c.memory_efficiency)
        return {"dp_allreduce": grads, "tied_allreduce": tied, "optimizer": step}

    @staticmethod
    def sharded(lay: Layout, params: float, experts: float) -> float:
        """A ZeRO slice of `params` elements (`experts` of them over dp/ep * cp, the rest over
        dp * cp: context-parallel ranks hold the same parameters)."""
        return (params - experts) / lay.replicas + experts / max(1, lay.dp // lay.ep * lay.cp)

    def memory(self, lay: Layout, in_flight: tuple) -> dict:
        """Bytes on the fullest pipeline rank (first or last); `in_flight[r]` chunk-microbatches.
        With cp > 1 a rank keeps the activations of 1/cp of each sequence; its parameters,
        gradients and optimizer state are whole (ZeRO shards them over dp * cp), and it holds the
        ring's K/V chunks in flight (two: one computed on, one arriving) as buffers."""
        parts = self.parts(lay)
        b, scale = lay.microbatch_size, self._act_scale
        pb, gb, mb, _, _ = self.bytes
        counts = chunk_layers(self.profile.layers, lay.pp * lay.virtual_stages)
        per_chunk = sum(counts) / len(counts)
        layer = parts["layer"]
        kept, rerun = self.kept_per_layer(lay)
        best = None
        for rank in {0, lay.pp - 1}:
            params = self.params_on(lay, rank)
            acts = in_flight[rank] * per_chunk * kept + rerun   # + the region rerunning in backward
            if rank == 0:
                # the embedding's output is the first layer's input (counted above); what it saves
                # for its own backward (the token ids) is one microbatch's working memory at most
                acts += parts["first"].saved_bytes(b) / lay.cp * scale
            if rank == lay.pp - 1:
                # logits and loss: one microbatch at a time
                acts += parts["last"].saved_bytes(b) / lay.cp * scale
            buffers = 2 * layer.out_bytes(b) / lay.cp * scale if lay.pp > 1 else 0.0
            if lay.cp > 1:
                buffers += 2 * layer.kv_bytes(b) / lay.cp * scale
            # the memory table's rule (autopart/memory/state.py) on the profile's elements:
            # ZeRO slices over dp * cp (experts over dp/ep * cp); zero=3 holds two layers
            # gathered (the one in use, the one prefetched)
            sliced = (self.sharded(lay, params, self.params_on(lay, rank, True)) if lay.zero
                      else params)
            row = state(Held.uniform(params, sliced, param_size=pb, grad_size=gb, master_size=mb,
                                     gathered=2 * parts["layer"].params * pb),
                        self.optimizer, lay.zero)
            row.update(activations=acts, buffers=buffers)
            row["total"] = sum(row.values())
            if best is None or row["total"] > best["total"]:
                best = row
        return best

    def ring_exposed(self, lay: Layout) -> float:
        """Seconds a step waits on the context-parallel ring on the first pipeline rank: its
        layers' exposed K/V transfers (forward, backward, and the forward's again when
        recomputed), over its microbatches."""
        if lay.cp <= 1:
            return 0.0
        parts, b = self.parts(lay), lay.microbatch_size
        f, bw = self.ring_times(parts["layer"], lay.tp, b, lay.cp)
        per_layer = f + bw + (f if lay.recompute == "full" else 0.0)
        if lay.recompute == "selective" and parts.get("core") is not None:
            per_layer += self.ring_times(parts["core"], lay.tp, b, lay.cp)[0]
        counts = chunk_layers(self.profile.layers, lay.pp * lay.virtual_stages)
        layers = sum(n for k, n in enumerate(counts) if k % lay.pp == 0)
        return self.microbatches(lay) * layers * per_layer

    def kept_per_layer(self, lay: Layout) -> tuple[float, float]:
        """(bytes a layer keeps per microbatch in flight, bytes of the region rerunning in
        backward): full keeps the layer's input and reruns all of it; selective keeps all but
        the attention core's insides (its output, read by the projection, stays) and reruns the
        core; none keeps everything (an upper bound: every non-view op's output). A
        context-parallel rank keeps 1/cp of each."""
        layer, core = self.parts(lay)["layer"], self.parts(lay).get("core")
        b, scale = lay.microbatch_size, self._act_scale / lay.cp
        if lay.recompute == "full":
            return layer.out_bytes(b) * scale, layer.saved_bytes(b) * scale
        if lay.recompute == "selective":
            inside = core.saved_bytes(b) - core.out_bytes(b)
            return (layer.saved_bytes(b) - inside) * scale, inside * scale
        return layer.saved_bytes(b) * scale, 0.0

    def model_flops(self, lay: Layout) -> float:
        """The paper's count: 96 (72 without recomputation) B s l h^2 (1 + s/6h + V/16lh);
        selective adds the attention core's forward once more, 4 B s^2 h per layer (QK^T, AV)."""
        p = self.profile
        B, s, l, h, V = self.batch, p.seq, p.blocks or p.layers, p.hidden, p.vocab
        k = 96 if lay.recompute == "full" else 72
        extra = 4 * B * s * s * h * l if lay.recompute == "selective" else 0.0
        return k * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)) + extra

    # -- a whole step ---------------------------------------------------------------------------

    def check(self, lay: Layout) -> str | None:
        """Why the layout cannot run at all (not memory), or None."""
        p = self.profile
        if (lay.tp, lay.ep) not in p.parts:
            return p.invalid_tp.get((lay.tp, lay.ep), f"tp={lay.tp}, ep={lay.ep} was not analysed")
        if lay.recompute == "selective" and p.parts[(lay.tp, lay.ep)].get("core") is None:
            return "selective recomputation reruns attention cores, and the layer has none"
        if lay.zero and lay.replicas == 1:
            return f"zero={lay.zero} shards over data-parallel replicas, and dp=1"
        if lay.cp > 1:
            layer = p.parts[(lay.tp, lay.ep)]["layer"]
            if layer.kv_bytes(1) <= 0:
                return ("cp shards attention cores (scaled_dot_product_attention) over the sequence, "
                        "and the layer has none")
            if p.seq % (2 * lay.cp):
                return (f"cp={lay.cp} splits the sequence into 2*cp = {2 * lay.cp} chunks (causal load "
                        f"balancing), which do not divide its {p.seq} tokens")
        if lay.dp % lay.ep:
            return f"ep={lay.ep} must divide dp={lay.dp} (experts are sharded over data-parallel ranks)"
        if self.batch % (lay.dp * lay.microbatch_size):
            return f"batch {self.batch} is not a multiple of dp*microbatch_size = {lay.dp * lay.microbatch_size}"
        m = self.microbatches(lay)
        if lay.pp * lay.virtual_stages > p.layers:
            return f"{lay.pp * lay.virtual_stages} chunks for {p.layers} layers"
        if lay.schedule == "interleaved-1f1b" and (lay.pp == 1 or m % lay.pp):
            return f"interleaved-1f1b needs pp > 1 and microbatches ({m}) a multiple of pp ({lay.pp})"
        if lay.schedule == "1f1b" and lay.virtual_stages != 1:
            return "1f1b runs one chunk per rank"
        return None

    def estimate(self, lay: Layout, simulate: bool = True) -> Estimate:
        fwd, bwd, _ = self.chunk_costs(lay)
        m = self.microbatches(lay)
        msg = self.message_time(lay)
        if simulate:
            makespan, in_flight = pipeline(lay.schedule, lay.pp, m, lay.virtual_stages, tuple(fwd), tuple(bwd), msg)
        else:
            makespan, in_flight = _pipeline_formula(lay, m, fwd, bwd, msg)
        after = self.after_pipeline(lay)
        step = makespan + sum(after.values())
        mem = self.memory(lay, in_flight)
        fits = mem["total"] <= self.cluster.memory_bytes
        why = None if fits else (f"needs {mem['total'] / 1e9:.1f} GB per rank (params+grads+master+optimizer "
                                 f"{(mem['params'] + mem['grads'] + mem['master'] + mem['optimizer']) / 1e9:.1f}, "
                                 f"activations {mem['activations'] / 1e9:.1f}) > {self.cluster.memory_bytes / 1e9:g} GB")
        devices = lay.devices
        tflops = self.model_flops(lay) / (step * devices) / 1e12
        compute = m * sum(f + b for k, (f, b) in enumerate(zip(fwd, bwd)) if k % lay.pp == 0)
        breakdown = {"pipeline": makespan, "compute_rank0": compute, "bubble_and_p2p": makespan - compute,
                     "message": msg, **after}
        if lay.cp > 1:
            breakdown["cp_ring_exposed"] = self.ring_exposed(lay)
        return Estimate(lay, step, tflops, mem, fits, why, breakdown, simulate)


def chunk_layers(layers: int, chunks: int) -> list[int]:
    """Layers per chunk, as even as possible (the larger chunks first)."""
    base, extra = divmod(layers, chunks)
    return [base + (k < extra) for k in range(chunks)]


@functools.lru_cache(maxsize=4096)
def pipeline(name: str, pp: int, m: int, v: int, fwd: tuple, bwd: tuple, msg: float) -> tuple[float, tuple]:
    """(makespan, peak in-flight chunk-microbatches per rank) from the C++ simulator.

    Past m = 2pp a step's makespan grows linearly with m (the steady state repeats; checked
    exactly for 1F1B and interleaved with unequal chunks and messages), so long pipelines are
    simulated at pp and 2pp microbatches and extended: 512 microbatches on 64 stages cost two
    short simulations instead of one of 130k actions."""
    if m <= 2 * pp:
        return _simulate(name, pp, m, v, fwd, bwd, msg)
    t1, _ = _simulate(name, pp, pp, v, fwd, bwd, msg)
    t2, peaks = _simulate(name, pp, 2 * pp, v, fwd, bwd, msg)
    return t2 + (t2 - t1) * (m - 2 * pp) / pp, peaks


@functools.lru_cache(maxsize=4096)
def _simulate(name, pp, m, v, fwd, bwd, msg):
    # cached apart from pipeline(): layouts differing in dp alone (so in m) share both runs
    from autopart import _C
    packed = _schedule(name, pp, m, v)
    half = [b / 2 for b in bwd]
    raw = _C.simulate(pp, m, v, packed, list(fwd), list(bwd), float(msg), math.inf, 0.0, half, half, name)
    return raw.makespan, tuple(raw.peak_in_flight)


@functools.lru_cache(maxsize=256)
def _schedule(name, pp, m, v):
    """The packed action lists (the same for every chunk cost)."""
    from autopart import _C
    return _C.make_schedule(name, pp, m, v)


def _pipeline_formula(lay: Layout, m: int, fwd, bwd, msg) -> tuple[float, tuple]:
    """The bubble formula (pp-1)/(v m) on the slowest rank, for the first pass of the search;
    in-flight counts as Megatron's warm-up gives them."""
    pp, v = lay.pp, lay.virtual_stages
    per_rank = [0.0] * pp
    for k, (f, b) in enumerate(zip(fwd, bwd)):    # one pass: chunk k runs on rank k % pp
        per_rank[k % pp] += f + b
    chunk = max(f + b for f, b in zip(fwd, bwd))
    makespan = m * max(per_rank) + (pp - 1) * (chunk + 2 * msg) + 2 * m * v * msg * (pp > 1)
    if v == 1:
        flight = tuple(min(m, pp - r) for r in range(pp))
    else:
        flight = tuple(min(m * v, (pp - r - 1) * 2 + (v - 1) * pp + 1) for r in range(pp))
    return makespan, flight


__all__ = ["Layout", "Estimate", "CostModel", "chunk_layers", "pipeline", "PRECISIONS"]
