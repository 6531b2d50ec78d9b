"""Rank functions for tests/test_precision.py: parallelize(..., precision="bf16") against the plain
model trained under the same mixed-precision recipe, written out here from its definition.

The recipe (what precision="bf16" promises): fp32 parameters, which the optimizer steps; each
microbatch's forward under torch.autocast(bf16) with the loss in fp32; backward outside autocast,
so every .grad is fp32 and sums over microbatches in fp32; the loss of the global batch is the mean
of the microbatch losses (weighted by their counted tokens when labels are ignored). The reference cuts the global batch into the microbatches the parallel
run uses (dp replica by replica, microbatch by microbatch), as a mixture-of-experts layer's
capacity and auxiliary loss depend on which tokens share a microbatch.
"""
from __future__ import annotations

import copy
import functools
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.workers.common import Case, _local_view, build, held_view

# Errors are relative, over the whole model: ||parallel - reference|| / ||reference||, the norm over
# every parameter this rank holds: of the step-1 gradients ("grad"), of the parameters' change in
# step 1 ("step1": lr * the reduced gradient, also under ZeRO-1) and over all the steps
# ("update"); and of each step's loss ("loss").
#
# Where the parallel run does exactly the reference's bf16 roundings (data parallel; pipeline,
# with the reference rounding at the cuts as the wire does), only the order of fp32 sums differs:
# "grad" and "step1" within 1e-6 (measured <= 1.4e-8). Expert parallelism runs the experts'
# matmuls on other shapes, which bf16 kernels block differently: 1e-3 (measured 9e-5). Tensor
# parallelism rounds each rank's partial row-parallel product to bf16 before the all-reduce adds
# them, where the reference rounds the sum: 2e-2 (measured 4.0e-3). A bf16 rounding that differs
# anywhere flips later roundings (bf16 has 8 significant bits), so after 3 steps every case's
# "update" differs at the level of one bf16 rounding: 2e-2 (measured <= 4.3e-3). Losses are fp32
# from bf16 logits: 1e-4 (measured <= 2.3e-5). Each case also measures the fp32 plain model
# against the bf16 reference (~4e-3 on "grad" and "step1"): where the bound is 1e-6 or 1e-3 the
# check tells bf16 compute from fp32; for tp, the test checks the dtypes on the wire instead.
#
# compile=True ("compiled"): Inductor's bf16 kernels round at other points than eager's (a fused
# run of ops is rounded once; its attention and matmul epilogues are its own): measured on gpt4
# pp=2 grad 9.3e-4 and 5.1e-4, loss 6.7e-6; on HF GPT-2 (gelu_new: eight pointwise ops eager
# rounds one by one) step1 3.8e-3 at zb-v dp=2 zero=2, where torch.compile of the plain model
# alone differs from eager bf16 by 3.2e-3 (one process, no autopart: /tmp-free repro in
# docs/composition.md). 1e-2: like "tp" it cannot tell bf16 from fp32, so the tests check the
# dtypes on the wire, and that artifacts ran, instead.
#
# HF Mixtral in bf16 (composition matrix): even at pp=2 1F1B without ep its gradients differ from
# the recipe by 2.3e-3-3.9e-3 (about half the fp32 gap; measured, cause not found: its router
# runs in fp32 and top-2 choices can flip on one rounding). "moe": 1e-2, which like "tp" and
# "compiled" cannot tell bf16 from fp32; it still catches a missing microbatch or replica.
BOUNDS = {"none": 1e-6, "kernels": 1e-3, "tp": 2e-2, "compiled": 1e-2,      # "grad", "step1"
          "moe": 1e-2,
          # context parallelism's attention takes the bf16 q, k, v and computes scores, softmax
          # and the merge in fp32 where the recipe's SDPA runs in bf16: measured 0.003-0.005
          # from the recipe, beside the recipe's own 0.004-0.006 from fp32
          "cp": 2e-2}
UPDATE_BOUND, LOSS_BOUND = 2e-2, 1e-4

# The loose classes (PER_PARAMETER) also bound each parameter's error alone: a bound on the whole
# model lets any small gradient go (on the tied GPT 24 of 52 gradients each hold under 1% of the
# norm, every LayerNorm among them: zeroed or doubled, the whole model moves < 1e-2). The bounds
# are set from how far two equally valid bf16 recipes differ per parameter, measured in plain
# torch (tests/workers/recipe_noise.py: the recipe against itself with the bf16 pipeline cut
# rounding, other microbatches, split-K matmuls as tp's, fp32 attention as cp's, torch.compile;
# the matrix's models, labels all at 2 rows a microbatch and ignored at 1). The largest over the
# parameters, step-1 gradient / change over 3 steps:
#   example GPT (tied)   cut 8.4e-3 / 1.8e-2, chunks 4.2e-3 / 1.7e-2, splitk 7.0e-3 / 1.8e-2,
#                        fp32attn 6.8e-3 / 2.0e-2, compiled 2.1e-3 / 1.1e-2
#   HF GPT-2 (tied)      cut 5.9e-3 / 6.5e-3, chunks 2.7e-3 / 4.7e-3, splitk 5.5e-3 / 7.3e-3,
#                        fp32attn 5.3e-3 / 7.2e-3, compiled 7.8e-3 / 9.8e-3
#   HF Mixtral (untied)  cut 0.18 / 0.084, chunks 2.8e-3 / 0.058, splitk 0.17 / 0.081,
#                        fp32attn 0.24 / 0.11 (a top-2 choice flipped by one rounding moves the
#                        router's gradient, and the experts' and norms' behind it)
# Dense models: 4e-2 / 8e-2, about 4x the largest (4.8x / 4x); a parameter's gradient zeroed or
# doubled is 1.0. Routed (Mixtral): 0.6 / 0.3 (2.5x / 2.7x), still well below 1.0. The matrix's
# bf16 runs, largest per parameter over the ranks (step-1 gradient / update), HF GPT-2: tp=2
# compiled 1.2e-2 / 2.7e-2, zb-v compiled zero=2 1.1e-2 / 9.3e-3, tp=2 dp=2 zero=1 1.1e-2 /
# 2.4e-2, cp=2 dp=2 zero=2 1.4e-2 / 2.0e-2; example GPT dualpipe-v compiled zero=1 3.0e-3 /
# 1.2e-2 (Mixtral's two not run: every Mixtral case fails at capture since commit 729477f).
#
# The fp32 plain model is as far from the bf16 recipe per parameter (GPT 7.5e-3-8.0e-3, GPT-2
# 8.5e-3, Mixtral 0.17-0.20) as another bf16 recipe is, so no bound on the distance to the recipe
# tells bf16 from fp32 in the loose classes. What does: the run's distance from the fp32 plain
# model over the whole model (FP32_APART; the runs above measured 3.3e-3 or more, an fp32 run
# is at fp32 round-off, 1e-6), and the wire (bf16 on every pipeline transfer: equivalence.py).
PER_PARAMETER = ("tp", "compiled", "moe", "cp")
PARAM_BOUNDS = {"dense": {"grad": 4e-2, "step1": 4e-2, "update": 8e-2},
                "routed": {"grad": 0.6, "step1": 0.6, "update": 0.3}}
FP32_APART = 1e-3     # "grad", whole model: 3x below bf16's distance, 1000x above fp32's


@dataclass(frozen=True)
class BCase(Case):
    """A bf16 equivalence case; `zero` = 1 runs the ZeRO-1 distributed optimizer."""
    zero: int = 0
    clip: float | None = None
    round_cuts: bool = True     # the reference rounds at the pipeline cuts (False: to measure it)
    noise: str = "none"         # which BOUNDS: none | kernels (ep) | tp | compiled | moe | cp
    compile: bool = False       # parallelize(compile=True): the chunks run through Inductor
    precision: str = "bf16"     # what the wire must show (tests/workers/equivalence.py)
    routed: bool = False        # the model routes tokens to experts: PARAM_BOUNDS["routed"]


def reference_step(model, inputs: tuple, target, loss_fn, microbatch: int, device_type: str):
    """One step of the recipe on the plain model over the global batch; returns its loss: the
    mean of the microbatch losses or, with labels ignored (-100) in a cross-entropy target, each
    microbatch's token mean weighted by its counted tokens (the global token mean, as
    passes/weigh_loss_by_tokens.py makes the parallel run's)."""
    n = inputs[0].shape[0] // microbatch
    parts = [slice(i * microbatch, (i + 1) * microbatch) for i in range(n)]
    weights = [1.0 / n] * n
    if target is not None and bool((target == -100).any()):
        counts = [int((target[rows] != -100).sum()) for rows in parts]
        weights = [c / sum(counts) for c in counts]
    total = torch.zeros(())
    for rows, weight in zip(parts, weights):
        if weight == 0:
            continue          # no counted token: it adds nothing (its own mean is 0/0)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = model(*(t[rows] for t in inputs))
            loss = loss_fn(out, target[rows]) if loss_fn is not None else out
        assert loss.dtype == torch.float32, loss.dtype     # autocast keeps the loss in fp32
        (loss * weight).backward()
        total += loss.detach().float() * weight
    return total


class _WireRound(torch.autograd.Function):
    """x rounded to bf16 and back, and its gradient likewise: a pipeline transfer in bf16."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype)


def round_at_pipeline_cuts(model, plan) -> int:
    """Round the hidden state entering each chunk that another pipeline rank feeds, as the bf16
    wire does (the cut is the plan's; the rounding is this file's). Returns the cuts hooked."""
    cuts = [layers[0] for c, layers in enumerate(plan.chunk_layers)
            if c > 0 and plan.chunk_ranks[c] != plan.chunk_ranks[c - 1]]
    for name in cuts:
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args: (_WireRound.apply(args[0]), *args[1:]))
    return len(cuts)


def fp32_step(model, inputs, target, loss_fn):
    out = model(*inputs)
    loss = loss_fn(out, target) if loss_fn is not None else out
    loss.backward()
    return loss.detach()


class Wire:
    """Records the dtype and size of every tensor a collective or a pipeline transfer carries
    (torch.distributed's functions, the two the tp ops bound at import, and, once `attach`ed,
    the gradient reducer's all-reduce, which it bound at construction). Names: isend, irecv
    (pipeline and cp ring), all_reduce, all_gather, reduce_scatter (tp), all_to_all (ep),
    grad_all_reduce and grad_reduce_scatter (data-parallel gradients: dp and ZeRO)."""

    def __init__(self):
        self.seen: list[tuple[str, torch.dtype, int]] = []
        self._saved = []

    def __enter__(self):
        from autopart.ops import tp
        for module, name, as_ in [(dist, n, n) for n in ("batch_isend_irecv", "all_reduce")] + \
                [(dist, "all_to_all_single", "all_to_all"),
                 (tp, "_all_gather_into", "all_gather"), (tp, "_reduce_scatter_into",
                                                          "reduce_scatter"),
                 (dist, "reduce_scatter_tensor", "grad_reduce_scatter")]:   # ZeRO's gradients
            self._patch(module, name, as_)
        return self

    def attach(self, pm) -> None:
        """Record pm's gradient reducer too (its all-reduce is an attribute bound at its
        construction, which a patch of torch.distributed does not reach)."""
        self._patch(pm._grads, "all_reduce", "grad_all_reduce")

    def _patch(self, owner, name: str, as_: str) -> None:
        fn = getattr(owner, name)
        self._saved.append((owner, name, fn))
        setattr(owner, name, self._wrap(as_, fn))

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def _wrap(self, name, fn):
        @functools.wraps(fn)    # keeps keeps_nccl_contract: the runtime lowers by that attribute
        def recorded(*args, **kwargs):
            if name == "batch_isend_irecv":
                self.seen += [(op.op.__name__, op.tensor.dtype, op.tensor.numel())
                              for op in args[0]]
            else:   # the input: an all-reduce's only tensor, the others' second
                t = args[0] if name.endswith("all_reduce") else args[1]
                self.seen.append((name, t.dtype, t.numel()))
            return fn(*args, **kwargs)
        return recorded

    def dtypes(self, kind: str) -> dict:
        """dtype -> {numel: how many tensors of that size} carried by `kind` calls."""
        out: dict = {}
        for n, d, numel in self.seen:
            if n == kind:
                sizes = out.setdefault(str(d).replace("torch.", ""), {})
                sizes[numel] = sizes.get(numel, 0) + 1
        return out

    def report(self) -> dict:
        """{kind: dtypes(kind)} for every kind recorded (what a rank result's "wire" holds)."""
        return {k: self.dtypes(k) for k in WIRE_KINDS}


WIRE_KINDS = ("isend", "irecv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
              "grad_all_reduce", "grad_reduce_scatter")


def bf16_equivalence(case: BCase, rank: int) -> dict:
    """Train `case` for case.steps SGD steps in bf16, parallel and plain; the relative errors
    (over the whole model, and per parameter), the fp32-vs-bf16 gaps, the dtypes on the wire,
    Inductor's report, and problems (none: within BOUNDS and PARAM_BOUNDS)."""
    import autopart
    from tests.workers.equivalence import held_grads, zero_replica

    start = time.perf_counter()
    model, loss_fn, inputs, target = build(case)
    ref, ref32 = copy.deepcopy(model), copy.deepcopy(model)
    mesh = autopart.Mesh(pp=case.pp, dp=case.dp, tp=case.tp, ep=case.ep,
                         cp=getattr(case, "cp", 1))
    pm = autopart.parallelize(model, mesh, inputs, loss_fn=loss_fn, target=target,
                              microbatches=case.microbatches, schedule=case.schedule,
                              virtual_stages=case.virtual_stages, zero=case.zero,
                              sequence_parallel=case.sequence_parallel,
                              precision="bf16", timeout=timedelta(seconds=120),
                              compile=case.compile,
                              recompute=getattr(case, "recompute", "none"))
    opts = [pm.optimizer(torch.optim.SGD, lr=0.1)] + \
        [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ref32)]
    mbs = case.batch // (case.dp * case.microbatches)
    if case.round_cuts:
        round_at_pipeline_cuts(ref, pm.compiled.plan)
    # what pm.named_parameters() holds of a plain tensor (zero=3: this rank's 1-D slice)
    mine, local = held_view(pm, rank), _local_view(pm, rank)
    ours = dict(pm.named_parameters())
    theirs, theirs32 = dict(ref.named_parameters()), dict(ref32.named_parameters())
    first = {n: p.detach().clone() for n, p in ours.items()}

    def moved(params: dict) -> dict:     # each parameter's change since the start, as held
        return {n: (p if params is ours else mine(n, params[n])).detach() - first[n]
                for n, p in ours.items()}
    problems: list[str] = []
    found: dict = {"errors": {}, "gap": {}, "apart": {}, "by_param": {}}
    errors, gap = found["errors"], found["gap"]
    wire = Wire()
    for step in range(1, case.steps + 1):
        with wire:
            wire.attach(pm)
            loss = pm.train_step(*inputs, target=target)
        ref_loss = reference_step(ref, inputs, target, loss_fn, mbs, "cpu")
        loss32 = fp32_step(ref32, inputs, target, loss_fn)
        if loss.dtype != torch.float32:
            problems.append(f"step {step} loss dtype {loss.dtype}, not fp32")
        errors["loss"] = max(errors.get("loss", 0.0), _rel([loss], [ref_loss]))
        gap["loss"] = max(gap.get("loss", 0.0), _rel([loss32], [ref_loss]))
        bad = [n for n, p in ours.items() if p.grad is not None and p.grad.dtype != torch.float32]
        if bad:
            problems.append(f"step {step}: .grad not fp32 for {bad}")
        if step == 1:    # at every zero level: the elements of each gradient this rank holds
            replica = zero_replica(pm, rank)
            got, want = held_grads(pm, local, theirs, replica)
            _measure("grad", got, want, held_grads(pm, local, theirs32, replica)[1], found)
        for o in opts:
            o.step(), o.zero_grad()
        if step == 1:
            _measure("step1", moved(ours), moved(theirs), moved(theirs32), found)
    _measure("update", moved(ours), moved(theirs), moved(theirs32), found)
    not_fp32 = [n for n, p in ours.items() if p.dtype != torch.float32]
    if not_fp32:
        problems.append(f"parameters {not_fp32} are not fp32: the master weights must stay fp32")
    problems += bound_problems(case.noise, found, getattr(case, "routed", False))
    return {"case": case.name, "rank": rank, "problems": problems, **found,
            "wire": wire.report(), "seconds": time.perf_counter() - start,
            "inductor": _inductor_report(pm)}


def _measure(what: str, ours: dict, ref: dict, ref32: dict, found: dict) -> None:
    """Into `found`: errors[what] (ours against the recipe) and gap[what] (the fp32 plain model
    against the recipe) over the whole model, apart[what] (ours against the fp32 plain model)
    and by_param[what] ({name: ours' relative error} for each parameter)."""
    order = list(ref)
    found["errors"][what] = _rel([ours[n] for n in order], [ref[n] for n in order])
    found["gap"][what] = _rel([ref32[n] for n in order], [ref[n] for n in order])
    found["apart"][what] = _rel([ours[n] for n in order], [ref32[n] for n in order])
    found["by_param"][what] = per_parameter(ours, ref)


def per_parameter(actual: dict, expected: dict) -> dict[str, float]:
    """{name: ||actual - expected|| / ||expected||} for each tensor in `expected` (inf where
    either holds a non-finite element)."""
    return {n: _rel([actual[n]], [e]) for n, e in expected.items()}


def bound_problems(noise: str, found: dict, routed: bool = False) -> list[str]:
    """`found` (_measure's) against the case's noise class: the whole model's errors against
    BOUNDS and, in the loose classes, each parameter's against PARAM_BOUNDS; the guards that
    bf16 ran (the run is FP32_APART from the fp32 plain model) and, where the bounds are
    tight, that they can tell bf16 from fp32."""
    errors, gap = found["errors"], found["gap"]
    bounds = {"grad": BOUNDS[noise], "step1": BOUNDS[noise], "update": UPDATE_BOUND,
              "loss": LOSS_BOUND}
    problems = [f"{what}: relative error {err:.3g} > {bounds[what]} (fp32 vs bf16 plain: "
                f"{gap[what]:.3g})" for what, err in errors.items() if not err <= bounds[what]]
    if noise in PER_PARAMETER:
        per = PARAM_BOUNDS["routed" if routed else "dense"]
        for what, errs in found["by_param"].items():
            problems += [f"{what} of {n}: relative error {e:.3g} > {per[what]} (this parameter "
                         "alone)" for n, e in errs.items() if not e <= per[what]]
    elif not gap["step1"] > 10 * bounds["step1"]:
        problems.append(f"test setup: fp32 differs from the bf16 reference by {gap['step1']:.3g}, "
                        f"not > 10x the bound {bounds['step1']}: the check cannot tell them apart")
    if not found["apart"]["grad"] > FP32_APART:
        problems.append(f"the step-1 gradients are {found['apart']['grad']:.3g} from the fp32 "
                        f"plain model's, not > {FP32_APART}: the run did not compute in bf16")
    return problems


def _inductor_report(pm) -> dict | None:
    """compile=True: what Inductor made on this rank (segments, artifacts, eager fallbacks)."""
    if pm.inductor is None:
        return None
    report = pm.inductor.report
    return {"segments": report.segments, "artifacts": report.artifacts,
            "fallbacks": dict(report.fallbacks)}


def _rel(actual: list, expected: list) -> float:
    """||actual - expected|| / ||expected||, the norms over all the tensors together; inf when any
    element of either is NaN or inf (a NaN error would pass `err <= bound` checks' callers that
    take max(previous, err), which drops a NaN)."""
    if not all(bool(torch.isfinite(t.detach()).all()) for t in [*actual, *expected]):
        return float("inf")
    num = sum(float((a.detach().double() - e.detach().double()).pow(2).sum())
              for a, e in zip(actual, expected))
    den = sum(float(e.detach().double().pow(2).sum()) for e in expected)
    return (num / max(den, 1e-30)) ** 0.5


def run_bf16_cases(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: every case in turn; a case that raises is recorded, later ones skipped."""
    return run_each(bf16_equivalence, rank, cases)


def run_each(equivalence, rank: int, cases: list) -> list[dict]:
    """equivalence(case, rank) of every case in turn; a case that raises is recorded, later
    ones skipped."""
    out = []
    for i, case in enumerate(cases):
        try:
            out.append(equivalence(case, rank))
        except Exception:  # noqa: BLE001  (reported by the test process, per case)
            out.append({"case": case.name, "rank": rank,
                        "problems": [f"raised on rank {rank}:\n{traceback.format_exc()}"]})
            out += [{"case": c.name, "rank": rank, "problems": ["not run: an earlier case failed"]}
                    for c in cases[i + 1:]]
            break
    return out
