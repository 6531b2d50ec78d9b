"""analyze_costs: the cost of every node as this rank runs it, symbolic in b and s.

Runs after the sharding passes, so work on tensor-parallel shards counts 1/tp and expert work
1/ep; autopart's own collectives and p2p markers cost no compute (their bytes are reported by
explain). The cut pass balances chunks by these costs.
"""
from __future__ import annotations

from autopart.analysis import analyze
from autopart.ir import Program


def analyze_costs(program: Program):
    """Return (program with .costs = node name -> NodeCost, report)."""
    costs = analyze(program)
    return program.replace(costs=costs), {"nodes": len(costs)}
