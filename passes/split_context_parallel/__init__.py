"""split_context_parallel: the sequence sharded over a context-parallel axis (cp ranks).

Each rank holds two of the sequence's 2*cp equal chunks (i and 2*cp-1-i: causal load balancing,
as Megatron-Core and torch's context_parallel do) and runs the model on them. The captured graph
is symbolic in the sequence length, so its shapes follow; what must change is found by ops and
dataflow:

  attention cores   (SDPA, or matmul-softmax-matmul written by hand, GQA/MQA included) become
                    ring attention (K/V passed peer to peer, partial results merged by their
                    log-sum-exp) or all-gather-K/V attention, `attention=`; a core's mask is
                    proved causal, absent or a causal sliding window of w keys by computing it
                    (masks.py), optionally with padded keys or packed documents from a (batch,
                    sequence) input, anything else refused; flex_attention is refused by
                    name (unrecognised.py: its BlockMask is built over the whole sequence)
  positions         aranges over the sequence become the global positions of the rank's chunks,
                    and tables sliced to the sequence length (RoPE caches) are indexed at them
  everything else   must work position by position: an op that mixes positions outside the
                    cores is refused, naming it (check.py), unless it lies in a *token island*
                    (a mixture-of-experts layer's sort, gathers and scatters) that the pass
                    `prove_token_islands` proved position-wise by running it (islands.py)

prove_token_islands runs first, on the plain model (before shard_experts adds all-to-alls and
tensor parallelism splits it), and records the islands' node names in `Program.cp_islands`.

The loss must be a token mean (weigh_loss_by_tokens rewrites it into a sum over counted tokens
scaled by the global count), so the ranks' sums add up to the plain model's loss. The runtime
hands each rank its chunks of every input whose dim 1 is the sequence, binds `cp_comm` to the
rank's context-parallel group and reduces gradients over dp x cp.
"""
from __future__ import annotations

import torch.fx as fx

from autopart.errors import AutopartError
from autopart.ir import ContextParallelPlan, Program

from .check import check_loss, check_position_wise, check_sequence_length, mixing_nodes
from .find import find_cores, position_sources, upstream
from .islands import prove_islands
from .masks import decide_causal
from .rewrite import KERNELS, rewrite
from .unrecognised import refuse_flex_attention, refuse_unrecognised_attention

ATTENTIONS = tuple(KERNELS)


def prove_token_islands(program: Program, *, cp: int, tp: int = 1,
                        sequence_parallel: bool = False):
    """Return (program with `cp_islands` set, report): the regions that mix positions outside
    the attention cores, each proved position-wise by running it (islands.py)."""
    if cp == 1:
        return program.replace(cp_islands=()), {"islands": []}
    refuse_flex_attention(program, cp)
    seq = check_sequence_length(program, cp, tp, sequence_parallel)
    check_loss(program, cp)         # before the islands: a loss's reductions are no island
    cores = find_cores(program)
    refuse_unrecognised_attention(program, cores, seq)    # before the islands: no island either
    islands = prove_islands(program, _outside_checks(program, cores), cp)
    names = tuple(sorted(n.name for island in islands for n in island.body))
    report = {"islands": [{"first": i.first.name, "entries": [n.name for n in i.entries],
                           "exits": [n.name for n in i.exits], "ops": len(i.body)}
                          for i in islands]}
    return program.replace(cp_islands=names), report


def split_context_parallel(program: Program, *, cp: int, attention: str = "ring",
                           tp: int = 1, sequence_parallel: bool = False):
    """Return (program rewritten for one context-parallel rank, report)."""
    if cp == 1:
        return program.replace(cp=ContextParallelPlan(1, attention)), {"cp": 1}
    refuse_flex_attention(program, cp)
    seq = check_sequence_length(program, cp, tp, sequence_parallel)
    check_loss(program, cp)
    cores = find_cores(program)
    refuse_unrecognised_attention(program, cores, seq)
    if not cores:
        raise AutopartError(
            f"context parallelism (cp={cp}) shards the sequence, but no attention core was "
            "found in the model (scaled_dot_product_attention, or q @ k^T -> softmax -> @ v): "
            "nothing mixes positions that the pass could replace.\n  remedy: drop the cp axis")
    inputs = set(program.inputs)
    for core in cores:
        core.causal = decide_causal(core, program.gm, inputs, seq)
    aranges, slices = position_sources(program)
    proved = set(program.cp_islands or ())
    check_position_wise(program, _outside_checks(program, cores)
                        | {n for n in program.gm.graph.nodes if n.name in proved}, set())
    gm = rewrite(program, cores, aranges, slices, cp, attention)
    islands = _first_ops(program, proved)
    plan = ContextParallelPlan(cp, attention,
                               tuple((c.last.name, _mask_name(c)) for c in cores),
                               tuple(n.name for n in aranges + slices), seq, seq // cp, islands,
                               tuple(sorted({c.doc_ids.name for c in cores if c.doc_ids})))
    report = {"cp": cp, "attention": attention, "cores": [list(c) for c in plan.cores],
              "positions": list(plan.positions), "local_seq_len": seq // cp,
              "islands": list(islands), "documents": list(plan.documents)}
    return program.replace(gm=gm, cp=plan, seq_len=seq // cp), report


def _mask_name(core) -> str:
    """How the plan, explain() and --json name a core's mask."""
    if core.window is not None:
        return f"window {core.window}"
    return "causal" if core.causal else "full"


def _outside_checks(program: Program, cores) -> set[fx.Node]:
    """What the position check skips: the cores (replaced), the nodes the outputs no longer
    need once they are (mask ops, proved by value) and the loss's reductions (weighed)."""
    live = _live_after_rewrite(program, cores)
    return _core_nodes(program, cores) | (set(program.gm.graph.nodes) - live) | \
        _loss_nodes(program)


def _first_ops(program: Program, proved: set[str]) -> tuple[str, ...]:
    """The mixing ops of the proved islands, as the graph still holds them (explain())."""
    return tuple(n.name for n in mixing_nodes(program, set()) if n.name in proved)


def _core_nodes(program: Program, cores) -> set[fx.Node]:
    """Every node a core computes from its q, k, v up to its output (what the rewrite replaces;
    the mask ops do not depend on q, k, v and are checked by value instead)."""
    order = {n: i for i, n in enumerate(program.gm.graph.nodes)}
    out: set[fx.Node] = set()
    for core in cores:
        stop, end = {core.q, core.k, core.v}, order[core.last]
        start = min(order[n] for n in stop)
        after, todo = set(), list(stop)         # downstream of q, k, v, up to the output
        while todo:
            n = todo.pop()
            for u in n.users:
                if u not in after and order[u] <= end:
                    after.add(u)
                    todo.append(u)
        before = upstream([core.last],           # upstream of the output, back to q, k, v
                          lambda n, start=start: [a for a in n.all_input_nodes
                                                  if order[a] >= start])
        out |= (after & before) - stop
    return out


def _live_after_rewrite(program: Program, cores) -> set[fx.Node]:
    """The nodes the outputs still need once each core reads only its q, k, v: the ops that
    build masks (checked by value in masks.py) are not among them."""
    by_last = {c.last: c for c in cores}
    out = next(n for n in program.gm.graph.nodes if n.op == "output")
    return upstream([out], lambda n: (by_last[n].q, by_last[n].k, by_last[n].v) if n in by_last
                    else n.all_input_nodes)


def _loss_nodes(program: Program) -> set[fx.Node]:
    """The reductions that make the loss a scalar: 0-dim nodes the loss output depends on."""
    out = next(n for n in program.gm.graph.nodes if n.op == "output").args[0]
    loss = out[0] if isinstance(out, (tuple, list)) else out
    def scalar(n) -> bool:
        return isinstance(n, fx.Node) and getattr(n.meta.get("val"), "dim", lambda: 1)() == 0
    return upstream([loss] if scalar(loss) else [],
                    lambda n: [a for a in n.all_input_nodes if scalar(a)])

__all__ = ["ATTENTIONS", "prove_token_islands", "split_context_parallel"]
