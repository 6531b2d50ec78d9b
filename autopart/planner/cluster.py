"""Clusters: what the cost model knows about the hardware, as one small frozen dataclass.

Named presets (:data:`PRESETS`), a JSON file (``Cluster.from_json``), or ``local``: this machine as
measured by ``autopart calibrate`` (saved to ``~/.cache/autopart/local-cluster.json``).

>>> c = cluster("a100-80gb-selene")
>>> c.gpus_per_node, c.peak_flops / 1e12, c.intra_bw / 1e9, c.inter_bw / 1e9
(8, 312.0, 300.0, 25.0)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from autopart.errors import AutopartError

LOCAL_PATH = Path(os.environ.get("AUTOPART_CACHE", Path.home() / ".cache" / "autopart")) / "local-cluster.json"


@dataclass(frozen=True)
class Cluster:
    """One kind of node, repeated. Bandwidths are bytes/s per device and per direction.

    The last seven fields are the calibration constants of the cost model (autopart/planner/cost.py),
    global to a cluster and its software (never per model): a GEMM of dimensions M, N, K runs at
    ``peak_flops * gemm_efficiency * prod(d / (d + gemm_half_dim))``; attention that materializes
    its scores (Megatron-LM in 2021: scale, mask, softmax, dropout as separate kernels; 0 for a
    fused flash attention) moves ``attention_score_bytes`` per score element in forward (twice that
    in backward); memory-bound ops move bytes at ``hbm_bw * memory_efficiency``; collectives and p2p
    reach ``intra_efficiency`` / ``inter_efficiency`` of the link's bandwidth, plus ``latency_s``
    per message step.
    """
    name: str
    gpus_per_node: int
    peak_flops: float          # dense bf16/fp16 matmul peak per device
    hbm_bw: float              # device memory bandwidth
    memory_bytes: float        # device memory
    intra_bw: float            # within a node (NVLink/NVSwitch), one direction
    inter_bw: float            # across nodes (InfiniBand), per device, one direction
    gemm_efficiency: float = 0.8
    gemm_half_dim: float = 32.0
    attention_score_bytes: float = 0.0
    intra_efficiency: float = 0.8
    inter_efficiency: float = 0.8
    memory_efficiency: float = 0.8
    latency_s: float = 1e-5
    op_overhead_s: float = 0.0     # per op: 0 on GPUs (launches are async, hidden behind the work)
    fused_attention_efficiency: float = 0.0   # > 0: SDPA runs as one fused kernel (flash/cuDNN) at
                                              # this fraction of peak on its unmasked FLOPs; 0:
                                              # scores materialized (attention_score_bytes)
    fp8_peak_flops: float = 0.0       # dense FP8 matmul peak per device; 0: no FP8 tensor cores
                                      # (precision="fp8" is refused)
    fp8_gemm_efficiency: float = 0.0  # as gemm_efficiency, for the GEMMs precision="fp8" runs in FP8
                                      # (the same gemm_half_dim shapes them)

    def __post_init__(self):
        problems = [f"{k} = {v!r}: {need}" for k, v, need in self._checks() if need]
        if problems:
            raise AutopartError(f"cluster {self.name!r} has values that cannot describe hardware:\n  "
                                + "\n  ".join(problems)
                                + "\n  remedy: fix them in the cluster file (`autopart plan --explain-cost` "
                                  "prints a preset's values to start from)")

    def _checks(self):
        """(field, value, what it must be, or "" where it is)."""
        def number(v, lo, hi=math.inf, lo_open=True):
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (v > lo if lo_open else v >= lo) and v <= hi)
            return "" if ok else (f"a number {'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi < math.inf else ""))
        yield "name", self.name, "" if isinstance(self.name, str) and self.name else "a non-empty string"
        g = self.gpus_per_node
        yield "gpus_per_node", g, "" if isinstance(g, int) and not isinstance(g, bool) and g >= 1 else "an integer >= 1"
        for k in ("peak_flops", "hbm_bw", "memory_bytes", "intra_bw", "inter_bw"):
            yield k, getattr(self, k), number(getattr(self, k), 0)
        for k in ("gemm_efficiency", "intra_efficiency", "inter_efficiency", "memory_efficiency"):
            yield k, getattr(self, k), number(getattr(self, k), 0, 1)
        for k in ("gemm_half_dim", "attention_score_bytes", "latency_s", "op_overhead_s", "fp8_peak_flops"):
            yield k, getattr(self, k), number(getattr(self, k), 0, lo_open=False)
        for k in ("fused_attention_efficiency", "fp8_gemm_efficiency"):
            yield k, getattr(self, k), number(getattr(self, k), 0, 1, lo_open=False)

    CONSTANTS = ("gemm_efficiency", "gemm_half_dim", "attention_score_bytes", "fused_attention_efficiency",
                 "intra_efficiency", "inter_efficiency", "memory_efficiency", "latency_s", "op_overhead_s")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Cluster:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AutopartError(f"cluster description has unknown keys {unknown}; known: {sorted(known)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise AutopartError(f"cluster description lacks {missing}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | Path) -> Cluster:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise AutopartError(f"cannot read cluster file {path}: {e}") from None
        if not isinstance(data, dict):
            raise AutopartError(f"cluster file {path} holds a JSON {type(data).__name__}; it must be one object "
                                f"with the keys {[f.name for f in dataclasses.fields(cls)]}")
        try:
            return cls.from_dict(data)
        except AutopartError as e:
            raise AutopartError(f"cluster file {path}: {e}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def explain(self) -> str:
        """The constants as `autopart plan --explain-cost` prints them."""
        lines = [f"cluster {self.name}: {self.gpus_per_node} devices/node, peak {self.peak_flops / 1e12:g} TFLOP/s, "
                 f"HBM {self.hbm_bw / 1e9:g} GB/s, memory {self.memory_bytes / 1e9:g} GB, intra-node "
                 f"{self.intra_bw / 1e9:g} GB/s, inter-node {self.inter_bw / 1e9:g} GB/s per device (one direction)",
                 "calibration constants (global to the cluster; " + _source(self.name) + "):"]
        lines += [f"  {k} = {getattr(self, k):g}" for k in self.CONSTANTS]
        if self.fp8_peak_flops > 0:
            lines.append(f"  fp8_gemm_efficiency = {self.fp8_gemm_efficiency:g} (of the {self.fp8_peak_flops / 1e12:g} "
                         f"TFLOP/s dense FP8 peak; " + _FP8_SOURCE.get(self.name, "from the cluster file") + ")")
        return "\n".join(lines)


def _source(name: str) -> str:
    return {"local": "measured by `autopart calibrate`",
            "a100-80gb-selene": "fitted on megatron_table1_given.json, A100",
            "h100-sxm": "fitted on published_h100_runs_given.json, H100",
            "h200": "the H100's, fitted on published_h100_runs_given.json"}.get(name, "from the cluster file")


# a100-80gb-selene: fitted by autopart/planner/fit.py on the five rows of
# autopart/planner/data/megatron_table1_given.json only (A100, Megatron-LM of 2021: materialized
# attention scores, runtime="megatron-2021").
_FITTED = dict(gemm_efficiency=0.6649, gemm_half_dim=31.19, attention_score_bytes=6.220, intra_efficiency=0.9285,
               inter_efficiency=0.9922, memory_efficiency=0.9284, latency_s=1e-5)

# h100-sxm: fitted by autopart/planner/published.py (`python -m bench.published --fit`) on the ten
# rows of autopart/planner/data/published_h100_runs_given.json (Megatron-LM's H100 scaling table,
# Llama 3 405B), runtime="megatron". What each means, and its physical range:
#   gemm_efficiency      a large bf16 GEMM's fraction of the 989 TFLOP/s dense peak (cuBLAS on
#                        H100 SXM reaches 0.6-0.8 in practice, below the 700 W clock's peak)
#   gemm_half_dim        the dimension at which a GEMM runs at half that (thin tp shards, heads)
#   fused_attention_efficiency  the fused SDPA kernel's fraction of peak on its unmasked FLOPs,
#                        forward; its backward is FLASH_BACKWARD (2.5) times the forward
#   intra/inter_efficiency  the bus bandwidth NCCL reaches of NVLink 4 (450 GB/s a direction) and
#                        of one 400 Gb/s NIC per GPU (50 GB/s): large messages; small ones pay
#                        latency_s per ring step (10 us, NCCL's order; not fitted), so the bandwidth
#                        a message gets grows with its size, n / (steps * latency + n / bw)
#   memory_efficiency    HBM3 bandwidth reached by the memory-bound ops (norms, activations,
#                        cross-entropy over the vocabulary)
#   op_overhead_s        per kernel, what launching adds where kernels are too short to hide it
# The rows were not split by this fit; H100_HALF_FIT below is the same fit on half of them
# (published.half_split), which tests/test_planner_h100.py checks on the other half.
_H100 = dict(gemm_efficiency=0.5852, gemm_half_dim=113.1, fused_attention_efficiency=0.1743, intra_efficiency=0.8582,
             inter_efficiency=0.9718, memory_efficiency=0.8106, op_overhead_s=2.419e-06, latency_s=1e-5,
             attention_score_bytes=0.0)
FP8_FITTED = 0.7446   # `python -m bench.published --fit-fp8` (the fit half only)
H100_HALF_FIT = dict(gemm_efficiency=0.5578, gemm_half_dim=101.0, fused_attention_efficiency=0.2358,
                     intra_efficiency=0.9926, inter_efficiency=0.8629, memory_efficiency=0.6941, op_overhead_s=2.429e-06)

# precision="fp8" on H100 and H200: dense FP8 peak 1979 TFLOP/s (twice bf16's); the FP8 GEMMs'
# efficiency fitted by autopart/planner/published.py (`python -m bench.published --fit-fp8`) on the
# fit half of autopart/planner/data/published_h100_fp8_runs.json (published.half_split), h100-sxm's
# other constants held; the other half is predicted with it (tests/test_planner_fp8.py).
_H100_FP8 = dict(fp8_peak_flops=1979e12, fp8_gemm_efficiency=FP8_FITTED)
_FP8_SOURCE = {"h100-sxm": "fitted on half of published_h100_fp8_runs.json, H100",
               "h200": "the H100's, fitted on half of published_h100_fp8_runs.json"}

PRESETS: dict[str, Cluster] = {
    # Selene (Narayanan et al. 2021): DGX A100 80GB, NVSwitch 600 GB/s bidirectional per GPU,
    # 8 x 200 Gb/s HDR InfiniBand per node (one HCA per GPU).
    "a100-80gb-selene": Cluster("a100-80gb-selene", 8, 312e12, 2.039e12, 80e9, 300e9, 25e9, **_FITTED),
    # DGX H100: 989 TFLOP/s dense bf16, NVLink 4 900 GB/s bidirectional, 8 x 400 Gb/s NDR.
    "h100-sxm": Cluster("h100-sxm", 8, 989e12, 3.35e12, 80e9, 450e9, 50e9, **_H100, **_H100_FP8),
    # H200: the H100's compute, links and kernels (the same constants: no H200 rows to fit), 141 GB
    # of HBM3e at 4.8 TB/s.
    "h200": Cluster("h200", 8, 989e12, 4.8e12, 141e9, 450e9, 50e9, **_H100, **_H100_FP8),
}


def cluster(name: str) -> Cluster:
    """A preset by name, ``local`` (this machine, from ``autopart calibrate``) or a JSON file."""
    if name in PRESETS:
        return PRESETS[name]
    if name == "local":
        if not LOCAL_PATH.is_file():
            raise AutopartError(f"no local profile at {LOCAL_PATH}.\n  remedy: run `autopart calibrate` "
                                "first (a short run timing matmuls and a two-process all-reduce)")
        return Cluster.from_json(LOCAL_PATH)
    if name.endswith(".json"):
        return Cluster.from_json(name)
    raise AutopartError(f"unknown cluster {name!r}; known: {', '.join([*PRESETS, 'local'])}, or a .json file")


__all__ = ["Cluster", "PRESETS", "LOCAL_PATH", "cluster"]
