"""Capture ONE repeated layer of a model and measure what the cost model needs, per tp.

A transformer's layers are identical, so the planner never traces them all: it shortens the
model's longest ``nn.ModuleList`` to two units (the forward loops over whatever the list holds;
a shortcut only), captures that with torch.export, runs ``split_tensor_parallel`` for each
candidate tp and the cost analysis (autopart/analysis.py), and finds the layers from the graph's
repeated structure (analysis.detect_layers), as the pipeline cut does: never by module names. A
model whose list is not its layer stack, or that has none, is captured whole. The nodes split into
``first`` (before the layers: embeddings), ``layer`` (one unit) and ``last`` (after: final norm,
head, loss). Every quantity is linear in
the microbatch size b at the model's sequence length, so it is stored at b=1 and b=2.

The result is plain numbers (JSON), cached under ~/.cache/autopart/layers keyed by the model file's
text, the class/function name, the config and a digest of autopart's sources, so a second plan of the same model skips the capture.
Each matmul's FP8 tags (Part.linears) come from linear_tags.py; a capture at another sequence
length (--seq) builds the model through seq_length.py.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import operator
from dataclasses import dataclass
from pathlib import Path

from autopart.errors import AutopartError
from autopart.planner.cluster import LOCAL_PATH
from autopart.planner.seq_length import SEQ_FIELDS, WithSequence, with_sequence

CACHE = LOCAL_PATH.parent / "layers"
TP_CANDIDATES = (1, 2, 4, 8, 16)


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """A digest of autopart's own sources (capture, passes, planner): a profile cached by an
    older autopart is not reused, with no version number to remember to bump."""
    import autopart.errors
    import autopart.passes
    roots = [Path(autopart.errors.__file__).parent, Path(autopart.passes.__path__[0])]
    h = hashlib.sha256()
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            if not f.name.startswith("test_"):
                h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Lin:
    """A value linear in the microbatch size: at b=1 and at b=2."""
    at1: float
    at2: float

    def __call__(self, b: float) -> float:
        return self.at1 + (self.at2 - self.at1) * (b - 1)


@dataclass(frozen=True)
class Part:
    """One part (first / layer / last) of the model on one tensor-parallel rank, fp32 capture."""
    gemms: tuple            # (flops Lin, M Lin, N, K, is_attention, causal): one per matmul, local
                            # to the rank; causal: an SDPA with is_causal (a fused kernel skips
                            # the masked half)
    elementwise_bytes: Lin  # bytes moved by the memory-bound ops (forward)
    allreduce_fwd: Lin      # bytes all-reduced over tp in forward (reduce_from_tp, embeddings)
    allreduce_bwd: Lin      # bytes all-reduced over tp in backward (copy_to_tp)
    saved_bytes: Lin        # outputs of every non-view op: what autograd may keep (upper bound)
    out_bytes: Lin          # the part's output (a layer's: the hidden state it passes on)
    params: float           # trainable elements on the rank
    ops: int = 0            # compute ops (kernels) in forward
    alltoall: Lin = Lin(0.0, 0.0)   # bytes the expert all-to-alls move in forward (dispatch + combine)
    expert_params: float = 0.0      # of `params`, the expert weights (reduced over dp / ep only)
    kv_bytes: Lin = Lin(0.0, 0.0)   # K and V of its attention cores (scaled_dot_product_attention),
                                    # before a grouped-query repeat: what a context-parallel ring passes on
    replicated_saved: Lin = Lin(0.0, 0.0)   # of saved_bytes, outputs of ops not split over tp (norms,
                                            # residual adds): what sequence parallelism cuts by tp
    replicated_bytes: Lin = Lin(0.0, 0.0)   # of elementwise_bytes, those ops' traffic (the same)
    kept_bytes: Lin = Lin(0.0, 0.0)         # what autograd keeps for the backward (saves.py), by op
    replicated_kept: Lin = Lin(0.0, 0.0)    # of kept_bytes, values not split over tp
    selective_kept: Lin = Lin(0.0, 0.0)     # of kept_bytes, what selective recomputation keeps:
                                            # GEMM outputs outside attention cores, the cores'
                                            # outputs, the part's inputs (saves.py)
    replicated_selective: Lin = Lin(0.0, 0.0)   # of selective_kept, values not split over tp
    linears: tuple = ()     # per GEMM (as `gemms`), what precision="fp8" decides by: () for a
                            # matmul that is no linear, else its tags (linear_tags.py)

    def flops(self, b: float) -> float:
        return sum(g[0](b) for g in self.gemms)


@dataclass(frozen=True)
class Profile:
    """What the planner knows about a model: per tp, its three parts; sizes for the paper's formula."""
    layers: int
    seq: int
    hidden: int
    vocab: int
    heads: int | None
    parts: dict             # (tp, ep) -> {"first": Part, "layer": Part, "last": Part, "shared_params": n}
    invalid_tp: dict        # (tp, ep) -> why split_tensor_parallel or shard_experts refused it
    seconds: float = 0.0    # capture time
    cached: bool = False    # read from ~/.cache/autopart/layers
    blocks: int = 0         # the model's blocks (layers = units of blocks that repeat)


def load_profile(target: str, spec: str | None, seq: int | None = None) -> Profile:
    """The profile of FILE.py:NAME built with `spec`, from the cache or by capturing one layer;
    `seq` (`autopart plan --seq`): at that sequence length instead of the config's (see
    `with_sequence`)."""
    from autopart.model_files import load_target as _load
    import time
    file = Path(target.rpartition(":")[0])
    module, name = _load(target)
    text = f"{_code_digest()}\n{file.read_text() if file.is_file() else ''}\n{name}\n{spec}" + (f"\n{seq}" if seq else "")
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    path = CACHE / f"{file.stem}-{name}-{key}.json"
    if path.is_file():
        try:
            return _from_json(json.loads(path.read_text()), cached=True)
        except (ValueError, KeyError, TypeError):
            pass                  # a stale or broken cache entry: capture again
    start = time.perf_counter()
    data = _capture_profile(module, name, spec, seq)
    data["seconds"] = time.perf_counter() - start
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    except OSError:
        pass                      # a read-only home: plan anyway, without the cache
    return _from_json(data)


def _capture_profile(module, name: str, spec: str | None, seq: int | None = None) -> dict:
    from autopart.model_files import build as _build
    if seq is None:
        built = _build(module, name, spec, 2, meta=True)
    else:
        built = _build(WithSequence(module, seq), name, spec, 2, meta=True, adjust=with_sequence(seq))
        got = built.inputs[0].shape[1] if getattr(built.inputs[0], "dim", lambda: 0)() > 1 else None
        if got != seq:
            raise AutopartError(f"--seq {seq}: the model's example inputs have sequence {got}; give the "
                                f"model's module an example_inputs(cfg, batch, device) that follows its "
                                f"config's sequence length ({', '.join(SEQ_FIELDS)})")
    return profile_data(built.model, built.inputs, built.loss_fn, built.target)


def profile_model(model, inputs: tuple, loss_fn=None, target=None) -> Profile:
    """The profile of an in-memory model (not cached); the model is left as it was."""
    return _from_json(profile_data(model, inputs, loss_fn, target))


def profile_data(model, inputs: tuple, loss_fn, target) -> dict:
    import torch
    from autopart.capture import capture
    inputs = tuple(t[:2] if isinstance(t, torch.Tensor) else t for t in inputs)
    target = None if target is None else target[:2]
    with _few_units(model) as hint:
        program = capture(model, inputs, loss_fn=loss_fn, target=target)
    found = _units(program, hint)
    if found is None:       # the graph disagrees with the list: capture the whole model
        program = capture(model, inputs, loss_fn=loss_fn, target=target)
        found = _units(program, None)
    units, blocks, copies = found
    seq = int(inputs[0].shape[1]) if inputs[0].dim() > 1 else 1
    parts, invalid = {}, {}
    for ep in _expert_candidates(program):
        for tp in TP_CANDIDATES:
            key = f"{tp},{ep}"
            try:
                parts[key] = _parts(program, tp, ep, seq, copies)
            except AutopartError as e:
                invalid[key] = str(e).splitlines()[0]
    if "1,1" not in parts:
        raise AutopartError(f"the cost analysis failed: {invalid.get('1,1')}")
    hidden, vocab = _sizes(model, seq)
    heads = getattr(getattr(model, "config", None), "n_head", None)
    return {"layers": units, "blocks": blocks, "seq": seq, "hidden": hidden, "vocab": vocab,
            "heads": heads, "parts": parts, "invalid_tp": invalid}


def _expert_candidates(program) -> list[int]:
    """1, and for a mixture-of-experts model the powers of two dividing its expert count."""
    from autopart.passes.shard_experts import shard_experts
    try:
        sharded, _ = shard_experts(program, ep=1)
        experts = min((layer.num_experts for layer in sharded.ep.layers), default=1)
    except AutopartError:
        experts = 1
    return [e for e in (2 ** i for i in range(0, 16)) if e <= experts and experts % e == 0]


COPIES = 2       # units captured: detect_layers needs two copies to see one repeat


@contextlib.contextmanager
def _few_units(model):
    """A capture-time shortcut, never the decision: within, the model's longest ModuleList holds
    only its first COPIES repeating units (a unit: one block, or `p` blocks when blocks differ
    with period p, as dense and MoE feed-forwards alternating), so a 126-layer model is traced as
    two. Yields (blocks in the list, blocks per unit, parameter elements kept), or None where
    there is no list to shorten. Which nodes form a layer is then read from the graph (_units).
    Restored after, so a user's model is left as it was."""
    import torch.nn as nn
    lists = [(len(m), path, m) for path, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    n, path, blocks = max(lists, key=operator.itemgetter(0), default=(0, "", None))
    keys = [repr(b) for b in blocks or ()]      # the module tree with its sizes: equal = same block
    period = next((p for p in range(1, n + 1)
                   if n % p == 0 and all(keys[i] == keys[i % p] for i in range(n))), n)
    if n // max(period, 1) <= COPIES:
        yield None
        return
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    kept = nn.ModuleList(list(blocks)[:COPIES * period])
    setattr(parent, attr, kept)
    try:
        yield n, period, sum(p.numel() for p in kept.parameters() if p.requires_grad)
    finally:
        setattr(parent, attr, blocks)


def _units(program, hint) -> tuple[int, int, int] | None:
    """(units in the model, its blocks, units in `program`), read from the graph's repeated
    structure (_main_run). Under _few_units' `hint` the capture holds COPIES units: the main run
    must have COPIES copies reading exactly the shortened list's parameters (counted in elements,
    a dataflow check), else None (the list was not the layer stack) and the caller captures the
    whole model."""
    from autopart.analysis import detect_layers
    layers = detect_layers(program)
    run = _main_run(layers)
    if hint is not None:
        n, period, numel = hint
        ok = run is not None and run[2] == COPIES and _read_numel(layers, run, program) == numel
        return (n // period, n, COPIES) if ok else None
    if run is None:
        raise AutopartError("the planner found no repeated layers in the model's graph (it needs "
                            "two or more blocks computing the same ops on their own parameters, "
                            "as a transformer's layers do)")
    _, period, copies = run
    return copies, period * copies, copies


def _main_run(layers) -> tuple[int, int, int] | None:
    """(start, period, copies) of the run of repeating units covering the most nodes among
    detect_layers' layers (in graph order): an embedding stack's copies, say, next to the
    transformer's. Units match layer by layer, by signature or node count (detect_layers lets a
    first copy differ in an op's constant: an auxiliary loss added to a Python 0)."""
    def same(x, y):
        return x.signature == y.signature or len(x.nodes) == len(y.nodes)
    best, n = None, len(layers)
    for start in range(n):
        for period in range(1, (n - start) // 2 + 1):
            copies = 1
            while start + (copies + 1) * period <= n and all(
                    same(layers[start + i], layers[start + copies * period + i]) for i in range(period)):
                copies += 1
            if copies >= 2:
                cover = sum(len(x.nodes) for x in layers[start:start + copies * period])
                if best is None or cover > best[0]:
                    best = (cover, start, period, copies)
    return best[1:] if best else None


def _read_numel(layers, run, program) -> int:
    start, period, copies = run
    nodes = {n.name: n for n in program.gm.graph.nodes}
    names = _param_names([nodes[x] for layer in layers[start:start + period * copies]
                          for x in layer.nodes], program)
    return int(sum(_numel(program.params[name].shape) for name in names))


def _parts(program, tp: int, ep: int, seq: int, copies: int) -> dict:
    from autopart.analysis import analyze, detect_layers
    from autopart.passes.recompute_activations import attention_cores
    from autopart.passes.split_tensor_parallel import split_tensor_parallel
    if ep > 1:
        from autopart.passes.shard_experts import shard_experts
        program, _ = shard_experts(program, ep=ep)
    local, _ = split_tensor_parallel(program, tp=tp)
    costs = analyze(local)
    groups = _groups(local, detect_layers(local), copies)
    shards = local.tp.params if tp > 1 else {}
    experts = local.ep.params if local.ep is not None and ep > 1 else {}
    # selective recomputation reruns the layer's attention cores, found as the runtime's
    # recompute_activations pass finds them (None: no core, selective is not offered)
    core = [n for c in attention_cores(groups["layer"]) for n in c]
    parts = {k: _part(nodes, costs, local, shards, tp, seq, k, experts, ep, set(core)) for k, nodes in groups.items()}
    parts["core"] = _part(core, costs, local, shards, tp, seq, "core", experts, ep) if core else None
    # tied weights (GPT's embedding = head): one tensor when first and last share a rank
    shared = _param_names(groups["first"], local) & _param_names(groups["last"], local)
    parts["shared_params"] = sum(_numel(local.params[n].shape) / (tp if n in shards else 1) for n in shared)
    return parts


def _groups(program, layers, copies: int) -> dict:
    """The call_function nodes as `layer` (the first unit of the main run of detect_layers'
    layers, which must have `copies` units), `first` (outside the run, before its end:
    embeddings, and masks or positions made once and read by every layer) and `last` (after:
    final norm, head, loss). The run's other units are left out: the cost model scales `layer`
    by the model's units."""
    run = _main_run(layers)
    if run is None or run[2] != copies:
        raise AutopartError(f"after the tensor-parallel split the graph's repeated layers no "
                            f"longer form {copies} units (found {run and run[2]})")
    start, period, _ = run
    unit = {x for layer in layers[start:start + period] for x in layer.nodes}
    repeated = {x for layer in layers[start:start + period * copies] for x in layer.nodes}
    nodes = [n for n in program.gm.graph.nodes if n.op == "call_function"]
    end = max(i for i, n in enumerate(nodes) if n.name in repeated)
    groups = {"first": [], "layer": [], "last": []}
    for i, n in enumerate(nodes):
        if n.name in unit:
            groups["layer"].append(n)
        elif n.name not in repeated:
            groups["first" if i < end else "last"].append(n)
    return groups


def _param_names(nodes, program) -> set:
    return {a.target for n in nodes for a in n.all_input_nodes
            if a.op == "get_attr" and a.target in program.params}


def _numel(shape) -> float:
    total = 1
    for d in shape:
        total *= int(d)
    return float(total)


def _part(nodes, costs, program, shards, tp, seq, which, experts, ep, core=frozenset()) -> dict:
    from autopart.analysis import _VIEWS, evaluate
    from autopart.ops import op_info
    from autopart.planner.linear_tags import linear_tags

    def lin(expr):
        return [evaluate(expr, 1, seq), evaluate(expr, 2, seq)]

    def nbytes(node):
        v = node.meta.get("val")
        return _numel_expr(v, program) * (v.element_size() if hasattr(v, "element_size") else 4)

    gemms, elt, ar_f, ar_b, saved, ops = [], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], 0
    gemm_nodes = []
    a2a, rep_saved, rep_bytes = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    for n in nodes:
        info = op_info(n.target)
        if info is not None and info.communicates:
            name = info.name
            size = lin(nbytes(n)) if hasattr(n.meta.get("val"), "shape") else [0.0, 0.0]
            if info.axis == "ep":
                a2a = _add(a2a, size)       # dispatch and combine; backward mirrors them
            elif name.startswith("copy_to"):
                ar_b = _add(ar_b, size)
            elif name.startswith(("reduce_from", "vocab_parallel_embedding")):
                ar_f = _add(ar_f, size)
            continue
        c = costs.get(n.name)
        if c is None or n.target in _VIEWS:
            continue
        g = _gemm(n, c, program, tp, seq)
        ops += 1
        replicated = tp > 1 and not _is_split(n)
        if g is not None:
            gemms.append(g)
            gemm_nodes.append(n)
        else:
            elt = _add(elt, lin(c.bytes_moved))
            if replicated:
                rep_bytes = _add(rep_bytes, lin(c.bytes_moved))
        saved = _add(saved, lin(c.out_bytes))
        if replicated and g is None:
            rep_saved = _add(rep_saved, lin(c.out_bytes))
    kept, rep_kept, sel, rep_sel = _kept(nodes, costs, lin, tp, core)
    out = lin(costs[nodes[-1].name].out_bytes) if nodes and nodes[-1].name in costs else [0.0, 0.0]
    if which == "layer":
        last = [n for n in nodes if n.name in costs and costs[n.name].out_bytes != 0]
        out = lin(costs[last[-1].name].out_bytes) if last else out
    if which == "core":      # what the rest of the layer reads from the core: kept under selective
        out = _core_output(nodes, costs, lin)
    return {"gemms": gemms, "elementwise_bytes": elt, "allreduce_fwd": ar_f, "allreduce_bwd": ar_b,
            "saved_bytes": saved, "out_bytes": out, "params": _params(nodes, program, shards, tp, experts, ep),
            "ops": ops, "alltoall": a2a, "kv_bytes": _kv_bytes(nodes, costs, lin, nbytes),
            "replicated_saved": rep_saved, "replicated_bytes": rep_bytes, "kept_bytes": kept,
            "replicated_kept": rep_kept, "selective_kept": sel, "replicated_selective": rep_sel,
            "linears": linear_tags(nodes, gemm_nodes, program),
            "expert_params": _params(nodes, program, shards, tp, experts, ep, only=set(experts))}


def _kept(nodes, costs, lin, tp, core) -> tuple[list, list, list, list]:
    """(bytes autograd keeps for the part's ops, those of values not split over tp; the same two
    of what selective recomputation keeps). Selective as Megatron-LM's --recompute-modules
    core_attn, layernorm and the activation functions: the attention cores and every memory-bound
    op rerun in backward from what stays, the GEMMs' outputs (outside the cores), the cores'
    outputs and the part's inputs."""
    from autopart.planner.saves import kept_values, stays_under_selective
    kept, rep, sel, rep_sel = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    mine = set(nodes)
    for n in kept_values(nodes):
        if n.name in costs:
            size = lin(costs[n.name].out_bytes)
            replicated = tp > 1 and not _is_split(n)
            kept = _add(kept, size)
            rep = _add(rep, size) if replicated else rep
            if stays_under_selective(n, mine, core):
                sel = _add(sel, size)
                rep_sel = _add(rep_sel, size) if replicated else rep_sel
    return kept, rep, sel, rep_sel


def _kv_bytes(nodes, costs, lin, nbytes) -> list:
    """Bytes of K and V that the part's attention cores (scaled_dot_product_attention) read on
    this rank, each at the smallest tensor on its way back to its projection (a grouped-query
    model repeats K and V after it; a context-parallel ring sends them before the repeat). Sizes
    are the graph's (whole) ones, scaled to the rank as the core's output is (heads over tp)."""
    total = [0.0, 0.0]
    for n in nodes:
        if "scaled_dot_product" not in getattr(n.target, "__name__", str(n.target)):
            continue
        whole, local = lin(nbytes(n)), lin(costs[n.name].out_bytes) if n.name in costs else None
        if not local or not whole[1]:
            continue
        share = local[1] / whole[1]                # 1/tp when the heads are split
        for arg in n.args[1:3]:
            best, node = None, arg
            for _ in range(64):          # back through views, the rotary embedding, the repeat
                if not hasattr(node, "op") or node.op != "call_function":
                    break
                if hasattr(node.meta.get("val"), "shape"):
                    size = lin(nbytes(node))
                    if size[1] > 0 and (best is None or size[1] < best[1]):
                        best = size
                name = getattr(node.target, "__name__", str(node.target))
                if any(k in name for k in ("linear", "mm", "matmul")):
                    break                 # the projection: K and V start here
                ins = list(node.all_input_nodes)
                if not ins:
                    break
                # follow the largest input (the activation, not a rotation table or a weight)
                node = max(ins, key=_numel_hint)
            if best is not None:       # K and V grow as b: the value at b=2, halved at b=1
                total = _add(total, [best[1] * share / 2, best[1] * share])
    return total


def _numel_hint(node) -> int:
    """The element count at the captured sizes, read from the SymInts' hints: int() of a SymInt
    adds a guard that fixes the batch and sequence for the whole shared ShapeEnv, after which
    every later tp's costs were constants (a step time that did not grow with the microbatch)."""
    import torch
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return 0
    total = 1
    for d in v.shape:
        hint = d.node.hint if isinstance(d, torch.SymInt) else int(d)
        total *= hint if hint is not None else 0
    return total


def _core_output(nodes, costs, lin) -> list:
    """Bytes of the core's values read outside it (the attention output the projection keeps)."""
    inside = set(nodes)
    total = [0.0, 0.0]
    for n in nodes:
        if n.name in costs and any(u not in inside for u in n.users):
            total = _add(total, lin(costs[n.name].out_bytes))
    return total


def _numel_expr(val, program):
    import sympy
    from autopart.ir import sym_shape
    if not hasattr(val, "shape"):
        return sympy.Integer(0)
    shape = sym_shape(val, program.symbols)
    return sympy.prod(shape) if shape else sympy.Integer(1)


def _gemm(node, cost, program, tp, seq):
    """(flops, M, N, K) of a matmul on this rank, or None. The local dims follow the split:
    a column-parallel linear has N/tp, a row-parallel one K/tp, attention splits its heads (a
    batch dimension, so M, N and K stay whole)."""
    import sympy
    from autopart.analysis import _matmul_flops, _shape, evaluate
    whole = _matmul_flops(node, program.symbols)
    if whole is None:
        return None
    flops = [evaluate(cost.flops, 1, seq), evaluate(cost.flops, 2, seq)]
    name = getattr(node.target, "__name__", str(node.target))
    out = _shape(node, program.symbols)
    a0 = _shape(node.args[0], program.symbols)
    if "scaled_dot_product" in name:
        k = _shape(node.args[1], program.symbols)
        dims = [a0[-2], k[-2], a0[-1]]            # s x s x head_dim (and P V: s x head_dim x s)
        causal = bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False))
        return [flops, [float(evaluate(dims[0], 1, seq))] * 2, float(evaluate(dims[1], 1, seq)),
                float(evaluate(dims[2], 1, seq)), True, causal]
    n_dim, k_dim = out[-1], a0[-1]
    m_dim = sympy.prod(out[:-1]) if len(out) > 1 else sympy.Integer(1)
    if tp > 1 and program.tp is not None:
        if node.name in program.tp.column:
            n_dim = n_dim / tp
        elif node.name in program.tp.row:
            k_dim = k_dim / tp
        elif _is_split(node):
            n_dim = n_dim / tp            # a vocab-parallel head: its output columns split
    return [flops, [evaluate(m_dim, 1, seq), evaluate(m_dim, 2, seq)], float(evaluate(n_dim, 1, seq)),
            float(evaluate(k_dim, 1, seq)), False, False]


def _is_split(node) -> bool:
    from autopart.analysis import _split_over_tp
    return _split_over_tp(node)


def _params(nodes, program, shards, tp, experts, ep, only: set | None = None) -> float:
    """Trainable elements read by the part's nodes (get_attr inputs), each once, 1/tp if split
    over tp, 1/ep if experts; `only`: those names."""
    seen, total = set(), 0.0
    attrs = {n.target: n for n in program.gm.graph.nodes if n.op == "get_attr"}
    for n in nodes:
        for a in n.all_input_nodes:
            if only is not None and a.target not in only:
                continue
            if a.op == "get_attr" and a.target in program.params and a.target not in seen:
                seen.add(a.target)
                info = program.params[a.target]
                numel = 1
                for d in info.shape:
                    numel *= int(d)
                total += numel / (tp if a.target in shards else 1) / (ep if a.target in experts else 1)
    del attrs
    return total


def _sizes(model, seq: int | None = None) -> tuple[int, int]:
    """Hidden size and vocabulary, for the paper's FLOPs formula: the largest nn.Embedding's,
    other than a learned position table of `seq` rows (larger than the vocabulary at 128K)."""
    import torch.nn as nn
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embeddings = [m for m in embeddings if m.num_embeddings != seq] or embeddings
    if not embeddings:
        return 0, 0
    e = max(embeddings, key=lambda m: m.num_embeddings)
    return e.embedding_dim, e.num_embeddings


def _add(a, b):
    return [a[0] + b[0], a[1] + b[1]]


def _from_json(data: dict, cached: bool = False) -> Profile:
    def part(d):
        return Part(tuple((Lin(*g[0]), Lin(*g[1]), g[2], g[3], g[4], bool(g[5:6] and g[5])) for g in d["gemms"]),
                    Lin(*d["elementwise_bytes"]), Lin(*d["allreduce_fwd"]), Lin(*d["allreduce_bwd"]),
                    Lin(*d["saved_bytes"]), Lin(*d["out_bytes"]), d["params"], d["ops"],
                    Lin(*d["alltoall"]), d["expert_params"], Lin(*d.get("kv_bytes", (0.0, 0.0))),
                    Lin(*d.get("replicated_saved", (0.0, 0.0))), Lin(*d.get("replicated_bytes", (0.0, 0.0))),
                    Lin(*d.get("kept_bytes", (0.0, 0.0))), Lin(*d.get("replicated_kept", (0.0, 0.0))),
                    Lin(*d.get("selective_kept", (0.0, 0.0))), Lin(*d.get("replicated_selective", (0.0, 0.0))),
                    tuple(tuple(t) for t in d.get("linears", ())))
    parts = {tuple(map(int, key.split(","))): {k: (part(v) if isinstance(v, dict) else v) for k, v in ps.items()}
             for key, ps in data["parts"].items()}
    invalid = {tuple(map(int, k.split(","))): v for k, v in data["invalid_tp"].items()}
    return Profile(data["layers"], data["seq"], data["hidden"], data["vocab"], data["heads"], parts,
                   invalid, data.get("seconds", 0.0), cached, data["blocks"])


__all__ = ["Lin", "Part", "Profile", "load_profile", "TP_CANDIDATES"]
