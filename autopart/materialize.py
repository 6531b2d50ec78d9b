"""Weights for a model built on the meta device, one module at a time.

    with autopart.meta_device():
        model = GPT(cfg)                      # no memory, no initialization
    autopart.materialize(model, seed=0)       # the plain model, initialized in place
    pm = autopart.parallelize(meta_model, mesh, ..., seed=0)   # each rank: its slices only

Every module that owns tensors directly is initialized whole and on its own: its parameters by
its own `reset_parameters()` (or the user's `init_fn(module)`, e.g. Hugging Face's
`model._init_weights`), under a generator seeded from `(seed, module path)`. So a module's
weights do not depend on which other modules a process initializes, or in which order: the plain
model and every rank of every layout get exactly the same numbers, and a rank that needs one
module's slice initializes that module only (peak memory: one module, not the model).

Buffers (RoPE's `inv_freq`, ALiBi slopes, causal masks) are not set by `reset_parameters`; they
were computed by the module's `__init__`. So a module that owns buffers is rebuilt: a fresh
instance of its class is constructed on a real device, its constructor's arguments read from
the module's attributes of the same names (`LlamaRotaryEmbedding(config)` keeps `self.config`),
and its buffers are kept. A module that cannot be rebuilt this way (an argument it does not keep,
or children with parameters that would be built too) is an error naming the buffer, unless an
`init_fn` is given (it is then trusted to fill the buffer, as Hugging Face's `_init_weights`
does for rotary embeddings).

A tensor shared by several modules (tied weights) is initialized by its first owner in
`model.named_modules()` order.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import warnings
from typing import Callable, Iterator

import torch
import torch.fx
import torch.nn as nn

from autopart.errors import AutopartError
from autopart.root_init import root_init_fn, run_root_init

InitFn = Callable[[nn.Module], None]

# torch.nn.init's functions: on the meta device they fill nothing (what Hugging Face's
# no_init_weights skips too)
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                   "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                   "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """`torch.device("meta")` with torch.nn.init's functions skipped while the model is built.

    A meta tensor holds no values, so initializing one only costs time: building megatron-1t
    (128 layers) took 2.3 s CPU under `torch.device("meta")`, 0.1 s here. The weights come
    later, from `materialize` or `load_pretrained`. Only meta tensors are skipped: one the
    constructor puts on a real device is initialized as usual."""
    saved = {n: getattr(nn.init, n) for n in _INIT_FUNCTIONS if hasattr(nn.init, n)}
    try:
        for n, f in saved.items():
            setattr(nn.init, n, _unless_meta(f))
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def _unless_meta(init: Callable) -> Callable:
    """`init`, doing nothing to a meta tensor. Not a plain no-op: a library imported inside
    meta_device() may keep the function it finds (transformers keeps torch's init functions to
    restore them), and must still get one that initializes real tensors."""
    @functools.wraps(init)
    def skip_meta(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return init(tensor, *args, **kwargs)
    return skip_meta


def materialize(model: nn.Module, seed: int = 0, init_fn: InitFn | None = None) -> nn.Module:
    """Initialize every tensor of `model` (meta or real) in place, module by module; returns it.

    Meta tensors are replaced by real ones on the CPU (or `model`'s real device); real tensors
    are overwritten in place, so an optimizer built over them stays valid.

    >>> import torch, autopart
    >>> with torch.device("meta"):
    ...     lin = torch.nn.Linear(4, 2)
    >>> a = autopart.materialize(lin, seed=1).weight
    >>> with torch.device("meta"):
    ...     lin2 = torch.nn.Linear(4, 2)
    >>> torch.equal(a, autopart.materialize(lin2, seed=1).weight)
    True
    """
    device = _real_device(model)
    replaced: dict[int, torch.Tensor] = {}       # id(old tensor) -> its new tensor (ties)
    tensors = {name: t for path, m in model.named_modules(remove_duplicate=False)
               for name, t in ((_join(path, k), t) for k, t in _direct(m).items())}

    def put(names: list[str], value: torch.Tensor) -> None:
        old = tensors[names[0]]
        if old.device.type != "meta":
            with torch.no_grad():
                old.copy_(value)
        elif id(old) not in replaced:
            replaced[id(old)] = (nn.Parameter(value.clone(), requires_grad=old.requires_grad)
                                 if isinstance(old, nn.Parameter) else value.clone())
    initial_values(model, put, seed=seed, init_fn=init_fn, device=device)
    # every owner of a replaced tensor (the tied ones too) gets the same new tensor
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None and id(t) in replaced:
                    table[key] = replaced[id(t)]
    return model


Sink = Callable[[list, torch.Tensor], None]


def initial_values(model: nn.Module, sink: Sink, *, seed: int, init_fn: InitFn | None, device,
                   wanted: set[str] | None = None) -> None:
    """Every tensor of `model` (with `wanted`, those of these full names) initialized from
    scratch and handed to `sink(names, value)` one at a time, `names` all of its names (ties).
    A root-level `init_weights()` (torchtitan) is run whole (autopart/root_init.py); else, and
    for what it leaves alone, each module on its own (module_states)."""
    aliases = _aliases(model)
    done: set[str] = set()
    if wanted is not None:            # a tie is initialized by its first owner: every name
        wanted = {n for w in wanted for n in aliases.get(w, [w])}

    def give(names, value) -> None:
        names = aliases.get(names[0], names)
        if not done.intersection(names) and (wanted is None or wanted.intersection(names)):
            sink(names, value)
        done.update(names)
    root = root_init_fn(model) if init_fn is None else None
    if root is not None:
        with _seeded(seed, "<init_weights>", torch.device(device)):
            for name, value in run_root_init(model, device, give, params=True).items():
                give([name], value)
    left = None if root is None else {n for ns in aliases.values() for n in ns} - done
    if left == set():
        return
    for path, module, values in module_states(model, seed=seed, init_fn=init_fn, device=device,
                                              wanted=left if wanted is None else
                                              (wanted if left is None else wanted & left)):
        for local, value in values.items():
            give([_join(path, local)], value)


def computed_buffers(model: nn.Module, sink: Sink, device) -> dict[str, str]:
    """Every buffer of `model` its own code computes (a fresh instance of the owning module's
    class, or the root's init_weights()), handed to `sink(names, value)`; returns {buffer name:
    why it cannot be computed} for the others. Parameters are neither allocated nor touched."""
    aliases = _aliases(model)
    done: set[str] = set()

    def give(names, value) -> None:
        names = aliases.get(names[0], names)
        if not done.intersection(names):
            sink(names, value)
        done.update(names)
    if root_init_fn(model) is not None:
        for name, value in run_root_init(model, device, give, params=False).items():
            give([name], value)
    problems = {}
    for path, module in model.named_modules():
        names = [_join(path, k) for k, b in module._buffers.items() if b is not None]
        if not names or done.issuperset(names):
            continue
        fresh, problem = _fresh(module, device)
        for k, b in module._buffers.items():
            if b is None or _join(path, k) in done:
                continue
            if fresh is not None and isinstance(fresh._buffers.get(k), torch.Tensor):
                give([_join(path, k)], fresh._buffers[k].to(device))
            else:
                problems[_join(path, k)] = buffer_problem(module, path, problem or
                                                          "its constructor does not make it")
    return problems


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Full name -> every full name of the same tensor (ties), first owner first."""
    by_id: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for k, t in _direct(m).items():
            names = by_id.setdefault(id(t), [])
            if _join(path, k) not in names:
                names.append(_join(path, k))
    return {n: names for names in by_id.values() for n in names}


def module_states(model: nn.Module, *, seed: int, init_fn: InitFn | None, device,
                  wanted: set[str] | None = None, own: "OwnInit | None" = None
                  ) -> Iterator[tuple[str, nn.Module, dict[str, torch.Tensor]]]:
    """(module path, module, {local name: initialized tensor}) for each module owning tensors
    first, in `named_modules` order, one module at a time; with `wanted` (full names), only the
    modules owning one of them. A tied tensor comes with its first owner only."""
    own = own or OwnInit(model)
    seen: set[int] = set()
    for path, module in model.named_modules():
        first = {k: t for k, t in _direct(module).items() if id(t) not in seen}
        seen.update(id(t) for t in first.values())
        if not first:
            continue
        if wanted is not None and not any(_join(path, k) in wanted for k in first):
            continue
        values = init_module(module, path, seed=seed, init_fn=init_fn, device=device, own=own)
        yield path, module, {k: values[k] for k in first}
    own.warn()


class OwnInit:
    """How `model` initializes itself when no init_fn is given (docs/memory.md, "Models that do not
    fit"): each module's `reset_parameters()`, then the root's per-module `_init_weights(module)`
    (Hugging Face's `PreTrainedModel`, nanoGPT) over it; a parameter neither set comes from a
    fresh instance of its module's class (the values its constructor gives) or, failing that,
    from the default, normal(0, 0.02) as GPT-2 and Megatron-LM use, with one warning naming
    them. (A root-level whole-model `init_weights()`, torchtitan's, is autopart/root_init.py.)"""

    def __init__(self, model: nn.Module):
        fn = getattr(model, "_init_weights", None)
        self.per_module = fn if callable(fn) else None
        self.defaulted: list[str] = []

    def __call__(self, shell: nn.Module, module: nn.Module, path: str, device) -> None:
        if hasattr(shell, "reset_parameters"):
            shell.reset_parameters()
        if self.per_module is not None:
            self.per_module(shell)
        left = [k for k, p in shell._parameters.items() if p is not None and _unset(p)]
        if not left:
            return
        fresh, _ = _fresh(module, device)
        with torch.no_grad():
            for k in left:
                p = shell._parameters[k]
                if fresh is not None and isinstance(fresh._parameters.get(k), torch.Tensor):
                    p.copy_(fresh._parameters[k])
                else:
                    p.normal_(0.0, DEFAULT_STD)
                    self.defaulted.append(_join(path, k))

    def warn(self) -> None:
        if self.defaulted:
            warnings.warn(
                f"autopart initialized {len(self.defaulted)} parameter(s) that no "
                f"reset_parameters(), _init_weights or constructor sets with normal(0, "
                f"{DEFAULT_STD}): {self.defaulted[:8]}{' ...' if len(self.defaulted) > 8 else ''}; "
                "pass init_fn=... to choose otherwise, or load them with pm.load_pretrained(...)",
                stacklevel=3)
            self.defaulted = []


DEFAULT_STD = 0.02


def _unset(t: torch.Tensor) -> bool:
    """Still the NaN init_module filled it with: nothing initialized it."""
    return t.is_floating_point() and bool(torch.isnan(t).all())


def init_module(module: nn.Module, path: str, *, seed: int, init_fn: InitFn | None,
                device, own: OwnInit | None = None) -> dict[str, torch.Tensor]:
    """`module`'s own tensors (not its children's), initialized on `device` under the
    generator of (seed, path); `module` itself is not changed."""
    device = torch.device(device)
    params = {k: p for k, p in module._parameters.items() if p is not None}
    buffers = {k: b for k, b in module._buffers.items() if b is not None}
    shell = _shell(module, device)
    with _seeded(seed, path, device):
        if buffers:
            rebuilt = _rebuilt_buffers(module, path, device, trust_init_fn=init_fn is not None)
            shell._buffers.update(rebuilt)
        if init_fn is not None:
            init_fn(shell)
        elif params:
            (own or OwnInit(module))(shell, module, path, device)
    return {**{k: v.detach() for k, v in shell._parameters.items() if v is not None},
            **{k: v for k, v in shell._buffers.items() if v is not None}}


def _shell(module: nn.Module, device) -> nn.Module:
    """A copy of `module` sharing nothing mutable with it, its own tensors new on `device`, the
    floating ones NaN (so an initializer that skips one shows: `_unset`)."""
    shell = copy.copy(module)
    # None entries stay (a Linear without bias keeps `bias = None`)
    shell._parameters = {k: None if p is None else
                         nn.Parameter(_nan_like(p, device), requires_grad=p.requires_grad)
                         for k, p in module._parameters.items()}
    shell._buffers = {k: None if b is None else torch.empty_like(b, device=device)
                      for k, b in module._buffers.items()}
    shell._modules = dict(module._modules)
    return shell


def _nan_like(t: torch.Tensor, device) -> torch.Tensor:
    out = torch.empty_like(t, device=device)
    return out.fill_(float("nan")) if out.is_floating_point() else out


def _fresh(module: nn.Module, device) -> tuple[nn.Module | None, str]:
    """(a new instance of `module`'s class built on `device` from the module's attributes named
    like its constructor's arguments, ""), or (None, why it cannot be built)."""
    if any(p is not None for child in module.children() for p in child.parameters()):
        return None, "it has children with parameters, which a rebuild would allocate too"
    try:
        args = _constructor_args(module)
        with torch.device(device):
            return type(module)(**args), ""
    except Exception as e:   # noqa: BLE001  (any constructor failure: say which)
        return None, f"rebuilding it failed: {type(e).__name__}: {e}"


def _rebuilt_buffers(module: nn.Module, path: str, device, trust_init_fn: bool) -> dict:
    """The buffers a fresh instance of `module`'s class computes in its constructor."""
    fresh, problem = _fresh(module, device)
    if fresh is not None:
        return {k: b.to(device) for k, b in fresh._buffers.items() if b is not None
                and k in module._buffers}
    if trust_init_fn:
        return {}
    raise AutopartError(buffer_problem(module, path, problem))


def buffer_problem(module: nn.Module, path: str, problem: str) -> str:
    names = sorted(k for k, b in module._buffers.items() if b is not None)
    return (
        f"cannot compute the buffers {names} of {type(module).__name__} at "
        f"{path or '<root>'!r} on the meta device: autopart recomputes a buffer by constructing "
        f"a fresh {type(module).__name__} from the module's attributes named like its "
        f"constructor's arguments, but {problem}.\n  remedy: keep the constructor's arguments "
        "as attributes of the same names (self.config = config), move the buffer into a "
        "module without parameterized children, give the root an init_weights() that computes "
        "it (torchtitan's convention), or pass init_fn=... that fills it")


def _constructor_args(module: nn.Module) -> dict:
    sig = inspect.signature(type(module).__init__)
    args = {}
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if hasattr(module, name):
            args[name] = getattr(module, name)
        elif p.default is inspect.Parameter.empty:
            raise AttributeError(f"the constructor's argument {name!r} is not an attribute")
    return args


class _seeded:
    """Run a block under the global RNG seeded from (seed, path), restoring it afterwards: the
    module's own init code draws from the global generator."""

    def __init__(self, seed: int, path: str, device: torch.device):
        digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
        self.value = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
        devices = [device.index or 0] if device.type == "cuda" else []
        self.fork = torch.random.fork_rng(devices=devices)

    def __enter__(self):
        self.fork.__enter__()
        torch.manual_seed(self.value)

    def __exit__(self, *exc):
        return self.fork.__exit__(*exc)


def _direct(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**{k: p for k, p in module._parameters.items() if p is not None},
            **{k: b for k, b in module._buffers.items() if b is not None}}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _real_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def is_meta(model: nn.Module) -> bool:
    """True when any parameter or buffer of `model` is on the meta device."""
    return any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


# -- one rank's share of a meta-device model -----------------------------------------------------

def allocate_program(chunks, device) -> dict[str, torch.Tensor]:
    """Give every meta tensor of this rank's chunk programs real (uninitialized) memory on
    `device`, its local shape only; returns name -> tensor. A name read by several chunks of
    the rank (a tied weight) gets one tensor, as the plain model has one."""
    made: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for node in chunk.gm.graph.nodes:
            if node.op != "get_attr":
                continue
            value = _attribute(chunk.gm, node.target)
            if not isinstance(value, torch.Tensor) or value.device.type != "meta":
                continue
            if node.target.startswith("_const_") and value.numel():
                raise AutopartError(
                    f"the model makes a tensor of {value.numel()} values in forward "
                    f"({node.target[len('_const_'):]}, shape {list(value.shape)}), and on the "
                    "meta device its values were never computed.\n  remedy: register it as a "
                    "buffer in the module's constructor, or build the model on a real device")
            if node.target not in made:
                empty = torch.empty(value.shape, dtype=value.dtype, device=device)
                made[node.target] = (nn.Parameter(empty, requires_grad=value.requires_grad)
                                     if isinstance(value, nn.Parameter) else empty)
            _set_attribute(chunk.gm, node.target, made[node.target])
    return made


def retarget_devices(chunks, device) -> None:
    """Factory ops captured from meta inputs (`arange(..., device='meta')` for positions) make
    their tensors on `device` instead: the rank computes on real tensors."""
    device = torch.device(device)

    def fix(v):   # meta, or the device type the program was traced for (cuda: cuda:0)
        if isinstance(v, str) and v.split(":")[0] in ("meta", device.type):
            v = torch.device(v)
        if isinstance(v, torch.device) and v.type in ("meta", device.type):
            return device
        return v
    for chunk in chunks:
        split = chunk.backward
        graphs = [chunk.gm] + ([g for g in (split.forward, split.input_grad, split.weight_grad)
                                if g is not None] if split is not None else [])
        for top in graphs:
            for gm in top.modules():
                if not isinstance(gm, torch.fx.GraphModule):
                    continue
                for node in gm.graph.nodes:
                    node.args = tuple(fix(a) for a in node.args)
                    node.kwargs = {k: fix(v) for k, v in node.kwargs.items()}
                gm.recompile()


def initial_state(model: nn.Module, names, *, seed: int, init_fn: InitFn | None,
                  device="cpu") -> dict[str, torch.Tensor]:
    """The from-scratch values of the full tensors `names` (state dict keys) of a meta model."""
    names, out = set(names), {}

    def keep(aliases: list[str], value: torch.Tensor) -> None:
        out.update({a: value.clone() for a in aliases if a in names})
    if names:
        initial_values(model, keep, seed=seed, init_fn=init_fn, device=device, wanted=names)
    return out


def _attribute(module: nn.Module, target: str):
    *path, leaf = target.split(".")
    for p in path:
        module = getattr(module, p)
    return getattr(module, leaf)


def _set_attribute(module: nn.Module, target: str, value: torch.Tensor) -> None:
    *path, leaf = target.split(".")
    for p in path:
        module = getattr(module, p)
    if leaf in module._parameters:
        module._parameters[leaf] = value
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        setattr(module, leaf, value)
class RankWeights:
    """A rank's share of a meta-device model: `allocate` gives its program real, unfilled tensors
    (and the buffers the model's code computes); `fill` puts the from-scratch values of its
    slices in them. The values can come instead from a checkpoint (runtime/pretrained.py)."""

    def __init__(self, model: nn.Module, canonical: dict[str, str]):
        self.model, self.canonical = model, canonical

    def allocate(self, program, plan, device, extra: dict | None = None) -> dict[str, str]:
        """Allocate this rank's tensors; returns {canonical name: why} for the model's tensors
        that hold no values yet: every parameter, and each buffer the model's code cannot
        compute (the same on every rank)."""
        retarget_devices(program.chunks, device)
        held = allocate_program(program.chunks, device)
        problems = computed_buffers(self.model, self._into(held, plan, program, extra), device)
        out = {self.canonical.get(n, n): "" for n, _ in self.model.named_parameters()}
        out.update({self.canonical.get(n, n): why for n, why in problems.items()})
        return out

    def fill(self, held: dict, plan, program, device, *, seed: int, init_fn: InitFn | None
             ) -> None:
        """Initialize each tensor this rank holds from scratch, as autopart.materialize(model,
        seed, init_fn) does the plain model's, keeping this rank's slice."""
        wanted = {a for a, n in self.canonical.items() if n in held} | set(held)
        initial_values(self.model, self._into(held, plan, program), seed=seed, init_fn=init_fn,
                       device=device, wanted=wanted)

    def _into(self, held: dict, plan, program, extra: dict | None = None) -> Sink:
        """A sink copying this rank's slice of a full tensor into `held` (by canonical name),
        and the whole of it into `extra` (state no chunk holds, by state dict key)."""
        from autopart.localize import rank_slice
        tp_rank, ep_rank = program.coords["tp"], plan.mesh.ep_rank(program.rank)

        def put(names: list[str], value: torch.Tensor) -> None:
            name = self.canonical.get(names[0], names[0])
            if name in held:
                with torch.no_grad():
                    held[name].copy_(rank_slice(plan, name, value, tp_rank, ep_rank))
            for key in names:
                if extra is not None and key in extra:
                    extra[key] = value.detach().to("cpu", copy=True)
        return put


__all__ = ["RankWeights", "allocate_program", "retarget_devices", "init_module", "initial_state",
           "initial_values", "computed_buffers", "is_meta", "materialize", "module_states",
           "meta_device", "OwnInit"]
