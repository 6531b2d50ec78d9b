"""compile=True: each rank's chunk programs run through Inductor, each distinct layer compiled once.

Each chunk's graph is cut into segments: maximal runs of ATen ops that belong to the same layer
(the chunk's layers, as analysis.detect_layers marked each node) or to the same stretch outside the
layers, broken at every op of ours (tensor-parallel collectives, expert all-to-alls, p2p
markers: they stay eager, between compiled segments) and at recomputed regions (whose own
graphs are cut the same way, so checkpoint replays compiled code). A segment takes the layer's
parameters as inputs, so its graph, printed with canonical names, is the same text for every
repeat of the layer: that text (its signature) and the input shapes key one compiled artifact,
which every repeat calls with its own parameters. A 128-layer model compiles as many artifacts
as a 2-layer one.

Under precision="bf16" the step runs in autocast: a segment is compiled on its first call inside
it, so AOTAutograd's trace records autocast's casts in the graph (and runs the artifact with
autocast off), the same artifact serving every repeat; the autocast dtype is part of the key.

Segments go to Inductor directly (torch._inductor.compile_fx on the fx graph), not through
torch.compile: the graphs are already ATen, so Dynamo would only re-trace them and add guards
(a few microseconds per call, per segment) that our own key (shapes, strides, dtypes,
requires_grad, grad mode) already stands for. compile_fx runs AOTAutograd, so each artifact
is a forward and a backward kernel set; Inductor's FX-graph and AOTAutograd caches on disk
(TORCHINDUCTOR_CACHE_DIR) make a second run of the same model start warm.

A segment Inductor cannot compile runs eager, with one warning naming the layer.

compile="cudagraphs": each artifact also replays as CUDA graphs, through Inductor's CUDA graph
trees (what torch.compile(mode="reduce-overhead") uses), under torch's contract for them:
  * parameters and buffers are static inputs: a segment's arguments that are nn.Parameters or
    the chunk's own state (get_attr) are marked in AOTAutograd's static_input_indices (which
    Dynamo fills for torch.compile and nothing fills for a graph handed to compile_fx), so a
    replay reads the weights where they are instead of copying them into the graph's input
    buffers. The tree records one CUDA graph per call position in the step (layer x microbatch
    x forward/backward), each keyed to its layer's weight addresses; the optimizer updates
    them in place, so step 3 onwards replays (step 1 warms up, step 2 records);
  * one artifact per distinct input layout (the key below), so each shape has its own graphs;
  * each train_step begins with torch.compiler.cudagraph_mark_step_begin() (StepDriver, via
    cudagraph_steps): every replay of a step runs in one generation of the tree, the outputs
    of earlier microbatches and layers (activations saved for backward, .grad accumulated
    over microbatches) stay live in the tree's pool while the step runs;
  * what outlives the step is taken out of the pool at its end: a replay of the next step
    writes over the pool's tensors, so each .grad (autograd's AccumulateGrad adopts the
    backward graph's output as .grad) and the microbatch losses and statistics are cloned.
    That is one gradient-sized copy per step; it keeps gradient accumulation across
    train_steps and a kept loss exact.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import operator
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from autopart.ir import META_LAYER
from autopart.ops import aten_groups as G
from autopart.ops import op_info
from autopart.runtime.compute import COMPILED

CUDAGRAPHS = "autopart_cudagraphs"   # gm.meta key: the chunk's artifacts replay as CUDA graphs

_FREE_OPS = {torch.ops.aten.sym_size.int, operator.mul, operator.add, operator.sub,
             operator.floordiv, operator.mod, operator.neg, operator.truediv}


# -- partition: what would be compiled (no tensors needed) --------------------------------------

@dataclass
class Segment:
    """One run of ATen ops of one layer (or of the stretch between layers)."""
    label: str                    # the layer path, or "<chunk N outside layers>"
    gm: fx.GraphModule            # canonical names: inputs a0.., values v0..
    signature: str                # equal for every repeat of the same layer
    inputs: list                  # nodes of the chunk graph fed in, in order
    outputs: list                 # nodes of the chunk graph it produces, in order
    nodes: list                   # the run of chunk-graph nodes it replaces

    @property
    def modules(self) -> list[str]:
        """The model's module paths its ops come from (deepest, in order): what a warning
        names."""
        paths = [_path(n) for n in self.nodes]
        return list(dict.fromkeys(p for p in paths if p))


def _is_free(node: fx.Node) -> bool:
    """A size computation (SymInt/int): recomputed wherever needed, never passed between
    segments, so a segment's inputs are tensors only."""
    return (node.op == "call_function" and node.target in _FREE_OPS
            and not isinstance(node.meta.get("val"), torch.Tensor))


def _is_compute(node: fx.Node) -> bool:
    if node.op != "call_function" or _is_free(node):
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and op_info(node.target) is None


def _path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else ""
    return "" if path.startswith("_empty") else path


def _label(node: fx.Node, layers: tuple, outside: str) -> str:
    """The node's layer among the chunk's `layers`: the mark analysis.detect_layers left
    (META_LAYER), the same record the passes read, so a layer its module paths do not name
    (`layer.<i>`: blocks without a module of their own) is still one segment, shared by its
    repeats. A node without the mark (a joint graph make_fx traced for a zero-bubble split)
    lies outside the layers."""
    layer = node.meta.get(META_LAYER)
    return layer if layer is not None and layer in layers else outside


def partition(gm: fx.GraphModule, layers: tuple, outside: str = "<outside layers>") -> list[list]:
    """The runs of compute nodes of `gm`, in graph order: each run one layer's (or the outside
    stretch's) consecutive ATen ops, broken by any other call (ours, checkpoint)."""
    runs, run, label = [], [], None
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "placeholder") or _is_free(node):
            continue
        here = _label(node, layers, outside) if _is_compute(node) else None
        if here is not None and _getitem_of_other_run(node, run):
            here = None
        if run and here != label:
            runs.append((label, run))
            run = []
        if here is not None:
            run.append(node)
        label = here
    if run:
        runs.append((label, run))
    return runs


def _getitem_of_other_run(node: fx.Node, run: list) -> bool:
    """A getitem of a list made outside this run (a split in the previous layer's run, or an op
    of ours returning a tuple) is not a compute of this run."""
    if node.target is not operator.getitem:
        return False
    src = node.args[0]
    return not isinstance(src, fx.Node) or src not in run


def build_segment(label: str, run: list) -> Segment | None:
    """The segment graph of `run`, or None when it cannot be one (it needs a non-tensor value
    made outside it, or gives one out)."""
    members = set(run)
    g, env, inputs = fx.Graph(), {}, []

    def value(n):
        if n in env:
            return env[n]
        if _is_free(n):
            env[n] = _copy(g, n, value, f"s{len(env)}")
            return env[n]
        if not isinstance(n.meta.get("val"), (torch.Tensor, int, torch.SymInt)):
            raise _NotTensor(n)     # a size made outside (a recomputed region's input) is fine
        env[n] = g.placeholder(f"a{len(inputs)}")
        env[n].meta = dict(n.meta)
        inputs.append(n)
        return env[n]

    try:
        for i, n in enumerate(run):
            env[n] = _copy(g, n, value, f"v{i}")
    except _NotTensor:
        return None
    outputs = [n for n in run if any(u not in members for u in n.users)]
    if not outputs or any(not isinstance(n.meta.get("val"), torch.Tensor) for n in outputs):
        return None
    g.output(tuple(env[n] for n in outputs))
    head = next(n for n in g.nodes if n.op != "placeholder")
    for p in [n for n in g.nodes if n.op == "placeholder"]:   # inputs first, in their order
        head.prepend(p)
    seg_gm = fx.GraphModule(torch.nn.Module(), g, class_name="Segment")
    sig = hashlib.sha256(seg_gm.code.encode()).hexdigest()[:16]
    return Segment(label, seg_gm, sig, inputs, outputs, list(run))


def _copy(g: fx.Graph, n: fx.Node, value, name: str) -> fx.Node:
    """`n` in `g` under a canonical name, so repeats of a layer print the same code."""
    kwargs = fx.map_arg(n.kwargs, value)
    if n.target in G.CHECKS:
        # export's fp32 assertion: under bf16 autocast the value is bf16, and the segment is
        # traced under the step's autocast (the executor relaxes it alike for eager chunks)
        kwargs = {**kwargs, "dtype": None}
    new = g.create_node(n.op, n.target, fx.map_arg(n.args, value), kwargs, name=name)
    new.meta = dict(n.meta)
    return new


class _NotTensor(Exception):
    pass


def plan_chunk(gm: fx.GraphModule, layers: tuple, chunk: int) -> list[Segment | tuple]:
    """Segments of one chunk graph; a run that cannot be a segment is returned as (label, run)."""
    out = []
    for label, run in partition(gm, layers, f"<chunk {chunk} outside layers>"):
        seg = build_segment(label, run)
        out.append(seg if seg is not None else (label, run))
    return out


def describe(compiled) -> list[dict]:
    """What `compile=True` would compile, per distinct (pp, tp, ep) rank program: segments,
    distinct artifacts and which layers share each (autopart compile --compile)."""
    rows = []
    for rp in compiled.programs.distinct():
        segs = [s for c in rp.chunks for s in _segments_of(c)]
        distinct: dict[str, list] = {}
        for s in segs:
            distinct.setdefault(s.signature, []).append(s.label)
        rows.append({"rank": rp.rank, "segments": len(segs), "distinct": len(distinct),
                     "artifacts": [{"signature": k, "labels": sorted(set(v)), "uses": len(v)}
                                   for k, v in distinct.items()]})
    return rows


def describe_lines(compiled) -> list[str]:
    """describe() as text: per distinct rank program, the artifacts and who shares them."""
    lines = ["compile=True (Inductor): per distinct rank program, the compiled segments (runs "
             "of ATen ops between our collectives) and the distinct artifacts they share"]
    for row in describe(compiled):
        lines.append(f"  rank {row['rank']}: {row['segments']} segments, {row['distinct']} "
                     "distinct artifacts")
        for a in row["artifacts"]:
            labels = a["labels"]
            shown = labels[0] if len(labels) == 1 else f"{labels[0]} .. {labels[-1]}"
            lines.append(f"    {a['signature']}: {a['uses']} uses ({shown})")
    return lines


def _segments_of(chunk) -> list[Segment]:
    segs = [s for s in plan_chunk(chunk.gm, chunk.layers, chunk.chunk) if isinstance(s, Segment)]
    for node in chunk.gm.graph.nodes:     # recomputed regions: compiled inside checkpoint
        if node.op == "get_attr":
            sub = _attr(chunk.gm, node.target)
            if isinstance(sub, fx.GraphModule):
                segs += [s for s in plan_chunk(sub, chunk.layers, chunk.chunk)
                         if isinstance(s, Segment)]
    return segs


def _attr(module, target: str):
    owner, _, leaf = target.rpartition(".")
    try:
        return getattr(module.get_submodule(owner), leaf)
    except AttributeError:
        return None


# -- running: one compiled artifact per (signature, input layout) -------------------------------

@dataclass
class CompileReport:
    """This rank's Inductor work: artifacts compiled, seconds, eager fallbacks."""
    seconds: float = 0.0               # wall time in Inductor (its C++ compiles run in
                                       # worker processes: this process's CPU time misses them)
    artifacts: int = 0                 # distinct (signature, input layout) compiled
    graphs: int = 0                    # Inductor graphs lowered now (forward, backward)
    cached: int = 0                    # artifacts loaded whole from the AOTAutograd cache on
                                       # disk (torch's counter): a warm start shows them here
    segments: int = 0                  # segment calls in this rank's programs
    fallbacks: dict = field(default_factory=dict)    # label -> why it runs eager

    def line(self) -> str:
        text = (f"inductor (this rank): {self.segments} segments, {self.artifacts} compiled "
                f"artifacts ({self.graphs} forward/backward graphs lowered, {self.cached} "
                f"artifacts from Inductor's cache), {self.seconds:.1f} s compiling")
        for label, why in self.fallbacks.items():
            text += f"\n  eager fallback: {label}: {why}"
        return text


class SegmentCompiler:
    """Compiles segments on first call, one artifact per (signature, input layout); owned by
    one ParallelModel (no process-wide table of ours; Inductor's own caches are on disk)."""

    def __init__(self, cudagraphs: bool = False):
        # CUDA graphs replay a segment's kernels in one launch: static shapes only, which ours
        # are (one artifact per input layout)
        self.cudagraphs = cudagraphs
        self.options = {"triton.cudagraphs": True} if cudagraphs else {}
        # Our artifacts are compiled without donated buffers (_inductor), which leaves their
        # metadata's donated list unset (None); torch's backward then refuses a retain_graph
        # call while this flag is on, whatever was donated. So it is off in a process that runs
        # our artifacts: it only ever saves memory, never changes a result.
        from torch._functorch import config as functorch_config
        functorch_config.donated_buffer = False
        self.cache: dict = {}
        self.report = CompileReport()
        self._eager: set[str] = set()      # signatures Inductor failed on: warned once

    def runner(self, seg: Segment) -> "CompiledSegment":
        self.report.segments += 1
        state = tuple(i for i, n in enumerate(seg.inputs) if n.op == "get_attr")
        return CompiledSegment(self, seg.signature, seg.label, seg.gm, seg.modules, state)

    def get(self, seg: "CompiledSegment", args: tuple):
        static = static_positions(seg.state, args) if self.cudagraphs else ()
        key = (seg.signature, torch.is_grad_enabled(), _autocast_state(args),
               tuple(map(_layout, args)), static)
        fn = self.cache.get(key)
        if fn is None:
            fn = self.cache[key] = self._compile(seg, list(args), static)
        return fn

    def _compile(self, seg, args: list, static: tuple = ()):
        if seg.signature in self._eager:
            return seg.gm
        from torch._dynamo.utils import counters
        start, hits = time.perf_counter(), counters["aot_autograd"]["autograd_cache_hit"]
        try:
            fn = _inductor(copy.deepcopy(seg.gm), args, self.options, self.report, static)
            self.report.artifacts += 1
            self.report.cached += counters["aot_autograd"]["autograd_cache_hit"] - hits
        except Exception as e:   # noqa: BLE001 -- any Inductor failure: this layer runs eager
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            where = ", ".join(seg.modules[:4]) + (" ..." if len(seg.modules) > 4 else "")
            warnings.warn(f"autopart compile=True: Inductor could not compile {seg.label} "
                          f"(modules {where}): {why}; it runs eager (each repeat too)",
                          stacklevel=2)
            self.report.fallbacks[seg.label] = why
            self._eager.add(seg.signature)
            fn = seg.gm
        self.report.seconds += time.perf_counter() - start
        return fn


def static_positions(state: tuple, args) -> tuple[int, ...]:
    """The positions of a segment's arguments that keep their address from step to step: the
    chunk's own parameters and buffers (`state`: inputs read by get_attr) and any argument that
    is an nn.Parameter (a recomputed region's or a split program's parameter inputs).
    compile="cudagraphs" marks them static: replays read them in place."""
    return tuple(i for i, a in enumerate(args) if i in state or isinstance(a, torch.nn.Parameter))


def _autocast_state(args: tuple):
    """The autocast dtype the segment runs under (precision="bf16"), or None. An artifact is
    traced under it (AOTAutograd records autocast's casts into the graph and then runs the
    artifact with autocast off), so it belongs in the key."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def _layout(a):
    """What an artifact is specialized on: a tensor's layout, an integer's value."""
    if isinstance(a, torch.Tensor):
        return a.shape, a.stride(), a.dtype, a.device, a.requires_grad
    return a


def _inductor(gm: fx.GraphModule, args: list, options: dict, report: CompileReport,
              static: tuple = ()):
    """compile_fx specialized on `args` (static shapes), as standalone_compile does: a fake
    mode with a ShapeEnv in a tracing context, without which Inductor bypasses its FX-graph and
    AOTAutograd caches; the backward lowered now, not at the first backward, so its seconds
    are counted here. No donated buffers: a zero-bubble schedule runs a chunk it could not
    split at compile time as two autograd calls (I with retain_graph=True, then W), which a
    backward that frees its saved buffers as it goes refuses. `static`: the positions of
    `args` that are static inputs of the CUDA graphs (static_positions)."""
    from torch._functorch import config as functorch_config
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def inner(*a, **kw):                 # each forward and backward graph Inductor makes
        report.graphs += 1
        return compile_fx_inner(*a, **kw)

    for node in gm.graph.nodes:          # the capture's symbolic fakes: Inductor retraces
        for k in ("val", "tensor_meta", "example_value"):
            node.meta.pop(k, None)
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))), config.patch(options), \
            functorch_config.patch(force_non_lazy_backward_lowering=True, donated_buffer=False), \
            _static_inputs(gm, static):
        return compile_fx(gm, args, inner_compile=inner, ignore_shape_env=True)


@contextlib.contextmanager
def _static_inputs(gm: fx.GraphModule, static: tuple):
    """AOTAutograd with `static` in its static_input_indices: the forward graph's
    static_input_idxs (compile_fx reads fw_metadata.static_input_indices), remapped by
    AOTAutograd itself if it dedupes or adds inputs, and part of its cache key. torch.compile
    gets them from Dynamo (_try_get_metadata_from_dynamo: the lifted parameters, and inputs
    marked static); a graph of ours comes without Dynamo's metadata, so the same function is
    answered here. The segment graph holds no parameters of its own, so AOTAutograd's
    arguments are the segment's, in order. The backward marks its saved values static itself
    (compile_fx_backward: every input before the tangents)."""
    if not static:
        yield
        return
    from torch._functorch import aot_autograd
    assert not any(True for _ in gm.parameters()) and not any(True for _ in gm.buffers())
    found = aot_autograd._try_get_metadata_from_dynamo

    def with_ours(mod, *args, **kwargs):
        sources, indices = found(mod, *args, **kwargs)
        return sources, sorted(set(indices) | set(static))

    aot_autograd._try_get_metadata_from_dynamo = with_ours
    try:
        yield
    finally:
        aot_autograd._try_get_metadata_from_dynamo = found


class CompiledSegment:
    """Called from the chunk graph in place of the segment's nodes."""

    def __init__(self, compiler: SegmentCompiler, signature: str, label: str, gm, modules=(),
                 state: tuple = ()):
        self.compiler, self.signature, self.label, self.gm = compiler, signature, label, gm
        self.modules = list(modules)
        self.state = state        # positions of inputs that are the chunk's parameters/buffers

    def __call__(self, *args):
        return self.compiler.get(self, args)(*args)

    def __repr__(self) -> str:
        return f"CompiledSegment({self.label}, {self.signature})"


def _call_segment(segment, *args):
    return segment(*args)


_call_segment.__module__ = "autopart_inductor"


# -- rewriting this rank's programs ------------------------------------------------------------

def rewrite(gm: fx.GraphModule, layers: tuple, chunk: int, compiler: SegmentCompiler,
            prefix: str) -> fx.GraphModule:
    """A GraphModule running `gm` with each segment replaced by a call of its compiled
    artifact; parameters and buffers stay the same objects at the same paths. `prefix` names
    the segment attributes: distinct per graph, because a split I/W program resolves names in
    its chunk's graph first."""
    plan = plan_chunk(gm, layers, chunk)
    last = {s.nodes[-1]: s for s in plan if isinstance(s, Segment)}
    inside = {n for s in last.values() for n in s.nodes}
    g, env, attrs = fx.Graph(), {}, {}

    def value(n):
        if n not in env:             # a size computation used by an op left eager
            env[n] = g.node_copy(n, value)
        return env[n]

    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attrs[node.target] = _subgraph(_attr(gm, node.target), layers, chunk, compiler,
                                           f"{prefix}_{len(attrs)}")
            env[node] = g.get_attr(node.target)
        elif node in last:
            _emit_segment(g, last[node], value, env, attrs, compiler, prefix)
        elif node not in inside and not _is_free(node):
            env[node] = g.node_copy(node, value)
    return fx.GraphModule(attrs, g, class_name=type(gm).__name__)


def _emit_segment(g, seg: Segment, value, env, attrs, compiler, prefix: str) -> None:
    name = f"{prefix}_segment_{len(attrs)}"
    attrs[name] = compiler.runner(seg)
    call = g.call_function(_call_segment, (g.get_attr(name), *(value(n) for n in seg.inputs)))
    for i, out in enumerate(seg.outputs):
        env[out] = g.call_function(operator.getitem, (call, i))
        env[out].meta = dict(out.meta)


def _subgraph(value, layers, chunk, compiler, prefix: str):
    """A recomputed region (a GraphModule under checkpoint) is rewritten the same way."""
    if isinstance(value, fx.GraphModule):
        return rewrite(value, layers, chunk, compiler, prefix)
    return value


def compile_rank_program(rank_program, compiler: SegmentCompiler):
    """`rank_program` with every chunk's graph (and its split I/W programs) running compiled
    segments. The returned chunks hold the same parameter objects."""
    chunks = []
    for c in rank_program.chunks:
        gm = rewrite(c.gm, c.layers, c.chunk, compiler, f"inductor{c.chunk}")
        gm.meta[COMPILED] = True       # the executor's autograd I/W split runs it whole
        gm.meta[CUDAGRAPHS] = compiler.cudagraphs
        chunks.append(replace(c, gm=gm, backward=_split(c, compiler)))
    return replace(rank_program, chunks=tuple(chunks))


def _split(chunk, compiler):
    """The zero-bubble I/W programs (traced joint graphs, run without autograd) compiled the
    same way; their parameters are still read from the chunk's graph by path."""
    sb = chunk.backward
    if sb is None or sb.fallback is not None:
        return sb
    return replace(sb, **{k: rewrite(getattr(sb, k), chunk.layers, chunk.chunk, compiler,
                                     f"inductor{chunk.chunk}_{k}")
                          for k in ("forward", "input_grad", "weight_grad")})


# -- compile="cudagraphs": around each train_step -----------------------------------------------

class CudagraphSteps:
    """What a step of a compile="cudagraphs" rank does around its actions (StepDriver.run):
    mark the step's beginning for the CUDA graph trees before the first replay, and at its end
    clone what outlives it out of the trees' pool (the module docstring)."""

    def __init__(self, chunks):
        params = {}
        for c in chunks:
            for p in c.gm.parameters():
                params.setdefault(id(p), p)
        self.params = list(params.values())

    def begin(self) -> None:
        torch.compiler.cudagraph_mark_step_begin()

    def end(self, ctx) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad = p.grad.clone()
        ctx.losses[:] = [t.clone() for t in ctx.losses]
        ctx.stats[:] = [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in row)
                        for row in ctx.stats]


def cudagraph_steps(chunks) -> CudagraphSteps | None:
    """The step hooks of a rank program whose chunks replay CUDA graphs, else None."""
    chunks = list(chunks)
    if any(c.gm.meta.get(CUDAGRAPHS) for c in chunks):
        return CudagraphSteps(chunks)
    return None
