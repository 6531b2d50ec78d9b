"""The budget: check it, and choose recomputation under it."""
from __future__ import annotations

import sympy
from autopart.analysis import evaluate
from autopart.config import Config, fmt_bytes
from autopart.errors import AutopartError
from autopart.ir import REDUCED_DTYPES, Program

from .activations import ActivationCache, ChunkActivations
from .per_rank import _rank_chunks_local, local_shaper, state_bytes, with_activations
from .units import KEYS

def check_budget(compiled) -> None:
    """Raise unless every pipeline rank fits the compile's memory budget (its Config's
    memory_budget), by the memory table: the program check's fake runs serve it, one per
    distinct chunk."""
    budget = compiled.config.memory_budget
    if budget is None:
        return
    mesh = compiled.plan.mesh
    for pp in range(mesh.pp):
        mem = compiled.memory[mesh.rank(pp=pp)]
        if mem["total"] > budget:
            raise budget_error(pp, mem, budget, compiled.config.recompute, mesh)


def budget_error(pp: int, mem: dict, budget: int, mode: str, mesh) -> AutopartError:
    parts = ", ".join(f"{k} {fmt_bytes(mem[k])}" for k in KEYS[:-1] if mem[k])
    state = mem["params"] + mem["grads"] + mem["master"] + mem["optimizer"]
    hint = [f"pp={2 * mesh.pp} (about half the layers and weights on each rank)"]
    hint.append(f"tp={2 * mesh.tp} (about half the weights and layer activations)")
    hint.append(f"dp > 1 with zero=1 (shards the {fmt_bytes(mem['optimizer'])} of optimizer "
                "state over dp)")
    if mode != "full":
        hint.insert(0, "recompute='full' or 'auto'")
    return AutopartError(
        f"pipeline rank {pp} (and every dp/tp rank with it) needs {fmt_bytes(mem['total'])} "
        f"({mem['total']} bytes: {parts}) but the memory budget is {fmt_bytes(budget)} "
        f"({budget} bytes) with recompute={mode!r}; state alone is {fmt_bytes(state)}.\n"
        f"  remedy: " + "; or ".join(hint))


def choose_recompute(program: Program, layers: dict, rewritten: dict, *, mesh, schedule,
                     microbatch_size: int, config: Config) -> dict:
    """(chunk, layer) -> none|selective|full: per pipeline rank, start from none and, while the
    rank is over config.memory_budget, take the step (none->selective, ->full) saving the most
    peak bytes per recomputed FLOP, until it fits; full everywhere that still does not fit is an
    error. `rewritten[chunk, kind]` is (the chunk with every layer recomputed so, its regions),
    made by the recompute pass: this module weighs them and rewrites nothing."""
    b, s, budget = microbatch_size, program.seq_len, config.memory_budget
    local, cache = local_shaper(program, mesh), ActivationCache(REDUCED_DTYPES[config.precision])
    choices = {}
    for pp in range(mesh.pp):
        mine = [c for c in program.chunks if c.rank == pp]
        variants = {}        # (chunk, kind) -> ChunkActivations with every layer of that kind
        flops = {}           # (chunk, kind) -> recomputed forward FLOPs per layer (mean)
        for c in mine:
            for kind in ("none", "selective", "full"):
                new, regions = rewritten[c.chunk, kind]
                variants[c.chunk, kind] = cache.get(new, program, b, s, local)
                n = max(len(layers[c.chunk]), 1)
                flops[c.chunk, kind] = sum(evaluate(program.costs[x].flops, b, s)
                                           for _, _, names in regions.values()
                                           for x in names if x in program.costs) / n
        current = {(c.chunk, layer): "none" for c in mine for layer in layers[c.chunk]}
        state = state_bytes(program, _rank_chunks_local(program, mesh, pp), mesh,
                            config.optimizer, config.precision, config.zero)
        while True:
            acts = _mixed(mine, layers, current, variants)
            mem = with_activations(state, schedule.ranks[pp], acts, b, s)
            if mem["total"] <= budget:
                break
            step = _best_step(current, variants, flops, b, s)
            if step is None:
                raise budget_error(pp, mem, budget, "auto", mesh)
            current[step[0]] = step[1]
        choices.update(current)
    return choices


def rank_memory(program: Program, pp: int, *, mesh, schedule, microbatch_size: int,
                config: Config, cache: ActivationCache) -> dict:
    """Pipeline rank `pp`'s memory row for `program` as it stands (what check_budget reads):
    a pass weighing choices of its own (gather_parameters' releases) asks it per candidate;
    `cache` keeps the activations' fake runs to one per distinct chunk across the asks."""
    b, s = microbatch_size, program.seq_len
    local = local_shaper(program, mesh)
    acts = {c.chunk: cache.get(c, program, b, s, local) for c in program.chunks if c.rank == pp}
    state = state_bytes(program, _rank_chunks_local(program, mesh, pp), mesh, config.optimizer,
                        config.precision, config.zero)
    return with_activations(state, schedule.ranks[pp], acts, b, s)


def _mixed(chunks, layers, current, variants) -> dict:
    """Per chunk: the none variant with each layer's bytes replaced by its chosen variant's."""
    out = {}
    for c in chunks:
        base = variants[c.chunk, "none"]
        total, rerun = base.saved, sympy.Integer(0)
        for layer in layers[c.chunk]:
            kind = current[c.chunk, layer]
            if kind != "none":
                v = variants[c.chunk, kind]
                total += v.per_layer.get(layer, 0) - base.per_layer.get(layer, 0)
                # bounded by: everything this chunk keeps plus the rerun of the variant's region
                rerun = sympy.Max(rerun, v.transient - v.saved)
        transient = sympy.expand(total) + rerun
        out[c.chunk] = ChunkActivations(sympy.expand(total), {}, transient, base.sends)
    return out


def _best_step(current, variants, flops, b, s):
    best, best_ratio = None, -1.0
    for (chunk, layer), kind in current.items():
        for nxt in ("selective", "full")[("none", "selective", "full").index(kind):]:
            if nxt == kind:
                continue
            before = evaluate(variants[chunk, kind].per_layer.get(layer, 0), b, s)
            after = evaluate(variants[chunk, nxt].per_layer.get(layer, 0), b, s)
            cost = flops[chunk, nxt] - flops[chunk, kind]
            saved = before - after
            if saved <= 0:
                continue
            ratio = saved / max(cost, 1.0)
            if ratio > best_ratio:
                best, best_ratio = ((chunk, layer), nxt), ratio
    return best
