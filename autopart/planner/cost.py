"""The cost model: one training step of one layout, in seconds, on a cluster.

Per microbatch and chunk, on one device:
    forward   GEMMs at flops / (peak * efficiency(M, N, K)) + memory-bound ops at bytes / HBM
              + tensor-parallel all-reduces over the node's links (Megatron does not overlap them)
    backward  twice the forward's GEMMs and memory-bound ops + its tp all-reduces (under
              autopart's runtime behind the weight gradients: passes/overlap_collectives.py)
              + with full recomputation, the layer's forward once more
The pipeline (1F1B or interleaved) is the C++ simulator (autopart._C, what autopart.schedule.simulate
runs; makespan.py) with those per-chunk costs and a p2p message time: a microbatch's hidden state cut in tp
slices, each over its own InfiniBand link, then all-gathered over NVLink (the paper's scatter/gather).
After it: what the data-parallel gradient reduction leaves exposed after the backward it
overlaps (autopart/planner/overlap.py), the tied-embedding all-reduce between first and last stage, and
the optimizer step (memory-bound). Context parallelism (cp) splits each sequence over cp ranks
(ring attention, causal load balancing: rank i holds chunks i and 2cp-1-i, so every rank does 1/cp
of the attention's work): every per-token cost, FLOPs, memory traffic, activations, tp and expert
messages, divides by cp, and each attention core passes its K and V around the ring (see
`ring_times`); the parameters are replicated over cp, so gradients are reduced, and ZeRO shards,
over dp * cp ranks. The efficiency of a GEMM is a smooth function of its dimensions,
``gemm_efficiency * prod(d / (d + gemm_half_dim))``: small dimensions (a head's 64-160, a thin
tp shard) run further from peak. Its two constants and the memory and link efficiencies are the
cluster's, global; nothing here is per model. Under precision="fp8" the linears the FP8 rule picks
(`fp8_mask`: autopart's rule under autopart's runtime, Transformer Engine's under Megatron-LM's)
run at the cluster's FP8 peak and fp8_gemm_efficiency (the same shape factor), and pay their casts
at HBM speed and, under autopart's runtime, their amax all-reduces over tp (`fp8_costs`): the
FP8 methods are fp8_costs.Fp8Pricing's, a mixin of CostModel.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopart.memory.state import Held, state
from autopart.planner.cluster import Cluster
from autopart.planner.expert_overlap import ExpertOverlap
from autopart.planner.fp8_costs import FP8_CAST_BYTES, FP8_TERMS, FP8_WEIGHT_BYTES, Fp8Pricing, fp8_refused
from autopart.planner.makespan import chunk_layers, pipeline, pipeline_formula, splits_backward
from autopart.planner.profile import Part, Profile

SCHEDULE_NAMES = ("1f1b", "interleaved-1f1b")
# whose overlaps a prediction assumes (autopart/planner/overlap.py): autopart's runtime as it is,
# Megatron-LM's (tp collectives behind GEMMs, sequence parallelism, the distributed optimizer's
# parameter all-gather behind the next forward), the runtime of the published H100 runs; or the
# Megatron-LM of the 2021 paper (Table 1: gradients all-reduced after the last backward, no
# sequence parallelism, tp collectives exposed)
RUNTIMES = ("autopart", "megatron", "megatron-2021")
FLASH_BACKWARD = 2.5      # a fused attention's backward runs 5 matmuls to the forward's 2 (it
                          # recomputes Q K^T from the saved log-sum-exp instead of keeping scores)
# precision -> (param bytes, grad bytes, master bytes, activation bytes, gradient all-reduce bytes).
# Megatron keeps fp32 main gradients; with fp16 (the paper) it all-reduces them in fp16, with bf16
# in fp32 (accumulate_allreduce_grads_in_fp32), so bf16 moves twice the bytes. fp8 holds what bf16
# does (the FP8 copies are made per microbatch and dropped; activations counted in bf16, a bound).
PRECISIONS = {"bf16": (2, 4, 4, 2, 4), "fp16": (2, 2, 4, 2, 2), "fp32": (4, 4, 0, 4, 4), "fp8": (2, 4, 4, 2, 4)}
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
    recompute_layers: int = 0   # with recompute="full": 0 every layer, N > 0 the first N layers of
                                # each chunk (Megatron-LM's --recompute-method block
                                # --recompute-num-layers N), the others keep their activations

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
                "schedule": lay.schedule, "recompute": lay.recompute, "recompute_layers": lay.recompute_layers,
                "zero": lay.zero,
                "step_time_s": round(self.step_time, 4),
                "tflops_per_device": round(self.tflops_per_device, 1),
                "memory_per_rank_gb": round(self.memory["total"] / 1e9, 2), "fits": self.fits,
                "rejected_because": self.rejected_because,
                # precision="fp8" only: seconds a step of the first rank (CostModel.fp8_terms), 4 digits
                **{k.replace("_rank0", "_s"): float(f"{self.breakdown[k]:.4g}") for k in FP8_TERMS if k in self.breakdown}}


class CostModel(Fp8Pricing, ExpertOverlap):
    """Predicts layouts of one model (its profile) for one global batch on one cluster."""

    def __init__(self, profile: Profile, cluster: Cluster, batch: int, *, precision: str = "bf16",
                 optimizer: str = "adam", runtime: str = "autopart"):
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime {runtime!r}: one of {RUNTIMES}")
        self.profile, self.cluster, self.batch = profile, cluster, batch
        self.precision, self.optimizer, self.runtime = precision, optimizer, runtime
        self.bytes = PRECISIONS[precision]
        self._act_scale = self.bytes[3] / 4          # the profile was captured in fp32
        self.check_fp8_cluster()

    # -- pieces ---------------------------------------------------------------------------------

    def gemm_time(self, flops: float, m: float, n: float, k: float, fp8: bool = False) -> float:
        """Seconds of one GEMM; `fp8`: at the cluster's FP8 peak and efficiency, the same shape
        factor (gemm_half_dim)."""
        c = self.cluster
        d0 = c.gemm_half_dim
        peak, top = (c.fp8_peak_flops, c.fp8_gemm_efficiency) if fp8 else (c.peak_flops, c.gemm_efficiency)
        eff = top * (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))
        return flops / (peak * eff)

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

    def attention_time(self, flops: float, m: float, n: float, k: float, causal: bool) -> tuple[float, float]:
        """(forward, backward) of one attention core (scaled_dot_product_attention) of `flops`
        (its whole Q K^T and P V). Fused (the cluster's fused_attention_efficiency > 0: flash or
        cuDNN kernels): a causal core skips the masked half, as the kernels do, at that fraction of
        peak; its backward recomputes the scores (FLASH_BACKWARD). Unfused (a 2021 Megatron-LM):
        two GEMMs plus the memory-bound passes over materialized scores, backward twice that."""
        c = self.cluster
        if c.fused_attention_efficiency > 0:
            fwd = flops * (0.5 if causal else 1.0) / (c.peak_flops * c.fused_attention_efficiency)
            return fwd, FLASH_BACKWARD * fwd
        fwd = self.gemm_time(flops, m, n, k) + self.attention_scores_time(flops, k)
        return fwd, 2 * fwd

    def sequence_parallel(self, lay_tp: int) -> bool:
        """Megatron-LM's published runs shard the norms', residuals' and dropouts' activations over
        tp (sequence parallelism); autopart's runtime does with Config(sequence_parallel=True), off
        by default, so its figure keeps them whole."""
        return self.runtime == "megatron" and lay_tp > 1

    def elementwise_time(self, part: Part, tp: int, b: int, cp: int = 1) -> float:
        """Forward seconds of a part's memory-bound ops (and the launches of all its ops)."""
        c = self.cluster
        elementwise = part.elementwise_bytes(b)
        if self.sequence_parallel(tp):
            elementwise -= part.replicated_bytes(b) * (1 - 1 / tp)
        return elementwise / cp * self._act_scale / (c.hbm_bw * c.memory_efficiency) + part.ops * c.op_overhead_s

    def part_times(self, part: Part, tp: int, b: int, ep: int = 1, cp: int = 1,
                   schedule: str = "1f1b", fp8: tuple | None = None,
                   paired: float = 0.0) -> tuple[float, float, float]:
        """(forward, backward, communication) of one part for one microbatch; with cp > 1 on one
        context-parallel rank: 1/cp of the tokens, plus the ring's exposed time. Under autopart's
        runtime the forward's tp collectives are exposed and the backward's run behind the
        column-parallel linears' weight gradients (passes/overlap_collectives.py; about half the
        part's GEMM time), except under schedules that split the backward (I/W), where the pass
        does not run; under Megatron-LM's (tp-comm-overlap) they run chunked behind the part's
        GEMMs, exposed only where longer. `fp8`: which GEMMs run in FP8 (fp8_mask; default: the
        part as a layer), with their casts and amax all-reduces (fp8_costs). `paired`: the
        fraction of microbatches whose expert all-to-alls run behind another microbatch's compute
        of the part (passes/overlap_experts.py; experts_overlapped), exposed only where longer;
        the others' are exposed whole."""
        c = self.cluster
        mask = self.fp8_mask(part) if fp8 is None else fp8
        # a linear's M (tokens) is 1/cp; an attention core runs cp blocks of s/cp queries by
        # s/cp keys, together 1/cp of its FLOPs (the causal load balancing evens them out)
        gemm = sum(self.gemm_time(f(b) / cp, mm(b) / cp, n, k, on)
                   for (f, mm, n, k, att, _), on in zip(part.gemms, mask) if not att)
        cast_f, cast_b, amax_f, amax_b = self.fp8_costs(part, tp, b, cp, mask) if any(mask) else (0.0,) * 4
        att_f = att_b = 0.0
        for f, mm, n, k, att, causal in part.gemms:
            if att:
                af, ab = self.attention_time(f(b) / cp, mm(b) / cp, n / cp, k, causal)
                att_f, att_b = att_f + af, att_b + ab
        mem = self.elementwise_time(part, tp, b, cp)
        ar_f = self.allreduce_time(part.allreduce_fwd(b) / cp * self._act_scale, tp, True)
        ar_b = self.allreduce_time(part.allreduce_bwd(b) / cp * self._act_scale, tp, True)
        if self.runtime == "megatron":
            ar_f, ar_b = max(0.0, ar_f - gemm), max(0.0, ar_b - 2 * gemm)
        elif self.runtime == "autopart" and not splits_backward(schedule):
            ar_b = max(0.0, ar_b - gemm / 2)
        # expert all-to-alls: ep ranks are dp ranks, tp * cp apart; the backward mirrors the forward's
        a2a = self.alltoall_time(part.alltoall(b) / cp * self._act_scale, ep, tp * cp * ep <= c.gpus_per_node)
        ring_f, ring_b = self.ring_times(part, tp, b, cp)
        a2a_f = a2a_b = a2a
        if paired and self.runtime == "autopart":
            hid_f, hid_b = max(0.0, a2a - gemm - att_f - mem), max(0.0, a2a - 2 * (gemm + mem) - att_b)
            a2a_f, a2a_b = (paired * hid + (1 - paired) * a2a for hid in (hid_f, hid_b))
        return (gemm + att_f + mem + ar_f + a2a_f + ring_f + cast_f + amax_f,
                2 * (gemm + mem) + att_b + ar_b + a2a_b + ring_b + cast_b + amax_b,
                ar_f + ar_b + 2 * a2a + ring_f + ring_b + amax_f + amax_b)

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
        block = sum(self.attention_time(f(b) / cp, mm(b) / cp, n / cp, k, causal)[0]
                    for f, mm, n, k, att, causal in part.gemms if att) / cp
        step = self.ring_transfer(part, tp, b, cp)
        return (cp - 1) * max(0.0, step - block), (cp - 1) * max(0.0, 2 * step - 2 * block)

    def chunk_costs(self, lay: Layout) -> tuple[list[float], list[float], list[int]]:
        """Per chunk (model order): forward, backward (with recomputation) and layer counts."""
        parts = self.parts(lay)
        b = lay.microbatch_size
        lf, lb, _ = self.part_times(parts["layer"], lay.tp, b, lay.ep, lay.cp, lay.schedule,
                                    paired=self.experts_overlapped(lay))
        again = 0.0
        if lay.recompute == "full":
            again = lf                    # the layer's forward once more before its backward
        elif lay.recompute == "selective":   # its attention core's (and its ring's, with cp) and
            # its memory-bound ops' forward (norms, activation functions: what selective drops)
            core = parts["core"]
            again = self.part_times(core, lay.tp, b, lay.ep, lay.cp, lay.schedule)[0] + max(
                0.0, self.elementwise_time(parts["layer"], lay.tp, b, lay.cp)
                - self.elementwise_time(core, lay.tp, b, lay.cp))     # the core's own counted once
        ff, fb, _ = self.part_times(parts["first"], lay.tp, b, lay.ep, lay.cp, lay.schedule,
                                    self.fp8_mask(parts["first"], "first"))
        tf, tb, _ = self.part_times(parts["last"], lay.tp, b, lay.ep, lay.cp, lay.schedule,
                                    self.fp8_mask(parts["last"], "last"))
        counts = self.chunk_counts(lay)
        fwd = [n * lf for n in counts]
        bwd = [n * lb + self.recomputed(lay, n) * again for n in counts]
        fwd[0] += ff
        bwd[0] += fb
        fwd[-1] += tf
        bwd[-1] += tb
        if self.precision == "fp8":
            self.fp8_edges(lay, fwd, bwd, lf, lb)
        return fwd, bwd, counts

    @staticmethod
    def recomputed(lay: Layout, layers: int) -> int:
        """Layers of a chunk of `layers` that rerun in backward."""
        if lay.recompute == "none":
            return 0
        return min(lay.recompute_layers, layers) if lay.recompute_layers else layers

    def parts(self, lay: Layout) -> dict:
        return self.profile.parts[(lay.tp, lay.ep)]

    def chunk_counts(self, lay: Layout) -> list[int]:
        """Layers per chunk of `lay`, model order (chunk_layers)."""
        return chunk_layers(self.profile.layers, lay.pp * lay.virtual_stages)

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
        counts = self.chunk_counts(lay)
        layers = sum(n for k, n in enumerate(counts) if k % lay.pp == rank)
        total = layers * count(parts["layer"])
        if rank == 0:
            total += count(parts["first"])
        if rank == lay.pp - 1:
            total += count(parts["last"])
            if lay.pp == 1 and not experts_only:
                total -= parts.get("shared_params", 0.0)
        return total

    def after_pipeline(self, lay: Layout, fwd: list | None = None, bwd: list | None = None) -> dict:
        """Exposed data-parallel traffic over dp * cp (overlap.py: behind which compute), the
        tied-embedding all-reduce and the optimizer step (seconds); `fwd`, `bwd`: the chunk costs
        (chunk_costs), whose sums on the fullest rank are the windows the collectives hide behind."""
        return self._after(lay, fwd, bwd)[0]

    def _after(self, lay: Layout, fwd=None, bwd=None) -> tuple[dict, dict]:
        from autopart.planner.overlap import data_parallel_terms
        c = self.cluster
        if fwd is None:
            fwd, bwd, _ = self.chunk_costs(lay)
        params = max(self.params_on(lay, 0), self.params_on(lay, lay.pp - 1))
        experts = max(self.params_on(lay, 0, True), self.params_on(lay, lay.pp - 1, True))
        intra = lay.tp * lay.cp * lay.dp <= c.gpus_per_node
        # expert weights are reduced only over the dp / ep (times cp) ranks holding the same experts
        grads = (self.allreduce_time((params - experts) * self.bytes[4], lay.replicas, intra)
                 + self.allreduce_time(experts * self.bytes[4], lay.dp // lay.ep * lay.cp, intra))
        windows = [(sum(fwd[k::lay.pp]), sum(bwd[k::lay.pp])) for k in {0, lay.pp - 1}]
        fw, bw = min(w[0] for w in windows), min(w[1] for w in windows)
        counts = self.chunk_counts(lay)
        terms, notes = data_parallel_terms(lay.zero, grads, params * self.bytes[4], self.bytes[0] / self.bytes[4],
                                           self.microbatches(lay), fw, bw, sum(counts[::lay.pp]), self.runtime)
        shared = self.parts(lay).get("shared_params", 0.0)
        tied = self.allreduce_time(shared * self.bytes[4], 2, False) if lay.pp > 1 else 0.0
        stepped = self.sharded(lay, params, experts) if lay.zero else params
        step = stepped * STEP_BYTES[self.optimizer] / (c.hbm_bw * c.memory_efficiency)
        notes.update(tied_allreduce="after the pipeline, not overlapped",
                     optimizer="memory-bound, after the gradients are reduced")
        return {**terms, "tied_allreduce": tied, "optimizer": step}, notes

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
        counts = self.chunk_counts(lay)
        per_chunk = sum(counts) / len(counts)
        layer = parts["layer"]
        kept, rerun = self.kept_per_layer(lay)
        if lay.recompute_layers:     # the chunk's other layers keep all their activations
            whole = self.kept_per_layer(dataclasses.replace(lay, recompute="none", recompute_layers=0))[0]
            again = sum(self.recomputed(lay, n) for n in counts) / len(counts)
            per_layer = (again * kept + (per_chunk - again) * whole) / per_chunk
        else:
            per_layer = kept
        best = None
        for rank in {0, lay.pp - 1}:
            params = self.params_on(lay, rank)
            acts = in_flight[rank] * per_chunk * per_layer + rerun   # + the region rerunning in backward
            if rank == 0:
                # the embedding's output is the first layer's input (counted above); what it saves
                # for its own backward (the token ids) is one microbatch's working memory at most
                acts += self._kept(parts["first"], b) / lay.cp * scale
            if rank == lay.pp - 1:
                # logits and loss: one microbatch at a time
                acts += self._kept(parts["last"], b) / lay.cp * scale
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

    def _kept(self, part: Part, b: int) -> float:
        """What autograd keeps for a part (saves.py), or every op's output for a profile cached
        before it was counted (its layer keeps nothing)."""
        new = next(iter(self.profile.parts.values()))["layer"].kept_bytes(1) > 0
        return part.kept_bytes(b) if new else part.saved_bytes(b)

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
        counts = self.chunk_counts(lay)
        layers = sum(n for k, n in enumerate(counts) if k % lay.pp == 0)
        return self.microbatches(lay) * layers * per_layer

    def kept_per_layer(self, lay: Layout) -> tuple[float, float]:
        """(bytes a layer keeps per microbatch in flight, bytes of the region rerunning in
        backward): full keeps the layer's input and reruns all of it; selective keeps all but
        the attention core's insides (its output, read by the projection, stays) and reruns the
        core; none keeps what autograd keeps (saves.py: the values the ops' backwards read). A
        context-parallel rank keeps 1/cp of each; sequence parallelism 1/tp of the values
        outside the tp regions."""
        layer, core = self.parts(lay)["layer"], self.parts(lay).get("core")
        b, scale = lay.microbatch_size, self._act_scale / lay.cp
        # what autograd keeps (saves.py); a profile without it: every op's output (a bound)
        kept = layer.kept_bytes(b) > 0
        saved = layer.kept_bytes(b) if kept else layer.saved_bytes(b)
        out = layer.out_bytes(b)
        if self.sequence_parallel(lay.tp):      # outside the tp regions, 1/tp of the sequence
            saved -= (layer.replicated_kept(b) if kept else layer.replicated_saved(b)) * (1 - 1 / lay.tp)
            out /= lay.tp
        if lay.recompute == "full":
            return out * scale, saved * scale
        if lay.recompute == "selective":
            if layer.selective_kept(b) > 0:
                stays = layer.selective_kept(b)
                if self.sequence_parallel(lay.tp):
                    stays -= layer.replicated_selective(b) * (1 - 1 / lay.tp)
                stays = min(stays, saved)
                return stays * scale, (saved - stays) * scale
            inside = min(core.saved_bytes(b) - core.out_bytes(b), saved)
            return (saved - inside) * scale, inside * scale
        return saved * scale, 0.0

    def model_flops(self, lay: Layout) -> float:
        """The paper's count: 96 (72 without recomputation) B s l h^2 (1 + s/6h + V/16lh);
        selective adds the attention core's forward once more, 4 B s^2 h per layer (QK^T, AV)."""
        p = self.profile
        B, s, l, h, V = self.batch, p.seq, p.blocks or p.layers, p.hidden, p.vocab
        again = sum(self.recomputed(lay, n) for n in self.chunk_counts(lay))
        k = 72 + 24 * again / p.layers if lay.recompute == "full" else 72
        extra = 4 * B * s * s * h * l if lay.recompute == "selective" else 0.0
        return k * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)) + extra

    def assumptions(self, lay: Layout) -> dict:
        """{term: the overlap (or kernel) it assumes}, as `autopart plan --explain-cost` prints them."""
        c = self.cluster
        megatron = self.runtime == "megatron"
        notes = {"attention": (f"fused SDPA kernel at {c.fused_attention_efficiency:g} of peak, causal half of "
                               "the FLOPs, O(s) memory" if c.fused_attention_efficiency > 0 else
                               "scores materialized (attention_score_bytes per score element)"),
                 "tp_collectives": ("behind the part's GEMMs (tp-comm-overlap), exposed only where longer"
                                    if megatron else "forward's exposed; backward's behind the column-"
                                    "parallel weight gradients (overlap_collectives), exposed where longer"
                                    + (" (not under this split-backward schedule)"
                                       if splits_backward(lay.schedule) else "")),
                 "activations": ("what autograd keeps; sequence parallelism: 1/tp outside the tp regions"
                                 if self.sequence_parallel(lay.tp) else "what autograd keeps"),
                 "message": "pipeline sends between stages, behind other microbatches' work where the "
                            "schedule has some (the simulator's delay)"}
        if lay.cp > 1:
            notes["cp_ring_exposed"] = "each K/V chunk's transfer behind one attention block, max(0, transfer - block)"
        if self.precision == "fp8":
            notes.update(self.fp8_notes(lay))
        return {**notes, **self._after(lay)[1]}

    def counted_flops(self) -> float:
        """The model's FLOPs a step as Megatron-LM counts them (num_floating_point_operations):
        three times the forward's matmuls, attention whole (causal masking not subtracted),
        recomputation not counted; read from the captured graph (tp=1), so grouped-query
        attention, SwiGLU and an untied head count as they are."""
        parts = self.profile.parts[(1, 1)]
        per_sequence = (self.profile.layers * parts["layer"].flops(1) + parts["first"].flops(1)
                        + parts["last"].flops(1))
        return 3 * self.batch * per_sequence

    # -- a whole step ---------------------------------------------------------------------------

    def check(self, lay: Layout) -> str | None:
        """Why the layout cannot run at all (not memory), or None."""
        p = self.profile
        if (lay.tp, lay.ep) not in p.parts:
            return p.invalid_tp.get((lay.tp, lay.ep), f"tp={lay.tp}, ep={lay.ep} was not analysed")
        if lay.recompute_layers and (lay.recompute != "full" or lay.recompute_layers < 0
                                     or lay.recompute_layers >= p.layers / (lay.pp * lay.virtual_stages)):
            return (f"recompute_layers={lay.recompute_layers} reruns part of each chunk's layers under "
                    f"recompute='full', fewer than its {p.layers / (lay.pp * lay.virtual_stages):g}")
        if lay.recompute == "selective" and p.parts[(lay.tp, lay.ep)].get("core") is None:
            return "selective recomputation reruns attention cores, and the layer has none"
        if lay.zero and lay.replicas == 1:
            return f"zero={lay.zero} shards over data-parallel replicas, and dp=1"
        if self.precision == "fp8" and self.runtime == "autopart":
            refused = fp8_refused(lay.zero, lay.cp, lay.ep)
            if refused:
                return refused
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
        k = 2 if self.pairs_microbatches(lay) else 1     # pairs: m/2 units of twice the work
        units = (tuple(k * f for f in fwd), tuple(k * b for b in bwd), k * msg)
        if simulate:
            makespan, in_flight = pipeline(lay.schedule, lay.pp, m // k, lay.virtual_stages, *units)
        else:
            makespan, in_flight = pipeline_formula(lay.pp, lay.virtual_stages, m // k, *units)
        in_flight = tuple(k * n for n in in_flight)
        after = self.after_pipeline(lay, fwd, bwd)
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
        if self.precision == "fp8":
            breakdown.update(self.fp8_terms(lay))
        return Estimate(lay, step, tflops, mem, fits, why, breakdown, simulate)


# re-exported: FP8_*, fp8_refused (fp8_costs.py) and chunk_layers, pipeline, splits_backward
# (makespan.py) were cost.py's own, and callers import them from here
__all__ = ["Layout", "Estimate", "CostModel", "chunk_layers", "pipeline", "PRECISIONS", "FP8_CAST_BYTES",
           "FP8_WEIGHT_BYTES", "FP8_TERMS", "fp8_refused", "splits_backward"]
