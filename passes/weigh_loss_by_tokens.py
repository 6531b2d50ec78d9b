"""weigh_loss_by_tokens: a loss that is a mean over the tokens that count made exact over
microbatches and data-parallel replicas.

The runtime sums microbatch losses, each scaled. Scaled by 1 / (microbatches * dp), a mean of
microbatch means is the plain model's loss only when every microbatch counts as many tokens;
with padding or prompt tokens set to `ignore_index` (-100), or documents shorter than the
sequence, it is not (a microbatch of 10 counted tokens weighs as much as one of 1000). This
pass finds, by ops and dataflow, a loss of the form

  cross_entropy / nll_loss(..., ignore_index=i, reduction="mean")   (a model's own loss from
                                                                     `labels` is one too)
  sum(l * mask) / mask.sum()

possibly through dtype casts or a constant factor, whose count (`target != i`, `mask.sum()`)
is a function of the inputs alone. It rewrites the loss into the sum over the microbatch's
counted elements and records the count as its own small program (`TokenCount`): train_step
runs it on every microbatch of the global batch, on every rank (the inputs are there), and
scales each microbatch's summed loss by 1 / (global count). The loss and the gradients are the
plain model's; a microbatch with no counted token adds 0, not NaN.

Any other loss keeps the microbatch-mean rule; when it holds a mean with excluded tokens that
the pass cannot separate (a cross-entropy plus an MoE auxiliary loss), `compile` warns once and
says so in `explain()`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopart.ir import Program, copied_graph, graph_module
from autopart.ops import aten_groups as G

aten = torch.ops.aten

# op -> (index of its reduction argument, index of its ignore_index argument)
TOKEN_MEANS = G.TOKEN_MEANS
MEAN, SUM = 1, 2
# ops between the mean and the model's loss output that keep it linear in the summed loss
PASS_THROUGH = ({aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.mul.Scalar,
                 aten.div.Scalar} | G.ALIASES)


@dataclass
class TokenCount:
    """What the loss is a mean over, per microbatch: `gm(*inputs named by self.inputs)` returns
    the count; `rule` says it in words (explain())."""
    gm: fx.GraphModule
    inputs: tuple
    rule: str


def weigh_loss_by_tokens(program: Program, *, splits: int):
    """Return (program, report): the loss summed over its counted tokens and `loss_count` set
    when it is a token mean and the batch is split (splits = microbatches * dp > 1)."""
    loss = _loss_node(program.gm)
    found = _token_mean(loss, program) if splits > 1 else None
    if found is None:
        rule = _microbatch_rule(loss, splits)
        return program.replace(loss_rule=rule), {"loss": rule}
    node, count, what = found
    gm = _summed(program.gm, node)
    rule = f"token-weighted: {what}, summed per microbatch and divided by the global count"
    counter = TokenCount(*_count_program(program, count), rule)
    return program.replace(gm=gm, loss_count=counter, loss_rule=rule), {"loss": rule}


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return out[0] if isinstance(out, (tuple, list)) else out


def _token_mean(loss: fx.Node, program: Program):
    """(the mean node, what counts its elements, words) when `loss` is a token mean reached
    through PASS_THROUGH ops, its count a function of the inputs alone; else None."""
    node = loss
    while node.op == "call_function" and node.target in PASS_THROUGH and len(node.users) == 1:
        node = node.args[0]
    if node.op != "call_function" or len(node.users) != 1:
        return None
    if node.target in TOKEN_MEANS:
        r, i = TOKEN_MEANS[node.target]
        args = list(node.args) + [None] * (6 - len(node.args))
        weight = args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        reduction = node.kwargs.get("reduction", MEAN if args[r] is None else args[r])
        ignore = node.kwargs.get("ignore_index", -100 if args[i] is None else args[i])
        target = node.args[1]
        if reduction != MEAN or weight is not None or not _from_inputs(target, program):
            return None
        return node, ("ne", target, ignore), f"{_op(node)} over targets != {ignore}"
    if node.target is aten.div.Tensor:
        num, den = node.args
        if (isinstance(den, fx.Node) and _is_full_sum(num) and den.target in
                (aten.sum.default, aten.sum.dim_IntList) and _from_inputs(den, program)):
            return node, ("value", den, None), f"sum(loss * mask) / {den.name}"
    return None


def _op(node: fx.Node) -> str:
    return node.target.__name__.split(".")[0]


def _is_full_sum(node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is aten.sum.default:
        return True
    val = node.meta.get("val")
    return node.target is aten.sum.dim_IntList and isinstance(val, torch.Tensor) and val.dim() == 0


def _cone(node: fx.Node) -> list[fx.Node]:
    seen, stack = {}, [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen[n] = None
            stack.extend(n.all_input_nodes)
    return list(seen)


def _from_inputs(node: fx.Node, program: Program) -> bool:
    """Whether `node` depends on user inputs alone (no parameter, buffer or random op)."""
    cone = _cone(node)
    if any(n.op not in ("placeholder", "call_function") for n in cone):
        return False
    return any(n.op == "placeholder" for n in cone) and not any(
        n.op == "call_function" and hasattr(n.target, "tags")
        and torch.Tag.nondeterministic_seeded in n.target.tags for n in cone)


def _summed(gm: fx.GraphModule, mean: fx.Node) -> fx.GraphModule:
    """A copy of `gm` whose token mean is the sum over the counted elements."""
    graph, env = copied_graph(gm)
    new = env[mean]
    if new.target in TOKEN_MEANS:
        r = TOKEN_MEANS[new.target][0]
        if "reduction" in new.kwargs:
            new.kwargs = {**new.kwargs, "reduction": SUM}
        else:
            args = list(new.args) + [None] * (r + 1 - len(new.args))
            defaults = {2: None, 3: MEAN, 4: -100}
            args = [defaults.get(k) if a is None and k < r else a for k, a in enumerate(args)]
            args[r] = SUM
            new.args = tuple(args)
    else:       # sum(l * mask) / count -> sum(l * mask)
        new.replace_all_uses_with(new.args[0])
        graph.erase_node(new)
    return graph_module(gm, graph)


def _count_program(program: Program, count) -> tuple[fx.GraphModule, tuple]:
    """A program of the inputs the count reads, returning the count (an integer tensor)."""
    kind, node, ignore = count
    cone = _cone(node)
    inputs = tuple(n for n in program.gm.graph.nodes if n.op == "placeholder" and n in cone)
    graph = fx.Graph()
    env: dict = {}
    for n in program.gm.graph.nodes:
        if n in cone:
            env[n] = graph.node_copy(n, lambda a: env[a])
    value = env[node]
    if kind == "ne":
        value = graph.call_function(aten.sum.default, (graph.call_function(
            aten.ne.Scalar, (value, ignore)),))
    graph.output(value)
    return graph_module(torch.nn.Module(), graph, "TokenCount"), tuple(n.name for n in inputs)


def _microbatch_rule(loss: fx.Node, splits: int) -> str:
    """The rule a loss the pass leaves alone follows; one warning where it can differ from the
    plain model's (a token mean inside it that the pass cannot separate)."""
    if splits == 1:
        return "whole batch: one microbatch, one replica (the plain model's loss)"
    inner = [n for n in _cone(loss) if n.op == "call_function" and n.target in TOKEN_MEANS]
    rule = "microbatch mean: the mean of the microbatch losses over microbatches and replicas"
    if inner:
        rule += (f" ({_op(inner[0])} at {inner[0].name} is a mean over counted tokens, but the "
                 "loss is more than it, e.g. plus an auxiliary loss: with ignored tokens or "
                 "padding, microbatches with fewer counted tokens weigh more than in the plain "
                 "model; return the token mean alone from loss_fn, or its sum with the count "
                 "as statistics, to be exact)")
        warnings.warn(f"autopart: the loss follows the {rule}", stacklevel=2)
    return rule
