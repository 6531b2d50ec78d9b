"""The composition matrix: every pair of feature values in at least one case, each case trained
3 steps against the plain model (tests/test_composition.py runs it).

AXES is the whole table. A case is one value per axis; `allowed` says which combinations make
sense (an ep axis needs a mixture-of-experts model and dp to shard over; sequence parallelism
needs tp; ...). `combos` builds a covering array over the allowed combinations: every pair of
axis values that some allowed combination holds appears in at least one case (checked again by
`uncovered_pairs`, written separately). Every case runs pp=2 with 4 microbatches, so
the schedule axis always matters.

A combination autopart does not support must be refused by `parallelize` naming both features:
REFUSED lists them (feature pair -> what the error must name), and the matrix expects the refusal.
"""
from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tests.workers import common
from tests.workers.equivalence import equivalence, run_cases

AXES: dict[str, tuple] = {
    "schedule":   ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v"),
    "tp":         ("1", "2", "2+sp"),            # 2+sp: tensor and sequence parallelism
    "dp":         (1, 2),
    "ep":         (1, 2),                        # experts over ep of the dp ranks (moe only)
    "recompute":  ("none", "selective", "full"),
    "zero":       (0, 1, 2, 3),
    "precision":  ("fp32", "bf16", "fp8"),       # fp8: against tests/workers/fp8.py's recipe
    "compile":    (False, True),                 # the chunks through Inductor
    "embeddings": ("tied", "untied"),
    "reuse":      ("on", "off"),                 # layer reuse at capture (AUTOPART_LAYER_REUSE)
    "model":      ("gpt", "hf-gpt2", "hf-mixtral"),
    "cp":         (1, 2),                        # the sequence over cp ranks (ring attention)
    "labels":     ("all", "ignored"),            # ignored: -100 on uneven parts of the rows
    "batch":      ("global", "local"),           # local: each rank's train_step its share only
}
V_SCHEDULES = {"interleaved-1f1b": 2, "zb-v": 2, "dualpipe-v": 2}   # virtual stages per rank
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipe-v")   # backward as I and W programs
PP, MICROBATCHES, MAX_WORLD = 2, 4, 8


def allowed(values: dict) -> bool:
    """Whether a (partial) assignment of axis values names a combination worth running."""
    get = values.get
    if get("ep") == 2 and (get("model") not in (None, "hf-mixtral") or get("dp") == 1):
        return False
    if get("zero") in (1, 2, 3) and get("dp") == 1:  # ZeRO shards over data-parallel replicas
        return False
    tp = 2 if get("tp") in ("2", "2+sp") else 1
    world = PP * tp * (get("dp") or 1) * (get("cp") or 1)
    # Inductor compiles every distinct layer in every rank: 8 ranks on a 2-core machine is
    # minutes per case, so compiled cases stay at 4 ranks (every pair still has a case)
    if get("compile") and world > 4:
        return False
    return world <= MAX_WORLD


def refusal(values: dict) -> tuple[str, ...]:
    """What parallelize's error must say for an allowed combination autopart refuses (empty:
    it must train like the plain model)."""
    fp8_refused = [named for named, on in (
        (f"cp={values['cp']}", values["cp"] > 1), (f"ep={values['ep']}", values["ep"] > 1),
        ("compile=True", values["compile"])) if on]     # zero=3: tensorwise FP8 gathers
    if values["precision"] == "fp8" and fp8_refused and not (
            values["zero"] == 3 and values["schedule"] in SPLIT_BACKWARD):   # refused first
        # FP8 is not held to its recipe there (autopart/config.py's check_fp8 names them
        # all; the first one is enough to tell the rules apart)
        return ("precision='fp8'", fp8_refused[0], "precision='bf16'")
    if values["model"] == "hf-mixtral" and values["tp"] == "2+sp" and values["ep"] == 1:
        # tp splits each expert (expert tensor parallelism), but not under sequence
        # parallelism; with ep the experts are sharded over ep and stay whole over tp
        return ("leaves the experts", "sequence parallelism", "drop sequence_parallel", "ep=2")
    if values["zero"] == 3 and values["schedule"] in SPLIT_BACKWARD:
        # the I and W programs of a split backward do not re-gather freed parameters
        return ("zero=3", f"schedule={values['schedule']!r}", "zero=2", "fused-backward")
    return ()


@dataclass(frozen=True)
class Combo:
    schedule: str
    tp: str
    dp: int
    ep: int
    recompute: str
    zero: int
    precision: str
    compile: bool
    embeddings: str
    reuse: str
    model: str
    cp: int = 1
    labels: str = "all"
    batch: str = "global"

    @property
    def name(self) -> str:
        parts = [self.model, self.embeddings, self.schedule, f"tp{self.tp}", f"dp{self.dp}"]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"rc-{self.recompute}"] if self.recompute != "none" else []
        parts += [f"zero{self.zero}"] if self.zero else []
        parts += [self.precision] if self.precision != "fp32" else []
        parts += ["compiled"] if self.compile else []
        parts += ["noreuse"] if self.reuse == "off" else []
        parts += ["ignored"] if self.labels == "ignored" else []
        parts += ["local"] if self.batch == "local" else []
        return "-".join(parts)

    def case(self) -> "CCase":
        tp = 2 if self.tp != "1" else 1
        noise = "cp" if self.cp > 1 else "tp" if tp > 1 else \
            "moe" if self.model == "hf-mixtral" else \
            "compiled" if self.compile else "kernels" if self.ep > 1 else "none"
        return CCase(name=self.name, model=f"c-{self.model}-{self.embeddings}", pp=PP, dp=self.dp,
                     tp=tp, ep=self.ep, cp=self.cp, sequence_parallel=self.tp == "2+sp",
                     schedule=self.schedule, virtual_stages=V_SCHEDULES.get(self.schedule, 1),
                     microbatches=MICROBATCHES, recompute=self.recompute, zero=self.zero,
                     precision=self.precision, compile=self.compile, reuse=self.reuse == "on",
                     noise=noise, routed=self.model == "hf-mixtral",
                     clip=None if self.precision in ("bf16", "fp8") else 0.05,
                     ignored="uneven" if self.labels == "ignored" else "",
                     feed=self.batch, refused=refusal(vars(self)))


def _world(values: dict) -> int:
    return PP * (1 if values["tp"] == "1" else 2) * values["dp"] * values["cp"]


def _cost(values: dict) -> int:
    """What a case costs to run here, in rough units: ranks, more for Inductor and bf16's
    second reference."""
    return _world(values) * (3 if values["compile"] else 1) + \
        (values["precision"] in ("bf16", "fp8"))


def combos() -> list[Combo]:
    """The covering array over the combinations that must train (allowed, not refused), then
    the cheapest combination of each refusal rule. Greedy and deterministic: repeatedly take
    the combination holding the most pairs not yet covered (ties: the cheapest, then the first
    in AXES order), until every pair a trainable combination holds is covered."""
    names = list(AXES)
    full = [dict(zip(names, v)) for v in itertools.product(*AXES.values())]
    full = [v for v in full if allowed(v)]
    refused = {}
    for v in full:
        if refusal(v) and (refusal(v) not in refused or _cost(v) < _cost(refused[refusal(v)])):
            refused[refusal(v)] = v
    full = [v for v in full if not refusal(v)]
    pairs = _pair_ids(full)
    cost = torch.tensor([_cost(v) for v in full], dtype=torch.float64)
    covered = torch.zeros(int(pairs.max()) + 1, dtype=torch.bool)
    rows = []
    while not covered.all():
        gain = (~covered[pairs]).sum(1).double()
        best = int(torch.argmax(gain * 1000 - cost))     # gain first, then cost, then order
        rows.append(Combo(**full[best]))
        covered[pairs[best]] = True
    return rows + [Combo(**v) for v in refused.values()]


def _pair_ids(full: list[dict]) -> torch.Tensor:
    """(combination, pair of axes) -> the number of that pair of axis values, 0.. over the
    pairs `full` holds; numbered on tensors (a dict entry per pair of every combination took
    seconds of each collection)."""
    names = list(AXES)
    at = torch.tensor([[AXES[a].index(v[a]) for a in names] for v in full])
    i, j = torch.combinations(torch.arange(len(names)), 2).T
    n = max(len(vs) for vs in AXES.values())
    _, ids = torch.unique(((i * len(names) + j) * n + at[:, i]) * n + at[:, j],
                          return_inverse=True)
    return ids


def uncovered_pairs(rows: list[Combo]) -> list:
    """Pairs of axis values that some trainable full combination holds but no row does."""
    names = list(AXES)
    possible = set()
    for full in itertools.product(*AXES.values()):
        values = dict(zip(names, full))
        if allowed(values) and not refusal(values):
            possible.update(itertools.combinations(zip(names, full), 2))
    seen = set()
    for row in rows:
        seen.update(itertools.combinations(zip(names, (getattr(row, a) for a in names)), 2))
    return sorted(possible - seen, key=str)


def fast_slice(rows: list[Combo]) -> list[Combo]:
    """Cases for the fast tier: every schedule, and every axis value at least once, greedily
    taking the case that adds the most unseen values per unit of cost, below 8 ranks where one
    does (ties: the first); then one case of each refusal rule."""
    want = {(a, v) for a, vs in AXES.items() for v in vs}
    chosen: list[Combo] = []
    refused = [c for c in rows if refusal(vars(c))]
    rows = [c for c in rows if not refusal(vars(c))]
    while want:
        def gain(c):
            return {(a, getattr(c, a)) for a in AXES} & want
        best = max(rows, key=lambda c: (bool(gain(c)), _world(vars(c)) < MAX_WORLD,
                                        len(gain(c)) / _cost(vars(c)), -rows.index(c)))
        chosen.append(best)
        want -= gain(best)
    return chosen + refused        # and every refusal rule (refused at compile: cheap)


@dataclass(frozen=True)
class CCase(common.Case):
    """A composition case (tests/workers/common.Case plus the axes it lacks)."""
    recompute: str = "none"
    zero: int = 0
    precision: str = "fp32"
    compile: bool = False
    reuse: bool = True
    noise: str = "none"          # bf16 only: which workers/precision.BOUNDS applies
    routed: bool = False         # bf16 only: experts' routers (workers/precision.PARAM_BOUNDS)
    round_cuts: bool = True      # bf16 only: the reference rounds at the pipeline cuts
    refused: tuple = ()          # what parallelize's error must say (empty: it must train)
    feed: str = "global"         # local: train_step given pm.local_batch of it (fed_shares)
    memory_budget: str | None = None   # zero=3: lets the gather pass keep groups gathered

    def options(self) -> dict:
        """parallelize's keyword arguments beyond tests/workers/common.Case's."""
        budget = {} if self.memory_budget is None else {"memory_budget": self.memory_budget}
        # fp8: only its refused cases reach parallelize through these (_expect_refusal); the
        # trained ones run tests/workers/fp8.py's harness, which passes its own precision
        fp8 = {"precision": "fp8"} if self.precision == "fp8" else {}
        return dict(recompute=self.recompute, zero=self.zero, compile=self.compile, **budget,
                    **fp8)


# -- models ---------------------------------------------------------------------------------------

VOCAB = 128


def _logits_loss(out, target):
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _gpt(tied: bool):
    from examples.gpt import GPT, GPTConfig, lm_loss
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=16,
                    tie_weights=tied)
    return GPT(cfg), lm_loss


def _hf_gpt2(tied: bool):
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg), _logits_loss


def _hf_mixtral(tied: bool):
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, num_experts_per_tok=2,
                                     num_local_experts=4, tie_word_embeddings=tied)
    return transformers.MixtralForCausalLM(cfg), _logits_loss


def _register() -> None:
    for name, make in (("gpt", _gpt), ("hf-gpt2", _hf_gpt2), ("hf-mixtral", _hf_mixtral)):
        for emb in ("tied", "untied"):
            def build(case, seed, device, make=make, tied=emb == "tied"):
                torch.manual_seed(seed)
                model, loss_fn = make(tied)
                g = torch.Generator().manual_seed(seed + 1)
                x = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
                y = torch.randint(0, VOCAB, (case.batch, case.seq), generator=g)
                return model.to(device), loss_fn, (x.to(device),), y.to(device)
            common.FAMILIES[f"c-{name}-{emb}"] = build


_register()


# -- the rank function ----------------------------------------------------------------------------

def run_composition(rank: int, world: int, cases: list) -> list[dict]:
    """Rank function: each case against the plain model (fp32:
    tests/workers/equivalence.equivalence; bf16: tests/workers/precision.bf16_equivalence, against
    the written-out bf16 recipe; fp8: tests/workers/fp8.fp8_equivalence, against the written-out
    FP8 recipe)."""
    from tests.workers.fp8 import run_fp8_cases
    from tests.workers.precision import Wire, run_bf16_cases
    out = []
    for case in cases:      # a plain Case (tests/workers/common.py) runs as an fp32 CCase
        os.environ["AUTOPART_LAYER_REUSE"] = "1" if getattr(case, "reuse", True) else "0"
        if getattr(case, "refused", ()):
            out.append(_expect_refusal(case, rank))
            continue
        with fed_shares(case) as fed:
            if getattr(case, "precision", "fp32") == "bf16":
                [result] = run_bf16_cases(rank, world, [case])
            elif getattr(case, "precision", "fp32") == "fp8":     # the written-out FP8 recipe
                [result] = run_fp8_cases(rank, world, [case])
            else:   # the wire too: an fp32 run must send no bf16 (judged in the test process)
                with Wire() as wire:
                    [result] = run_cases(rank, world, [case], wire)
                result["wire"] = wire.report()
        result["problems"] += share_problems(case, fed)
        out.append(result)
        if any(p.startswith("raised on rank") for p in result["problems"]):
            out += [{"case": c.name, "rank": rank,
                     "problems": [f"not run: case {case.name!r} failed before it"]}
                    for c in cases[len(out):]]
            break
    return out


@contextmanager
def fed_shares(case):
    """case.feed == "local": while the case runs, every pm.train_step is given only this rank's
    share of the global batch the harness passes it, pm.local_batch(...) with local=True, under
    whichever harness runs the case (fp32, bf16, fp8); the plain model still trains on the global
    batch. Yields the shapes each call was given (None: a tensor the rank does not read)."""
    from autopart.runtime.parallel_model import ParallelModel
    fed: list = []
    whole = ParallelModel.train_step

    def share_only(pm, *inputs, target=None, local=None):
        xs, t = pm.local_batch(*inputs, target=target)
        fed.append([None if v is None else tuple(v.shape) for v in (*xs, t)])
        return whole(pm, *xs, target=t, local=True)
    if getattr(case, "feed", "global") == "local":
        ParallelModel.train_step = share_only
    try:
        yield fed
    finally:
        ParallelModel.train_step = whole


def share_problems(case, fed: list) -> list[str]:
    """A local case's train_step calls were each given a share: every tensor given is its
    replica's batch / dp rows and, on the sequence, seq / cp positions (None for the others: a
    rank holding only middle chunks, as pp rank 1 under a V schedule, is given nothing)."""
    if getattr(case, "feed", "global") != "local":
        return []
    if not fed:
        return ["a local-batch case, but no train_step was given a share"]
    want = (case.batch // case.dp, case.seq // case.cp)
    bad = [shapes for shapes in fed if any(s is not None and tuple(s[:2]) != want for s in shapes)]
    return [f"train_step given {bad[0]}, not shares of {want} rows x positions"] if bad else []


def _expect_refusal(case: CCase, rank: int) -> dict:
    """parallelize must raise an AutopartError saying each of case.refused (at compile time, on
    every rank alike, so no rank is left in a collective)."""
    import autopart
    problems = []
    try:
        equivalence(case, rank)
        problems.append(f"trained, but autopart should refuse it saying {case.refused}")
    except autopart.AutopartError as e:
        missing = [s for s in case.refused if s not in str(e)]
        if missing:
            problems.append(f"refused without saying {missing}: {e}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"raised {type(e).__name__}, not an AutopartError: {e}")
    return {"case": case.name, "rank": rank, "problems": problems}
