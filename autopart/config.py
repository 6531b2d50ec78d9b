"""The options of a parallel run, as one validated value (torchtitan's JobConfig, in small).

`Config` is what `compile`, `parallelize`, the pass list, the runtime, the command lines and the
planner's choice all read: one frozen dataclass whose field types spell the allowed values, so
each option's values are written once (here) and checked once (on construction, where the user
wrote them). Values that live elsewhere by nature are read from there: the schedule names from
the C++ core.

    cfg = autopart.Config(microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    compiled = autopart.compile(model, mesh, inputs, config=cfg)
    pm = autopart.parallelize(model, mesh, inputs, config=cfg.replace(nonfinite="skip"))
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass
from typing import Literal, Union

from autopart.errors import AutopartError
from autopart.schedule import SCHEDULES

Schedule = Literal[SCHEDULES]                       # the C++ core's names (autopart/schedule.py)
Recompute = Literal["none", "selective", "full", "auto"]
Optimizer = Literal["sgd", "sgd-momentum", "adam"]  # what the memory lines count
Precision = Literal["fp32", "bf16", "fp8"]
Fp8Scaling = Literal["tensorwise", "rowwise"]    # autopart/ops/fp8.py
Fp8Linears = Literal["auto", "all"]             # passes/fp8_linears.py
Zero = Literal[0, 1, 2, 3]
Nonfinite = Literal["raise", "skip", "ignore"]
CompileMode = Literal[False, True, "cudagraphs"]
CpAttention = Literal["ring", "allgather"]

REMEDIES = {
    "schedule": "a schedule named in autopart.schedule.SCHEDULES (--schedule on the command line)",
    "recompute": "none, selective (attention's inner ops), full (whole layers) or auto (the "
                 "cheapest that fits memory_budget)",
    "optimizer": "the optimizer the memory lines count: 'adam' (Adam and AdamW), 'sgd-momentum' "
                 "or 'sgd'",
    "precision": "precision=\"bf16\" (bf16 compute and transfers, fp32 master weights and "
                 "gradients), \"fp8\" (bf16, with the linears as FP8 GEMMs) or \"fp32\"; fp16 "
                 "would need loss scaling, which autopart does not do",
    "fp8_scaling": "'tensorwise' (one scale per tensor, the default) or 'rowwise' (one per row "
                   "of each GEMM operand), with precision='fp8'",
    "fp8_linears": "'auto' (the first, last and small linears stay bf16: passes/fp8_linears.py) "
                   "or 'all' (every linear found), with precision='fp8'",
    "zero": "zero=0, 1, 2 or 3 (ZeRO stage 1: optimizer state and fp32 master slice sharded "
            "over data-parallel replicas; stage 2: the gradients too; stage 3: the parameters "
            "too, gathered a layer at a time)",
    "nonfinite": "raise (stop with the step, stage and microbatch), skip (drop the step's "
                 "gradients) or ignore",
    "compile": "False, True (Inductor) or 'cudagraphs'",
    "cp_attention": "'ring' (K/V passed peer to peer around the context-parallel ranks, "
                    "overlapped with compute) or 'allgather' (K/V all-gathered at once)",
    "microbatches": "a positive integer that divides the global batch per data-parallel replica",
    "virtual_stages": "a positive integer: model chunks per pipeline rank (2 or more for the "
                      "interleaved and V schedules)",
    "zero_bucket_size": "an int such as 40000000 (gradient elements per reduce-scatter and "
                        "all-gather, Megatron-LM's 40M, the default), or leave it out",
    "batch_check_every": "a positive integer: train_step checks every this many steps that "
                         "ranks training the same share were given the same data (100 by "
                         "default; the first step and new shapes are always checked)",
    "memory_budget": "bytes per rank as an int, or a size such as '20GB' or '512MiB'",
}

# the options the planner chooses under mesh="auto" when the user leaves them unset
PLANNED = ("microbatches", "schedule", "virtual_stages", "recompute")


@dataclass(frozen=True)
class Config:
    """Every option of compile and parallelize; a wrong value fails here, naming the option, the
    value, the allowed values and a remedy."""
    microbatches: int = 1
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    memory_budget: Union[int, None] = None   # bytes per rank; '20GB' is parsed on construction
    optimizer: Optimizer = "adam"
    precision: Precision = "fp32"
    fp8_scaling: Fp8Scaling = "tensorwise"     # precision="fp8" only
    fp8_linears: Fp8Linears = "auto"           # precision="fp8" only
    zero: Zero = 0
    cp_attention: CpAttention = "ring"
    # tp's input-gradient all-reduce behind the weight gradients (passes/overlap_collectives.py);
    # ep's all-to-alls behind the other microbatch of a pair (passes/overlap_experts.py)
    overlap: bool = True
    # runtime-only: read by parallelize's ParallelModel, not by the compiler
    nonfinite: Nonfinite = "raise"
    compile: CompileMode = False
    zero_bucket_size: Union[int, None] = None
    # train_step checks that the ranks training one share of the batch were given the same
    # values (one all-gather of hashes) on its first step, on new shapes and every this many
    batch_check_every: int = 100

    def __post_init__(self):
        if self.memory_budget is not None:     # '20GB', 20e9 -> bytes, or a clear error
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        hints = _hints()
        for f in dataclasses.fields(self):
            _check(f.name, getattr(self, f.name), hints[f.name])
        if self.recompute == "auto" and self.memory_budget is None:
            raise AutopartError("recompute='auto' chooses under a memory budget, but none was "
                                "given.\n  remedy: pass memory_budget (e.g. '20GB'), or recompute="
                                "'none' | 'selective' | 'full'")
        for name in ("fp8_scaling", "fp8_linears"):
            if self.precision != "fp8" and getattr(self, name) != _field_default(name):
                raise AutopartError(f"{name}={getattr(self, name)!r} chooses how FP8 linears "
                                    f"run, but precision={self.precision!r} has none.\n  remedy: "
                                    f"pass precision='fp8', or leave {name} out")
        if self.zero_bucket_size is not None and not self.zero:
            raise AutopartError(f"zero_bucket_size={self.zero_bucket_size} sizes the buckets of "
                                "zero=1's reduce-scatter and all-gather, but zero=0 has none.\n"
                                "  remedy: pass zero=1, or leave zero_bucket_size out")

    def replace(self, **changes) -> "Config":
        """A copy with `changes` (checked like the constructor's)."""
        unknown = set(changes) - set(names())
        if unknown:
            raise AutopartError(f"Config has no option {', '.join(sorted(unknown))}: the options "
                                f"are {', '.join(names())}")
        return dataclasses.replace(self, **changes)

    def changed(self) -> dict:
        """The options that differ from their defaults, in field order (what explain() prints)."""
        default = Config()
        return {n: getattr(self, n) for n in names() if getattr(self, n) != getattr(default, n)}

    def __str__(self) -> str:
        set_ = self.changed()
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in set_.items()) + ")"


def _field_default(name: str):
    return Config.__dataclass_fields__[name].default


@functools.cache
def _hints() -> dict:
    """Config's field types, resolved once (get_type_hints evaluates the annotation strings:
    ~150 us a call, and the memory model checks its optimizer and ZeRO level per rank)."""
    return typing.get_type_hints(Config)


def names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config))


def choices(name: str) -> tuple:
    """The allowed values of a choice option (what the command lines offer)."""
    args = typing.get_args(_hints()[name])
    if not args or not all(isinstance(a, (str, bool, int)) for a in args):
        raise KeyError(f"{name} is not a choice option")
    return args


def from_options(config: Config | None, options: dict) -> Config:
    """The Config of a call that may pass `config=` and/or options as keywords: keywords given
    (not None) override the config's fields; a name that is no option is refused."""
    if config is not None and not isinstance(config, Config):
        raise AutopartError(f"config is a {type(config).__name__}, not an autopart.Config.\n"
                            "  remedy: config=autopart.Config(...), or the options as keywords")
    given = {k: v for k, v in options.items() if v is not None}
    if not given:       # a Config is checked when it is made: nothing to check again
        return config or Config()
    return (config or Config()).replace(**given)


def check_choice(name: str, value):
    """Raise unless `value` is allowed for option `name` (for code handed one option alone: the
    memory model's optimizer, the runtime's nonfinite mode); return it."""
    _check(name, value, _hints()[name])
    return value


def _check(name: str, value, kind) -> None:
    origin = typing.get_origin(kind)
    if origin is Literal:
        allowed = typing.get_args(kind)
        # same type too: zero=True or compile=1 would compare equal to 1 / True
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise AutopartError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}."
                                f"\n  remedy: {REMEDIES[name]}")
    elif kind is bool:
        if not isinstance(value, bool):
            raise AutopartError(
                f"{name}={value!r} is a {type(value).__name__}, not a bool (any non-empty string "
                f"or non-zero number would switch it on).\n  remedy: pass {name}=True or "
                f"{name}=False (on the command line: the flag --{name.replace('_', '-')}, or "
                "leave it out)")
    elif kind is int or (origin is Union and value is not None):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AutopartError(f"{name}={value!r} must be >= 1 (an integer).\n  remedy: "
                                f"{REMEDIES[name]}")


# Sizes: memory_budget's parser (here, where the option is checked) and its printer
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


_SIZE = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(value, name: str = "memory_budget") -> int:
    """'20GB' -> 20e9, '1.5GiB' -> 1.5 * 2**30, 123 -> 123; anything else (a malformed string,
    a non-positive, nan or infinite number, a bool) is an AutopartError naming the option."""
    n = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m and m.group(2).upper() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if n is None or not math.isfinite(n) or n < 1:
        why = ("is not a size" if n is None else
               "is not a size: a budget must be a positive, finite number of bytes")
        flag = "--" + name.replace("_", "-")
        raise AutopartError(      # one line: the command line prints it as it is
            f"{name}={value!r} ({flag} on the command line) {why}; remedy: a positive number of "
            "bytes per rank (e.g. 20e9) or a size such as '20GB', '512MiB', '1.5GiB' (units B, "
            "KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(n)


def fmt_bytes(n: float) -> str:
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


__all__ = ["Config", "PLANNED", "REMEDIES", "check_choice", "choices", "fmt_bytes", "from_options", "names",
           "parse_bytes", "Schedule",
           "Recompute", "Optimizer", "Precision", "Fp8Scaling", "Fp8Linears", "Zero", "Nonfinite", "CompileMode",
           "CpAttention", "check_fp8"]


def check_fp8(cfg: Config, mesh) -> None:
    """Refuse what precision="fp8" is not tested to train right with (tests/test_fp8.py), on the
    mesh (anything with .cp and .ep): here, not in the compiler, so the planner ranks only what
    the compile runs in FP8 by the same rule."""
    if cfg.precision != "fp8":
        return
    untested = [what for what, on in (
        (f"cp={mesh.cp} (context parallelism)", mesh.cp > 1),
        (f"ep={mesh.ep} (expert parallelism: the experts' matmuls are not FP8)", mesh.ep > 1),
        ("zero=3 with fp8_scaling='rowwise' (the weight is cast per row in forward and per "
         "column for the input gradient: two FP8 casts, which one gathered weight cannot "
         "carry; tensorwise casts before the gather)",
         cfg.zero == 3 and cfg.fp8_scaling == "rowwise"),
        ("sequence_parallel=True with fp8_scaling='rowwise' (the gathered input's token "
         "columns would need a second, bf16 gather)",
         cfg.sequence_parallel and cfg.fp8_scaling == "rowwise"),
        (f"compile={cfg.compile!r} (Inductor)", cfg.compile is not False)) if on]
    if untested:
        raise AutopartError(
            f"precision='fp8' is not supported with {', '.join(untested)}: no test holds FP8 "
            "to its recipe there.\n  remedy: precision='bf16' with these options, or "
            "precision='fp8' without them (pp, tp, dp, zero=1/2, recompute, and under "
            "tensorwise scaling sequence_parallel and zero=3, are held to its recipe)")
