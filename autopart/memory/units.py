"""The model's units and options: state kinds, optimizer states, ZeRO levels, byte sizes."""
from __future__ import annotations

import math
import re
from autopart.config import choices
from autopart.errors import AutopartError


KEYS = ("params", "grads", "master", "optimizer", "activations", "buffers", "total")
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2}   # param-sized tensors per parameter
# written once, in autopart/config.py. 1: optimizer state and fp32 master slice sharded over dp
# (ZeRO-1); 2: the gradients too (ZeRO-2); 3: the parameters too (ZeRO-3)
ZERO_LEVELS = choices("zero")
ADAM_STEP = 4               # torch.optim.Adam's `step`: one fp32 scalar per tensor it steps
# Parameter-sized temporaries of one parameter's step: Adam's sqrt(v) and sqrt(v) / c (denom);
# SGD's momentum update is in place. With ZeRO-1 the step runs on buckets (runtime/optimizer.py).
STEP_TEMPORARIES = {"sgd": 0, "sgd-momentum": 0, "adam": 2}


def check_optimizer(optimizer: str) -> None:
    from autopart.config import check_choice     # the one check of option values
    check_choice("optimizer", optimizer)


def check_zero(zero: int) -> None:
    from autopart.config import check_choice
    check_choice("zero", zero)


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
