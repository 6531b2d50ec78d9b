"""Rehearse a layout before a cluster run: train it and the plain model side by side, compare.

`autopart.verify(...)` (and `autopart verify`, autopart/cli/verify.py) runs the mesh as real
processes, trains `steps` optimizer steps of the compiled layout (`autopart.parallelize`) and of
a deep copy of the plain model taken before parallelize, on the same batch in every rank
process, and compares the loss of every step and every parameter after the last step: each rank
compares the shard it holds (`local_view`: its tensor-parallel slice, its experts) with the same
slice of the plain model's parameter (with `local_batches=True` each rank's train_step is given
only its share of the batch, `pm.local_batch`, as a loader feeding each rank would, while the
plain copy trains on the whole batch). The result is a `VerifyReport`: per parameter group (a
layer, the embeddings, the head, a norm), the largest difference, PASS/FAIL against the stated
tolerance and the first parameter that differs, in the plain model's order.

Tolerances (fp32; `tolerance=(rtol, atol)` overrides): a parallel run sums the same products in
another order (per microbatch, then across microbatches, stages and replicas), so it agrees to
fp32 round-off, not bits. SGD: |parallel - plain| <= 1e-6 + 1e-5 * |plain| (measured max errors
~5e-7 on values up to ~1 in tests/workers/, where a missing microbatch, replica or tied-weight
share is a >= 12% error). Adam: atol 1e-5 for everything, since Adam divides each gradient
element by its own running magnitude, so an element whose gradient is within a few hundred ulps
of zero moves by a visibly different fraction of lr=1e-3 (measured up to 1.6e-6); 1e-5 is still
1% of one Adam step. A non-finite value (NaN, inf) on either side is always a FAIL. bf16 is
refused: its results differ from the fp32 plain model by ~4e-3 relative (docs/memory.md, Mixed
precision), too much for an elementwise check to tell a wrong layout from rounding; the layout is
the same in fp32, so rehearse it in fp32.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.nn as nn

from autopart.errors import AutopartError
from autopart.mesh import Mesh

DEFAULT_TOLERANCE = {"sgd": (1e-5, 1e-6), "adam": (1e-5, 1e-5)}   # (rtol, atol), fp32
LEARNING_RATE = {"sgd": 0.1, "adam": 1e-3}
MAX_WORLD = 8            # ranks run as processes on this machine
SPAWN_TIMEOUT = 600.0    # seconds for the whole spawned run (compile and training, every rank)
PG_TIMEOUT = 120.0       # the default process group's, and parallelize's


# -- the report -----------------------------------------------------------------------------------

@dataclass
class GroupRow:
    """One parameter group (a layer, an embedding, the head, a norm): its largest difference over
    every parameter and rank, and the first parameter (plain model order) that differs."""
    group: str
    parameters: int                  # parameter tensors in the group
    elements: int                    # elements of the plain model's tensors
    max_diff: float                  # largest |parallel - plain| on any rank (inf: non-finite)
    ok: bool
    first_differing: str | None = None
    detail: str | None = None        # what differs in first_differing, on which rank

    @property
    def verdict(self) -> str:
        return "PASS" if self.ok else "FAIL"


@dataclass
class StepLoss:
    step: int
    parallel: float
    plain: float
    diff: float
    ok: bool


@dataclass
class VerifyReport:
    """What `autopart.verify` found. `ok`: every loss and parameter within the tolerance.
    `str(report)` is the table `autopart verify` prints; `to_dict()` its JSON."""
    ok: bool
    mesh: str
    world: int
    steps: int
    optimizer: str
    lr: float
    rtol: float
    atol: float
    losses: list[StepLoss]
    groups: list[GroupRow]
    first_differing: str | None          # the first differing parameter in the plain model
    unused: list[str] = field(default_factory=list)     # no gradient in the plain model; no rank holds it
    problems: list[str] = field(default_factory=list)   # anything else that differs
    notes: list[str] = field(default_factory=list)      # what verify changed (shrink, dropout)
    seconds: float = 0.0
    # local_batches=True: each rank's train_step was given its share of the batch only
    # (pm.local_batch); `fed[r]`: the shapes rank r was given on step 1 (None: it passed None)
    local_batches: bool = False
    fed: list = field(default_factory=list)

    @property
    def max_diff(self) -> float:
        return max([g.max_diff for g in self.groups] + [s.diff for s in self.losses], default=0.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        for g, row in zip(out["groups"], self.groups):
            g["verdict"] = row.verdict
        out["max_diff"] = self.max_diff
        return _json_safe(out)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self, notes: bool = True) -> list[str]:
        out = list(self.notes) if notes else []
        out += [f"tolerance: |parallel - plain| <= {self.atol:g} + {self.rtol:g} * |plain| "
               f"(fp32, {self.optimizer}); non-finite values always fail", ""]
        out.append(f"{'step':>4}  {'loss parallel':>14}  {'loss plain':>14}  {'|diff|':>9}  verdict")
        for s in self.losses:
            out.append(f"{s.step:>4}  {s.parallel:>14.8f}  {s.plain:>14.8f}  {_num(s.diff):>9}  "
                       f"{'PASS' if s.ok else 'FAIL'}")
        out.append("")
        width = max([len("group")] + [len(g.group) for g in self.groups])
        out.append(f"{'group':<{width}}  {'params':>6}  {'elements':>9}  {'max |diff|':>10}  "
                   f"verdict  first differing parameter")
        for g in self.groups:
            first = "" if g.first_differing is None else f"{g.first_differing}: {g.detail}"
            out.append(f"{g.group:<{width}}  {g.parameters:>6}  {g.elements:>9}  "
                       f"{_num(g.max_diff):>10}  {g.verdict:<7}  {first}".rstrip())
        if self.unused:
            out.append(f"not compared (no gradient in the plain model, held by no rank): "
                       f"{', '.join(self.unused)}")
        out += [f"problem: {p}" for p in self.problems]
        out.append("")
        bad = [g.group for g in self.groups if not g.ok]
        bad_steps = [s.step for s in self.losses if not s.ok]
        if self.ok:
            out.append(f"PASS: {self.steps} steps of {self.optimizer} on {self.mesh} "
                       f"match the plain model: {len(self.losses)} losses, "
                       f"{len(self.groups)} parameter groups; largest difference "
                       f"{_num(self.max_diff)} ({self.seconds:.0f} s)")
        else:
            what = []
            if bad_steps:
                what.append(f"loss at step {', '.join(map(str, bad_steps))}")
            if bad:
                what.append(f"{len(bad)} of {len(self.groups)} parameter groups "
                            f"({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
            if self.problems:
                what.append(f"{len(self.problems)} other problem(s)")
            first = f"; first differing parameter: {self.first_differing}" \
                if self.first_differing else ""
            out.append(f"FAIL: the layout {self.mesh} differs from the plain model: "
                       f"{'; '.join(what)}{first}")
        return out


def _num(x: float) -> str:
    return f"{x:.2e}" if math.isfinite(x) else str(x)


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)          # "inf", "nan": JSON has no such numbers
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


# -- grouping and comparing -----------------------------------------------------------------------

def group_of(name: str) -> str:
    """A parameter's group: its name up to the first numbered component (a layer:
    `transformer.h.0`, `model.layers.3`), else its module (`transformer.wte`, `lm_head`,
    `model.norm`)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def local_view(pm, rank: int) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """name, plain tensor -> the part of it `rank` holds: its experts (dim 0 cut in ep equal
    parts, part dp index mod ep), then its tensor-parallel shard (the shard's dim cut section by
    section, the tp index's 1/tp of each). Sliced here by the placement alone (which dim, which
    sections), not by autopart/localize.py, which cut the rank's tensors: a wrong cut there
    must show as a difference, not be repeated on the plain side."""
    plan, mesh = pm.compiled.plan, pm.mesh
    at = mesh.coords(rank)
    cuts = [(plan.ep_shards, mesh.ep, at["dp"] % mesh.ep), (plan.tp_shards, mesh.tp, at["tp"])]

    def view(name: str, tensor: torch.Tensor) -> torch.Tensor:
        for shards, parts, index in cuts:      # experts first, then each expert's tp shard
            if parts > 1 and name in shards:
                tensor = _part_of_sections(tensor, shards[name].dim, shards[name].sections,
                                           parts, index)
        return tensor
    return view


def _part_of_sections(tensor: torch.Tensor, dim: int, sections, parts: int, index: int
                      ) -> torch.Tensor:
    """Rows [start + index * n, start + (index + 1) * n) of `dim` of each section (n = its
    length / parts), joined in order."""
    rows, start = [], 0
    for length in sections:
        if length % parts:
            raise AutopartError(f"a section of {length} along dim {dim} does not divide into "
                                f"{parts} parts")
        n = length // parts
        rows.extend(range(start + index * n, start + (index + 1) * n))
        start += length
    return tensor.index_select(dim, torch.tensor(rows, dtype=torch.long, device=tensor.device))


def held_view(pm, rank: int) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """name, plain tensor -> what `pm.named_parameters()` holds of it between steps: its
    `local_view`, and under zero=3 (docs/memory.md, ZeRO) for a trainable parameter only this
    rank's chunk of that, flattened: padded to a multiple of the replica group's size d and cut
    in d, chunk i for the group's i-th rank (dense parameters: the dp x cp ranks of this one's
    pp and tp; experts: those also holding its experts). Computed here, not read from the
    runtime's layout."""
    view = local_view(pm, rank)
    if pm.zero != 3:
        return view
    mesh, experts = pm.mesh, pm.compiled.plan.ep_shards
    dense = mesh.group("dp", rank)
    same_experts = next((g for g in mesh.ep_replica_groups() if rank in g), dense)
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}

    def held(name: str, tensor: torch.Tensor) -> torch.Tensor:
        local = view(name, tensor)
        if name not in trainable:
            return local
        group = same_experts if name in experts and mesh.ep > 1 else dense
        flat, i = local.reshape(-1), sorted(group).index(rank)
        chunk = -(-flat.numel() // len(group))
        return flat[min(i * chunk, flat.numel()):min((i + 1) * chunk, flat.numel())]
    return held


def compare(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
            ) -> tuple[float, str | None]:
    """(max |actual - expected|, None when within the tolerance else what differs). A non-finite
    element on either side differs (its error is inf)."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    if actual.shape != expected.shape:
        return math.inf, f"shape {tuple(actual.shape)} != plain {tuple(expected.shape)}"
    for side, t in (("parallel", actual), ("plain", expected)):
        bad = ~torch.isfinite(t)
        if bad.any():
            i = int(bad.reshape(-1).nonzero()[0])
            return math.inf, (f"{int(bad.sum())} non-finite elements in the {side} value, first "
                              f"at flat index {i}: {float(t.reshape(-1)[i])!r}")
    if actual.numel() == 0:
        return 0.0, None
    err = (actual - expected).abs()
    bad = err > atol + rtol * expected.abs()
    worst = float(err.max())
    if not bad.any():
        return worst, None
    i = int(err.argmax())
    return worst, (f"{int(bad.sum())} of {err.numel()} elements differ, max {worst:.3g} at "
                   f"flat index {i} ({float(actual.reshape(-1)[i]):.8g} vs plain "
                   f"{float(expected.reshape(-1)[i]):.8g})")


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(b)


def tolerance_for(optimizer: str, tolerance=None) -> tuple[float, float]:
    if optimizer not in DEFAULT_TOLERANCE:
        raise AutopartError(f"optimizer={optimizer!r}: verify trains with 'sgd' (lr 0.1) or "
                            f"'adam' (lr 1e-3)")
    if tolerance is None:
        return DEFAULT_TOLERANCE[optimizer]
    if isinstance(tolerance, (int, float)):
        return float(tolerance), float(tolerance)
    rtol, atol = tolerance
    if not (rtol >= 0 and atol >= 0):
        raise AutopartError(f"tolerance={tolerance!r}: rtol and atol must be >= 0")
    return float(rtol), float(atol)


# -- one rank -------------------------------------------------------------------------------------

def _zero_dropout(model: nn.Module) -> list[str]:
    """Dropout masks are random and drawn differently by each layout: p=0 for the rehearsal."""
    changed = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            changed.append(name)
            m.p = 0.0
    return changed


def _plain_loss(ref: nn.Module, inputs: tuple, loss_fn, target):
    out = ref(*inputs)
    loss = loss_fn(out, target) if loss_fn is not None else out
    if isinstance(loss, tuple):      # (loss, statistics): the model's own convention
        loss = loss[0]
    return loss


def _share(pm, inputs: tuple, target, wrong: bool) -> tuple[tuple, Any]:
    """This rank's share of the global batch (pm.local_batch: its rows, its cp chunks, None
    where it reads nothing). `wrong` (tests only): the share of the global batch with its rows
    rolled by one replica's, i.e. another data-parallel replica's rows, which the comparison
    must catch."""
    if wrong:
        if pm.mesh.dp < 2:
            raise AutopartError("a wrong share (another replica's rows) needs dp >= 2")

        def roll(t):
            return torch.roll(t, pm.batch_shard.local_rows, 0) \
                if isinstance(t, torch.Tensor) and t.dim() else t
        inputs, target = tuple(map(roll, inputs)), roll(target)
    return pm.local_batch(*inputs, target=target)


def _shapes(tensors) -> list:
    return [None if t is None else list(t.shape) for t in tensors]


def verify_rank(model: nn.Module, mesh: Mesh, example_inputs: tuple, *, loss_fn=None,
                target=None, steps: int = 3, optimizer: str = "sgd", tolerance=None,
                timeout: float = PG_TIMEOUT, perturb: str | None = None,
                local_batches: bool = False, wrong_share: int | None = None,
                **parallelize_kwargs) -> dict:
    """This rank's half of verify (inside an initialized process group, on every rank): train
    the layout and the plain model `steps` steps on `example_inputs`; return plain data that
    `merge` turns into the report. `local_batches`: the layout's train_step is given only this
    rank's share of the batch (pm.local_batch), the plain model the whole batch. `perturb`
    (tests only): a plain parameter's name, nudged by 1e-3 in the plain copy before training;
    `wrong_share` (tests only, with local_batches): the rank fed another replica's rows. Either
    way the layout must be reported as differing."""
    import torch.distributed as dist
    from autopart.api import parallelize

    rtol, atol = tolerance_for(optimizer, tolerance)
    rank = dist.get_rank()
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    dropped = _zero_dropout(model)
    ref = copy.deepcopy(model)            # the unmodified model, before parallelize touches it
    ref_params = dict(ref.named_parameters())
    order = [n for n, p in ref_params.items() if p.requires_grad]
    numel = {n: ref_params[n].numel() for n in order}
    if perturb is not None:
        with torch.no_grad():
            ref_params[perturb].add_(1e-3)
    parallelize_kwargs.setdefault("optimizer", optimizer)   # the memory model's optimizer
    # a NaN or inf trains on, as in the plain model, and fails the comparison (with "raise" it
    # would stop the run with an error instead of a FAIL row)
    parallelize_kwargs.setdefault("nonfinite", "ignore")
    pm = parallelize(model, mesh, inputs, loss_fn=loss_fn, target=target,
                     timeout=timedelta(seconds=timeout), **parallelize_kwargs)
    cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
    opt = pm.optimizer(cls, lr=LEARNING_RATE[optimizer])
    ref_opt = cls(ref.parameters(), lr=LEARNING_RATE[optimizer])
    losses, had_grad, fed = [], set(), None
    for _ in range(steps):
        if local_batches:   # local=True: under cp with dp=1 a share has a global batch's shape
            given, given_target = _share(pm, inputs, target, wrong_share == rank)
            fed = fed or _shapes((*given, given_target))
            loss = pm.train_step(*given, target=given_target, local=True)
        else:
            loss = pm.train_step(*inputs, target=target)
        ref_loss = _plain_loss(ref, inputs, loss_fn, target)
        ref_loss.backward()
        losses.append((float(loss.detach()), float(ref_loss.detach())))
        had_grad |= {n for n in order if ref_params[n].grad is not None}
        opt.step(), opt.zero_grad()
        ref_opt.step(), ref_opt.zero_grad()
    mine = held_view(pm, rank)
    params = {}
    for name, p in pm.named_parameters():
        diff, detail = compare(p, mine(name, ref_params[name]), rtol, atol)
        params[name] = (diff, detail)
    return {"rank": rank, "losses": losses, "params": params, "order": order, "numel": numel,
            "had_grad": sorted(had_grad), "dropout": dropped, "fed": fed}


def merge(per_rank: list[dict], *, mesh: Mesh, steps: int, optimizer: str, tolerance=None,
          notes: list[str] | None = None, seconds: float = 0.0) -> VerifyReport:
    """Every rank's `verify_rank` result -> the report."""
    rtol, atol = tolerance_for(optimizer, tolerance)
    first = per_rank[0]
    order, numel = first["order"], first["numel"]
    problems = []
    losses = []
    for step, (par, plain) in enumerate(first["losses"], 1):
        others = {r["losses"][step - 1][0] for r in per_rank}
        if len(others) > 1:
            problems.append(f"step {step}: ranks returned different losses {sorted(others)}")
        losses.append(StepLoss(step, par, plain, abs(par - plain) if math.isfinite(par - plain)
                               else math.inf, _close(par, plain, rtol, atol)))
    # per parameter: worst over the ranks holding it, and the first rank that differs
    worst: dict[str, float] = {}
    failed: dict[str, str] = {}
    for r in sorted(per_rank, key=lambda r: r["rank"]):
        for name, (diff, detail) in r["params"].items():
            worst[name] = max(worst.get(name, 0.0), diff)
            if detail is not None and name not in failed:
                failed[name] = f"rank {r['rank']}: {detail}"
    had_grad = set(first["had_grad"])
    unused = [n for n in order if n not in worst and n not in had_grad]
    for n in order:
        if n not in worst and n in had_grad:
            failed[n] = "no rank holds it, but it has a gradient in the plain model"
            worst[n] = math.inf
    groups: dict[str, GroupRow] = {}
    for n in order:
        if n in unused:
            continue
        g = groups.setdefault(group_of(n), GroupRow(group_of(n), 0, 0, 0.0, True))
        g.parameters += 1
        g.elements += numel[n]
        g.max_diff = max(g.max_diff, worst[n])
        if n in failed and g.ok:
            g.ok, g.first_differing, g.detail = False, n, failed[n]
    first_bad = next((n for n in order if n in failed), None)
    notes, fed = _notes(per_rank, notes)
    local = any(f is not None for f in fed)
    ok = (all(s.ok for s in losses) and all(g.ok for g in groups.values()) and not problems)
    return VerifyReport(ok=ok, mesh=str(mesh), world=mesh.world_size, steps=steps,
                        optimizer=optimizer, lr=LEARNING_RATE[optimizer], rtol=rtol, atol=atol,
                        losses=losses, groups=list(groups.values()), first_differing=first_bad,
                        unused=unused, problems=problems, notes=notes, seconds=seconds,
                        local_batches=local, fed=fed if local else [])


def _notes(per_rank: list[dict], notes: list[str] | None) -> tuple[list[str], list]:
    """The report's notes (the caller's, then what the ranks changed or were fed) and, per rank
    in rank order, the shapes it was fed on step 1 (None everywhere: the global batch)."""
    notes = list(notes or [])
    dropped = per_rank[0].get("dropout") or []
    if dropped:
        notes.append(f"dropout set to 0 in {len(dropped)} module(s) (random masks differ "
                     f"between layouts): {', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}")
    fed = [r.get("fed") for r in sorted(per_rank, key=lambda r: r["rank"])]
    if any(f is not None for f in fed):
        notes.append("local batches: each rank's train_step was given only its share of the "
                     "batch (pm.local_batch), the plain model the whole batch")
    return notes, fed


# -- the Python API -------------------------------------------------------------------------------

def check_mesh(mesh: Mesh) -> None:
    if mesh.world_size > MAX_WORLD:
        raise AutopartError(
            f"mesh {mesh} has {mesh.world_size} ranks; verify runs each rank as a process on "
            f"this machine, at most {MAX_WORLD}: rehearse a smaller mesh with the same axes "
            f"(e.g. smaller dp)")


def _api_rank(rank: int, world: int, build: Callable, mesh: Mesh, inputs, kwargs: dict) -> dict:
    torch.manual_seed(0)
    return verify_rank(build(), mesh, inputs, **kwargs)


def verify(model: nn.Module | Callable[[], nn.Module], mesh: Mesh | str, example_inputs, *,
           loss_fn: Callable | None = None, target: torch.Tensor | None = None, steps: int = 3,
           optimizer: str = "sgd", tolerance: float | tuple[float, float] | None = None,
           timeout: float = SPAWN_TIMEOUT, local_batches: bool = False,
           **parallelize_kwargs) -> VerifyReport:
    """Train the layout `parallelize(model, mesh, ...)` and the plain model `steps` steps on the
    batch `example_inputs` (and `target`), and compare every loss and parameter.

    Two ways to call it:

    - `model` a zero-argument function building the model (module level, so the rank processes
      can import it), with no process group: verify starts `mesh.world_size` local Gloo
      processes (at most 8), each seeds torch with 0 and calls it, and returns the report here.
      The function must build the same model each time (seeded initialisation does).

          report = autopart.verify(build_model, autopart.Mesh(tp=2, pp=2), (tokens,),
                                   loss_fn=lm_loss, target=targets, schedule="zb-v",
                                   microbatches=4)
          print(report); assert report.ok

    - `model` a module, inside an initialized process group of `mesh.world_size` ranks (like
      `parallelize`; each rank calls it with the same model and batch): every rank returns the
      same report. The model is consumed as parallelize consumes it; the plain copy is taken
      first.

    `optimizer`: "sgd" (lr 0.1) or "adam" (lr 1e-3); `tolerance`: (rtol, atol), or one number
    for both, default (1e-5, 1e-6) for sgd and (1e-5, 1e-5) for adam (module docstring: why).
    Other keyword arguments go to `parallelize` (microbatches, schedule, virtual_stages,
    sequence_parallel, recompute, zero, ...). nn.Dropout modules get p=0 on both sides (their
    masks are random); the report's notes say so. `timeout`: seconds for the spawned run.
    `local_batches=True`: each rank's train_step is given only its share of the batch
    (`pm.local_batch(*example_inputs, target=target)`: its rows, its cp chunks, None for what
    it does not read), as a data loader feeding each rank would; the plain model still trains
    on the whole batch, and the comparison is the same (`report.fed`: what each rank was given).
    """
    import torch.distributed as dist

    start = time.perf_counter()
    mesh = Mesh.parse(mesh) if isinstance(mesh, str) else mesh
    if not isinstance(mesh, Mesh):
        raise AutopartError(f"mesh must be an autopart.Mesh or a string like 'tp=2,pp=2', "
                            f"not {type(mesh).__name__}")
    if parallelize_kwargs.get("precision", "fp32") != "fp32":
        raise AutopartError("verify compares with the fp32 plain model elementwise; bf16 differs "
                            "from it by ~4e-3 by design: rehearse the layout with precision='fp32'")
    if steps < 1:
        raise AutopartError(f"steps={steps}: verify trains at least one step")
    tolerance_for(optimizer, tolerance)
    kwargs = dict(loss_fn=loss_fn, target=target, steps=steps, optimizer=optimizer,
                  tolerance=tolerance, local_batches=local_batches, **parallelize_kwargs)
    summary = dict(mesh=mesh, steps=steps, optimizer=optimizer, tolerance=tolerance)
    if dist.is_initialized():
        if not isinstance(model, nn.Module):
            torch.manual_seed(0)
            model = model()
        mine = verify_rank(model, mesh, example_inputs, **kwargs)
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        return merge(per_rank, **summary, seconds=time.perf_counter() - start)
    if isinstance(model, nn.Module):
        raise AutopartError(
            "autopart.verify with a model needs torch.distributed.init_process_group first (each "
            "rank calls it, like parallelize); without a process group pass a zero-argument "
            "module-level function that builds the model, and verify starts the ranks itself")
    if not callable(model):
        raise AutopartError(f"model must be an nn.Module or a function building one, "
                            f"not {type(model).__name__}")
    check_mesh(mesh)
    from autopart.runtime.launch import spawn
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    per_rank = spawn(_api_rank, mesh.world_size, model, mesh, inputs, kwargs, timeout=timeout,
                     pg_timeout=PG_TIMEOUT)
    return merge(per_rank, **summary, seconds=time.perf_counter() - start)
