"""Rank functions for tests/test_fp8_zero3.py: zero=3 with precision="fp8" (tensorwise) against
the plain model under the written-out FP8 recipe (tests/workers/fp8.fp8_equivalence), and what
its parameter all-gathers carried.

The bytes: every tensor handed to zero=3's all-gather (runtime/param_shards.py's
_all_gather_into, wrapped here) is recorded during the training steps, by dtype and element
count. What each gather should carry is counted here from the program's groups (each group's
parameters, and when it is freed: "forward" gathers twice a microbatch, forward and backward,
"backward" once a microbatch, "step" once a step) and the layout's per-rank chunk of each
parameter: the weights of the linears the recipe converts (the test's own list, by module name)
as uint8 (FP8 bytes: Gloo has no FP8 type), 1 byte an element, every other parameter as fp32.
And after the steps each FP8 weight as gathered (e4m3 and scale) is bitwise the recipe's cast of
the whole weight, its amax taken over every rank's share here (cast_problems).
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from tests.workers.fp8 import FCase, fp8_equivalence
from tests.workers.precision import run_each

GATHERS = {"forward": 2, "backward": 1}     # a group's all-gathers per microbatch


@dataclasses.dataclass(frozen=True)
class ZCase(FCase):
    zero: int = 3
    broken: str = ""    # "local-amax": each rank scales its slices with their own amax


def gathered_bytes(pm, converted: list[str]):
    """Record zero=3's all-gathers during pm.train_step; returns the check (a list of
    problems) comparing what they carried with the count above."""
    from autopart.runtime import param_shards
    gather, train = param_shards._all_gather_into, pm.train_step
    seen, steps, active = [], [0], [False]

    def recorded(out, inp, *args, **kwargs):
        if active[0]:       # in a step, not gathered() for a comparison
            seen.append((inp.dtype, inp.numel()))
        return gather(out, inp, *args, **kwargs)

    def counted(*args, **kwargs):
        steps[0] += 1
        active[0] = True
        try:
            return train(*args, **kwargs)
        finally:
            active[0] = False

    def check() -> list[str]:
        param_shards._all_gather_into = gather
        del pm.train_step
        got = Counter()
        for dtype, n in seen:
            got[str(dtype)] += n
        fp8_names = {f"{m}.weight" for m in converted}
        want = expected(pm, fp8_names, steps[0])
        problems = cast_problems(pm, fp8_names)
        if got != want or not want["torch.uint8"]:
            problems.append(f"zero=3 all-gathers carried {dict(got)} elements by dtype, not "
                            f"{dict(want)} (the FP8 weights as uint8, 1 byte an element; the "
                            "others fp32)")
        return problems

    param_shards._all_gather_into = recorded
    pm.train_step = counted
    return check


def expected(pm, fp8_names: set[str], steps: int) -> Counter:
    """dtype -> elements this rank's zero=3 all-gathers hand the collective over `steps`."""
    names = {id(p): n for n, p in pm.named_parameters()}
    microbatches = pm.compiled.plan.config.microbatches
    want = Counter({"torch.uint8": 0, "torch.float32": 0})
    for chunk in pm.program.chunks:
        shards = getattr(chunk.gm, "param_shards", None)
        for params, after in zip(getattr(shards, "params", ()), getattr(shards, "after", ())):
            times = steps * (1 if after == "step" else GATHERS[after] * microbatches)
            for p in params:
                lay, i = pm._sharded.where[id(p)]
                dtype = "torch.uint8" if names[id(p)] in fp8_names else "torch.float32"
                want[dtype] += times * lay.chunks[i]
    return want


def cast_problems(pm, fp8_names: set[str]) -> list[str]:
    """After the steps: each FP8 weight as the runtime gathers it (e4m3 and scale) bitwise the
    recipe's cast of the whole weight (tests/workers/fp8._q: scale = 448 / the amax over every
    rank's share, over dp and tp, gathered here as objects; not autopart's all-reduce)."""
    import torch.distributed as dist
    from tests.workers.fp8 import E4, _q
    mine = {n: p for n, p in pm.named_parameters() if n in fp8_names}
    with pm._all_gathered():        # fp32, this rank's tp shard whole
        whole = {n: p.detach().clone() for n, p in mine.items()}
    amaxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(amaxes, {n: float(w.abs().max()) for n, w in whole.items()})
    problems = []
    pm._sharded.gather(list(mine.values()))
    for name, p in mine.items():
        amax = torch.tensor(max(a[name] for a in amaxes if name in a))
        w8, scale = pm._sharded.fp8_weight(p)
        want8, want_scale = _q(whole[name], amax, E4, False)
        if not (torch.equal(scale, want_scale) and torch.equal(w8.view(torch.uint8),
                                                                want8.view(torch.uint8))):
            problems.append(f"{name}: gathered e4m3 weight (scale {float(scale)!r}) is not the "
                            f"recipe's cast of the whole weight (scale {float(want_scale)!r})")
    pm._sharded.release(list(mine.values()))
    return problems


def zero3_equivalence(case: ZCase, rank: int) -> dict:
    """fp8_equivalence of `case` with its all-gathers checked; `broken` breaks the global
    amax (tests/test_fp8_zero3.py shows the comparison then fails)."""
    from autopart.ops import fp8 as fp8_ops
    from autopart.runtime.param_shards import ShardedParameters
    if case.model.startswith("c-"):
        import tests.composition  # noqa: F401  (registers the matrix's models, c-hf-gpt2-...)
    if case.broken != "local-amax":
        return fp8_equivalence(case, rank, watch=gathered_bytes)
    right = ShardedParameters._fp8_scales

    def local(self, lay, indices):
        return {i: fp8_ops.amax_to_scale(lay.store[lay.offsets[i]:lay.offsets[i + 1]].abs()
                                         .amax().float(), fp8_ops.E4M3, False) for i in indices}
    ShardedParameters._fp8_scales = local
    try:
        return fp8_equivalence(case, rank, watch=gathered_bytes)
    finally:
        ShardedParameters._fp8_scales = right


def run_zero3_cases(rank: int, world: int, cases: list) -> list[dict]:
    return run_each(zero3_equivalence, rank, cases)
