"""Finding MoE layers: expert matmuls, the regions around them, their routing, capacity and
routing groups (no rewrite). Plain data out: an ExpertPlan and the regions to rewrite.

A shared analysis, below the passes: shard_experts (passes/shard_experts/) rewrites the regions
found here, and split_tensor_parallel (passes/split_tensor_parallel/expert_linears.py) reads the
same recognition of an expert matmul (GROUPED_MM, PARAM_VIEWS, param_source, dtype_check,
find_moe_layers), so the two passes share one definition and neither imports the other."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autopart.errors import module_path, node_error, user_source_line
from autopart.ir import BATCH, SEQ, ExpertPlan, MoELayer, ParamShard, Program, sym_shape
from autopart.placement import ELEMENTWISE, ndim, shape_of
from autopart.ops import aten_groups as G

aten = torch.ops.aten
MATMULS = G.MATMULS_BATCHED
ROUTING = {aten.topk.default, aten.argmax.default, aten.max.dim, aten.one_hot.default,
           aten.sort.default, aten.argsort.default, aten.sort.stable}
LINEARS = G.LINEARS
# ops through which a parameter is still "the parameter" (the expert dim stays dim 0)
PARAM_VIEWS = ({aten.transpose.int, aten.permute.default, aten._to_copy.default, aten.to.dtype,
                aten.to.dtype_layout} | G.ALIASES | G.COPIES)
ROW_LOCAL_LAST = G.SOFTMAXES | G.LOG_SOFTMAXES
SPLITS = G.SPLITS
GROUPED_MM = ("transformers::grouped_mm_fallback", "aten::_grouped_mm")


# ---------------------------------------------------------------------------------------------
# Finding expert matmuls


def param_source(node, params):
    """(parameter name, view nodes) if `node` is a parameter seen through dim-0-keeping views."""
    chain = []
    while isinstance(node, fx.Node):
        if node.op == "get_attr":
            return (node.target, chain) if node.target in params else None
        if node.op != "call_function" or node.target not in PARAM_VIEWS:
            return None
        if node.target is aten.transpose.int and 0 in {d % ndim(node) for d in node.args[1:3]}:
            return None
        if node.target is aten.permute.default and node.args[1][0] % ndim(node) != 0:
            return None
        chain.append(node)
        node = node.args[0]
    return None


def _is_param_derived(node, params) -> bool:
    return param_source(node, params) is not None


def _static(d) -> int | None:
    try:
        return int(d)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class _ExpertMM:
    node: fx.Node
    x: fx.Node                   # the activation
    param: str
    views: tuple                 # nodes between the parameter and the matmul
    experts: int
    offsets: fx.Node | None = None   # sorted rows: cumulative rows per expert


def _grouped_matmul(node, params) -> _ExpertMM | None:
    """grouped_mm(x [S, a], w [E, a, b], offsets [E]): rows sorted by expert."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
            or node.target._schema.name not in GROUPED_MM:
        return None
    x, w = node.args[:2]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    src = param_source(w, params)
    if src is None or not isinstance(offs, fx.Node) or ndim(w) != 3 or ndim(x) != 2:
        return None
    E = _static(shape_of(w)[0])
    if E is None or _static(shape_of(offs)[0]) != E:
        return None
    return _ExpertMM(node, x, src[0], tuple(src[1]), E, offs)


def _expert_matmul(node, params) -> _ExpertMM | None:
    if node.op != "call_function":
        return None
    grouped = _grouped_matmul(node, params)
    if grouped is not None:
        return grouped
    if node.target in MATMULS:
        x, w = node.args[:2]
        if not isinstance(x, fx.Node) or _is_param_derived(x, params):
            return None
        src = param_source(w, params)
        if src is None or ndim(w) != 3 or ndim(x) != 3:
            return None
        E = _static(shape_of(w)[0])
        if E is None or _static(shape_of(x)[0]) != E:
            return None
        return _ExpertMM(node, x, src[0], tuple(src[1]), E)
    if node.target is aten.einsum.default and len(node.args[1]) == 2:
        eq = node.args[0].replace(" ", "")
        if "..." in eq or "->" not in eq:
            return None
        ins, out = eq.split("->")
        (la, lb), (a, b) = ins.split(","), node.args[1]
        for xs, ws, x, w in ((la, lb, a, b), (lb, la, b, a)):
            src = param_source(w, params)
            if src is None or _is_param_derived(x, params) or len(ws) != ndim(w) or ndim(w) < 2:
                continue
            if len(xs) < 2 or not (xs[0] == ws[0] == out[0]) or len(out) < 2:
                continue
            token = xs[1]
            if token in ws or out[1] != token:
                continue
            E = _static(shape_of(w)[0])
            if E is None or _static(shape_of(x)[0]) != E:
                continue
            return _ExpertMM(node, x, src[0], tuple(src[1]), E)
    return None


# ---------------------------------------------------------------------------------------------
# Growing regions of expert-local ops


class _Finder:
    def __init__(self, program: Program):
        self.program = program
        self.gm = program.gm
        self.params = program.params
        self.order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        self.activations = _activations(self.gm, set(self.params) | set(program.buffers))
        self.mms = {}
        for n in self.gm.graph.nodes:
            mm = _expert_matmul(n, self.params)
            if mm is not None:
                self.mms[n] = mm

    def local_op(self, node: fx.Node, seed: _ExpertMM, region: set) -> bool:
        """Does `node` treat each (expert, token) row of its region inputs on its own?"""
        if node.op != "call_function":
            return False
        E, offs = seed.experts, seed.offsets
        if node in self.mms:
            mm = self.mms[node]
            return mm.experts == E and mm.offsets is offs
        t = node.target
        if t is operator.getitem:
            return node.args[0] in region
        val = node.meta.get("val")
        if t in SPLITS and isinstance(node.args[0], fx.Node):
            val = node.args[0].meta.get("val")        # a split's output is a list: its input
        if not isinstance(val, torch.Tensor) or val.dim() < 2 - (offs is not None):
            return False
        nd = val.dim()
        # the first non-row dim: experts-major [E, N, ...] keeps dims 0, 1; sorted rows dim 0
        free = 1 if offs is not None else 2
        if offs is None and _static(val.shape[0]) != E:
            return False
        if offs is not None and not _same(val.shape[0], shape_of(seed.node)[0]):
            return False
        if t in SPLITS:
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            return dim % nd >= free
        if t in ROW_LOCAL_LAST:
            return node.args[1] % nd >= free
        if t in G.NORMS:
            return len(node.args[1]) <= nd - free and self._others_ok(node, seed, region, nd)
        if t in ELEMENTWISE:
            return self._others_ok(node, seed, region, nd)
        return False

    def _others_ok(self, node, seed, region, nd) -> bool:
        E, rows = seed.experts, seed.offsets is not None
        for a in node.all_input_nodes:
            if a in region:
                continue
            shape = shape_of(a)
            lead = nd - len(shape)          # broadcasting aligns trailing dims
            dims = {lead + i: d for i, d in enumerate(shape)}
            if a.name not in self.activations:      # weights, constants: same on every rank
                if not rows and _static(dims.get(0, 1)) == E and param_source(a, self.params):
                    continue                         # a per-expert parameter: sharded too
                if _static(dims.get(0, 1)) == 1 and (rows or _static(dims.get(1, 1)) == 1):
                    continue
                return False
            # another activation: dispatched alongside when it has the same row layout
            if len(shape) != nd:
                return False
            if rows and not _same(shape[0], shape_of(seed.node)[0]):
                return False
            if not rows and _static(shape[0]) != E:
                return False
        return True

    def regions(self) -> list[tuple[set, _ExpertMM]]:
        """Connected regions of expert-local ops around the expert matmuls."""
        done: set = set()
        out = []
        for mm in sorted(self.mms, key=self.order.get):
            if mm in done:
                continue
            region = self._grow(self.mms[mm])
            done |= region
            out.append((region, self.mms[mm]))
        return out

    def _grow(self, seed: _ExpertMM) -> set:
        """Forward closure from the seed's matmuls, pruned to ops that lead to a matmul; then
        joined with any other matmul sharing an input (gate and up projections)."""
        closure, stack = {seed.node}, [seed.node]
        while stack:
            n = stack.pop()
            for u in n.users:
                if u not in closure and self.local_op(u, seed, closure):
                    closure.add(u)
                    stack.append(u)
            if n in self.mms:                # siblings reading the same x (gate and up)
                for u in self.mms[n].x.users:
                    if u in self.mms and u not in closure and self.local_op(u, seed, closure):
                        closure.add(u)
                        stack.append(u)
        keep = {n for n in closure if n in self.mms}
        changed = True
        while changed:                       # ops on a path from one matmul to another
            changed = False
            for n in closure - keep:
                if any(u in keep for u in n.users):
                    keep.add(n)
                    changed = True
        for n in list(keep):                 # whole multi-output ops: every getitem joins
            if not isinstance(n.meta.get("val"), torch.Tensor):
                keep |= {u for u in n.users if u.target is operator.getitem}
        return keep


def dtype_check(node) -> bool:
    """torch.export's dtype/device assertion before a cast: true of the local rows as well."""
    return node.target is aten._assert_tensor_metadata.default and \
        node.kwargs.get("size") is None and node.kwargs.get("stride") is None


def _same(a, b) -> bool:
    """Two (possibly symbolic) sizes are the same expression."""
    ea = sympy.sympify(a.node.expr) if isinstance(a, torch.SymInt) else sympy.Integer(int(a))
    eb = sympy.sympify(b.node.expr) if isinstance(b, torch.SymInt) else sympy.Integer(int(b))
    return sympy.simplify(ea - eb) == 0


def _activations(gm, state: set) -> set[str]:
    """Nodes that a graph input flows into (the rest is computed from weights and constants)."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


def _cone(start: list, limit: int = 4000) -> list:
    """Nodes `start` is computed from (breadth first, nearest first)."""
    seen, order, frontier = set(start), [], list(start)
    while frontier and len(order) < limit:
        nxt = []
        for n in frontier:
            order.append(n)
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    return order


# ---------------------------------------------------------------------------------------------
# Deciding layers


def find_moe_layers(program: Program, ep: int = 1) -> ExpertPlan:
    """The MoE layers of `program` and, for ep ranks, what each rank keeps (no rewrite)."""
    return find_regions(program, ep)[0]


def find_regions(program: Program, ep: int):
    """(the ExpertPlan, one region per MoE layer to rewrite)."""
    f = _Finder(program)
    plan = ExpertPlan(ep)
    regions = []
    symbols = program.symbols
    for n in f.gm.graph.nodes:      # stacked weights gathered per token: no expert dim left
        if n.target is aten.index.Tensor and ndim(n.args[0]) == 3 and \
                param_source(n.args[0], f.params) is not None:
            weight = param_source(n.args[0], f.params)[0]
            plan.skipped.append((n.name, f"the stacked weight {weight} "
                                 "is gathered per token (weight[expert_ids]), so its matmuls have "
                                 "no expert dimension to shard (Hugging Face "
                                 "experts_implementation='batched_mm'; the default 'grouped_mm' "
                                 "shards)"))
    for region, seed in f.regions():
        mms = sorted((n for n in region if n in f.mms), key=f.order.get)
        first = mms[0]
        E, offs = seed.experts, seed.offsets
        rows = offs is not None
        entries = sorted({a for n in region for a in n.all_input_nodes
                          if a not in region and a.name in f.activations and a is not offs},
                         key=f.order.get)
        exits = sorted((n for n in region if isinstance(n.meta.get("val"), torch.Tensor)
                        and any(u not in region and not dtype_check(u) for u in n.users)),
                       key=f.order.get)
        routing = [n for n in _cone(entries + ([offs] if rows else []))
                   if n.op == "call_function" and n.target in ROUTING]
        if not routing:
            plan.skipped.append((first.name, f"{E}-way batched matmul with a stacked weight, but "
                                 "its input is not computed from a top-k/argmax/one-hot routing"))
            continue
        router = _router(routing, E, f.params)
        params = _region_params(region, f, E)
        _check_param_uses(f, params, region)
        tokens = [sym_shape(n.meta["val"], symbols)[0 if rows else 1] for n in entries + exits]
        if any(sympy.simplify(t - tokens[0]) != 0 for t in tokens):
            raise node_error(first, "the tensors entering and leaving this MoE layer's experts "
                             f"have different token counts {tokens}", "route every expert input "
                             "and output through the same [experts, tokens, ...] layout")
        nbytes = sum(_nbytes(n, symbols) for n in entries + exits) * sympy.Rational(ep - 1, ep)
        at = nbytes.subs({BATCH: program.batch_size, SEQ: program.seq_len or 1})
        plan.layers.append(MoELayer(
            name=_layer_name(first), num_experts=E, experts_per_rank=E // ep if E % ep == 0 else 0,
            matmuls=tuple(n.name for n in mms), entries=tuple(n.name for n in entries),
            exits=tuple(n.name for n in exits), params=tuple(params), router=router,
            routing=tuple(sorted({n.target._schema.name.split("::")[-1] for n in routing})),
            capacity=None if rows else _capacity(entries, routing, E),
            group_size=None if rows else _group_size(routing, E),
            tokens_per_expert=str(tokens[0]), a2a_bytes=str(nbytes), a2a_bytes_at_capture=int(at),
            source=user_source_line(first), layout="sorted-rows" if rows else "experts-major"))
        regions.append(_Region(region, entries, exits, first, offs))
        for p in params:
            plan.params[p] = ParamShard(0, (E,))
    return plan, regions


@dataclass
class _Region:
    nodes: set
    entries: list
    exits: list
    first: fx.Node
    offsets: fx.Node | None      # sorted rows: the cumulative rows per expert


def _layer_name(node) -> str:
    path = module_path(node)
    return path.rsplit(".", 1)[0] if path.endswith("experts") else path


def _router(routing, E, params) -> str | None:
    """The weight of the linear whose E outputs the routing op ranks."""
    for n in _cone(routing, limit=200):
        if n.op == "call_function" and n.target in LINEARS and _static(shape_of(n)[-1]) == E:
            for a in n.all_input_nodes:
                src = param_source(a, params)
                if src is not None:
                    return src[0]
    return None


def _group_size(routing, E) -> int | None:
    """Tokens per routing group: dim -2 of the scores [..., group, E] the routing op ranks."""
    sizes = {_static(shape_of(n.args[0])[-2]) for n in routing
             if n.target in (aten.topk.default, aten.argmax.default, aten.max.dim)
             and ndim(n.args[0]) >= 3 and _static(shape_of(n.args[0])[-1]) == E}
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def _capacity(entries, routing, E) -> int | None:
    """The size of the one-hot of buffer positions (the one-hot that is not over experts)."""
    sizes = {n.args[1] for n in _cone(entries, limit=400)
             if n.op == "call_function" and n.target is aten.one_hot.default
             and isinstance(n.args[1] if len(n.args) > 1 else None, int) and n.args[1] != E}
    return sizes.pop() if len(sizes) == 1 else None


def _region_params(region, f: _Finder, E) -> list[str]:
    """The expert matmuls' weights and any per-expert parameter [E, ...] the region broadcasts."""
    out = []
    for n in sorted(region, key=f.order.get):
        if n in f.mms and f.mms[n].param not in out:
            out.append(f.mms[n].param)
            continue
        for a in n.all_input_nodes:
            src = param_source(a, f.params)
            if src is not None and ndim(a) == ndim(n) and _static(shape_of(a)[0]) == E \
                    and src[0] not in out:
                out.append(src[0])
    return out


def _check_param_uses(f: _Finder, params, region) -> None:
    """A sharded expert weight must not be needed whole anywhere else: every use is an expert
    op of the region, possibly through dim-0-keeping views (transpose, cast)."""
    for n in f.gm.graph.nodes:
        if n.op != "get_attr" or n.target not in params:
            continue
        stack = [n]
        while stack:
            v = stack.pop()
            for u in v.users:
                if u in region:
                    continue
                if dtype_check(u):
                    continue
                if u.target in PARAM_VIEWS and param_source(u, f.params) is not None:
                    stack.append(u)
                    continue
                raise node_error(u, f"expert weight {n.target} is also used by {u.name} "
                                 f"({u.target}), outside the experts, which needs all "
                                 f"{shape_of(n)[0]} experts", "use the stacked expert weights "
                                 "only in the expert computation")


def _nbytes(node, symbols):
    val = node.meta["val"]
    return sympy.prod(sym_shape(val, symbols)) * val.element_size()


__all__ = ["GROUPED_MM", "PARAM_VIEWS", "dtype_check", "find_moe_layers", "find_regions",
           "param_source"]
