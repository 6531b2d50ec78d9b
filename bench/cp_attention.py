"""Context parallelism at cp=2 on a long sequence: autopart's ring attention against its all-gather
attention, against torch's `context_parallel` where it runs on this machine, and the activation
bytes a rank keeps at cp=2 against one rank holding the whole sequence (cp=1).

    python bench/cp_attention.py                              # seq 4096, 10 rounds, table
    python bench/cp_attention.py --rounds 30 --json           # what `python -m bench` runs
    python bench/cp_attention.py --rounds 1 --seq 256 --sides ring,cp1      # plumbing

The example GPT (examples/gpt.py) at `tiny,n_layer=2,n_embd=128,n_head=4,vocab_size=1024,
block_size=SEQ` (`--config` overrides; block_size is always `--seq`), one global batch of 1 x SEQ
random tokens and targets, fp32, AdamW (lr 1e-3). Sides (`--sides`):
  ring       autopart.parallelize(..., Mesh(cp=2), cp_attention="ring"): K/V passed peer to peer
  allgather  the same, cp_attention="allgather": K/V all-gathered
  torch      torch.distributed.tensor.experimental.context_parallel on a 1-D DeviceMesh of the 2
             Gloo ranks, the same GPT (SDPA) with its positions passed in (GPT.forward makes them
             with arange over the rank's local length, wrong under CP), buffers = tokens,
             targets, positions (seq dims 1, 1, 0; torch's head-tail load balancing, as autopart's),
             forward and backward inside the context, then the gradients and the loss averaged
             over the 2 ranks (what train_step does), AdamW
  cp1        autopart on one rank, Mesh() (no CP): the whole sequence; the activation baseline
Each rank passes the global batch to train_step; autopart takes the rank's chunks (rank i holds
chunks i and 3-i of 4).

Memory (one fresh process group per side, so each side's peak RSS is its own): 1 step, then one
train_step under saved-tensor hooks: per rank, the peak bytes of the distinct storages autograd
keeps saved for backward (parameters and buffers excluded; tests/workers/memory.py's counter) and
the total of every distinct storage saved in the step; then the optimizer step and the process's
peak RSS (ru_maxrss). torch's side is probed here: if it raises, the reason (the error and the
torch source line raising it) is its result and it is left out of the timing.

Time (one process group, the cp=2 sides that ran): the first two steps of every side are checked
(step 1's loss against the plain model's on the global batch, rtol 1e-4; step 2's, after one
AdamW step, against each other, 1e-3), then `--warmup` + `--rounds` rounds in which every side
steps once (train_step + opt.step + zero_grad), each from a barrier, lasting as long as its
slowest rank, the order reversed every other round. Ratios are medians of per-round ratios:
ring / allgather, ring / torch. cp1's step time is measured in its own process after its memory
step, `--warmup` + `--rounds` steps, unpaired (a rough figure: no ratio to it is printed).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # for `examples.gpt`, `bench`

from bench.run_all import _per_round  # noqa: E402
from examples.gpt import GPT, config, lm_loss  # noqa: E402

CONFIG = "tiny,n_layer=2,n_embd=128,n_head=4,vocab_size=1024"
SIDES = ("ring", "allgather", "torch", "cp1")
CP_SIDES = ("ring", "allgather", "torch")      # two ranks each
LR = 1e-3


def model_config(spec: str, seq: int):
    return config(f"{spec},block_size={seq}")


def global_batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same 1 x seq token ids and targets on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (1, cfg.block_size), generator=g)
    return x, y


def plain_model(opts: dict) -> GPT:
    torch.manual_seed(opts["seed"])
    return GPT(model_config(opts["config"], opts["seq"]))


# -- the sides -----------------------------------------------------------------------------------
class Side:
    """step() -> the global mean loss; held: tensors that are weights, not activations."""

    def __init__(self, step, held):
        self.step, self.held = step, list(held)


def autopart_side(plain: GPT, x, y, side: str) -> Side:
    import autopart
    mesh = autopart.Mesh() if side == "cp1" else autopart.Mesh(cp=2)
    kw = {} if side == "cp1" else {"cp_attention": side}
    pm = autopart.parallelize(plain, mesh, (x,), loss_fn=lm_loss, target=y,
                              timeout=timedelta(seconds=600), **kw)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)

    def step() -> float:
        loss = pm.train_step(x, target=y)
        opt.step()
        opt.zero_grad()
        return float(loss)
    held = [t for c in pm.program.chunks for t in list(c.gm.parameters()) + list(c.gm.buffers())]
    return Side(step, held)


def gpt_forward(model: GPT, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """GPT.forward with the positions given (the rank's, under torch's CP) -> logits."""
    t = model.transformer
    x = t.drop(t.wte(idx) + t.wpe(pos))
    for block in t.h:
        x = block(x)
    return model.lm_head(t.ln_f(x))


def torch_side(plain: GPT, x, y) -> Side:
    """torch's context_parallel: each step shards fresh copies of tokens, targets and positions
    (the context manager reshapes its buffers in place), forward + backward inside the context,
    the gradients and loss averaged over the ranks (each rank's loss is the mean of its half of
    the tokens: equal halves, so the global mean is their mean), AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    model = copy.deepcopy(plain)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    world = dist.get_world_size()

    def step() -> float:
        xs, ys, ps = x.clone(), y.clone(), torch.arange(x.shape[1])
        with context_parallel(mesh, buffers=[xs, ys, ps], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={xs, ys, ps}):
            loss = lm_loss(gpt_forward(model, xs, ps), ys)
            loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        flat /= world
        torch._foreach_copy_(grads, [v.view_as(g) for v, g in
                                     zip(flat[:-1].split([g.numel() for g in grads]), grads)])
        opt.step()
        opt.zero_grad()
        return float(flat[-1])
    return Side(step, list(model.parameters()))


def build(side: str, plain: GPT, x, y) -> Side:
    return torch_side(plain, x, y) if side == "torch" else autopart_side(copy.deepcopy(plain),
                                                                         x, y, side)


def why_not(e: BaseException) -> str:
    """The error and the innermost torch source line of its traceback: why torch's side fails."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = (f" (raised at torch/{f.filename.split('/torch/', 1)[1]}:{f.lineno}, "
                 f"in {f.name}: {f.line})")
    return f"{type(e).__name__}: {e}".strip() + where


# -- memory: one process group per side ----------------------------------------------------------
def saved_bytes(side: Side) -> dict:
    """One step under saved-tensor hooks: the peak of live saved storages and the total of every
    distinct storage saved (parameters and buffers excluded)."""
    from tests.workers.memory import _Live, _Saved
    live = _Live({t.untyped_storage().data_ptr() for t in side.held})
    distinct: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key and key not in live.weights:
            distinct[key] = max(distinct.get(key, 0), t.untyped_storage().nbytes())
        return _Saved(t, live)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.t):
        loss = side.step()
    return {"activation_bytes": live.peak, "saved_total_bytes": sum(distinct.values()),
            "loss": loss}


def memory_rank(rank: int, world: int, opts: dict, side: str) -> dict:
    plain = plain_model(opts)
    x, y = global_batch(plain.config, opts["seed"] + 1)
    try:
        s = build(side, plain, x, y)
        first = s.step()
    except Exception as e:       # noqa: BLE001 - torch's side may not run here: that is a result
        if side != "torch":
            raise
        return {"error": why_not(e)}
    out = saved_bytes(s)
    out = {"first_loss": first, **out,
           "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if side == "cp1":       # its step time here, on its own (no peer to pair with)
        out["step_seconds"] = []
        for it in range(opts["warmup"] + opts["rounds"]):
            start = time.perf_counter()
            s.step()
            if it >= opts["warmup"]:
                out["step_seconds"].append(time.perf_counter() - start)
    return out


# -- time: the cp=2 sides in one process group ----------------------------------------------------
def check_losses(losses: dict, ref: float, rtol: float, what: str) -> None:
    bad = {k: v for k, v in losses.items() if abs(v - ref) > rtol * abs(ref)}
    if bad:
        raise AssertionError(f"{what}: not the same work: {bad} against {ref} (rtol {rtol}); "
                             f"all: {losses}")


def slowest(times: list[float]) -> list[float]:
    """A step lasts as long as its slowest rank."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_rank(rank: int, world: int, opts: dict, sides: tuple) -> dict:
    plain = plain_model(opts)
    x, y = global_batch(plain.config, opts["seed"] + 1)
    with torch.no_grad():
        ref = float(lm_loss(plain(x), y))
    built = {s: build(s, plain, x, y) for s in sides}
    first = {s: built[s].step() for s in sides}
    check_losses(first, ref, opts["rtol"], "first-step loss vs the plain model")
    second = {s: built[s].step() for s in sides}
    check_losses(second, second[sides[0]], 10 * opts["rtol"], f"second-step loss vs {sides[0]}")
    wall = {s: [] for s in sides}
    for it in range(opts["warmup"] + opts["rounds"]):
        for s in sides if it % 2 == 0 else sides[::-1]:
            dist.barrier()
            start = time.perf_counter()
            built[s].step()
            if it >= opts["warmup"]:
                wall[s].append(time.perf_counter() - start)
    return {"equal_work": {"plain": ref, "first": first, "second": second},
            "step_seconds": {s: slowest(v) for s, v in wall.items()}}



# -- the run -------------------------------------------------------------------------------------
def run(a) -> dict:
    from autopart.runtime.launch import spawn
    opts = dict(config=a.config, seq=a.seq, seed=a.seed, rounds=a.rounds, warmup=a.warmup,
                rtol=a.rtol)
    cfg = model_config(a.config, a.seq)
    load_before = os.getloadavg()
    memory, torch_error = {}, None
    for side in [s for s in ("cp1", *CP_SIDES) if s in a.sides]:
        ranks = spawn(memory_rank, 1 if side == "cp1" else 2, opts, side, timeout=a.timeout,
                      pg_timeout=a.timeout)
        if "error" in ranks[0]:
            torch_error = ranks[0]["error"]
            continue
        memory[side] = ranks
    timed = tuple(s for s in CP_SIDES if s in a.sides and s in memory)
    out = spawn(time_rank, 2, opts, timed, timeout=a.timeout, pg_timeout=a.timeout)[0] \
        if timed else {"equal_work": None, "step_seconds": {}}
    times = dict(out["step_seconds"])
    if "cp1" in memory:
        times["cp1"] = memory["cp1"][0]["step_seconds"]
    ratios = {f"{s} / {p}": statistics.median(_per_round(times[s], times[p]))
              for s, p in (("ring", "allgather"), ("ring", "torch"))
              if s in timed and p in timed}
    act = {s: [r["activation_bytes"] for r in ranks] for s, ranks in memory.items()}
    act_ratio = ({s: [b / act["cp1"][0] for b in act[s]] for s in act if s != "cp1"}
                 if "cp1" in act else {})
    return {"bench": "cp_attention", "config": f"{a.config},block_size={a.seq}", "seq": a.seq,
            "batch": 1, "params": sum(p.numel() for p in GPT(cfg).parameters()),
            "rounds": a.rounds, "warmup": a.warmup, "sides": list(a.sides),
            "timed": list(timed), "equal_work": out["equal_work"], "step_seconds": times,
            "median_step_seconds": {s: statistics.median(v) for s, v in times.items()},
            "ratios": ratios, "activation_bytes": act,
            "saved_total_bytes": {s: [r["saved_total_bytes"] for r in ranks]
                                  for s, ranks in memory.items()},
            "activation_ratio_to_cp1": act_ratio,
            "maxrss_bytes": {s: [r["maxrss_bytes"] for r in ranks] for s, ranks in memory.items()},
            "torch_context_parallel": "ran" if "torch" in memory else
                                      (torch_error or "not asked (--sides)"),
            "torch_version": torch.__version__, "load_before": load_before,
            "load_after": os.getloadavg()}


def table(r: dict) -> str:
    mib = 2 ** 20
    lines = [f"context parallelism, Gloo, 1 thread/rank: GPT {r['config']} "
             f"({r['params'] / 1e6:.2f}M params), batch 1 x {r['seq']}, fp32, AdamW; "
             f"{r['rounds']} rounds after {r['warmup']} warm-up"]
    if r["equal_work"]:
        c = r["equal_work"]
        lines.append(f"equal work: plain first-step loss {c['plain']:.6f}; " + ", ".join(
            f"{k} {v:.6f}" for k, v in c["first"].items()) + " (match)")
    lines += ["", f"{'side':<11}{'ranks':>6}{'median step s':>15}{'act MiB':>22}"
                  f"{'act / cp1':>18}{'saved MiB':>20}{'maxrss MiB':>14}"]
    for s in SIDES:
        if s not in r["sides"]:
            continue
        t = r["median_step_seconds"].get(s)
        if s == "torch" and "torch" not in r["activation_bytes"]:
            lines.append(f"{'torch':<11}{2:>6}  did not run: {r['torch_context_parallel']}")
            continue
        acts = r["activation_bytes"].get(s, [])
        per = r["activation_ratio_to_cp1"].get(s, [])
        saved = r["saved_total_bytes"].get(s, [])
        lines.append(f"{s:<11}{1 if s == 'cp1' else 2:>6}"
                     f"{'-' if t is None else f'{t:.3f}':>15}"
                     f"{' / '.join(f'{b / mib:.1f}' for b in acts):>22}"
                     f"{' / '.join(f'{q:.3f}' for q in per) if per else '-':>18}"
                     f"{' / '.join(f'{b / mib:.1f}' for b in saved):>20}"
                     f"{' / '.join(f'{b / mib:.0f}' for b in r['maxrss_bytes'].get(s, [])):>14}")
    lines.append("")
    for k, v in r["ratios"].items():
        lines.append(f"{k}: {v:.3f} (median of per-round ratios; lower: the first faster)")
    lines += ["act: peak bytes of storages saved for backward in one train_step, per rank "
              "(rank 0 / rank 1); saved: every distinct storage saved in that step; maxrss: "
              "the process's peak RSS (ru_maxrss), each side in its own processes; cp1's "
              "step time is unpaired (its own process)",
              f"load average {r['load_before'][0]:.2f} before, {r['load_after'][0]:.2f} after, "
              f"on {os.cpu_count()} cpus"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="measured rounds (default 10)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds before measuring (default 1)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens in the sequence (default 4096)")
    ap.add_argument("--config", default=CONFIG,
                    help=f"examples.gpt config spec (default {CONFIG}); block_size is --seq")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help="which of " + ", ".join(SIDES) + " (default all)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="first-step loss tolerance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per process group")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON line on stdout (the table goes to stderr)")
    a = ap.parse_args(argv)
    names = [s.strip() for s in a.sides.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SIDES))
    if unknown or not names:
        ap.error(f"--sides: {', '.join(unknown) or 'none'}; known: {', '.join(SIDES)}")
    a.sides = tuple(s for s in SIDES if s in names)
    if a.seq % 4:
        ap.error(f"--seq {a.seq}: cp=2 splits the sequence into 4 equal chunks")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    result = run(a)
    print(table(result), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
