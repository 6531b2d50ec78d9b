"""`python -m autopart.smoke [--dry-run] [--json]`: a GPU machine's check of autopart, one command.

Each step is one row of one table (step, status, seconds, key figure, note); a status is "pass",
"fail" or "skip" (the note says why: nothing that could be tested ran):

  cuda tests        the repository's tests that skip without CUDA (a skipif whose reason names
                    CUDA), run by pytest in a subprocess; a checkout only (a wheel has no tests/);
                    skipped when every selected test skipped or none was selected
  train bf16 zero=1 a tiny GPT (defined here: examples/ is not installed with the package) on 2
                    ranks (dp=2 over NCCL, 2 GPUs), precision="bf16", zero=1, 2 microbatches, 4
                    AdamW steps: each loss against the plain model's under autocast, and each
                    rank's AdamW moments against its share (1/2 of the plain optimizer's)
  save / resume     on one GPU, world 1, bf16: 4 AdamW steps against the plain model, pm.save
                    after step 2; a fresh model and optimizer pm.load it and train steps 3 and 4:
                    their losses equal the uninterrupted run's (step 4 on a GPU within 2e-3: its
                    gradients may be summed in another order)
  compile=True      fp32, 2 microbatches, 4 SGD steps against the plain model eager: every loss
  compile=cudagraphs  and parameter; "cudagraphs" (step 1 warms up, 2 records, 3-4 replay) also
                    counts the CUDA graphs captured and replayed: none replayed fails the row
  fp8               world 1, precision="fp8" (tensorwise, every linear: fp8_linears="all"), 2
                    microbatches, 4 AdamW steps: the FP8 GEMMs ran (aten._scaled_mm calls counted;
                    on a GPU, CUDA's FP8 kernel) and each loss is within FP8's band
                    of the plain model's under bf16 autocast (docs/precision.md's recipe tests hold
                    the numerics exactly; this row checks the GPU runs them)
  meta model        the tiny GPT built on the meta device, parallelized (allocated on the rank's
                    device), filled by load_pretrained from the plain model's safetensors file,
                    2 SGD steps in fp32: every loss and parameter against the plain model
  pp=2 1f1b         with 2+ GPUs, 2 ranks over NCCL, fp32, SGD, 2 steps: every loss and every
  tp=2              parameter after against the plain model

The 2-rank rows are skipped on fewer than 2 GPUs (NCCL refuses two ranks on one GPU); a row of
a spawn fails when any rank's check failed. A comparison passes only on a number within its
bound: a NaN error fails (`worst`).

--dry-run (a CPU machine, CI): the same steps on the CPU over Gloo, 2 CPU ranks for the 2-rank
steps; compile="cudagraphs" and the CUDA tests are skipped there (no CUDA: Inductor would run
its CPU code and capture no graph; the CUDA tests all skip).

Exit status 0 when no row failed, 1 otherwise. Also a pytest plugin (`-p autopart.smoke`):
with AUTOPART_SMOKE_CUDA_TESTS=1 it keeps only the tests that need CUDA.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

_CUDA_TESTS = "AUTOPART_SMOKE_CUDA_TESTS"
_VOCAB, _SEQ, _BATCH = 64, 16, 4
_BF16_TOL = 2e-2    # a loss of ~4 computed in bf16 against the plain model's: roundings differ
_FP8_TOL = 1e-2     # the same loss with the linears' operands in e4m3 (3 mantissa bits) and their
                    # gradients in e5m2: 7.3e-4 measured on the CPU (bf16 alone: 5.9e-5), so 14x
                    # room for a GPU's other summation order, and far below a wrong GEMM's error


# -- the tiny GPT (nanoGPT's shape: tied embedding, pre-norm blocks) -----------------------------

class _Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), _Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token embedding (tied with the output), position embedding, `layers` blocks, a norm."""

    def __init__(self, layers: int = 2, width: int = 32, heads: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(_VOCAB, width), nn.Embedding(_SEQ, width)
        self.blocks = nn.ModuleList([_Block(width, heads) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, _VOCAB, bias=False)
        self.head.weight = self.tok.weight
        for emb in (self.tok, self.pos):     # GPT-2's init: the first loss near ln(vocab)
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _gpt(device, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT().to(device)


def _batch(step: int, device):
    g = torch.Generator().manual_seed(100 + step)
    x, y = (torch.randint(0, _VOCAB, (_BATCH, _SEQ), generator=g) for _ in range(2))
    return x.to(device), y.to(device)


# -- rows ---------------------------------------------------------------------------------------

def _row(name: str, status: str, seconds: float = 0.0, figure: str = "", note: str = "") -> dict:
    return {"name": name, "status": status, "seconds": round(seconds, 1), "figure": figure,
            "note": note}


def _check(rows: list, name: str, note: str, fn) -> None:
    """Run `fn` (returns (passed, figure)) as the row `name`; an exception fails the row."""
    start = time.perf_counter()
    try:
        passed, figure = fn()
        status = "pass" if passed is True else "fail"
    except Exception as e:   # noqa: BLE001 -- the row says what failed; the next step still runs
        status, figure = "fail", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        traceback.print_exc(file=sys.stderr)
    rows.append(_row(name, status, time.perf_counter() - start, figure, note))


def worst(errors) -> float:
    """The largest of `errors`, NaN if any is NaN. Python's max keeps what it holds when the
    next value is a NaN (`nan > x` is False), so max(1e-6, nan) is 1e-6 and a NaN error would
    pass; a NaN here fails every `err <= bound` below."""
    errs = [float(e) for e in errors]
    return math.nan if any(math.isnan(e) for e in errs) else max(errs, default=0.0)


def _max_diff(a, b) -> float:
    return worst(abs(x - y) for x, y in zip(a, b, strict=True))


# -- world 1: resume, compile, meta -------------------------------------------------------------

def _train(device, steps: int, mesh=None, zero: int = 0, save: str | None = None,
           load: str | None = None, first: int = 0, precision: str = "bf16", **options):
    """(losses, optimizer) of train_steps first.. of the tiny GPT (bf16, 2 microbatches, AdamW);
    `save`: a checkpoint after step 2; `load`: start from one (a model of another seed)."""
    import autopart
    x, y = _batch(first, device)
    pm = autopart.parallelize(_gpt(device, seed=1 if load else 0), mesh or autopart.Mesh(pp=1),
                              (x,), loss_fn=lm_loss, target=y, microbatches=2,
                              precision=precision, zero=zero, **options)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    if load:
        pm.load(load, optimizer=opt)
    losses = []
    for step in range(first, first + steps):
        if save and step == 2:
            pm.save(save, optimizer=opt)
        x, y = _batch(step, device)
        losses.append(float(pm.train_step(x, target=y)))
        opt.step()
        opt.zero_grad()
    return losses, opt


def _plain(device, steps: int) -> list[float]:
    """The plain model's losses under the bf16 recipe (forward in autocast, fp32 weights)."""
    model = _gpt(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = _batch(step, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses


def _resume(device, workdir: str) -> tuple[bool, str]:
    """The uninterrupted run against the plain model, then steps 3 and 4 after pm.load against
    it. Step 3 reads only the loaded state: the same loss. Step 4 also reads step 3's
    gradients, which a GPU may sum in another order (atomics in attention's backward), and a
    bf16 rounding can then flip: 2e-3 there, exact on the CPU."""
    path = os.path.join(workdir, "ckpt")
    whole, _ = _train(device, 4, save=path)
    d = _max_diff(whole, _plain(device, 4))
    resumed, _ = _train(device, 2, load=path, first=2)
    d3, d4 = (abs(a - b) for a, b in zip(resumed, whole[2:], strict=True))
    return (d <= _BF16_TOL and d3 <= 1e-5 and d4 <= (1e-5 if device.type == "cpu" else 2e-3),
            f"4 losses {whole[0]:.3f}..{whole[-1]:.3f}, max |diff| vs plain {d:.1e}; after "
            f"load: step 3 |diff| {d3:.1e}, step 4 {d4:.1e} vs uninterrupted")


class ScaledMatmuls(TorchDispatchMode):
    """Counts aten._scaled_mm calls (the FP8 GEMMs), forward and backward."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten._scaled_mm.default
        return func(*args, **(kwargs or {}))


def _fp8(device, precision: str = "fp8") -> tuple[bool, str]:
    """4 AdamW steps under `precision` (the row: "fp8", every linear as an FP8 GEMM) against the
    plain model under bf16 autocast: FP8 GEMMs must have run, and each loss stay within
    _FP8_TOL of the plain model's."""
    with ScaledMatmuls() as gemms:
        losses, _ = _train(device, 4, precision=precision,
                           **({"fp8_linears": "all"} if precision == "fp8" else {}))
    d = _max_diff(losses, _plain(device, 4))
    return (d <= _FP8_TOL and gemms.calls > 0,
            f"{gemms.calls} FP8 GEMMs (parallelize and 4 steps); 4 losses {losses[0]:.3f}..{losses[-1]:.3f}, max "
            f"|diff| vs plain bf16 {d:.1e} (bound {_FP8_TOL:.0e})")


class GraphCounts:
    """The CUDA graphs captured and replayed in each step (torch.cuda.CUDAGraph's capture_end
    and replay, which Inductor's CUDA graph trees call): compile="cudagraphs" falling back to
    launching its kernels one by one (a CPU tensor, an input it cannot make static) would
    still match the plain model, so the row also needs replays after the recording step."""

    def __init__(self):
        self.step, self.captured, self.replayed = 0, {}, {}

    def at(self, step: int) -> None:
        self.step = step

    def __enter__(self):
        graph = torch.cuda.CUDAGraph
        self.saved = graph.capture_end, graph.replay

        def counted(real, per_step):
            def call(g, *args, **kwargs):
                per_step[self.step] = per_step.get(self.step, 0) + 1
                return real(g, *args, **kwargs)
            return call
        graph.capture_end = counted(self.saved[0], self.captured)
        graph.replay = counted(self.saved[1], self.replayed)
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.capture_end, torch.cuda.CUDAGraph.replay = self.saved


def _compiled(device, mode) -> tuple[bool, str]:
    """compile=`mode` against the plain model eager, in fp32 (both sides round alike but for
    Inductor's fused and reordered reductions: _steps_against_plain's bound; bf16 would hide a
    bug under its roundings). 4 steps: with "cudagraphs" step 1 warms up, 2 records, 3-4 replay,
    and at least one replay in steps 3-4 is required."""
    import autopart
    if mode != "cudagraphs":
        return _equivalence(device, autopart.Mesh(pp=1), steps=4, compile=mode)
    with GraphCounts() as graphs:
        ok, figure = _equivalence(device, autopart.Mesh(pp=1), steps=4, compile=mode,
                                  before_step=graphs.at)
    captured = sum(graphs.captured.values())
    replayed = graphs.replayed.get(2, 0) + graphs.replayed.get(3, 0)
    return (ok and captured > 0 and replayed > 0,
            f"CUDA graphs: {captured} captured, {replayed} replayed in steps 3-4; {figure}")


def single_gpu(rank: int, world: int, dry: bool, workdir: str, names: list) -> list[dict]:
    """The world-1 rows in `names` (spawned: one rank, NCCL on cuda:0, or Gloo on the CPU with
    --dry-run)."""
    from autopart.runtime.launch import rank_device
    device = rank_device()
    where = "dry-run: cpu/gloo" if dry else f"{torch.cuda.get_device_name(device)}, nccl"
    steps = {"save / resume": (f"{where}, world 1", lambda: _resume(device, workdir)),
             "compile=True": (where, lambda: _compiled(device, True)),
             "fp8": (f"{where}, tensorwise", lambda: _fp8(device)),
             "compile=cudagraphs": (where, lambda: _compiled(device, "cudagraphs")),
             "meta model": (where, lambda: _meta_model(
                 device, os.path.join(workdir, "plain.safetensors")))}
    rows: list = []
    for name in names:
        _check(rows, name, *steps[name])
    return rows


def _meta_model(device, path: str) -> tuple[bool, str]:
    """A model built on the meta device, parallelized (its tensors allocated on this rank's
    device, unfilled), filled by load_pretrained from the plain model's safetensors file, then
    2 SGD steps in fp32: every loss and parameter against the plain model's."""
    import autopart
    from safetensors.torch import save_file
    plain = _gpt(device)
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()
               if k != "head.weight"}, path)           # tied to tok.weight: saved once
    with autopart.meta_device():
        model = TinyGPT()
    x, y = _batch(0, device)
    pm = autopart.parallelize(model, autopart.Mesh(pp=1), (x,), loss_fn=lm_loss, target=y)
    pm.load_pretrained(path)
    held = {str(p.device) for p in pm.parameters()}
    return _steps_against_plain(pm, plain, device, 2, f"parameters on {', '.join(sorted(held))}; ")


# -- world 2: ZeRO-1, pipeline and tensor parallel against the plain model ----------------------

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero(device, world: int) -> tuple[bool, str]:
    """dp=`world`, zero=1, bf16: the losses against the plain model's under autocast, and the
    AdamW moments each rank holds against its share, computed from the plain model's
    parameters: runtime/optimizer.py cuts every parameter into `world` chunks, a rank's slice
    its chunk of each, so a rank holds at most sum(ceil(n / world)) elements of each moment,
    fewer than the plain optimizer's sum(n), and the ranks together hold every element."""
    import autopart
    import torch.distributed as dist
    losses, opt = _train(device, 4, mesh=autopart.Mesh(dp=world), zero=1)
    d = _max_diff(losses, _plain(device, 4))
    sizes = [p.numel() for p in _gpt("cpu").parameters()]    # the tied head counted once
    total, share = sum(sizes), sum(math.ceil(n / world) for n in sizes)
    mine = torch.tensor([sum(st[k].numel() for st in opt.state.values() if k in st)
                         for k in _MOMENTS], device=device)
    held = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(held, mine)
    held = [h.tolist() for h in held]
    shared = all(0 < n <= share and n < total for h in held for n in h)
    whole = all(sum(h[i] for h in held) >= total for i in range(len(_MOMENTS)))
    return (d <= _BF16_TOL and shared and whole,
            f"4 losses, max |diff| vs plain {d:.1e}; AdamW moments per rank "
            f"{'/'.join(str(h[0]) for h in held)} of {total} (share <= {share})")


def _equivalence(device, mesh, steps: int = 2, before_step=None, **options) -> tuple[bool, str]:
    import autopart
    model = _gpt(device)
    plain = copy.deepcopy(model)
    x, y = _batch(0, device)
    pm = autopart.parallelize(model, mesh, (x,), loss_fn=lm_loss, target=y, microbatches=2,
                              **options)
    return _steps_against_plain(pm, plain, device, steps, before_step=before_step)


def _steps_against_plain(pm, plain, device, steps: int, prefix: str = "",
                         before_step=None) -> tuple[bool, str]:
    """`steps` SGD steps of `pm` and of the plain model on the same batches (fp32): every loss,
    then every parameter after, compared. The bound: fp32 on both sides, so only the order of
    sums differs (a few ulps per op, ~1e-7 of a loss near 4.2); 1e-5 on the CPU, 1e-4 on a GPU
    (whose kernels, Inductor's too, may sum in another order or with atomics)."""
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    ours, refs = [], []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        x, y = _batch(step, device)
        ours.append(float(pm.train_step(x, target=y)))
        ref = lm_loss(plain(x), y)
        ref.backward()
        refs.append(float(ref.detach()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full, state = pm.full_state_dict(), plain.state_dict()
    pdiff = worst((full[k].to(device) - v).abs().max() for k, v in state.items() if k in full)
    ldiff = _max_diff(ours, refs)
    tol = 1e-5 if device.type == "cpu" else 1e-4
    return (ldiff <= tol and pdiff <= tol and set(full) == set(state),
            f"{prefix}{steps} steps: loss |diff| {ldiff:.1e}, parameters |diff| {pdiff:.1e}")


def two_gpus(rank: int, world: int, dry: bool) -> list[dict]:
    import autopart
    from autopart.runtime.launch import rank_device
    device = rank_device()
    where = "dry-run: 2 cpu ranks/gloo" if dry else "2 GPUs, nccl"
    rows: list = []
    _check(rows, "train bf16 zero=1", f"{where}, dp=2", lambda: _zero(device, world))
    _check(rows, "pp=2 1f1b", f"{where}, fp32", lambda: _equivalence(device, autopart.Mesh(pp=2),
                                                                   schedule="1f1b"))
    _check(rows, "tp=2", f"{where}, fp32", lambda: _equivalence(device, autopart.Mesh(tp=2)))
    return rows


# -- the CUDA tests -----------------------------------------------------------------------------

def pytest_collection_modifyitems(config, items):
    """With AUTOPART_SMOKE_CUDA_TESTS=1: only the tests a skipif keeps off machines without CUDA."""
    if os.environ.get(_CUDA_TESTS) != "1":
        return
    keep = [i for i in items if any("CUDA" in str(m.kwargs.get("reason", ""))
                                    for m in i.iter_markers("skipif"))]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def cuda_tests(dry: bool, timeout: float) -> dict:
    root = Path(__file__).resolve().parent.parent
    name = "cuda tests"
    if not (root / "tests").is_dir() or not (root / "pyproject.toml").is_file():
        return _row(name, "skip", note=f"no tests/ beside the package ({root}): an installed "
                                       "wheel; run from a checkout")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "autopart.smoke", "-p",
               "no:cacheprovider", f"--junitxml={report}"]
        try:
            done = subprocess.run(cmd, cwd=root, env={**os.environ, _CUDA_TESTS: "1"},
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return _row(name, "fail", time.perf_counter() - start, f"over {timeout:.0f} s")
        seconds = time.perf_counter() - start
        if not report.is_file():
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            return _row(name, "fail", seconds, f"pytest exit {done.returncode}: {tail[0]}")
        counts = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
    return _cuda_row(name, counts, done, seconds, dry)


def _cuda_row(name: str, counts: dict, done, seconds: float, dry: bool) -> dict:
    """pass when some selected test passed and none failed; skip when none ran (all skipped,
    or none selected: pytest's exit 5), which tested nothing; fail otherwise."""
    bad = counts["failures"] + counts["errors"]
    passed = counts["tests"] - bad - counts["skipped"]
    figure = (f"{counts['tests']} selected: {passed} passed, {bad} failed, "
              f"{counts['skipped']} skipped")
    nothing_ran = not bad and passed <= 0 and done.returncode in (0, 5)
    if nothing_ran:
        why = "no CUDA here (dry-run)" if dry else "see their skip reasons: pytest -rs"
        return _row(name, "skip", seconds, figure, f"no test ran: {why}" if counts["tests"]
                    else "pytest selected no test that needs CUDA")
    if bad or done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:])
        return _row(name, "fail", seconds, figure + f" (pytest exit {done.returncode})")
    return _row(name, "pass", seconds, figure, "python -m pytest, full tier included")


# -- main ---------------------------------------------------------------------------------------

ROWS = ["cuda tests", "train bf16 zero=1", "save / resume", "compile=True", "compile=cudagraphs",
        "fp8", "meta model", "pp=2 1f1b", "tp=2"]


def run(dry: bool) -> list[dict]:
    """Every row of ROWS, in its order: the world-1 rows in one spawned rank, the 2-rank rows
    in two; on the CPU (--dry-run, or no CUDA device) what needs CUDA is skipped, not run."""
    from autopart.runtime.launch import spawn
    rows = [cuda_tests(dry, 300 if dry else 3600)]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cpu" if dry else "cuda"
    single = ["save / resume", "compile=True", "compile=cudagraphs", "fp8", "meta model"]
    if device == "cpu":
        rows.append(_row("compile=cudagraphs", "skip", note="dry-run on the CPU: CUDA graphs "
                         "need a CUDA device (Inductor's CPU code would capture none)"))
        single.remove("compile=cudagraphs")
    if not dry and not gpus:
        rows += [_row(n, "skip", note="no CUDA device (--dry-run runs it on the CPU)")
                 for n in single]
    else:
        with tempfile.TemporaryDirectory() as workdir:
            rows += _spawned(spawn, single_gpu, 1, single, dry, workdir, single, device=device,
                             timeout=600 if dry else 1800)
    pair = ["train bf16 zero=1", "pp=2 1f1b", "tp=2"]
    if not dry and gpus < 2:
        rows += [_row(n, "skip", note=f"needs 2 GPUs, this machine has {gpus} (2 ranks; "
                                      "NCCL runs one per GPU)") for n in pair]
    else:
        rows += _spawned(spawn, two_gpus, 2, pair, dry, device=device, timeout=600)
    return sorted(rows, key=lambda r: ROWS.index(r["name"]))


def _spawned(spawn, fn, world: int, names: list, *args, device: str, timeout: float) -> list:
    """The rows of `fn` over `world` spawned ranks, rank 0's unless another rank's failed;
    every row failed if a rank died."""
    start = time.perf_counter()
    try:
        per_rank = spawn(fn, world, *args, device=device, timeout=timeout)
    except Exception as e:   # noqa: BLE001 -- a rank died: its rows say so
        why = str(e).strip().splitlines()
        sys.stderr.write(str(e) + "\n")
        return [_row(n, "fail", time.perf_counter() - start, (why[-1] if why else "")[:160],
                     f"{world} spawned rank(s) failed") for n in names]
    return merge_ranks(per_rank)


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's rows, each replaced by another rank's row of that name where that one failed
    (its figure prefixed with the rank): every rank checks, and any rank can fail a row."""
    merged = []
    for row in per_rank[0]:
        for r, rows in enumerate(per_rank[1:], start=1):
            other = {o["name"]: o for o in rows}[row["name"]]
            if other["status"] == "fail" and row["status"] != "fail":
                row = {**other, "figure": f"rank {r}: {other['figure']}"}
        merged.append(row)
    return merged


def table(rows: list[dict]) -> str:
    cols = [("step", "name"), ("status", "status"), ("s", "seconds"), ("figure", "figure"),
            ("note", "note")]
    cells = [[h for h, _ in cols]] + [[str(r[k]) for _, k in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i == 2 else c.ljust(w)
                       for i, (c, w) in enumerate(zip(cell, widths))).rstrip() for cell in cells]
    return "\n".join([lines[0], "-" * len(max(lines, key=len)), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autopart.smoke", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="the same steps on the CPU over Gloo (a machine without GPUs, CI)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON, not a table")
    args = p.parse_args(argv)
    start = time.perf_counter()
    rows = run(args.dry_run)
    ok = all(r["status"] in ("pass", "skip") for r in rows)
    summary = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skip")}
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "ok": ok, "seconds": round(
            time.perf_counter() - start, 1), "counts": summary, "rows": rows}, indent=1))
    else:
        print(table(rows))
        print(f"{summary['pass']} passed, {summary['fail']} failed, {summary['skip']} skipped "
              f"in {time.perf_counter() - start:.0f} s" + (" (dry-run)" if args.dry_run else ""))
    return 0 if ok else 1


if __name__ == "__main__":     # run as autopart.smoke, so spawned ranks import the same functions
    from autopart.smoke import main as _main
    sys.exit(_main())
