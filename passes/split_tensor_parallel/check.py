"""Checks of a decided plan before the rewrite: heads and large projections divide by tp, the
share a rank holds, the replicated-linear warning, the sequence length under SP."""
from __future__ import annotations

import warnings

import torch

from autopart.errors import AutopartError, module_path, node_error, user_source_line
from autopart.ir import SEQ
from autopart.placement import shape_of

aten = torch.ops.aten

from .expert_linears import moe_matmuls
from .find import find_linears


def check_heads(program, plan, tp) -> None:
    """Heads and large projections must divide by tp: name the node, the numbers, a remedy."""
    gm = program.gm
    for n in gm.graph.nodes:
        if n.target is aten.scaled_dot_product_attention.default:
            heads = int(shape_of(n.args[0])[1])
            if heads % tp:
                ok = [t for t in range(1, heads + 1) if heads % t == 0]
                raise node_error(n, f"{heads} attention heads do not divide by tp={tp}",
                                 f"use tp in {ok}")
    nodes = {n.name: n for n in gm.graph.nodes}
    linears = find_linears(gm, program.params, plan.expert_matmuls)
    size = {name: program.params[u.weight].numel for name, u in linears.items()}
    largest = max(size.values(), default=0)
    for name, reason in plan.skipped:
        feats = int(shape_of(nodes[name])[-1])
        if feats % tp and size[name] * 4 >= largest:
            ok = [t for t in range(1, min(feats, 64) + 1) if feats % t == 0]
            padded = -(-feats // tp) * tp
            raise node_error(nodes[name], f"linear {name} has {feats} output features, not "
                             f"divisible by tp={tp}", f"use tp in {ok}, or pad that dimension to "
                             f"a multiple of {tp} (e.g. {feats} -> {padded}, as Megatron pads "
                             "its vocabulary)")


def check_share(program, plan, tp) -> None:
    """Replicating whole layers is not tensor parallelism: fail, naming what blocked the split."""
    total = sum(p.numel for p in program.params.values())
    ep_plan = program.ep       # experts sharded over ep (shard_experts ran)
    experts, ep = (ep_plan.params, ep_plan.ep) if ep_plan is not None else ({}, 1)
    local = sum(p.numel // (tp if name in plan.params else 1) // (ep if name in experts else 1)
                for name, p in program.params.items())
    if total and local / total > 1.5 / tp:
        _check_experts_replicated(program, plan, experts, local / total, tp)
        nodes = {n.name: n for n in program.gm.graph.nodes}
        linears = find_linears(program.gm, program.params, plan.expert_matmuls)
        worst = max(plan.skipped, key=lambda s: program.params[linears[s[0]].weight].numel,
                    default=None)
        share = (f"tensor parallelism leaves each rank {local / total:.0%} of the parameters, "
                 f"more than 1.5/tp = {1.5 / tp:.0%}")
        if worst is None:       # no linear at all: name the op that reads the largest weight
            _no_linear_found(program, plan, share)
        raise node_error(nodes[worst[0]], f"{share}; the largest replicated linear is "
                         f"{worst[0]} ({worst[1]})", "rewrite the op named above with standard "
                         "ATen ops, or use pipeline parallelism for this model")
    _warn_replicated(program, plan, total)


def _no_linear_found(program, plan, share: str) -> None:
    """No op read a 2-D weight as a linear: raise naming the op that reads the largest
    replicated parameter, its source line and shape."""
    whole = [(p.numel, n) for n, p in program.params.items() if n not in plan.params]
    name = max(whole)[1] if whole else None
    reader = next((u for n in program.gm.graph.nodes if n.op == "get_attr" and n.target == name
                   for u in n.users), None)
    what = (f"; no op reads a weight as a linear (F.linear, x @ w, x @ w.T, einsum); the "
            f"largest parameter, {name} {tuple(program.params[name].shape)}, is read by "
            f"{reader.name} ({reader.target})" if reader is not None else "")
    raise node_error(reader, share + what, "write that op as a linear (F.linear(x, w) or "
                     "x @ w.T), or use pipeline parallelism for this model")


def _check_experts_replicated(program, plan, experts: dict, share: float, tp: int) -> None:
    """Most of what stays whole is a mixture-of-experts layer's stacked experts, which tensor
    parallelism could not split (sequence parallelism, or an expert computation without a
    tensor-parallel rule) and no ep axis divides: say which expert matmul, why, and the
    meshes that do divide them."""
    from autopart.moe_layers import find_moe_layers
    whole = {n: p.numel for n, p in program.params.items()
             if n not in plan.params and n not in experts}
    moe = [n for n in (find_moe_layers(program).params if not experts else ()) if n in whole]
    mass = sum(whole[n] for n in moe)
    if not moe or 2 * mass < sum(whole.values()):
        return
    total = sum(p.numel for p in program.params.values())
    node, why = _expert_blocker(program, plan)
    raise node_error(node, f"tensor parallelism (tp={tp}) leaves the experts of the "
                     f"mixture-of-experts layers whole ({moe[0]} and {len(moe) - 1} more: "
                     f"{mass / total:.0%} of the parameters): {why}; each rank would hold "
                     f"{share:.0%} of the parameters, more than 1.5/tp = {1.5 / tp:.0%}",
                     ("drop sequence_parallel (experts are then split over tp), or " if
                      plan.sequence_parallel else "") + "shard the experts over an "
                     f"expert-parallel axis too, e.g. Mesh(tp={tp}, dp=2, ep=2) (ep divides dp "
                     "and the expert count), or use pipeline parallelism instead of tp")


def _expert_blocker(program, plan):
    """(the expert matmul left whole, why): the region search's reason, or sequence parallelism
    (under which expert tensor parallelism is not done)."""
    nodes = {n.name: n for n in program.gm.graph.nodes}
    for name, reason in plan.skipped:
        if name in plan.expert_matmuls:
            return nodes[name], f"the expert matmul {name} stays whole ({reason})"
    matmuls = moe_matmuls(program)
    first = next((n for n in program.gm.graph.nodes if n.name in matmuls), None)
    if plan.sequence_parallel:
        return first, ("expert tensor parallelism is not done under sequence parallelism "
                       "(sequence_parallel=True with experts and no ep axis)")
    return first, "no tensor-parallel split of the expert computation was found"


def _warn_replicated(program, plan, total: int) -> None:
    """One warning for all linears left replicated, grouped by the op that stopped each split,
    with its source line and the share of the model every rank holds whole because of it."""
    linears = find_linears(program.gm, program.params, plan.expert_matmuls)
    nodes = {n.name: n for n in program.gm.graph.nodes}
    groups: dict = {}
    for name, reason in plan.skipped:
        stopper, _, why = reason.partition(": ")
        op = nodes.get(stopper)
        key = (str(op.target) if op is not None else stopper, why)
        groups.setdefault(key, []).append((name, op))
    if not groups:
        return
    share = sum(program.params[linears[n].weight].numel for n, _ in plan.skipped) / max(total, 1)
    lines = []
    for (target, why), members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        name, op = members[0]
        more = f" and {len(members) - 1} more like it" if len(members) > 1 else ""
        lines.append(f"  - {target}: {why}\n      stops {name} ({module_path(nodes[name]) or 'top'})"
                     f"{more}\n      at {user_source_line(op)}")
    warnings.warn(f"autopart: {len(plan.skipped)} linear(s) stay replicated over tp={plan.tp}, "
                  f"{share:.1%} of the parameters held whole on every rank; what stopped them:\n"
                  + "\n".join(lines) + "\n  remedy: write the op with one that has a "
                  "tensor-parallel rule (autopart/placement.py RULES), or accept the replication",
                  stacklevel=2)


def check_sequence(program, plan, tp) -> None:
    """The sequence the reductions scatter is the activations' (a ViT's patches + class
    token), not necessarily the first input's dim 1 (its channels)."""
    nodes = {n.name: n for n in program.gm.graph.nodes}
    for name, dim in plan.seq_shards.items():
        shape = shape_of(nodes[name])
        size = shape[dim] if dim < len(shape) else None
        if isinstance(size, int) and size % tp:
            raise node_error(nodes[name], f"sequence parallelism splits the sequence ({int(size)} "
                             f"tokens) over tp={tp} ranks", f"a sequence length divisible by {tp}"
                             ", or sequence_parallel=False")
    if program.seq_len is not None and program.seq_len % tp and SEQ in program.symbols.values():
        raise AutopartError(f"sequence parallelism splits the sequence ({program.seq_len} tokens) "
                            f"over tp={tp} ranks.\n  remedy: a sequence length divisible by {tp}")
