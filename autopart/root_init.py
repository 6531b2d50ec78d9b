"""A model's own whole-model `init_weights()` (torchtitan's convention), run on a meta model.

torchtitan builds its models on the meta device, then calls `model.init_weights()` once on the
root: it recomputes buffers (RoPE's `freqs_cis`) and initializes every parameter in place from
the global generator, layer after layer. The numbers a parameter gets depend on everything
initialized before it, so a rank cannot initialize only its own layers: it must run the whole
function, in order, drawing the same random numbers as the plain model does.

This runs it on a copy of the meta model under a dispatch mode that gives each parameter a real
"shadow" tensor the moment an op touches it, and hands the finished tensor to `sink(names,
value)` as soon as the function moves on to another tensor (one full tensor alive at a time, so
a rank keeps only its slice). Factory ops asked for the meta device (the buffer recomputation
runs under `torch.device(self.freqs_cis.device)`, which is meta) make real tensors instead, so
buffers come out real. `params=False` runs it for the buffers only: ops on parameters are
skipped (no time, no memory), buffers computed as above.

A function that touches a tensor again after moving on (rare in init code) is refused, naming
the tensor: its values were already handed over.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import textwrap
from typing import Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopart.errors import AutopartError

Sink = Callable[[list[str], torch.Tensor], None]


def root_init_fn(model: nn.Module) -> Callable | None:
    """The root's whole-model `init_weights`, when the model follows torchtitan's convention
    (a Hugging Face model's `init_weights` is its per-module `_init_weights` run over the tree:
    autopart runs that one per module instead)."""
    if callable(getattr(model, "_init_weights", None)):
        return None
    fn = getattr(model, "init_weights", None)
    return fn if callable(fn) else None


def run_root_init(model: nn.Module, device, sink: Sink, *, params: bool) -> dict[str, torch.Tensor]:
    """Run `model.init_weights()` on a copy of the meta `model`; parameters (and buffers it fills in
    place) go to `sink` one at a time; returns {name: value} of the buffers it assigned anew
    (`self.freqs_cis = ...`), by every name they have."""
    twin = copy.deepcopy(model)
    names = _names_by_storage(twin)
    mode = _Shadows(names, torch.device(device), sink, params)
    # buffers only (the parameters come from a load): trunc_normal_'s meta early return stays,
    # since its sampling would read bounds back with .item() from a parameter left meta
    sampling = _sampling_meta_tensors() if params else contextlib.nullcontext()
    with torch.no_grad(), sampling, mode:
        twin.init_weights()
    mode.finish()
    out = {}
    for path, module in twin.named_modules(remove_duplicate=False):
        for k, b in module._buffers.items():
            if b is not None and b.device.type != "meta":
                out[f"{path}.{k}" if path else k] = b
    return out


_META_RETURN = "    if tensor.is_meta:\n        return tensor\n"


@contextlib.contextmanager
def _sampling_meta_tensors():
    """torch >= 2.12's `nn.init.trunc_normal_` returns at once for a meta tensor (no storage to
    sample into), above this module's dispatch mode, so a root init_weights() would never write
    those weights. While it runs, the same function without that early return, compiled from
    torch's own source: the numbers drawn are the plain model's, whatever torch's algorithm."""
    original = nn.init._no_grad_trunc_normal_
    source = textwrap.dedent(inspect.getsource(original))
    if _META_RETURN not in source:
        yield
        return
    scope: dict = {}
    exec(compile(source.replace(_META_RETURN, ""), inspect.getsourcefile(original), "exec"),
         vars(nn.init), scope)
    nn.init._no_grad_trunc_normal_ = scope[original.__name__]
    try:
        yield
    finally:
        nn.init._no_grad_trunc_normal_ = original


def _names_by_storage(model: nn.Module) -> dict[int, tuple[list[str], torch.Tensor]]:
    out: dict[int, tuple[list[str], torch.Tensor]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for k, t in table.items():
                if t is not None and t.device.type == "meta":
                    entry = out.setdefault(_key(t), ([], t))
                    name = f"{path}.{k}" if path else k
                    if name not in entry[0]:
                        entry[0].append(name)
    return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Shadows(TorchDispatchMode):
    def __init__(self, names: dict, device: torch.device, sink: Sink, params: bool):
        super().__init__()
        self.names, self.device, self.sink, self.params = names, device, sink, params
        self.shadows: dict[int, torch.Tensor] = {}    # storage key -> flat real storage
        self.done: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        leaves = pytree.tree_leaves((args, kwargs))
        mine = {_key(t) for t in leaves if isinstance(t, torch.Tensor) and t.is_meta
                and _key(t) in self.names}
        if not mine:
            if kwargs.get("device") == torch.device("meta"):
                kwargs["device"] = self.device          # a buffer being computed: make it real
            return func(*args, **kwargs)
        if not self.params:                              # buffers only: parameters stay meta
            return args[0] if _in_place(func) else func(*args, **kwargs)
        for key in set(self.shadows) - mine:            # moved on: hand the finished ones over
            self._hand_over(key)
        real = pytree.tree_map(self._real, (args, kwargs))
        out = func(*real[0], **real[1])
        return args[0] if _in_place(func) else out

    def _real(self, x):
        if not (isinstance(x, torch.Tensor) and x.is_meta and _key(x) in self.names):
            return x
        key = _key(x)
        if key in self.done:
            names = self.names[key][0]
            raise AutopartError(
                f"init_weights() touched {names[0]} again after initializing other tensors; "
                "autopart runs a model's own init_weights one tensor at a time (each rank keeps "
                "only its slice), so it cannot go back to one.\n  remedy: pass init_fn=... (a "
                "function initializing one module in place), or load weights with "
                "pm.load_pretrained(...)")
        if key not in self.shadows:
            st = x.untyped_storage()
            self.shadows[key] = torch.empty(st.nbytes() // x.element_size(), dtype=x.dtype,
                                            device=self.device)
        return self.shadows[key].as_strided(x.size(), x.stride(), x.storage_offset())

    def _hand_over(self, key: int) -> None:
        flat = self.shadows.pop(key)
        names, t = self.names[key]
        self.sink(names, flat.as_strided(t.size(), t.stride(), t.storage_offset()))
        self.done.add(key)

    def finish(self) -> None:
        for key in list(self.shadows):
            self._hand_over(key)


def _in_place(func) -> bool:
    return func._schema.is_mutable and bool(func._schema.returns) and \
        func._schema.returns[0].alias_info is not None and func._schema.returns[0].alias_info.is_write


__all__ = ["root_init_fn", "run_root_init"]
