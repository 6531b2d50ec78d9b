"""The registry of autopart's own graph ops: what each one is, looked up by identity.

Passes insert these ops into rank programs; analyses (costs, explain, the program checker) must
recognise them. They look them up here instead of matching strings, so a new op is one
`register` call. `namespace` is the name the op prints under in emitted code
(`autopart_tp_ops_copy_to_tp(...)`): part of the documented program text, kept stable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class OpInfo:
    name: str
    kind: str          # "collective" (moves data between ranks), "p2p" (a pipeline transfer
                       # marker) or "local" (an op of ours that computes on this rank only)
    axis: str          # the mesh axis it communicates over: "tp", "ep" or "pp"
    # its output feeds a linear (Megatron's f, sequence parallelism's gather-then-linear): under
    # bf16 the executor casts its input before it, so that its collectives carry bf16 too
    before_linear: bool = False

    @property
    def communicates(self) -> bool:
        return self.kind != "local"


_OPS: dict[Callable, OpInfo] = {}


def register(*fns: Callable, kind: str, axis: str, namespace: str,
             before_linear: bool = False) -> None:
    """Record `fns` as autopart ops of `kind` over `axis`, printed under `namespace`."""
    for fn in fns:
        fn.__module__ = namespace
        _OPS[fn] = OpInfo(fn.__name__, kind, axis, before_linear)


def op_info(target) -> OpInfo | None:
    """The OpInfo of a call_function target, or None for anything not ours (ATen ops)."""
    try:
        return _OPS.get(target)
    except TypeError:        # an unhashable target is not one of ours
        return None


def is_autopart_op(target, *, axis: str | None = None, kind: str | None = None) -> bool:
    info = op_info(target)
    return info is not None and (axis is None or info.axis == axis) and \
        (kind is None or info.kind == kind)
