"""Activations: what autograd saves, measured on fake tensors (one run per distinct chunk)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
import sympy
import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode
from autopart.analysis import layer_of
from autopart.ir import BATCH, SEQ, Boundary, ChunkProgram, Program, sym_shape
from autopart.ops import aten_groups as G
from autopart.ops import op_info
from autopart.ops.comm import GroupComm


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
        if target in G.CHECKS and self.reduced is not None:
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
