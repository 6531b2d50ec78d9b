"""Rank functions for `autopart.runtime.launch.spawn` (module level, so that the rank processes
can import them): the equivalence harness the multi-process tests share, and a few other rank
functions on the shared models, batches and cases (tests/workers/common.py).

Every equivalence case trains the parallel model and a deep copy of the unmodified model, taken
before `parallelize`, on the same global batch in the same rank process, and compares the loss of
every step, the gradients of the first step, the clipped gradient norm and every parameter after
the last step. A rank returns plain data (problems found, parameter counts, timings); the test
process asserts on it, so a failure names the case, the rank and the parameter.
"""
from __future__ import annotations

import copy
import os
import sys
import time
import traceback
from datetime import timedelta

import torch

from tests.workers.common import (ATOL, RTOL, Case, _compare, _local_view, build, gpt_config,
                                  held_view, zero_chunk)
from tests.workers.precision import _inductor_report

__all__ = ["api_checks", "assert_all_ranks_equal_plain", "claim_problems", "die_mid_step",
           "equivalence", "held_grads", "mesh_mismatch", "run_cases", "run_group"]


# -- the equivalence harness ----------------------------------------------------------------------

def options(case) -> dict:
    """parallelize's keyword arguments a case subclass adds (tests/composition.py's CCase)."""
    return case.options() if hasattr(case, "options") else {}


def _optimizer(kind: str, model):
    """`kind` over a plain model's parameters or, for a ParallelModel, through pm.optimizer
    (with zero=1, the distributed optimizer over this rank's slices)."""
    from autopart.runtime.parallel_model import ParallelModel
    make = model.optimizer if isinstance(model, ParallelModel) else \
        (lambda cls, **kw: cls(model.parameters(), **kw))
    if kind == "sgd":
        return make(torch.optim.SGD, lr=0.1)
    if kind == "adamw":
        return make(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    return make(torch.optim.Adam, lr=1e-3)


def held_grads(pm, local, plain: dict, replica) -> tuple[dict, dict]:
    """The step-1 gradient this rank holds after train_step, and the same elements of the plain
    model's (`plain`: name -> its parameter), as {name: tensor} each. zero=0: each parameter's
    gradient (`local`: this rank's tp/ep shard of the plain one). zero >= 1: this rank's ZeRO
    chunk of each parameter in a layout, cut here (`replica(name)`: (group size, index);
    tests/workers/common.zero_chunk), reduced: zero=1 in the full-shaped `.grad`, zero=2 and 3
    at the parameter's place in the layout's slice; a parameter in no layout whole. None and
    all-zero gradients are the same to an optimizer without weight decay."""
    def grad(p):
        return p.grad.detach() if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
    layouts = pm._grads.zero_layouts if pm.zero else ()
    params = dict(pm.named_parameters())
    laid_out = {n for lay in layouts for n in lay.names}
    got = {n: grad(p) for n, p in params.items() if n not in laid_out}
    want = {n: local(n, grad(plain[n])) for n in got}
    for lay in layouts:
        places = {name: at for name, _, _, _, at in lay.spans()}
        for name in lay.names:
            want[name] = zero_chunk(local(name, grad(plain[name])).reshape(-1), *replica(name))
            n = want[name].numel()
            if lay.grad is None:
                got[name] = zero_chunk(grad(params[name]).reshape(-1), *replica(name))
            else:   # (a chunk the layout does not place: an empty tensor, a shape mismatch)
                at = places.get(name)
                got[name] = lay.grad[at:at + n] if at is not None else lay.grad[:0]
    return got, want


def zero_replica(pm, rank: int):
    """name -> (size, index) of this rank in the parameter's ZeRO replica group, from the mesh
    coordinates as tests/workers/common.held_view has them: dense parameters over dp x cp,
    experts over the dp // ep ranks holding the same ones."""
    mesh, at = pm.mesh, pm.mesh.coords(rank)

    def replica(name: str) -> tuple[int, int]:
        if mesh.ep > 1 and name in pm.compiled.plan.ep_shards:
            return mesh.dp // mesh.ep * mesh.cp, at["dp"] // mesh.ep * mesh.cp + at["cp"]
        return mesh.dp * mesh.cp, at["dp"] * mesh.cp + at["cp"]
    return replica


def _param_atol(case: Case) -> float:
    # Adam divides each gradient element by its own running magnitude, so an element whose
    # gradient is within a few hundred ulps of zero (summed in another order) moves by a visibly
    # different fraction of lr=1e-3: measured up to 1.6e-6. 1e-5 is still 1% of one Adam step
    # (lr), so a parameter that missed a step or moved the wrong way fails. The loss and the
    # step-1 gradients keep their tight bounds; SGD cases keep atol=1e-6 for the parameters.
    # zero=2 sums each microbatch over the replicas before the microbatches (the others the
    # other way round): measured 1.3e-5 on one element of 4096 (gpt dp=2, m=2): 2e-5. zero=3
    # reduces as zero=2 does.
    if case.optim in ("adam", "adamw"):
        return 2e-5 if options(case).get("zero") in (2, 3) else 1e-5
    return ATOL


def equivalence(case: Case, rank: int, wire=None, feed=None) -> dict:
    """Train `case` for case.steps steps, parallel and plain; return what differs (none: equal).
    `wire` (tests/workers/precision.Wire, entered by the caller) also records pm's gradient
    reducer. `feed(pm, inputs, target)`: what pm.train_step is given instead of the global
    batch, as (inputs, target, keywords) (tests/workers/local_batches.py: each rank's share);
    the plain model always trains on the global batch."""
    import autopart

    start = time.perf_counter()
    device = f"cuda:{rank}" if case.device == "cuda" else "cpu"
    model, loss_fn, inputs, target = build(case, device=device)
    ref = copy.deepcopy(model)            # the unmodified model, before parallelize touches it
    # a model whose eager form cannot train here gives the same function in one that can
    # (tests/workers/flex.py: HF flex_attention, whose backward torch refuses on the CPU)
    ref = ref.plain_twin() if hasattr(ref, "plain_twin") else ref
    ref_sd0 = ref.state_dict()
    ref_keys = list(ref_sd0.keys())
    ref_shapes = {k: tuple(v.shape) for k, v in ref_sd0.items()}
    ref_params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    mesh = autopart.Mesh(pp=case.pp, dp=case.dp, tp=case.tp, ep=case.ep, cp=case.cp)
    cp_options = {"cp_attention": case.cp_attention} if case.cp > 1 else {}
    pm = autopart.parallelize(model, mesh, inputs, **cp_options,
                              loss_fn=loss_fn, target=target, microbatches=case.microbatches,
                              schedule=case.schedule, virtual_stages=case.virtual_stages,
                              sequence_parallel=case.sequence_parallel,
                              timeout=timedelta(seconds=120), **options(case))
    compile_s = time.perf_counter() - start
    if wire is not None:
        wire.attach(pm)
    zero = options(case).get("zero", 0)
    opt, ref_opt = _optimizer(case.optim, pm), _optimizer(case.optim, ref)
    mine = _local_view(pm, rank)        # the plain tensor -> this rank's shard of it
    problems: list[str] = []
    max_err = 0.0
    for step in range(1, case.steps + 1):
        for call in range(case.accumulate):
            what = f"step {step}" + (f" call {call + 1}" if case.accumulate > 1 else "")
            given = (inputs, target, {}) if feed is None else feed(pm, inputs, target)
            loss = pm.train_step(*given[0], target=given[1], **given[2])
            out = ref(*inputs)
            ref_loss = loss_fn(out, target) if loss_fn is not None else out
            if isinstance(ref_loss, tuple):        # (loss, statistics summed over the batch)
                ref_loss, ref_stats = ref_loss
                if set(pm.last_stats) != set(ref_stats):
                    problems.append(f"{what} stats {sorted(pm.last_stats)} != {sorted(ref_stats)}")
                for k, v in ref_stats.items():
                    if k in pm.last_stats and not torch.equal(pm.last_stats[k].cpu(), v.cpu()):
                        problems.append(f"{what} stat {k}: {pm.last_stats[k].tolist()} != plain "
                                        f"{v.tolist()}")
            ref_loss.backward()
            max_err = max(max_err, _compare(f"{what} loss", loss, ref_loss, RTOL, ATOL, problems))
        if step == 1:
            # a parameter forward never reads has no gradient and never changes: no rank needs it
            used = sorted(n for n, p in ref_params.items() if p.grad is not None)
            got, want = held_grads(pm, mine, ref_params, zero_replica(pm, rank))
            for name in want:      # at every zero level: the elements this rank holds, reduced
                _compare(f"step 1 grad of {name}", got[name], want[name], RTOL, ATOL, problems)
            kept = [n for n, p in pm.named_parameters() if p.grad is not None]
            if zero >= 2 and kept:
                problems.append(f"zero={zero} kept .grad of {kept[:3]}")
        if step == 2 and case.clip is not None:
            norm = pm.clip_grad_norm_(case.clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip)
            if float(ref_norm) <= case.clip:
                problems.append(f"test setup: plain grad norm {float(ref_norm)} <= clip {case.clip}"
                                " so clipping was not exercised")
            _compare("step 2 clip_grad_norm_", norm, ref_norm, RTOL, ATOL, problems)
        opt.step(), opt.zero_grad()
        ref_opt.step(), ref_opt.zero_grad()
    held = {}
    # zero=3: a parameter is this rank's 1-D slice of it between steps (runtime/param_shards.py)
    holds = held_view(pm, rank)
    for name, p in pm.named_parameters():
        held[name] = p.numel()
        max_err = max(max_err, _compare(f"parameter {name} after {case.steps} steps", p,
                                        holds(name, ref_params[name]), RTOL, _param_atol(case),
                                        problems))
    sd = pm.full_state_dict()
    if list(sd.keys()) != ref_keys:
        missing, extra = set(ref_keys) - set(sd), set(sd) - set(ref_keys)
        problems.append(f"full_state_dict keys differ from model.state_dict(): missing "
                        f"{sorted(missing)}, extra {sorted(extra)}"
                        + ("" if missing or extra else " (same keys, different order)"))
    ref_sd = ref.state_dict()
    for k, v in sd.items():
        if k in ref_shapes and tuple(v.shape) != ref_shapes[k]:
            problems.append(f"full_state_dict[{k!r}] shape {tuple(v.shape)} != {ref_shapes[k]}")
        elif k in ref_sd and ref_sd[k].is_floating_point():
            _compare(f"full_state_dict[{k!r}]", v, ref_sd[k], RTOL, _param_atol(case), problems)
    return {"case": case.name, "rank": rank, "problems": problems, "held": held,
            "held_numel": sum(held.values()), "plain_names": used, "read": names_read(pm),
            "tp_sharded": sorted(pm.compiled.plan.tp_shards),
            "ep_sharded": sorted(pm.compiled.plan.ep_shards),
            "total_numel": sum(p.numel() for p in ref_params.values()), "max_err": max_err,
            "chunks": [c.chunk for c in pm.program.chunks], "compile_s": compile_s,
            "seconds": time.perf_counter() - start, "inductor": _inductor_report(pm)}


def names_read(pm) -> list[str]:
    """The attributes (parameters, buffers, constants) the graphs of this rank's chunks read, by
    get_attr node: what the rank needs, whatever its parameter list says it holds."""
    names = set()
    for chunk in pm.program.chunks:
        for path, module in chunk.gm.named_modules():
            if isinstance(module, torch.fx.GraphModule):
                names.update(f"{path}.{n.target}" if path else n.target
                             for n in module.graph.nodes if n.op == "get_attr")
    return sorted(names)


def run_cases(rank: int, world: int, cases: list[Case], wire=None) -> list[dict]:
    """Rank function: every case in turn (all of this world size). A case that raises is recorded;
    the cases after it are not run, since a peer may be stuck in that case's communication."""
    out = []
    for i, case in enumerate(cases):
        assert case.world == world, (case, world)
        try:
            out.append(equivalence(case, rank, wire))
        except Exception:  # noqa: BLE001  (reported by the test process, per case)
            out.append({"case": case.name, "rank": rank,
                        "problems": [f"raised on rank {rank}:\n{traceback.format_exc()}"]})
            out += [{"case": c.name, "rank": rank,
                     "problems": [f"not run: case {case.name!r} failed before it"]}
                    for c in cases[i + 1:]]
            break
    return out


SPAWN_TIMEOUT = 420.0   # per spawn group: a hang is a failure, never a stuck CI job
PG_TIMEOUT = 120.0      # the default process group's (parallelize is given its own timeout)


def assert_all_ranks_equal_plain(case: Case, ranks: list[dict]) -> None:
    """Every rank of `case` reported, none found a difference from the plain model, and what the
    ranks report as data (the wire, Inductor's work) is what the case claims."""
    assert sorted(r["rank"] for r in ranks) == list(range(case.world)), f"{case.name}: ranks?"
    problems = [f"rank {r['rank']}: {p}" for r in ranks
                for p in r["problems"] + claim_problems(case, r)]
    assert not problems, f"{case}\n" + "\n".join(problems)


def claim_problems(case, r: dict) -> list[str]:
    """A rank result's data against what the case claims, judged here so that none goes unread:
    a case naming its precision (tests/composition.CCase, tests/workers/precision.BCase) must
    show the dtypes that precision puts on the wire; compile=True, that Inductor compiled the
    programs. A refused case trained nothing."""
    if getattr(case, "refused", ()):
        return []
    out = wire_problems(case, r.get("wire")) if hasattr(case, "precision") else []
    if getattr(case, "compile", False):
        out += inductor_problems(r.get("inductor"))
    return out


def wire_problems(case, wire: dict | None) -> list[str]:
    """What the collectives carried (tests/workers/precision.Wire.report) against the case's
    precision. fp32: no bf16 anywhere. bf16: the compute's tensors travel in bf16 (the pipeline's
    transfers all of them, cp's ring, tp's reductions of partial sums), gradients reduce over the
    replicas in fp32 (the recipe: tests/workers/precision.py). ep's token exchange is not
    claimed: it carries what the plain model's router hands its experts, under autocast a
    norm's fp32 output and the fp32 routing weights' products (HF Mixtral: fp32 both ways)."""
    if wire is None:
        return ["no record of what the collectives carried (wire): the dtypes were not checked"]
    has = {kind: set(dtypes) for kind, dtypes in wire.items()}
    if case.precision == "fp32":
        out = [f"{k} carried bfloat16 in an fp32 run: {wire[k]}" for k in has
               if "bfloat16" in has[k]]
    else:
        sends = ["isend", "irecv"] if case.pp > 1 or case.cp > 1 else []
        out = [f"{k} carried no bfloat16 ({wire.get(k)}): bf16 compute sends bf16" for k in sends
               if "bfloat16" not in has.get(k, ())]
        # tp: the row-parallel linears' partial sums are bf16. Under sp they are reduce-scattered,
        # except where the model flattens (batch, sequence) into the GEMM's rows (HF GPT-2's
        # Conv1D addmm): no sequence shard survives the view, so they are all-reduced and the
        # sum sliced. sp's all-gathers carry what feeds the linear: a norm's output, fp32 under
        # autocast as in the plain model, so they are not claimed.
        summed = has.get("all_reduce", set()) | has.get("reduce_scatter", set())
        if case.tp > 1 and "bfloat16" not in summed:
            out.append(f"tp's reductions carried no bfloat16 (all_reduce {wire.get('all_reduce')}"
                       f", reduce_scatter {wire.get('reduce_scatter')}): bf16 compute sends bf16")
        # (cp's ring carries its dk, dv sums in fp32 over the same sends: pipeline only)
        out += [f"{k} carried float32 ({wire[k]}): every pipeline transfer is bf16" for k in
                ("isend", "irecv") if case.cp == 1 and "float32" in has.get(k, ())]
    reduced = has.get("grad_all_reduce", set()) | has.get("grad_reduce_scatter", set())
    if "bfloat16" in reduced:
        out.append(f"gradients reduced in bfloat16: {wire}")
    if case.dp * case.cp > 1 and "float32" not in reduced:
        out.append(f"no fp32 gradient reduction over the replicas: {wire}")
    return out


def inductor_problems(report: dict | None) -> list[str]:
    """compile=True: every rank's programs ran Inductor's artifacts, none of them eager."""
    if report is None:
        return ["compile=True, but the rank has no Inductor report: its programs ran eager"]
    out = [f"eager fallback {label}: {why}" for label, why in report["fallbacks"].items()]
    if report["artifacts"] < 1 or report["segments"] < 1:
        out.append(f"Inductor compiled {report['artifacts']} artifacts for "
                   f"{report['segments']} segments")
    return out


def run_group(cache: dict, key, cases: list, timeout: float = SPAWN_TIMEOUT,
              rank_fn=None) -> dict:
    """Run `cases` (same world size) in one spawn, once per session; {case name: [rank dicts]}.
    `rank_fn(rank, world, cases)` runs them on each rank (default: run_cases)."""
    from autopart.runtime.launch import spawn

    if key not in cache:
        world = cases[0].world
        assert all(c.world == world for c in cases), key
        start = time.monotonic()
        try:
            per_rank = spawn(rank_fn or run_cases, world, list(cases), timeout=timeout,
                             pg_timeout=PG_TIMEOUT, device=getattr(cases[0], "device", "cpu"))
        except Exception as e:  # noqa: BLE001  (every test of the group reports it)
            cache[key] = e
        else:
            results: dict = {c.name: [] for c in cases}
            for rank_results in per_rank:
                for r in rank_results:
                    results[r["case"]].append(r)
            cache[key] = results
        print(f"[spawn {key}: {world} ranks, {len(cases)} cases, "
              f"{time.monotonic() - start:.1f} s]", file=sys.stderr)
    if isinstance(cache[key], Exception):
        raise cache[key]
    return cache[key]


# -- other rank functions on the shared models ----------------------------------------------------

def mesh_mismatch(rank: int, world: int, meshes: list[dict]) -> list[str]:
    """Rank function: parallelize with each mesh (none of size `world`); return each error text."""
    import autopart
    from examples.gpt import GPT, lm_loss

    errors = []
    x = torch.zeros(8, 16, dtype=torch.long)
    for sizes in meshes:
        torch.manual_seed(0)
        try:
            autopart.parallelize(GPT(gpt_config(8)), autopart.Mesh(**sizes), (x,), loss_fn=lm_loss,
                                 target=x, microbatches=4, timeout=timedelta(seconds=30))
            errors.append("no error")
        except autopart.AutopartError as e:
            errors.append(f"AutopartError: {e}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__} (not AutopartError): {e}")
    return errors


def api_checks(rank: int, world: int) -> dict:
    """Rank function for runtime/test_parallel_model.py: Mesh(pp=world) on Extras; returns
    what the API did, for the test process to assert on."""
    import autopart

    case = Case("api", model="extras", pp=world, microbatches=2)
    model, loss_fn, inputs, target = build(case)
    pm = autopart.parallelize(model, autopart.Mesh(pp=world), inputs, loss_fn=loss_fn,
                              target=target, microbatches=2, timeout=timedelta(seconds=60))
    out: dict = {"rank": rank}
    errors = {}
    for what, args, kwargs in [("batch", (inputs[0][:4],), {"target": target[:4]}),
                               ("arity", inputs, {}),
                               ("extra", inputs + inputs, {"target": target})]:
        try:
            pm.train_step(*args, **kwargs)
            errors[what] = "no error"
        except Exception as e:  # noqa: BLE001
            errors[what] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    loss = pm.train_step(*inputs, target=target)
    out["loss"] = float(loss)
    out["loss_shape"] = tuple(loss.shape)
    out["params_unchanged"] = all(torch.equal(before[n], p) for n, p in pm.named_parameters())
    out["grads"] = {n: p.grad is not None for n, p in pm.named_parameters()}
    out["named_is_parameters"] = [id(p) for _, p in pm.named_parameters()] == \
        [id(p) for p in pm.parameters()]
    out["code"] = pm.program.code
    out["chunks"] = [c.chunk for c in pm.program.chunks]
    out["explain"] = pm.explain()
    out["model_names"] = [n for n, _ in model.named_parameters()]
    out["state_keys"] = list(pm.full_state_dict().keys())
    out["plain_state_keys"] = list(model.state_dict().keys())
    return out


def die_mid_step(rank: int, world: int, how: str, victim: int, timeout_s: float,
                 dp: int = 1) -> None:
    """Rank function: Mesh(pp=world // dp, dp=dp) training in which rank `victim`, in its first
    forward of step 2, exits (how="exit", as a killed process) or stops responding for longer
    than the timeout (how="hang"). Every other rank must raise; its error says how long after
    the start of its step it failed ("failed after 12.3 s in step 2")."""
    import autopart

    case = Case("die", pp=world // dp, dp=dp, microbatches=4)
    model, loss_fn, inputs, target = build(case)
    pm = autopart.parallelize(model, autopart.Mesh(pp=case.pp, dp=dp), inputs, loss_fn=loss_fn,
                              target=target, microbatches=4, timeout=timedelta(seconds=timeout_s))
    step = 0
    if rank == victim:
        from autopart.runtime.executable import executable
        runs = executable(pm.program.chunks[0].gm)   # the copy of the program the executor calls
        forward = runs.forward

        def dying_forward(*args):
            if step == 2:
                if how == "exit":
                    os._exit(13)
                time.sleep(2 * timeout_s + 5)   # long enough for the others to time out, bounded
                os._exit(14)
            return forward(*args)
        runs.forward = dying_forward
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    for step in (1, 2, 3):
        started = time.monotonic()
        try:
            pm.train_step(*inputs, target=target)
        except Exception as e:
            raise RuntimeError(f"rank {rank} failed after {time.monotonic() - started:.1f} s in "
                               f"step {step}: {type(e).__name__}: {e}") from e
        opt.step(), opt.zero_grad()


def activation_bytes(rank: int, world: int, seq: int = 64) -> dict:
    """Rank function: bytes of activations autograd saves for backward in one forward of the
    example GPT, per rank, for the plain model, tensor parallelism and tensor + sequence
    parallelism (weights excluded: only what grows with batch and sequence)."""
    import autopart
    from examples.gpt import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=seq)
    x = torch.randint(0, 128, (4, seq), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, sp in (("plain", None), ("tp", False), ("tp+sp", True)):
        torch.manual_seed(0)
        model = GPT(cfg)
        if sp is None:
            weights = {p.data_ptr() for p in model.parameters()}
            run = lambda: lm_loss(model(x), x)      # noqa: E731
        else:
            pm = autopart.parallelize(model, autopart.Mesh(tp=world), (x,), loss_fn=lm_loss,
                                      target=x, sequence_parallel=sp,
                                      timeout=timedelta(seconds=60))
            gm = pm.program.chunks[0].gm
            weights = {p.data_ptr() for p in gm.parameters()}
            run = lambda gm=gm: gm(x, x)[0]          # noqa: E731
        saved = []

        def pack(t, saved=saved, weights=weights):
            if t.data_ptr() not in weights:
                saved.append((t.data_ptr(), t.numel() * t.element_size()))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run()
        loss.backward()
        out[name] = sum(dict(saved).values())     # each storage once
    return out
