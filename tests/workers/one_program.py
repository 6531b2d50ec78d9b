"""Rank functions for tests/test_one_program.py: parallelize on ranks whose Python string hash
seeds differ (so a forward looping over a set traces its ops in another order on each), counting
the torch.export calls each rank makes, then the equivalence harness against the plain model.

ModernBERT is registered here as a family (tests/workers/family.py's build_family builds it):
its forward builds one rotary table per attention type over `set(config.layer_types)`.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.workers import common, family
from tests.workers.equivalence import equivalence


def modernbert(case, g):
    tf = family._quiet_transformers()
    cfg = tf.ModernBertConfig(vocab_size=family.VOCAB, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=4, num_attention_heads=4,
                              max_position_embeddings=64, local_attention=8,
                              global_attn_every_n_layers=2, attn_implementation="eager",
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2)
    return family._causal_lm(tf.ModernBertForMaskedLM(cfg), case, g)


family.FAMILIES["modernbert"] = modernbert
common.FAMILIES["modernbert"] = family.build_family


def exports_and_equivalence(rank: int, world: int, case) -> dict:
    """Rank function: equivalence(case) (parallelize checks that every rank compiled one
    program, and raises if not), with torch.export.export counted on this rank."""
    real, calls = torch.export.export, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    torch.export.export = counted
    try:
        result = equivalence(case, rank)
    except Exception as e:  # noqa: BLE001  (the test process reports it, per rank)
        result = {"problems": [f"raised on rank {rank}: {type(e).__name__}: {e}"]}
    finally:
        torch.export.export = real
    return {**result, "rank": rank, "exports": len(calls), "order": set_order(),
            "hashseed": os.environ.get("PYTHONHASHSEED")}


def set_order() -> list[str]:
    """The order this process iterates the layer types' set in (as Gemma3 and ModernBERT do)."""
    return list({"sliding_attention", "full_attention"})


def seeds_with_both_orders(world: int, draw) -> list[int]:
    """`world` hash seeds drawn by `draw()`, redrawn until rank 0's set order differs from
    rank 1's: every run then has ranks that trace in different orders."""
    seeds = [draw() for _ in range(world)]
    while _order(seeds[0]) == _order(seeds[1]):
        seeds[1] = draw()
    return seeds


def _order(seed: int) -> str:
    code = "print(list({'sliding_attention', 'full_attention'}))"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ,
                          "PYTHONHASHSEED": str(seed)}, capture_output=True, text=True,
                          check=True, timeout=30).stdout


def spawn_with_seeds(fn, seeds: list[int], *args, timeout: float, pg_timeout: float) -> list:
    """autopart.runtime.launch.spawn, rank r's interpreter starting with PYTHONHASHSEED=seeds[r]
    (a spawned process takes the environment it is started with); bounded by `timeout`."""
    from autopart.runtime import launch
    return launch.spawn(fn, len(seeds), *args, timeout=timeout, pg_timeout=pg_timeout,
                        rank_env=lambda r: {"PYTHONHASHSEED": seeds[r]})
