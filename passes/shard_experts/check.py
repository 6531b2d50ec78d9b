"""Checks before the rewrite: experts divide by ep, microbatches hold whole routing groups."""
from __future__ import annotations

from autopart.errors import AutopartError, node_error
from autopart.ir import ExpertPlan, Program


def check_shardable(plan: ExpertPlan, regions, ep: int, dp: int | None) -> None:
    """ep > 1 needs MoE layers, and each layer's experts must divide by ep."""
    if not plan.layers:
        why = "".join(f"\n  {n}: {r}" for n, r in plan.skipped)
        raise AutopartError(
            f"ep={ep} shards mixture-of-experts layers, but the model has none: no matmul of "
            "routed tokens ([E, tokens, d] batched, or rows sorted by expert in a grouped matmul) "
            f"with a parameter stacked over E experts [E, d, f] was found{why}\n  remedy: use "
            "ep=1 (plain data parallelism), or write the experts as stacked weights with a "
            "leading expert dimension")
    for layer, region in zip(plan.layers, regions):
        E = layer.num_experts
        if E % ep:
            ok = [d for d in range(1, E + 1) if E % d == 0 and (dp is None or dp % d == 0)]
            within = f" dp={dp}" if dp is not None else " dp"
            raise node_error(region.first, f"MoE layer '{layer.name}' has {E} experts, not "
                             f"divisible by ep={ep}", f"use ep in {ok} (the divisors of {E} that "
                             f"divide{within}), or {-(-E // ep) * ep} experts")


def check_groups(program: Program, plan: ExpertPlan, regions, microbatch_size: int) -> None:
    """Each microbatch routes on its own: it must hold whole routing groups, or a rank would route
    a group the plain model never forms."""
    seq = program.seq_len or 1
    tokens = microbatch_size * seq
    for layer, region in zip(plan.layers, regions):
        S = layer.group_size
        if S is None or tokens % S == 0:
            continue
        ok = [b for b in range(1, 4 * S + 1) if (b * seq) % S == 0][:4]
        raise node_error(region.first, f"MoE layer '{layer.name}' routes groups of {S} tokens, "
                         f"but a microbatch holds {microbatch_size} x {seq} = {tokens} tokens, "
                         f"not a multiple of {S}", f"use a microbatch size (global batch / "
                         f"(dp * microbatches)) in {ok} ..., fewer microbatches, or a group "
                         f"size dividing {tokens}")
