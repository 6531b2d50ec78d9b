"""What precision="fp8" adds to the cost model (autopart/planner/cost.py), kept apart from it.

`Fp8Pricing` is a mixin of cost.CostModel: which linears run in FP8 (`fp8_mask`: autopart's rule,
passes/fp8_linears.py, under autopart's runtime; Transformer Engine's under Megatron-LM's), what
their casts and amax all-reduces cost (`fp8_costs`, `weight_cast_time`, `weight_amax_time`), the
first and last layers the rule keeps in bf16 (`edge_layers`), the FP8 terms of a step's breakdown
(`fp8_terms`) and what they assume (`fp8_notes`). The GEMMs themselves are priced by
CostModel.gemm_time at the cluster's FP8 peak and fp8_gemm_efficiency. `fp8_refused` asks
autopart's own compile rule which layouts it refuses under FP8. The mixin reads the host's
cluster, precision, runtime, parts, part_times, gemm_time, allreduce_time, microbatches and
chunk_counts; cost.py re-exports every public name here.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from autopart.errors import AutopartError

if TYPE_CHECKING:
    from autopart.planner.profile import Part

# bytes per element a cast to FP8 moves, reading bf16 and writing one byte (an FP8 linear's input
# in forward, its output gradient in backward); the weight's is read in fp32 under autopart's
# runtime (its master weights, cast each microbatch), in bf16 under Megatron-LM's (Transformer
# Engine casts the bf16 parameter on a step's first microbatch and keeps the FP8 copy for the
# others: is_first_microbatch)
FP8_CAST_BYTES = 3
FP8_WEIGHT_BYTES = {"autopart": 5, "megatron": 3, "megatron-2021": 3}
FP8_TERMS = ("fp8_gemms_rank0", "fp8_casts_rank0", "fp8_amax_rank0")


class Fp8Pricing:
    """CostModel's FP8 methods (see the module docstring for what they read from it); `lay` is
    a cost.Layout (not imported: cost.py imports this module)."""

    def check_fp8_cluster(self) -> None:
        """Refuse precision="fp8" on a cluster with no FP8 GEMM figures (it would divide by 0)."""
        c = self.cluster
        if self.precision == "fp8" and not (c.fp8_peak_flops > 0 and c.fp8_gemm_efficiency > 0):
            raise AutopartError(f"precision='fp8': cluster {c.name!r} has no FP8 GEMMs (fp8_peak_flops "
                                f"{c.fp8_peak_flops:g}, fp8_gemm_efficiency {c.fp8_gemm_efficiency:g})"
                                "\n  remedy: plan bf16 there, or an FP8 cluster (h100-sxm, h200), or set both "
                                "fields in the cluster file")

    def fp8_mask(self, part: Part, where: str = "layer") -> tuple:
        """Per GEMM of `part` (profile.Part.linears), whether it runs in FP8. `where`: first, last,
        layer, or layer-first / layer-last (the model's first / last layer where the first / last
        part has no linear). Under autopart's runtime passes/fp8_linears.py's rule ("auto"): every
        linear but the model's first (no linear before it) and last (none after it) and the small
        or misaligned ones; under Megatron-LM's, Transformer Engine's: every linear of the
        transformer layers (embedding and output layer stay bf16), misaligned ones excepted."""
        tags = part.linears if len(part.linears) == len(part.gemms) else ((),) * len(part.gemms)
        if self.precision != "fp8":
            return (False,) * len(tags)
        if self.runtime != "autopart":
            return tuple(bool(t) and "misaligned" not in t and where.startswith("layer") for t in tags)
        first, last = where in ("first", "layer-first"), where in ("last", "layer-last")
        return tuple(bool(t) and not ({"small", "misaligned"} & set(t)) and not (first and "entry" in t)
                     and not (last and "exit" in t) for t in tags)

    def fp8_costs(self, part: Part, tp: int, b: int, cp: int, mask: tuple) -> tuple[float, float, float, float]:
        """(forward casts, backward casts, forward amax all-reduces, backward ones) in seconds, one
        microbatch of `part`'s FP8 GEMMs (`mask`). Casts at HBM speed: per linear the input
        (FP8_CAST_BYTES an element) and, under autopart's runtime, the weight (FP8_WEIGHT_BYTES) in
        forward, the output gradient in backward (Megatron-LM's weights: weight_cast_time).
        Amaxes (tensorwise, autopart/ops/fp8.py): an input's amax is reduced over tp where its K
        is split (row-parallel), an output gradient's where N is (column-parallel), one max
        all-reduce of 4 bytes each (the weights' once per chunk: weight_amax_time). Under
        Megatron-LM's runtime Transformer Engine reduces amaxes once a step: not priced."""
        c = self.cluster
        hbm = c.hbm_bw * c.memory_efficiency
        cast_f = cast_b = 0.0
        rows = cols = 0
        for (_, mm, n, k, _, _), on, tags in zip(part.gemms, mask, part.linears):
            if on:
                m = mm(b) / cp
                weight = FP8_WEIGHT_BYTES["autopart"] * k * n if self.runtime == "autopart" else 0.0
                cast_f += (FP8_CAST_BYTES * m * k + weight) / hbm
                cast_b += FP8_CAST_BYTES * m * n / hbm
                rows, cols = rows + ("row" in tags), cols + ("column" in tags)
        if tp == 1 or self.runtime != "autopart":
            return cast_f, cast_b, 0.0, 0.0
        one = self.allreduce_time(4.0, tp, True)
        return cast_f, cast_b, rows * one, cols * one

    def edge_layers(self, lay) -> list[tuple[str, int]]:
        """[(fp8_mask's where, chunk)] of the layers whose linears the FP8 rule keeps in bf16 as
        the model's first or last (autopart's runtime, where the first / last part has none)."""
        if self.precision != "fp8" or self.runtime != "autopart":
            return []
        parts = self.parts(lay)
        return [(f"layer-{end}", k) for end, k in (("first", 0), ("last", -1))
                if not any(parts[end].linears) and any(parts["layer"].linears)]

    def fp8_edges(self, lay, fwd: list, bwd: list, lf: float, lb: float) -> None:
        """Add to the chunk costs (CostModel.chunk_costs) what precision="fp8" adds beyond the
        layer's price: the first and last layer's bf16 linears (edge_layers; rerun in backward
        under full recomputation), per chunk the one all-reduce of its weights' amaxes
        (weight_amax_time) and, under Megatron-LM's runtime, its layers' weight casts
        (weight_cast_time)."""
        layer, b = self.parts(lay)["layer"], lay.microbatch_size
        for where, k in self.edge_layers(lay):
            ef, eb, _ = self.part_times(layer, lay.tp, b, lay.ep, lay.cp, lay.schedule, self.fp8_mask(layer, where))
            fwd[k] += ef - lf
            bwd[k] += eb - lb + (ef - lf if lay.recompute == "full" else 0.0)
        weights = self.weight_amax_time(lay)
        for k, n in enumerate(self.chunk_counts(lay)):
            fwd[k] += weights + n * self.weight_cast_time(lay)

    def weight_cast_time(self, lay) -> float:
        """Under Megatron-LM's runtime, a layer's FP8 weights cast once a step (bf16 read, FP8
        written), in seconds per microbatch (the step's cast spread over its microbatches); 0
        under autopart's, where fp8_costs casts them every microbatch."""
        if self.runtime == "autopart":
            return 0.0
        layer, c = self.parts(lay)["layer"], self.cluster
        elements = sum(g[2] * g[3] for g, on in zip(layer.gemms, self.fp8_mask(layer)) if on)
        hbm = c.hbm_bw * c.memory_efficiency
        return FP8_WEIGHT_BYTES[self.runtime] * elements / hbm / self.microbatches(lay)

    def weight_amax_time(self, lay) -> float:
        """Seconds of the one max all-reduce over tp of a chunk's FP8 weights' amaxes, per
        microbatch (autopart's runtime, where the layer has tp-split FP8 linears), else 0."""
        layer = self.parts(lay)["layer"]
        split = any(on and ({"row", "column"} & set(t)) for on, t in zip(self.fp8_mask(layer), layer.linears))
        return self.allreduce_time(4.0, lay.tp, True) if split and self.runtime == "autopart" else 0.0

    def fp8_notes(self, lay) -> dict:
        """{FP8 term: what it assumes}, for CostModel.assumptions()."""
        c, layer = self.cluster, self.parts(lay)["layer"]
        on, found = sum(self.fp8_mask(layer)), sum(map(bool, layer.linears))
        ours = self.runtime == "autopart"
        rule = ("autopart's rule (passes/fp8_linears.py): the model's first and last linears and small ones "
                "stay bf16" if ours else "Megatron-LM's (Transformer Engine): the transformer layers' linears; "
                "embedding and output layer bf16")
        return {"fp8_gemms_rank0": (f"{on} of a layer's {found} linears in FP8, {rule}; at {c.fp8_peak_flops / 1e12:g} "
                                    f"TFLOP/s * fp8_gemm_efficiency {c.fp8_gemm_efficiency:g} * the shape factor; "
                                    "attention cores bf16; part of compute_rank0"),
                "fp8_casts_rank0": (f"per FP8 linear and microbatch, at HBM speed: input {FP8_CAST_BYTES} B/element "
                                    f"and weight {FP8_WEIGHT_BYTES[self.runtime]} in forward, output gradient "
                                    f"{FP8_CAST_BYTES} in backward; part of compute_rank0"),
                "fp8_amax_rank0": ("tensorwise amaxes max-all-reduced over tp, exposed: per linear the input's "
                                   "(row-parallel) and the output gradient's (column-parallel), the weights' once "
                                   "a chunk; part of compute_rank0" if ours else
                                   "Transformer Engine reduces amaxes once a step: not priced")}

    def fp8_terms(self, lay) -> dict:
        """Seconds a step of the first pipeline rank spends in FP8 GEMMs (forward and backward),
        FP8 casts and amax all-reduces (FP8_TERMS), part of its compute_rank0 (recomputation's
        reruns not counted)."""
        parts, b = self.parts(lay), lay.microbatch_size
        counts = self.chunk_counts(lay)
        mine = [(parts["layer"], "layer", sum(n for k, n in enumerate(counts) if k % lay.pp == 0)),
                (parts["first"], "first", 1)]
        if lay.pp == 1:
            mine.append((parts["last"], "last", 1))
        for where, k in self.edge_layers(lay):       # one of rank 0's layers priced apart
            if k == 0 or lay.pp == 1:
                mine += [(parts["layer"], "layer", -1), (parts["layer"], where, 1)]
        gemms = casts = amax = 0.0
        for part, where, n in mine:
            mask = self.fp8_mask(part, where)
            g = sum(self.gemm_time(f(b) / lay.cp, mm(b) / lay.cp, nn, k, True)
                    for (f, mm, nn, k, att, _), on in zip(part.gemms, mask) if on and not att)
            cf, cb, af, ab = self.fp8_costs(part, lay.tp, b, lay.cp, mask)
            gemms, casts, amax = gemms + n * 3 * g, casts + n * (cf + cb), amax + n * (af + ab)
        m = self.microbatches(lay)
        amax += len(range(0, len(counts), lay.pp)) * self.weight_amax_time(lay)   # rank 0's chunks
        casts += mine[0][2] * self.weight_cast_time(lay)
        return dict(zip(FP8_TERMS, (m * gemms, m * casts, m * amax)))


@functools.lru_cache(maxsize=64)
def fp8_refused(zero: int, cp: int, ep: int) -> str | None:
    """Why autopart's compile refuses precision="fp8" with this ZeRO level, cp and ep (its own
    check, config.check_fp8, so the planner ranks only what autopart runs), or None."""
    from types import SimpleNamespace
    from autopart.config import Config, check_fp8
    try:
        check_fp8(Config(precision="fp8", zero=zero), SimpleNamespace(cp=cp, ep=ep))
    except AutopartError as e:
        return str(e).splitlines()[0]
    return None


__all__ = ["Fp8Pricing", "FP8_CAST_BYTES", "FP8_WEIGHT_BYTES", "FP8_TERMS", "fp8_refused"]
