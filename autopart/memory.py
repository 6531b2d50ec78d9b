"""The memory model: per rank, bytes of state and activations as sympy formulas in b and s.

    state        what the runtime holds after a step (see `state_bytes`): params (parameters
                 and buffers the rank holds, its shards only), grads (one per trainable element,
                 full-shaped also with ZeRO), master weights (without ZeRO none: the fp32
                 parameters are the masters; with zero=1 the distributed optimizer's fp32 copy of
                 this rank's 1/dp slice) and optimizer state (sgd 0, sgd-momentum 1, adam 2 fp32
                 tensors per parameter, or per element of the 1/dp slice with zero=1, plus Adam's
                 one-element `step` tensor per tensor it steps);
    activations  what autograd saves for backward per microbatch per chunk, measured from the
                 graph itself: each chunk program runs forward on fake tensors (nothing allocated)
                 under torch.autograd.graph.saved_tensors_hooks, and every storage a backward
                 would read is counted once, weights excluded. Recomputed regions save only their
                 inputs (torch's checkpoint saves them through the same hooks), so the count
                 follows the recompute choice. Each storage's size is a formula in b and s (its
                 producing node's shape), so one run serves every microbatch and sequence size;
                 times the microbatches the schedule really keeps in flight on the rank: this
                 rank's action list is walked in order, adding a chunk's bytes at its forward and
                 dropping them at its backward, and while a backward runs, the recomputed region
                 being rerun (its own saved tensors) is added on top;
    buffers      pipeline p2p buffers: a chunk's sent outputs, held until its backward, and one
                 set of received gradients.

Precision changes no state byte: bf16 (autopart.compiler.PRECISIONS) runs forward and backward under autocast
with fp32 parameters, which are the master weights, and fp32 gradients. It changes the
activations: the fake run is made under the same autocast, so what autograd saves is counted in
the dtypes it has then (bf16 matmul outputs, fp32 where autocast keeps fp32).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode

from autopart.analysis import evaluate, layer_of
from autopart.errors import AutopartError
from autopart.ir import BATCH, REDUCED_DTYPES, SEQ, Boundary, ChunkProgram, Program, sym_shape
from autopart.ops import op_info
from autopart.ops.comm import GroupComm

KEYS = ("params", "grads", "master", "optimizer", "activations", "buffers", "total")
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2}   # param-sized tensors per parameter
ZERO_LEVELS = (0, 1)        # 1: optimizer state and fp32 master slice sharded over dp (ZeRO-1)
ADAM_STEP = 4               # torch.optim.Adam's `step`: one fp32 scalar per tensor it steps


def check_optimizer(optimizer: str) -> None:
    from autopart.arguments import check_choice     # the one check of option values
    check_choice("optimizer", optimizer)


def check_zero(zero: int) -> None:
    from autopart.arguments import check_choice
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


# -- activations: what autograd saves, measured on fake tensors ---------------------------------

@dataclass
class ChunkActivations:
    """Bytes one microbatch leaves saved for backward in one chunk, as formulas in b and s."""
    saved: sympy.Expr                                   # the whole chunk
    per_layer: dict = field(default_factory=dict)       # layer -> bytes its ops saved first
    transient: sympy.Expr = sympy.Integer(0)            # peak while its backward reruns regions
    sends: sympy.Expr = sympy.Integer(0)                # outputs held until backward
    exact: bool = True                                  # False: fake run failed, estimated


def chunk_activations(chunk: ChunkProgram, program: Program, b: int, s: int | None,
                      local_shape=lambda name, shape: shape,
                      reduced: torch.dtype | None = None) -> ChunkActivations:
    """Run `chunk` forward on fake tensors at microbatch b, sequence s, and count the storages
    autograd saves. `local_shape(param name, full shape)` gives a rank's shard shape; `reduced`
    (bf16) runs it under autocast to that dtype, as the runtime does."""
    sends = sum((boundary_bytes(x) for x in chunk.sends), sympy.Integer(0))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            run = SavedCounter(chunk.gm, mode, program.symbols, b, s or 1, local_shape,
                               set(chunk.layers), reduced=reduced)
            run.count(*chunk_inputs(chunk, run.placeholders, program, b, s))
    except Exception:  # noqa: BLE001  (data-dependent sizes, e.g. dropless MoE: estimate instead)
        return _estimate(chunk, program, sends)
    return ChunkActivations(run.total(), run.per_layer(), run.transient, sends)


class ActivationCache:
    """chunk_activations, run once per distinct chunk: chunks that are the same program up to
    parameter, node and layer names (the middle pipeline ranks of a model of repeated layers)
    share one fake run, per-layer bytes renamed to each chunk's own layers."""

    def __init__(self, reduced: torch.dtype | None = None):
        self.reduced = reduced      # bf16: counted under autocast (REDUCED_DTYPES)
        self._seen: dict = {}       # signature -> (layers of the chunk that ran, its result)
        self.runs = 0               # fake runs made (the rest were reused)
        self._signatures: dict = {}   # id(chunk) -> (chunk, its signature)

    def get(self, chunk: ChunkProgram, program: Program, b: int, s: int | None,
            local_shape=lambda name, shape: shape) -> ChunkActivations:
        sig = self.signature(chunk, local_shape)
        hit = self.lookup(sig, chunk)
        if hit is not None:
            return hit
        self.runs += 1
        acts = chunk_activations(chunk, program, b, s, local_shape, self.reduced)
        self.put(sig, chunk, acts)
        return acts

    def signature(self, chunk: ChunkProgram, local_shape) -> tuple:
        """chunk_signature, made once per chunk: the program check and the memory table both
        ask (one cache serves one program's chunks, with one local shape rule)."""
        hit = self._signatures.get(id(chunk))
        if hit is None or hit[0] is not chunk:
            hit = self._signatures[id(chunk)] = (chunk, chunk_signature(chunk, local_shape))
        return hit[1]

    def lookup(self, sig: tuple, chunk: ChunkProgram) -> ChunkActivations | None:
        """The count made for another chunk of signature `sig`, per-layer bytes renamed to
        `chunk`'s layers; None if none was made."""
        hit = self._seen.get(sig)
        if hit is None:
            return None
        layers, acts = hit
        rename = dict(zip(layers, chunk.layers))
        return dataclasses.replace(acts, per_layer={rename.get(k, k): v
                                                    for k, v in acts.per_layer.items()})

    def put(self, sig: tuple, chunk: ChunkProgram, acts: ChunkActivations) -> None:
        """Keep `chunk`'s count (made here or by the program checker's fake run) for the chunks
        of the same signature."""
        if acts.exact:       # an estimate reads program.costs by node name: not shareable
            self._seen[sig] = (chunk.layers, acts)


def chunk_signature(chunk: ChunkProgram, local_shape=lambda name, shape: shape) -> tuple:
    """Everything chunk_activations reads, names left out: boundaries, and per node its op, target,
    arguments (nodes by position), meta shape and dtype, and which of the chunk's layers it is in;
    a weight by its local shape, dtype and trainability; a recomputed region by its own graph."""
    head = tuple((tuple(x.shape), x.dtype) for x in chunk.recvs + chunk.sends)
    # a tuple, compared by hash: printing its shapes' sympy sizes cost more than the fake run
    return head, chunk.is_last, _graph_signature(chunk.gm, chunk.layers, local_shape)


def _graph_signature(gm: fx.GraphModule, layers: tuple, local_shape) -> tuple:
    paths, index, first = set(layers), {}, {}
    out = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op == "get_attr":      # one target read twice is one storage: keep who aliases whom
            args = first.setdefault(n.target, i)
        else:
            args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("%", index[a]))
        if _is_p2p(n):           # identities: the peer in their arguments changes no byte
            args = args[0]
        target = n.target if n.op in ("call_function", "call_method", "output") \
            else None if n.op == "placeholder" else _attr_signature(gm, n.target, layers, local_shape)
        layer = layer_of(n, paths)
        out.append((n.op, target, repr(args), _meta_signature(n.meta.get("val")),
                    layers.index(layer) if layer is not None else None))
    return tuple(out)


def _attr_signature(gm: fx.GraphModule, target: str, layers: tuple, local_shape):
    value = functools.reduce(getattr, target.split("."), gm)
    if isinstance(value, fx.GraphModule):
        return ("graph", _graph_signature(value, layers, local_shape))
    if isinstance(value, GroupComm):
        return ("comm", type(value).__name__, value.size, value.rank)
    if isinstance(value, torch.Tensor):
        return ("tensor", local_shape(target, tuple(value.shape)), str(value.dtype),
                isinstance(value, torch.nn.Parameter), value.requires_grad)
    return ("other", type(value).__name__, repr(value))


def _is_p2p(n: fx.Node) -> bool:
    info = op_info(n.target) if n.op == "call_function" else None
    return info is not None and info.kind == "p2p"


def _meta_signature(val):
    if isinstance(val, torch.Tensor):
        return ("T", tuple(d.node.expr if isinstance(d, torch.SymInt) else d for d in val.shape),
                val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(_meta_signature(v) for v in val)
    return repr(val)


class SavedCounter(fx.Interpreter):
    """Runs a graph on fake tensors under saved-tensor hooks; each saved storage is counted once,
    as a formula: its concrete size at (b, s) times how its producer's shape grows with b, s."""

    def __init__(self, gm, mode, symbols, b, s, local_shape, layers, params=None, reduced=None,
                 device_type: str = "cpu"):
        super().__init__(gm, garbage_collect_values=False)
        self.reduced, self.device_type = reduced, device_type     # autocast, as the runtime
        self.mode, self.symbols, self.b, self.s = mode, symbols, b, s
        self.local_shape, self.layers = local_shape, layers
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.attrs: dict = {}
        self.weights: set = set() if params is None else params   # storages of state
        self.sizes: dict = {}          # storage key -> bytes formula (first producer)
        self.saved: dict = {}          # storage key -> (bytes formula, layer that saved it)
        self.transient = sympy.Integer(0)   # max over regions: saved up to it + its rerun
        self.running = sympy.Integer(0)     # bytes saved so far, in forward order
        self.current: fx.Node | None = None
        self.growths: dict = {}             # shape text -> growth (shapes repeat: one sympy each)

    def count(self, *args):
        for ph, a in zip(self.placeholders, args):
            self._register(ph, a)
        # an op that fails inside a grad-mode region (HF's rotary embedding runs under
        # wrap_with_set_grad_enabled) can leave grad mode off, and the next real forward would
        # build no graph: the context manager puts back the mode found on entry
        with torch.set_grad_enabled(torch.is_grad_enabled()), self._autocast(), \
                torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            return self.run(*args)

    def _autocast(self):
        """The runtime's autocast (bf16), where the device has one (not on meta)."""
        if self.reduced is None or not torch.amp.is_autocast_available(self.device_type):
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, self.reduced)

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten._assert_tensor_metadata.default and self.reduced is not None:
            # export's dtype checks hold for the traced fp32 dtypes; under autocast the runtime
            # checks device and layout only (runtime/executor.py), and so does this run
            kwargs = {**kwargs, "dtype": None}
        return super().call_function(target, args, kwargs)

    def total(self) -> sympy.Expr:
        return sympy.expand(sum((v for v, _ in self.saved.values()), sympy.Integer(0)))

    def per_layer(self) -> dict:
        out: dict = {}
        for v, layer in self.saved.values():
            out[layer] = out.get(layer, sympy.Integer(0)) + v
        return {k: sympy.expand(v) for k, v in out.items()}

    def _pack(self, t):
        key = storage_key(t)
        if key is not None and key not in self.weights and key not in self.saved:
            size = self.sizes.get(key)
            if size is None:          # made inside an op (a Function's own buffer)
                size = t.untyped_storage().nbytes() * self._growth(self.current)
            layer = layer_of(self.current, self.layers) if self.current is not None else None
            self.saved[key] = (size, layer)
            self.running += size
        return t

    def fetch_attr(self, target: str):
        if target not in self.attrs:
            value = super().fetch_attr(target)
            if isinstance(value, GroupComm):
                value = type(value)(value.size, value.rank, shape_only=True)
            elif isinstance(value, torch.Tensor):
                shape = self.local_shape(target, tuple(value.shape))
                fake = torch.empty(shape, dtype=value.dtype, device="cpu")
                if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                    fake.requires_grad_(True)
                self.weights.add(storage_key(fake))
                value = fake
            self.attrs[target] = value
        return self.attrs[target]

    def run_node(self, n: fx.Node):
        self.current = n
        rerun = None
        if n.op == "call_function" and n.target is torch.utils.checkpoint.checkpoint:
            rerun = self._rerun_bytes(n)
        out = super().run_node(n)
        self._register(n, out)
        if rerun is not None:
            # Backward reaches this region after freeing what later nodes saved: then it holds
            # what was saved up to here plus the region's rerun.
            self.transient = sympy.Max(self.transient, sympy.expand(self.running + rerun))
        return out

    def _rerun_bytes(self, n: fx.Node) -> sympy.Expr:
        """What rerunning this region in backward saves at once (its own tensors, not its inputs):
        the region's graph counted by a nested counter whose hooks shadow ours."""
        sub = self.fetch_attr(n.args[0].target)
        args = [self.env[a] if isinstance(a, fx.Node) else a for a in n.args[1:]]
        inner = SavedCounter(sub, self.mode, self.symbols, self.b, self.s, self.local_shape,
                             self.layers, params=set(self.weights) | set(self.sizes),
                             reduced=self.reduced, device_type=self.device_type)
        inner.growths = self.growths
        inner.count(*args)
        return inner.total()

    def _register(self, n: fx.Node, out) -> None:
        vals = n.meta.get("val")
        if vals is None:      # a checkpoint call: its outputs are registered at their getitems
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        vals = vals if isinstance(vals, (tuple, list)) else (vals,) * len(outs)
        for t, v in zip(outs, vals):
            key = storage_key(t) if isinstance(t, torch.Tensor) else None
            if key is not None and key not in self.sizes:
                self.sizes[key] = t.untyped_storage().nbytes() * self._growth_of(v)

    def _growth_of(self, val) -> sympy.Expr:
        """numel(b, s) / numel(b0, s0) of a FakeTensor shape: 1 for a fixed-size tensor."""
        if not isinstance(val, torch.Tensor):
            return sympy.Integer(1)
        key = str(tuple(val.shape))
        if key not in self.growths:
            numel = sympy.prod(sym_shape(val, self.symbols)) if val.dim() else sympy.Integer(1)
            at = numel.subs({BATCH: self.b, SEQ: self.s})
            self.growths[key] = numel / at if at else sympy.Integer(1)
        return self.growths[key]

    def _growth(self, node) -> sympy.Expr:
        """For a storage no node produced: grows like the largest tensor the op touches."""
        if node is None:
            return sympy.Integer(1)
        vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
        vals = [v for v in vals if isinstance(v, torch.Tensor)]
        return max((self._growth_of(v) for v in vals), key=lambda g: sympy.total_degree(g)
                   if g.free_symbols else 0, default=sympy.Integer(1))


def storage_key(t: torch.Tensor):
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata if storage.nbytes() else None


def chunk_inputs(chunk: ChunkProgram, placeholders: list, program: Program, b: int,
                 s: int | None, device=lambda val: torch.device("cpu")) -> list[torch.Tensor]:
    """Empty tensors for a chunk's placeholders at microbatch b, sequence s: the boundaries it
    receives (requiring grad where the sender's value does), then its own inputs (integers
    zeroed: they index). `device(meta val)` says where each is made. The memory model's and the
    program check's fake runs both start here."""
    args = []
    for r, ph in zip(chunk.recvs, placeholders):
        t = torch.empty(r.concrete_shape(b, s), dtype=r.dtype, device=device(ph.meta.get("val")))
        args.append(t.requires_grad_(r.differentiable))
    for ph in placeholders[len(chunk.recvs):]:
        val = ph.meta["val"]
        shape = (Boundary("", sym_shape(val, program.symbols), val.dtype, 0, 0).concrete_shape(b, s)
                 if program.dynamic else tuple(val.shape))
        t = torch.empty(shape, dtype=val.dtype, device=device(val))
        args.append(t if val.dtype.is_floating_point or val.dtype.is_complex else t.zero_())
    return args


def boundary_bytes(x: Boundary) -> sympy.Expr:
    return sympy.prod(x.shape) * x.dtype.itemsize if x.shape else sympy.Integer(x.dtype.itemsize)


def _estimate(chunk, program, sends) -> ChunkActivations:
    """Without a fake run: every new tensor the chunk's nodes make (an upper bound)."""
    names = {n.name for n in chunk.gm.graph.nodes}
    total = sum((c.out_bytes for n, c in program.costs.items() if n in names), sympy.Integer(0))
    return ChunkActivations(sympy.expand(total), {}, sympy.Integer(0), sends, exact=False)


# -- per rank --------------------------------------------------------------------------------

def state_bytes(program: Program, chunks, mesh, optimizer: str, precision: str = "fp32",
                zero: int = 0, local=None) -> dict[str, int]:
    """params / grads / master / optimizer bytes of one rank holding `chunks` (localized, or
    global with `local(name, tensor)` giving the tensor of this rank's shape, see _RankShapes):

        params     every parameter and buffer element at its dtype (fp32: 4 bytes)
        grads      every trainable element at its dtype (full-shaped .grad, also with zero=1)
        zero=0     master 0 (the parameters are the masters); optimizer 4 * states per element
        zero=1     runtime/optimizer.py lays the trainable parameters end to end per replica
                   group (dense over dp, experts over dp/ep), padded to the group size d; this
                   rank keeps an fp32 copy of its ceil(n/d) elements (master 4 bytes each) and
                   the optimizer's state for them (4 * states bytes each)
    plus, for Adam, one 4-byte `step` per tensor stepped (each parameter, or each flat slice)."""
    check_zero(zero)        # precision changes no state byte (see the module docstring)
    held: dict = {}
    for c in chunks:
        for name, t in list(c.gm.named_parameters()) + list(c.gm.named_buffers()):
            if name.startswith("recompute_"):
                continue
            held.setdefault(name, t)
    if local is not None:
        held = {name: local(name, t) for name, t in held.items()}
    params = sum(t.numel() * t.element_size() for t in held.values())
    trainable = {n: t for n, t in held.items() if n in program.params and t.requires_grad}
    grads = sum(t.numel() * t.element_size() for t in trainable.values())
    per = OPTIMIZER_STATES[optimizer]
    step = ADAM_STEP if optimizer == "adam" else 0
    if not zero:
        numel = sum(t.numel() for t in trainable.values())
        return {"params": params, "grads": grads, "master": 0,
                "optimizer": per * 4 * numel + step * len(trainable)}
    slices = _zero_slices(trainable, program, mesh)
    return {"params": params, "grads": grads, "master": 4 * sum(slices),
            "optimizer": per * 4 * sum(slices) + step * len(slices)}


def _zero_slices(trainable: dict, program: Program, mesh) -> list[int]:
    """Elements of this rank's slice of each ZeRO-1 flat buffer (runtime/optimizer.FlatLayout):
    the dense parameters over the dp replicas, the experts over the dp/ep ranks holding them."""
    experts = program.ep.params if (program.ep is not None and mesh.ep > 1) else {}
    out = []
    for names, d in (([n for n in trainable if n not in experts], mesh.dp),
                     ([n for n in trainable if n in experts], mesh.dp // mesh.ep)):
        if names:
            out.append(-(-sum(trainable[n].numel() for n in names) // d))
    return out


def activation_peak(actions, acts: dict[int, ChunkActivations], b: int, s: int | None):
    """(peak saved bytes, in-flight counts per chunk at that peak) walking one rank's actions:
    a forward adds its chunk's saved bytes, a backward (W when split) drops them; while a
    backward reruns recomputed regions, that microbatch holds up to its `transient` instead."""
    at = {c: evaluate(a.saved, b, s) for c, a in acts.items()}
    rerun = {c: evaluate(a.transient, b, s) for c, a in acts.items()}
    kinds = {str(a.kind) for a in actions}
    release = "W" if "W" in kinds else "B"
    alive, live, peak, where = {}, 0.0, 0.0, {}
    for a in actions:
        kind = str(a.kind)
        if kind == "F":
            alive[a.chunk] = alive.get(a.chunk, 0) + 1
            live += at[a.chunk]
            if live > peak:
                peak, where = live, dict(alive)
        elif kind in ("B", "I"):
            during = live - at[a.chunk] + max(at[a.chunk], rerun[a.chunk])
            if during > peak:
                peak, where = during, dict(alive)
        if kind == release:
            alive[a.chunk] -= 1
            live -= at[a.chunk]
    return peak, where


def buffer_bytes(acts: dict[int, ChunkActivations], in_flight: dict, b: int, s) -> float:
    held = sum(evaluate(acts[c].sends, b, s) * n for c, n in in_flight.items())
    return held + max((evaluate(a.sends, b, s) for a in acts.values()), default=0.0)


class MemoryTable(Mapping):
    """rank -> {params, grads, master, optimizer, activations, buffers, total} (ints, bytes),
    for any global rank, built on first access; ranks with the same programs share one entry."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.mesh = compiled.plan.mesh
        self.optimizer = compiled.plan.optimizer
        self.precision = getattr(compiled.plan, "precision", "fp32")
        self.zero = getattr(compiled, "zero", 0)
        self._acts: dict = {}
        # the program checker's fake runs counted the saved tensors already (check_programs.py)
        self._runs = getattr(compiled, "activation_runs", None) or \
            ActivationCache(REDUCED_DTYPES[self.precision])
        self._cache: dict = {}

    def __getitem__(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.mesh.world_size:
            raise KeyError(rank)
        c = self.mesh.coords(rank)
        key = (c["pp"], c["tp"], self.mesh.ep_rank(rank))
        if key not in self._cache:
            self._cache[key] = self._rank(rank)
        return dict(self._cache[key])

    def __iter__(self):
        return iter(range(self.mesh.world_size))

    def __len__(self) -> int:
        return self.mesh.world_size

    def activations(self, rank: int) -> dict[int, ChunkActivations]:
        """chunk -> ChunkActivations for the chunks of `rank` (formulas in b and s)."""
        compiled = self.compiled
        out = {}
        pp, local = self.mesh.coords(rank)["pp"], local_shaper(compiled.program, self.mesh)
        for ch in compiled.program.chunks:
            if ch.rank != pp:
                continue
            if ch.chunk not in self._acts:     # tp/ep ranks of a chunk save the same sizes
                self._acts[ch.chunk] = self._runs.get(
                    ch, compiled.program, compiled.plan.microbatch_size, compiled.program.seq_len,
                    local)
            out[ch.chunk] = self._acts[ch.chunk]
        return out

    def _rank(self, rank: int) -> dict[str, int]:
        compiled = self.compiled
        plan, program = compiled.plan, compiled.program
        b, s = plan.microbatch_size, program.seq_len
        c = self.mesh.coords(rank)
        pp = c["pp"]
        # the global chunks with this rank's shard shapes: localizing every pipeline rank's
        # chunks (a GraphModule each) only to count bytes is most of a 3072-rank table's time
        chunks = [ch for ch in program.chunks if ch.rank == pp]
        local = _RankShapes(plan, c["tp"], self.mesh.ep_rank(rank))
        state = state_bytes(program, chunks, self.mesh, self.optimizer, self.precision,
                            self.zero, local=local)
        return with_activations(state, compiled.schedule.ranks[pp], self.activations(rank), b, s)


class _RankShapes:
    """name, full tensor -> a meta tensor of the shape, dtype and trainability one rank holds,
    cut as localize_module cuts it (experts, then tp sections); one per distinct case."""

    def __init__(self, plan, tp_rank: int, ep_rank: int):
        self.plan, self.tp_rank, self.ep_rank = plan, tp_rank, ep_rank
        self._seen: dict = {}

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        from autopart.localize import rank_cuts, shard_tensor
        cuts = rank_cuts(self.plan, name, self.tp_rank, self.ep_rank)
        if not cuts:
            return t
        key = (tuple(t.shape), t.dtype, t.requires_grad, repr(cuts))
        if key not in self._seen:
            local = torch.empty(t.shape, dtype=t.dtype, device="meta")
            for sh, size, rank in cuts:
                local = shard_tensor(local, sh.dim, sh.sections, size, rank)
            self._seen[key] = local.requires_grad_(t.requires_grad)
        return self._seen[key]


# -- the budget: check it, and choose recomputation under it -----------------------------------

def local_shaper(program: Program, mesh):
    """param name, full shape -> the shape tp/ep rank 0 holds (every rank's is the same size)."""
    tp_shards = program.tp.params if (program.tp is not None and mesh.tp > 1) else {}
    ep_shards = program.ep.params if (program.ep is not None and mesh.ep > 1) else {}

    def local(name, shape):
        shape = list(shape)
        for shards, size in ((ep_shards, mesh.ep), (tp_shards, mesh.tp)):
            if name in shards:
                shape[shards[name].dim] //= size
        return tuple(shape)
    return local


def _rank_chunks_local(program, mesh, pp: int):
    """This pipeline rank's chunks as tp/ep rank 0 holds them (views, nothing copied)."""
    from autopart.localize import localize_module
    tp = program.tp.params if (program.tp is not None and mesh.tp > 1) else {}
    ep = program.ep.params if (program.ep is not None and mesh.ep > 1) else {}
    return [dataclasses.replace(ch, gm=localize_module(ch.gm, tp_shards=tp, tp=(mesh.tp, 0),
                                                       ep_shards=ep, ep=(mesh.ep, 0), copy=False))
            for ch in program.chunks if ch.rank == pp]


def with_activations(state: dict, actions, acts: dict, b: int, s) -> dict[str, int]:
    """`state` (state_bytes' dict) plus the activations and p2p buffers of a rank that runs
    `actions` with its chunks' `acts`, and the total: the memory table's row and the one
    choose_recompute weighs."""
    out = dict(state)
    peak, in_flight = activation_peak(actions, acts, b, s)
    out["activations"] = int(peak)
    out["buffers"] = int(buffer_bytes(acts, in_flight, b, s))
    out["total"] = sum(out[k] for k in KEYS[:-1])
    return out


def check_budget(compiled) -> None:
    """Raise unless every pipeline rank fits the compile's memory budget
    (compiled.program.recompute.budget), by the memory table: the program check's fake runs
    serve it, one per distinct chunk."""
    rp = compiled.program.recompute
    if rp is None or rp.budget is None:
        return
    mesh = compiled.plan.mesh
    for pp in range(mesh.pp):
        mem = compiled.memory[mesh.rank(pp=pp)]
        if mem["total"] > rp.budget:
            raise budget_error(pp, mem, rp.budget, rp.mode, mesh)


def budget_error(pp: int, mem: dict, budget: int, mode: str, mesh) -> AutopartError:
    parts = ", ".join(f"{k} {fmt_bytes(mem[k])}" for k in KEYS[:-1] if mem[k])
    state = mem["params"] + mem["grads"] + mem["master"] + mem["optimizer"]
    hint = [f"pp={2 * mesh.pp} (about half the layers and weights on each rank)"]
    hint.append(f"tp={2 * mesh.tp} (about half the weights and layer activations)")
    hint.append(f"dp > 1 with zero=1 (shards the {fmt_bytes(mem['optimizer'])} of optimizer "
                "state over dp)")
    if mode != "full":
        hint.insert(0, "recompute='full' or 'auto'")
    return AutopartError(
        f"pipeline rank {pp} (and every dp/tp rank with it) needs {fmt_bytes(mem['total'])} "
        f"({mem['total']} bytes: {parts}) but the memory budget is {fmt_bytes(budget)} "
        f"({budget} bytes) with recompute={mode!r}; state alone is {fmt_bytes(state)}.\n"
        f"  remedy: " + "; or ".join(hint))


def choose_recompute(program: Program, layers: dict, *, mesh, schedule, microbatch_size: int,
                     budget: int, optimizer: str, rewrite, zero: int = 0,
                     precision: str = "fp32") -> dict:
    """(chunk, layer) -> none|selective|full: per pipeline rank, start from none and, while the
    rank is over budget, take the step (none->selective, ->full) saving the most peak bytes per
    recomputed FLOP, until it fits; full everywhere that still does not fit is an error."""
    b, s = microbatch_size, program.seq_len
    local, cache = local_shaper(program, mesh), ActivationCache(REDUCED_DTYPES[precision])
    choices = {}
    for pp in range(mesh.pp):
        mine = [c for c in program.chunks if c.rank == pp]
        variants = {}        # (chunk, kind) -> ChunkActivations with every layer of that kind
        flops = {}           # (chunk, kind) -> recomputed forward FLOPs per layer (mean)
        for c in mine:
            for kind in ("none", "selective", "full"):
                new, regions, _ = rewrite(c, {layer: kind for layer in layers[c.chunk]})
                variants[c.chunk, kind] = cache.get(new, program, b, s, local)
                n = max(len(layers[c.chunk]), 1)
                flops[c.chunk, kind] = sum(evaluate(program.costs[x].flops, b, s)
                                           for _, _, names in regions.values()
                                           for x in names if x in program.costs) / n
        current = {(c.chunk, layer): "none" for c in mine for layer in layers[c.chunk]}
        state = state_bytes(program, _rank_chunks_local(program, mesh, pp), mesh, optimizer,
                            precision, zero)
        while True:
            acts = _mixed(mine, layers, current, variants)
            mem = with_activations(state, schedule.ranks[pp], acts, b, s)
            if mem["total"] <= budget:
                break
            step = _best_step(current, variants, flops, b, s)
            if step is None:
                raise budget_error(pp, mem, budget, "auto", mesh)
            current[step[0]] = step[1]
        choices.update(current)
    return choices


def _mixed(chunks, layers, current, variants) -> dict:
    """Per chunk: the none variant with each layer's bytes replaced by its chosen variant's."""
    out = {}
    for c in chunks:
        base = variants[c.chunk, "none"]
        total, rerun = base.saved, sympy.Integer(0)
        for layer in layers[c.chunk]:
            kind = current[c.chunk, layer]
            if kind != "none":
                v = variants[c.chunk, kind]
                total += v.per_layer.get(layer, 0) - base.per_layer.get(layer, 0)
                # bounded by: everything this chunk keeps plus the rerun of the variant's region
                rerun = sympy.Max(rerun, v.transient - v.saved)
        transient = sympy.expand(total) + rerun
        out[c.chunk] = ChunkActivations(sympy.expand(total), {}, transient, base.sends)
    return out


def _best_step(current, variants, flops, b, s):
    best, best_ratio = None, -1.0
    for (chunk, layer), kind in current.items():
        for nxt in ("selective", "full")[("none", "selective", "full").index(kind):]:
            if nxt == kind:
                continue
            before = evaluate(variants[chunk, kind].per_layer.get(layer, 0), b, s)
            after = evaluate(variants[chunk, nxt].per_layer.get(layer, 0), b, s)
            cost = flops[chunk, nxt] - flops[chunk, kind]
            saved = before - after
            if saved <= 0:
                continue
            ratio = saved / max(cost, 1.0)
            if ratio > best_ratio:
                best, best_ratio = ((chunk, layer), nxt), ratio
    return best


__all__ = ["KEYS", "OPTIMIZER_STATES", "ZERO_LEVELS", "check_zero",
           "ChunkActivations", "ActivationCache", "MemoryTable", "chunk_activations",
           "chunk_signature",
           "activation_peak", "state_bytes", "parse_bytes", "check_budget", "choose_recompute"]
