"""Deciding: the linears, the regions grown from them op by op, the sequence-parallel stream
and the vocabulary-parallel embeddings. Plain data out: a TensorParallelPlan."""
from __future__ import annotations

import heapq
import operator
from collections import ChainMap
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopart.ir import SEQ, ParamShard, Program, TensorParallelPlan, sym_shape
from autopart.placement import (NoRule, Need, P, R, Shard, SplitOnShard, carry, ndim, shape_of)

from .expert_linears import expert_matmul, moe_matmuls, weight_users
from .sliced_params import shard_sliced_params
from .layouts import (_Reject, check_meets, keep_merged, merged_rows, new_origin, range_met,
                      section_scatter, track_offset)

aten = torch.ops.aten


@dataclass(frozen=True)
class LinearUse:
    """A linear-like node: activation x times a 2-D parameter weight (+ bias), or an expert
    matmul: routed tokens times a weight stacked over experts [E, a, b] (expert_linears.py)."""
    node: str
    x: str
    weight: str                 # parameter name
    out_dim: int                # weight dim of the output features (0 for linear, 1 for addmm)
    bias: str | None
    contracted: int | None = None   # weight dim contracted, when not 1 - out_dim (experts)

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim if self.contracted is None else self.contracted


def find_linears(gm: fx.GraphModule, params, experts=frozenset()) -> dict[str, LinearUse]:
    """Linear-like nodes by name, and the expert matmuls named in `experts` (moe_matmuls:
    split over tp like the dense MLP's linears, expert tensor parallelism)."""
    out = {}
    for n in gm.graph.nodes:
        use = _linear_use(n, params)
        if use is None and n.name in experts and (found := expert_matmul(n, params)):
            x, weight, out_dim, contracted = found
            use = LinearUse(n.name, x.name, weight, out_dim, None, contracted)
        if use is not None:
            out[n.name] = use
    return out


def _param_name(a, params) -> str | None:
    if isinstance(a, fx.Node) and a.op == "get_attr" and a.target in params:
        return a.target
    return None


def _linear_use(n: fx.Node, params) -> LinearUse | None:
    if n.op != "call_function":
        return None
    a = n.args
    if n.target is aten.linear.default and _param_name(a[1], params) and ndim(a[1]) == 2:
        bias = _param_name(a[2], params) if len(a) > 2 else None
        return LinearUse(n.name, a[0].name, a[1].target, 0, bias)
    if n.target is aten.addmm.default and _param_name(a[2], params) and not _param_name(a[1], params):
        return LinearUse(n.name, a[1].name, a[2].target, 1, _param_name(a[0], params))
    if n.target in (aten.mm.default, aten.matmul.default) and _param_name(a[1], params) \
            and ndim(a[1]) == 2 and not _param_name(a[0], params):
        return LinearUse(n.name, a[0].name, a[1].target, 1, None)
    return None


# ---------------------------------------------------------------------------------------------
# Deciding regions


@dataclass
class _Region:
    seeds: list
    pl: ChainMap            # the region's own placements over the committed ones (read-through)
    activations: set
    rows: set = field(default_factory=set)
    ces: set = field(default_factory=set)
    sections: dict = field(default_factory=dict)
    pieces: dict = field(default_factory=dict)      # origin -> {[start, end) read as a tensor}
    scatters: dict = field(default_factory=dict)
    indexed: dict = field(default_factory=dict)     # index node -> origin whose shard it picks
    # where a node's sharded dim lies in its origin's features (an int, a tuple for a split's
    # outputs): a split of a part (Mamba-2's x|B|C inside the in_proj's xBC) cuts the origin
    # there, and a replicated operand meeting it is sliced per section (section_scatters)
    offsets: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)      # origin -> its feature count
    scatter_at: dict = field(default_factory=dict)  # (consumer, input) -> (origin, start, size)
    scatter_sections: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)       # a concatenation's parts: its sections
    meets: dict = field(default_factory=dict)       # op -> its sharded inputs (check_meets)
    merged: dict = field(default_factory=dict)      # heads merged into the rows (layouts.py)


def decide(program: Program, tp: int, sequence_parallel: bool) -> TensorParallelPlan:
    gm = program.gm
    by_index = list(gm.graph.nodes)
    nodes = {n.name: n for n in by_index}
    order = {n.name: i for i, n in enumerate(by_index)}
    plan = TensorParallelPlan(tp, sequence_parallel)
    # experts split over tp too, except under sequence parallelism (check_share refuses it
    # unless ep shards them)
    plan.expert_matmuls = frozenset() if sequence_parallel else moe_matmuls(program)
    linears = find_linears(gm, program.params, plan.expert_matmuls)
    ctx = _Context(nodes, order, by_index, linears, param_dependent(gm, program.params),
                   weight_users(gm, program.params), tp)
    committed: dict = {}
    for name in sorted(linears, key=order.get):
        if name in plan.column or name in plan.row:
            continue
        use = linears[name]
        if isinstance(committed.get(nodes[use.x]), Shard):
            continue
        try:
            region = _grow([nodes[name]], committed, ctx)
            _check_params(region, ctx, plan)
        except _Reject as e:
            plan.skipped.append((name, f"{e.node}: {e.reason}"))
            continue
        _commit(region, plan, committed, linears)
    _decide_embeddings(gm, plan, program, tp)
    plan.placements = {k: v for k, v in committed.items()}
    shard_sliced_params(gm, plan, program.params)     # A_log, D, conv filters: by heads
    _plan_partial_grads(gm, plan, ctx.activations)
    if sequence_parallel:
        _plan_sequence(gm, plan, program, linears, ctx.activations)
    return plan


def _sharded(placement) -> bool:
    return isinstance(placement, (Shard, tuple))


def _partial_operand(node, a, plan, activations, sharded_here) -> bool:
    """Whether `node`, run on a shard, reads `a` whole though `a` has a gradient: then this
    rank's backward gives `a` only its shard's share of the gradient."""
    return (a.name in activations and not sharded_here(a)
            and not (a.op == "get_attr" and a.target in plan.params)
            and (node.name, a.name) not in plan.scatters)


def _plan_partial_grads(gm, plan: TensorParallelPlan, activations: set) -> None:
    """Replicated values computed from parameters that meet a tp-sharded tensor elsewhere than
    in a linear (a per-head RMSNorm weight times this rank's heads, a (1 + weight) scale, a
    learned scalar): the gradient each rank computes for them is a partial sum over its own
    heads or features. They are read through copy_to_tp (Megatron's f), whose backward sums
    the partial gradients over tp; found by dataflow, whatever the modules are called."""
    def sharded_here(a):
        return _sharded(plan.placements.get(a))
    for node in gm.graph.nodes:
        if not sharded_here(node) or node.name in plan.column:
            continue
        for a in node.all_input_nodes:
            if _partial_operand(node, a, plan, activations, sharded_here):
                plan.partial_grads.add((node.name, a.name))


def _seq_dim(node: fx.Node, program: Program) -> int | None:
    """The sequence dim of an activation: the dim whose size is the symbolic s (dim 1 if static)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    shape = sym_shape(val, program.symbols)
    dims = [i for i, d in enumerate(shape) if d == SEQ]
    if dims:
        return dims[0]
    # a static sequence (a ViT's patches, or a model that fixes its length): dim 1 of [b, s, h]
    return 1 if SEQ not in program.symbols.values() and val.dim() == 3 else None


def _plan_sequence(gm, plan: TensorParallelPlan, program: Program, linears,
                   activations: set) -> None:
    """Sequence parallelism: reductions become reduce-scatters along the sequence and the ops
    after them run on sequence shards until a column-parallel linear (or an op without a
    rule, which gets its input all-gathered first)."""
    seq = plan.seq_shards
    for node in gm.graph.nodes:
        if node.name in plan.row or node.name in plan.vocab_embedding:
            d = _seq_dim(node, program)
            if d is not None:
                seq[node.name] = d
                bias = linears[node.name].bias if node.name in linears else None
                if bias:
                    plan.sp_grad_reduce.add(bias)     # added after the reduce-scatter
            continue
        ins = [a for a in node.all_input_nodes if a.name in seq]
        if not ins:
            continue
        pl = {a: Shard(seq[a.name]) for a in ins}
        if node.name in plan.column:
            x = linears[node.name].x
            if x in seq and node.target is not aten.linear.default:
                plan.gathers[(node.name, x)] = seq[x]
            continue
        if node.op == "output" or node.name in plan.vocab_loss or isinstance(
                plan.placements.get(node), (Shard, tuple)):
            for a in ins:
                plan.gathers[(node.name, a.name)] = seq[a.name]
            continue
        try:
            out = _carry_seq(node, pl, plan)
        except NoRule:
            for a in ins:
                plan.gathers[(node.name, a.name)] = seq[a.name]
            continue
        seq[node.name] = out.dim
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a.target in program.params and a.target not in plan.params:
                plan.sp_grad_reduce.add(a.target)     # a replicated weight sees only local tokens
            elif _partial_operand(node, a, plan, activations,
                                  lambda v: v.name in seq or _sharded(plan.placements.get(v))):
                plan.partial_grads.add((node.name, a.name))   # computed from one: (1 + weight)


def _carry_seq(node, pl, plan: TensorParallelPlan) -> Shard:
    for _ in range(4):
        out = carry(node, pl, plan.tp)
        if isinstance(out, Need):
            plan.scatters[(node.name, out.arg.name)] = out.dim
            pl = {**pl, out.arg: Shard(out.dim)}
            continue
        if isinstance(out, Shard):
            return out
        raise NoRule(f"{node.target} does not keep the sequence shard")
    raise NoRule("unresolvable")


def _grow(seeds, committed, ctx, unpullable=frozenset()) -> _Region:
    """Shard the seeds' outputs and carry the shard forward until every path closes."""
    if len(seeds) > 16:
        raise _Reject(seeds[0].name, "too many projections pulled into one region")
    # an overlay, not a copy: copying every committed placement per region (and per node
    # visited) made deciding a 128-layer model quadratic in its size
    region = _Region(seeds=list(seeds), pl=ChainMap({}, committed), activations=ctx.activations)
    seed_names = {s.name for s in seeds}
    frontier: list[int] = []
    for s in seeds:
        if int(shape_of(s)[-1]) % ctx.tp:
            raise _Reject(s.name, f"{shape_of(s)[-1]} output features do not divide by tp={ctx.tp}")
        region.pl[s] = Shard(ndim(s) - 1, s.name)
        region.offsets[s], region.totals[s.name] = 0, int(shape_of(s)[-1])
        frontier += [ctx.order[u.name] for u in s.users]
    heapq.heapify(frontier)
    done: set[int] = set()
    while frontier:      # visit users of sharded values in graph order, each once
        i = heapq.heappop(frontier)
        if i in done:
            continue
        done.add(i)
        node = ctx.by_index[i]
        if node.name in seed_names:
            continue
        if node.op == "output":
            raise _Reject(node.name, "a sharded tensor reaches the model output")
        if _terminal(node, region, ctx.linears):
            continue
        while True:
            pulled = _carry_into(node, region, ctx.linears, ctx.tp, unpullable)
            if pulled is None:
                break
            try:    # the attention's other projections join the region (separate q, k, v)
                return _grow(seeds + [ctx.nodes[p] for p in pulled], committed, ctx, unpullable)
            except _Reject:     # they cannot be split (e.g. fewer kv heads than tp): slice locally
                unpullable = unpullable | set(pulled)
        if isinstance(region.pl.get(node), (Shard, tuple)):
            for u in node.users:
                heapq.heappush(frontier, ctx.order[u.name])
    if not region.rows and not region.ces:
        raise _Reject(seeds[0].name, "no row-parallel linear or vocabulary-parallel loss closes it")
    _check_sections(region, ctx)
    check_meets(region)
    return region


def _check_sections(region, ctx) -> None:
    """A tensor that spans a projection cut in sections holds, per rank, 1/tp of each section,
    not one contiguous 1/tp: neither a replicated operand sliced contiguously to meet it
    (a `* scale` over the fused features before their split) nor an index of per-rank blocks
    reads it right."""
    for name, origin in region.indexed.items():
        if len(region.sections.get(origin, ())) > 1:
            raise _Reject(name, f"an index of the sharded dim of {origin}, which is cut in "
                          f"sections {region.sections[origin]}")
    for (name, arg), dim in region.scatters.items():
        if section_scatter(region, (name, arg), ctx.tp):
            continue
        node = ctx.nodes[name]
        p = region.pl.get(node)
        sections = region.sections.get(p.origin, ()) if isinstance(p, Shard) else ()
        if len(sections) > 1 and p.dim == ndim(node) - 1 and shape_of(node)[-1] == sum(sections):
            raise _Reject(name, f"{arg} (replicated) meets {p.origin}'s output, which is cut in "
                          f"sections {sections}, before the cut: a rank's share of it is not "
                          "one contiguous slice")


@dataclass
class _Context:
    """Indexes of the graph shared by every region search of one decide() call."""
    nodes: dict
    order: dict
    by_index: list
    linears: dict
    activations: set
    weight_users: dict
    tp: int


def _terminal(node, region, linears) -> bool:
    """Row-parallel linear or vocabulary-parallel cross-entropy: the region closes here."""
    use = linears.get(node.name)
    if use is not None:
        x = node.args[1] if node.target is aten.addmm.default else node.args[0]
        s = region.pl.get(x)
        if isinstance(s, Shard) and s.dim == ndim(x) - 1:
            region.rows.add(node.name)
            region.pl[node] = P
            return True
        raise _Reject(node.name, "a linear reads a tensor sharded on a dim it does not contract")
    if node.target is aten.cross_entropy_loss.default:
        logits = node.args[0]
        s = region.pl.get(logits)
        ok = isinstance(s, Shard) and s.dim == ndim(logits) - 1 and _plain_ce(node)
        if ok and s.origin not in region.sections:
            region.ces.add(node.name)
            region.pl[node] = R
            return True
        raise _Reject(node.name, "cross-entropy on a sharded tensor that is not plain logits")
    return False


def _plain_ce(node) -> bool:
    args = list(node.args) + [None] * (6 - len(node.args))
    weight, reduction, _, smoothing = args[2], args[3], args[4], args[5]
    reduction = node.kwargs.get("reduction", 1 if reduction is None else reduction)
    smoothing = node.kwargs.get("label_smoothing", smoothing or 0.0)
    return weight is None and reduction in (1, 2) and not smoothing   # mean, or sum (weigh_loss)


def _carry_into(node, region, linears, tp, unpullable):
    """Set node's placement in the region; return linears to pull into it, or None."""
    sliced: dict = {}     # inputs this node reads through a local slice (R -> Shard)
    merged = merged_rows(node, region, region.pl, tp)
    if merged is not None:
        region.pl[node] = merged
        return None
    for _ in range(8):
        try:
            out = carry(node, ChainMap(sliced, region.pl), tp)
        except NoRule as e:
            raise _Reject(node.name, str(e)) from None
        if isinstance(out, Need):
            sources = _column_sources(out.arg, linears, region)
            if sources and not sources & unpullable:
                return sorted(sources)
            region.scatters[(node.name, out.arg.name)] = out.dim
            at = range_met(node, out, ChainMap(sliced, region.pl), region)
            if at is not None:
                region.scatter_at[(node.name, out.arg.name)] = at
            sliced[out.arg] = Shard(out.dim, None)
            continue
        marker = None
        if isinstance(out, tuple) and out and isinstance(out[0], SplitOnShard):
            marker, out = out
            if marker.origin == node.name:       # a concatenation along the sharded dim
                new_origin(region, node, marker)
            else:
                _merge_sections(region, marker, node, tp)
        region.pl[node] = out
        track_offset(node, out, marker, region)
        keep_merged(node, out, region)
        shards = [a for a in node.all_input_nodes if isinstance(region.pl.get(a), Shard)]
        if len(shards) > 1:
            region.meets[node.name] = shards
        src = region.pl.get(node.args[0]) if node.target is aten.index.Tensor else None
        if isinstance(src, Shard) and src.dim < len(node.args[1]) and node.args[1][src.dim] is not None:
            region.indexed[node.name] = src.origin     # per-rank groups of one block (_grow)
        return None
    raise _Reject(node.name, "unresolvable sharding requirements")


def _merge_sections(region, marker, node, tp) -> None:
    """The origin's sections: cut wherever a split or slice of it starts or ends (a split of a
    part of it where that part lies). Each range an op reads must stay one whole section
    (ranges equal or apart), or a rank's share of it would not be one contiguous 1/tp of it."""
    total = region.totals.get(marker.origin, sum(marker.sections))
    base = region.offsets.get(node.args[0])
    if not isinstance(base, int):
        if sum(marker.sections) != total:
            raise _Reject(node.name, f"a cut of a part of {marker.origin} whose place in its "
                          "features is not known")
        base = 0
    pieces = region.pieces.setdefault(marker.origin, set())
    for a, b in ((a + base, b + base) for a, b in marker.pieces):
        if any(a < d and c < b and not (c <= a and b <= d) and not (a <= c and d <= b)
               for c, d in pieces):     # crossing: neither inside the other (a nested split)
            raise _Reject(node.name, "two cuts of one projection that overlap")
    pieces.update((a + base, b + base) for a, b in marker.pieces)
    cuts = sorted({0, total} | {p for piece in pieces for p in piece})
    sections = tuple(b - a for a, b in zip(cuts, cuts[1:]))
    if any(v % tp for v in sections):
        raise _Reject(node.name, f"sections {sections} of one projection do not divide by tp={tp}")
    if marker.origin in region.fixed and sections != region.fixed[marker.origin]:
        raise _Reject(node.name, f"a cut inside a part {sections} of the concatenation "
                      f"{marker.origin} along the sharded dim {region.fixed[marker.origin]}")
    region.sections[marker.origin] = sections


def _column_sources(arg: fx.Node, linears, region) -> set[str]:
    """The linears (with replicated inputs) that `arg` is computed from, through ops that only
    mix in weights and input-derived tensors (rotary tables, masks, an empty cache); empty if
    `arg` also depends on some other activation."""
    found, seen, stack = set(), set(), [arg]
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.name in linears:
            x = n.args[1] if n.target is aten.addmm.default else n.args[0]
            if isinstance(region.pl.get(x), Shard):
                return set()
            found.add(n.name)
            continue
        if n.op in ("placeholder", "get_attr") or n.name not in region.activations:
            continue
        if n.op != "call_function" or len(seen) > 256:
            return set()
        stack.extend(n.all_input_nodes)
    return found


def param_dependent(gm: fx.GraphModule, params) -> set[str]:
    """Nodes that a parameter flows into (activations); the rest come from inputs, buffers and
    constants alone (masks, rotary tables, an empty cache) and are the same on every tp rank."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        if (n.op == "get_attr" and n.target in params) or any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


def _check_params(region, ctx, plan) -> None:
    """Every use of a weight this region shards must be a use that can take the shard."""
    for s in region.seeds:
        use = ctx.linears[s.name]
        sections = region.sections.get(s.name, (int(shape_of(s)[-1]),))
        _claim(plan, use.weight, ParamShard(use.out_dim, sections), s, region, ctx)
        if use.bias:
            _claim(plan, use.bias, ParamShard(0, sections), s, region, ctx)
    for r in region.rows:
        use = ctx.linears[r]
        _claim(plan, use.weight, ParamShard(use.in_dim, (_in_features(use, region),)),
               ctx.nodes[r], region, ctx)


def _in_features(use: LinearUse, region) -> int:
    def named(placed):
        return next((n for n in placed if isinstance(n, fx.Node) and n.name == use.x), None)
    x = named(region.pl.maps[0]) or named(region.pl)     # the region's own first: far fewer
    return int(shape_of(x)[-1])


def _claim(plan, param, want, node, region, ctx) -> None:
    have = plan.params.get(param)
    if have is not None and have != want:
        raise _Reject(node.name, f"weight {param} is already split as {have}, not {want}")
    seeds = {s.name for s in region.seeds}
    for u in ctx.weight_users.get(param, ()):
        if u.name in seeds or u.name in region.rows or u.name in plan.column or u.name in plan.row:
            continue
        if u.target is aten.embedding.default and want.dim == 0 and len(want.sections) == 1:
            continue
        raise _Reject(node.name, f"weight {param} is also used by {u.name} ({u.target}), which "
                      "needs it whole")


def _commit(region, plan, committed, linears) -> None:
    for s in region.seeds:
        plan.column[s.name] = region.sections.get(s.name)
        use = linears[s.name]
        sections = region.sections.get(s.name) or (int(shape_of(s)[-1]),)
        plan.params[use.weight] = ParamShard(use.out_dim, sections)
        if use.bias:
            plan.params[use.bias] = ParamShard(0, sections)
    for r in region.rows:
        plan.row.add(r)
        use = linears[r]
        plan.params[use.weight] = ParamShard(use.in_dim, (_in_features(use, region),))
    plan.vocab_loss |= region.ces
    plan.scatters.update(region.scatters)
    plan.scatter_sections.update(region.scatter_sections)
    for node, p in region.pl.maps[0].items():     # what the committed ones do not hold yet
        if isinstance(node, fx.Node) and (isinstance(p, (Shard, tuple)) or p is P):
            committed[node] = R if p is P else p


def _decide_embeddings(gm, plan, program, tp) -> None:
    for n in gm.graph.nodes:
        if n.target is not aten.embedding.default or not _param_name(n.args[0], program.params):
            continue
        w = n.args[0].target
        rows, width = (int(d) for d in shape_of(n.args[0]))
        tied = plan.params.get(w)
        if tied is not None:
            plan.vocab_embedding.add(n.name)      # tied to a vocabulary-parallel head
        # a vocabulary (GPT-3 50257 x 12288, Llama-2-70B 32000 x 8192, Llama 3 128256 x 16384:
        # 2 to 8 rows per feature) is split, as Megatron's VocabParallelEmbedding; a position
        # table (GPT-2 1024 x 768, GPT-3 2048 x 12288) stays whole: an all-reduce it would cost
        elif rows % tp == 0 and rows >= 2 * width:
            plan.vocab_embedding.add(n.name)
            plan.params[w] = ParamShard(0, (rows,))
