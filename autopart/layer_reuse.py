"""Layer reuse: capture a model whose layers repeat by tracing two of them, not all.

torch.export spends ~0.15 s per transformer layer, so a 128-layer model took ~20 s to capture
although its layers are one graph 128 times. When a module list's children are structurally
identical (same type, the same parameter and buffer names, shapes, dtypes and persistence, the
same non-tensor attribute values at every depth, no hooks, no state shared with the rest of the
model), the model is exported with that list cut to its first two children; the two layers'
graphs are compared (layer 1 must be layer 0 with `.0.` renamed `.1.` in its parameters and
module paths, reading layer 0's output where layer 0 read the layer input) and the layer-1
subgraph is copied for layers 2..N-1 with parameter names and nn_module_stack paths renamed.
The result is node for node the Program the full trace gives: the same node names, ops, args,
meta["val"], nn_module_stack and stack_trace.

Anything that could make the layers differ falls back to tracing every layer: layers whose two
graphs differ; a forward that asks the shortened list for its length or for one layer by index
(it could depend on the layer count); an attribute that differs between layers (HF's layer_idx)
and is read while tracing; constants lifted from inside a layer (their names are numbered over
the whole model); node names the splice cannot reproduce. AUTOPART_LAYER_REUSE=0 turns it off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from autopart.errors import AutopartError
from autopart.ir import Program, graph_module

log = logging.getLogger(__name__)
ENV = "AUTOPART_LAYER_REUSE"
_MIN_LAYERS = 3          # with two or fewer the short trace is the full one
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}


def enabled(flag: bool | None = None) -> bool:
    """`flag` if given, else on unless AUTOPART_LAYER_REUSE is 0/false/off (for debugging)."""
    if flag is not None:
        return flag
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@dataclasses.dataclass
class Repeat:
    """A module list of `n` structurally identical children at module path `path`."""
    path: str
    parent: nn.Module
    attr: str
    children: nn.Module       # the list itself
    n: int
    differing: frozenset      # (submodule path in a layer, attribute name) whose values differ


def capture_reusing(model: nn.Module, trace: Callable[[], Program]) -> Program | None:
    """The Program of `model` traced with its longest repeated list cut to two layers and the
    rest spliced in, or None (trace the whole model) when that cannot be shown to be exact.
    `trace()` exports the model as it is at the time of the call."""
    rep = find_repeat(model)
    if rep is None:
        return None
    with _shortened(rep) as reads:
        try:
            small = trace()
        except AutopartError:
            return None          # e.g. indexes layers past the second: the full trace explains
    if reads:
        return _skip(rep, f"forward reads {sorted(reads)}, which may depend on the layer")
    why = _unsupported(small, rep)
    if why:
        return _skip(rep, why)
    try:
        program = splice(small, model, rep, rep.n)
        log.info("layer reuse: traced 2 of the %d layers of %s, spliced the rest", rep.n, rep.path)
        return program
    except _Mismatch as e:
        return _skip(rep, str(e))


def _skip(rep: Repeat, why: str) -> None:
    log.info("layer reuse off for %s (%d layers): %s; tracing every layer", rep.path, rep.n, why)
    return None


# -- finding the repeated children ------------------------------------------------------------------

def find_repeat(model: nn.Module) -> Repeat | None:
    """The longest nn.ModuleList / nn.Sequential (children named 0..N-1, N >= 3) whose children
    are structurally identical, or None."""
    lists = [(path, m) for path, m in model.named_modules()
             if path and type(m) in (nn.ModuleList, nn.Sequential) and len(m) >= _MIN_LAYERS
             and list(m._modules) == [str(i) for i in range(len(m))]]
    if not lists:
        return None
    path, lst = max(lists, key=lambda pm: len(pm[1]))
    children = list(lst)
    shapes = [_structure(c) for c in children]
    if any(s is None or s[0] != shapes[0][0] for s in shapes) or _shares_state(model, path, children):
        return None
    differing = frozenset(key for key in shapes[0][1]
                          if len({s[1].get(key) for s in shapes}) > 1)
    parent_path, _, attr = path.rpartition(".")
    return Repeat(path, model.get_submodule(parent_path), attr, lst, len(children), differing)


def _structure(layer: nn.Module):
    """(what must be equal in every layer, {(submodule, attribute): value key}); None when the
    layer has hooks (they may differ per layer and run outside the graph's view)."""
    fixed, values = [], {}
    for sub, m in layer.named_modules(remove_duplicate=False):
        if any(v for k, v in vars(m).items() if "hook" in k and isinstance(v, dict)):
            return None
        fixed.append((sub, type(m), tuple(m._modules),
                      tuple((k, _tensor_key(v)) for k, v in m._parameters.items()),
                      tuple((k, _tensor_key(v), k in m._non_persistent_buffers_set)
                            for k, v in m._buffers.items())))
        for k, v in vars(m).items():
            if k not in _MODULE_INTERNALS:
                values[(sub, k)] = _value_key(v)
    fixed.append(tuple(sorted(values)))        # the same attribute names everywhere
    return tuple(fixed), values


def _tensor_key(t):
    return None if t is None else (tuple(t.shape), t.dtype, t.requires_grad, type(t).__name__)


def _value_key(v):
    """Plain values compare by value; any other object by identity (a shared config is equal,
    a per-layer object differs)."""
    if isinstance(v, (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)):
        return (type(v).__name__, repr(v))
    if isinstance(v, (tuple, list, frozenset)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    return ("id", id(v))


def _shares_state(model: nn.Module, path: str, children: list) -> bool:
    """A tensor or module of one layer also reachable elsewhere (tied across layers or with the
    embeddings): its names would not follow the per-layer renaming."""
    inside = {id(c) for c in children}
    seen = [id(m) for _, m in model.named_modules(remove_duplicate=False)]
    if any(seen.count(i) != 1 for i in inside):
        return True
    owner: dict[int, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + \
        list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        m = re.match(rf"{re.escape(path)}\.(\d+)\.", name)
        where = m.group(1) if m else "outside"
        if owner.setdefault(id(t), where) != where:
            return True
    return False


# -- the shortened trace ----------------------------------------------------------------------------

@contextlib.contextmanager
def _shortened(rep: Repeat):
    """Within: the list holds only its first two children, and yields the set of suspicious
    reads made while tracing (the list's length or one of its items; a differing attribute)."""
    reads: set = set()
    short = _short_list(type(rep.children), list(rep.children)[:2], rep.n, reads)
    short.training = rep.children.training
    with _watch_attributes(rep, reads):
        rep.parent._modules[rep.attr] = short
        try:
            yield reads
        finally:
            rep.parent._modules[rep.attr] = rep.children


def _short_list(cls, kept: list, n: int, reads: set) -> nn.Module:
    """A `cls` holding `kept` that records every access other than iterating over all of it
    (or over a slice [:n] of it, as HF's layers[: config.num_hidden_layers])."""

    class Short(cls):
        def __len__(self):
            reads.add("len(layers)")
            return super().__len__()

        def __getitem__(self, idx):
            if isinstance(idx, slice) and idx.start in (None, 0) and idx.step in (None, 1) \
                    and (idx.stop is None or idx.stop >= n):
                return self
            reads.add(f"layers[{idx!r}]")
            return super().__getitem__(idx)

    # the list is itself a module in nn_module_stack when it is called (nn.Sequential)
    Short.__name__, Short.__qualname__, Short.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    short = Short()
    for i, m in enumerate(kept):
        short.add_module(str(i), m)
    return short


class _Watched:
    """A data descriptor put on a layer's class while tracing: reading `name` is recorded."""

    def __init__(self, name: str, reads: set):
        self.name, self.reads = name, reads

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        self.reads.add(self.name)
        try:
            return obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value


@contextlib.contextmanager
def _watch_attributes(rep: Repeat, reads: set):
    first = list(rep.children)[0]
    classes = {(type(first.get_submodule(sub)), name) for sub, name in rep.differing}
    for cls, name in classes:
        if any(name in vars(c) for c in cls.__mro__):
            reads.add(f"{cls.__name__}.{name} (a class attribute too)")
    installed = [(cls, name) for cls, name in classes if not any(name in vars(c) for c in cls.__mro__)]
    for cls, name in installed:
        setattr(cls, name, _Watched(name, reads))
    try:
        yield
    finally:
        for cls, name in installed:
            delattr(cls, name)


# -- splicing ---------------------------------------------------------------------------------------

class _Mismatch(Exception):
    """Layer 1 is not layer 0 renamed: trace every layer."""


def _unsupported(small: Program, rep: Repeat) -> str | None:
    for node in small.gm.graph.nodes:
        if node.op == "get_attr" and isinstance(small.gm.get_submodule(node.target.rpartition(".")[0])
                                                ._modules.get(node.target.rpartition(".")[2]), nn.Module):
            return "the graph has higher-order-op submodules (numbered over the whole model)"
        if node.op == "get_attr" and str(node.target).startswith("_const_") and \
                any(_layer(u, rep.path) is not None for u in node.users):
            return "a layer uses a lifted constant (numbered over the whole model)"
    return None


def _layer(node: fx.Node, path: str) -> int | None:
    """0 or 1 for a node of that layer (its parameter or buffer, or an op inside it), else None."""
    if node.op == "get_attr":
        m = re.match(rf"{re.escape(path)}\.(\d+)\.", str(node.target))
        return int(m.group(1)) if m else None
    if node.op != "call_function":
        return None
    for p, _ in (node.meta.get("nn_module_stack") or {}).values():
        m = re.fullmatch(rf"{re.escape(path)}\.(\d+)(\..*)?", p)
        if m:
            return int(m.group(1))
    return None


def _renamer(path: str, k: int) -> Callable[[str], str]:
    """Layer 1's name -> layer k's (parameters, module paths and nn_module_stack keys)."""
    pattern = re.compile(rf"(^|\.){re.escape(path)}\.1(?=\.|$)")
    done: dict[str, str] = {}      # a layer's few module paths recur in every node's stack

    def rename(s: str) -> str:
        if s not in done:
            done[s] = pattern.sub(lambda m: f"{m.group(1)}{path}.{k}", s)
        return done[s]
    return rename


def _runs(nodes: list, layer: dict) -> list[tuple[list, list]]:
    """[(layer-0 run, the layer-1 run right after it)]: maximal runs of consecutive nodes of one
    layer, which must come as such adjacent pairs."""
    runs: list[tuple[int | None, list]] = []
    for node in nodes:
        i = layer.get(node)
        if runs and runs[-1][0] == i:
            runs[-1][1].append(node)
        else:
            runs.append((i, [node]))
    pairs = []
    for j, (i, run) in enumerate(runs):
        if i == 0:
            if j + 1 == len(runs) or runs[j + 1][0] != 1:
                raise _Mismatch("the two layers' nodes are not two consecutive copies")
            if len(run) != len(runs[j + 1][1]):
                raise _Mismatch(f"layer 0 has {len(run)} nodes there, layer 1 {len(runs[j + 1][1])}")
            pairs.append((run, runs[j + 1][1]))
        elif i == 1 and (j == 0 or runs[j - 1][0] != 0):
            raise _Mismatch("the two layers' nodes are not two consecutive copies")
    return pairs


def splice(small: Program, model: nn.Module, rep: Repeat, n: int) -> Program:
    """`small` (traced with layers 0 and 1) with layer 1's nodes copied for layers 2..n-1."""
    nodes = list(small.gm.graph.nodes)
    layer = {node: i for node in nodes if (i := _layer(node, rep.path)) is not None}
    pairs = _runs(nodes, layer)
    partner = {one: zero for zeros, ones in pairs for zero, one in zip(zeros, ones)}
    end = nodes.index(pairs[-1][1][-1]) if pairs else len(nodes)
    _check_users(nodes, layer, end)
    for one, zero in partner.items():
        _same_node(zero, one, partner, layer, rep.path)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}            # small's node -> its node in the new graph
    copies: list[dict] = [{} for _ in range(max(n, 2))]   # [k]: layer-1 node -> layer k's node
    run_end = {ones[-1]: ones for _, ones in pairs}
    for i, node in enumerate(nodes):
        after = i > end                         # the head: layer 1 there means the last layer
        arg = (lambda a: copies[n - 1][a] if layer.get(a) == 1 and n > 2 else env[a]) if after \
            else env.__getitem__
        name = _name(node)
        env[node] = _emit(graph, node.op, node.target, fx.map_arg((node.args, node.kwargs), arg),
                          name, node.type, dict(node.meta))
        if layer.get(node) == 1:
            copies[1][node] = env[node]
        for k in range(2, n) if node in run_end else ():
            _copy_run(graph, run_end[node], k, copies, env, layer, partner, rep.path)
    return _program(small, model, rep, n, graph)


def _copy_run(graph, run: list, k: int, copies: list, env: dict, layer: dict, partner: dict,
              path: str) -> None:
    """Layer k's copy of a run of layer-1 nodes: its own parameters, the previous layer's output
    where layer 1 reads layer 0's, the same nodes outside the layers."""
    rename = _renamer(path, k)
    follows = {zero: one for one, zero in partner.items()}

    def arg(a):
        if layer.get(a) == 1:
            return copies[k][a]
        if layer.get(a) == 0:
            return copies[k - 1][follows[a]]
        return env[a]

    for one in run:
        if one.op == "get_attr":
            target, name = rename(one.target), None
        else:
            target, name = one.target, _name(one)
        copies[k][one] = _emit(graph, one.op, target, fx.map_arg((one.args, one.kwargs), arg),
                               name, one.type, _renamed_meta(one.meta, rename))


def _emit(graph: fx.Graph, op: str, target, args_kwargs, name: str | None, type_expr, meta: dict):
    args, kwargs = args_kwargs
    if name is None:
        new = graph.get_attr(target)            # named after its target, as capture names it
    else:
        new = graph.create_node(op, target, args, kwargs, name, type_expr)
    new.meta = meta
    return new


def base_name(name: str) -> str:
    """linear_3 -> linear: the graph's namespace numbers nodes of one op again in graph order."""
    return re.sub(r"_\d+$", "", name)


def _name(node: fx.Node) -> str:
    return base_name(node.name) if node.op == "call_function" else node.name


def _renamed_meta(meta: dict, rename) -> dict:
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = {rename(k): (rename(p), cls) for k, (p, cls) in stack.items()}
    return out


def _check_users(nodes: list, layer: dict, end: int) -> None:
    """Layer 0's nodes feed only layers 0 and 1; layer 1's only itself and what follows the
    layers (else a later layer or the head would read an intermediate of one particular layer)."""
    position = {node: i for i, node in enumerate(nodes)}
    for node, i in layer.items():
        for user in node.users:
            j = layer.get(user)
            if (i == 0 and j is None) or (i == 1 and j == 0) or \
                    (i == 1 and j is None and position[user] <= end):
                raise _Mismatch(f"{user.name} reads {node.name} of layer {i}")


def _same_node(zero: fx.Node, one: fx.Node, partner: dict, layer: dict, path: str) -> None:
    to_one = re.compile(rf"(^|\.){re.escape(path)}\.0(?=\.|$)")

    def renamed(s):
        return to_one.sub(lambda m: f"{m.group(1)}{path}.1", s)

    target = renamed(zero.target) if zero.op == "get_attr" else zero.target
    if zero.op != one.op or target != one.target:
        raise _Mismatch(f"{one.name} ({one.target}) is not {zero.name} ({zero.target}) renamed")
    if not _same_args((zero.args, zero.kwargs), (one.args, one.kwargs), partner, layer):
        raise _Mismatch(f"{one.name}'s arguments differ from {zero.name}'s")
    meta0 = _renamed_meta(zero.meta, renamed)
    for key in ("nn_module_stack", "stack_trace"):
        if meta0.get(key) != one.meta.get(key):
            raise _Mismatch(f"{one.name}'s {key} differs from {zero.name}'s")
    for key in ("val", "tensor_meta"):
        if _value(zero.meta.get(key)) != _value(one.meta.get(key)):
            raise _Mismatch(f"{one.name}'s {key} differs from {zero.name}'s")


def _same_args(a0, a1, partner: dict, layer: dict) -> bool:
    if isinstance(a1, fx.Node):
        if not isinstance(a0, fx.Node):
            return False
        if a1 in partner:                        # a node of layer 1: layer 0's counterpart
            return partner[a1] is a0
        if layer.get(a1) == 0:                   # layer 1's input is layer 0's output where
            return a0 not in layer               # layer 0 read something from outside
        return a0 is a1                          # the same node outside the layers
    if isinstance(a1, (tuple, list)):
        return type(a0) is type(a1) and len(a0) == len(a1) and \
            all(_same_args(x, y, partner, layer) for x, y in zip(a0, a1))
    if isinstance(a1, dict):
        return isinstance(a0, dict) and a0.keys() == a1.keys() and \
            all(_same_args(a0[k], a1[k], partner, layer) for k in a1)
    if isinstance(a1, slice):
        return isinstance(a0, slice) and _same_args((a0.start, a0.stop, a0.step),
                                                     (a1.start, a1.stop, a1.step), partner, layer)
    return type(a0) is type(a1) and repr(a0) == repr(a1)


def _value(v):
    """A comparable form of meta['val'] (FakeTensors: shape, stride, dtype, device, grad)."""
    if isinstance(v, torch.Tensor):
        return ("T", str(tuple(v.shape)), str(v.stride()) if v.layout == torch.strided else None,
                v.dtype, v.device.type, v.requires_grad)
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    return repr(v)


def _program(small: Program, model: nn.Module, rep: Repeat, n: int, graph: fx.Graph) -> Program:
    """The spliced graph as a Program: state of layers 2..n-1 named and ordered as capture names
    and orders the full model's (right after layer 1's)."""
    named = {**dict(model.named_buffers(remove_duplicate=False)),
             **dict(model.named_parameters(remove_duplicate=False))}
    attrs = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            t = node.target
            attrs[t] = named[t] if t in named else getattr(small.gm, t)
    return dataclasses.replace(small, gm=graph_module(attrs, graph),
                               params=_expand(small.params, rep.path, n),
                               buffers=_expand(small.buffers, rep.path, n))


def _expand(infos: dict, path: str, n: int) -> dict:
    """name -> TensorInfo with layer 1's entries repeated (renamed) for layers 2..n-1 after each
    run of them."""
    pattern = re.compile(rf"{re.escape(path)}\.1\.")
    items = list(infos.items())
    out = {}
    for i, (name, info) in enumerate(items):
        out[name] = info
        ends_run = pattern.match(name) and (i + 1 == len(items) or not pattern.match(items[i + 1][0]))
        if not ends_run:
            continue
        start = i
        while start > 0 and pattern.match(items[start - 1][0]):
            start -= 1
        for k in range(2, n):
            rename = _renamer(path, k)
            for one, inf in items[start:i + 1]:
                out[rename(one)] = dataclasses.replace(
                    inf, name=rename(inf.name), aliases=tuple(rename(a) for a in inf.aliases))
    return out


__all__ = ["ENV", "Repeat", "capture_reusing", "enabled", "find_repeat", "splice"]
