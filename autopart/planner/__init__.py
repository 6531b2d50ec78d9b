"""The planner: a cost model of a training step (calibrated on the Megatron-LM paper's Table 1) and
a search over layouts that keeps those that fit in memory.

    from autopart.planner import plan
    ranked = plan("examples/gpt.py:GPT", "megatron-1t", gpus=3072, batch=3072, cluster="a100-80gb-selene")
    ranked[0].row()   # {'mesh': 'tp=8,pp=...', 'step_time_s': ..., 'tflops_per_device': ..., ...}
"""
from __future__ import annotations

from autopart.gc_paused import gc_paused
from autopart.planner.cluster import PRESETS, Cluster, cluster
from autopart.planner.cost import CostModel, Estimate, Layout


@gc_paused
def plan(target: str, spec: str | None, *, gpus: int, batch: int, cluster: str | Cluster = "a100-80gb-selene",
         precision: str | None = None, optimizer: str = "adam", simulate_top: int = 24, **knobs) -> list[Estimate]:
    """Ranked layouts of FILE.py:NAME (config `spec`) for `gpus` devices and a global `batch`."""
    from autopart.planner.cluster import cluster as get_cluster
    from autopart.planner.profile import load_profile
    from autopart.planner.search import search
    c = get_cluster(cluster) if isinstance(cluster, str) else cluster
    model = CostModel(load_profile(target, spec), c, batch, precision=precision or default_precision(c),
                      optimizer=optimizer)
    return search(model, gpus, simulate_top=simulate_top, **knobs)


def default_precision(c: Cluster) -> str:
    """bf16 mixed precision on GPU clusters, fp32 on the local (CPU) profile."""
    return "fp32" if c.name == "local" else "bf16"


__all__ = ["plan", "Cluster", "PRESETS", "cluster", "CostModel", "Estimate", "Layout", "default_precision"]
