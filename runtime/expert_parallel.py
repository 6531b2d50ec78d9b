"""The runtime's expert-parallel duties: this rank's experts and its bound EPComm.

Gradient reduction (expert gradients over the ranks holding the same experts) lives with the
other reductions in parallel_model.py."""
from __future__ import annotations

import dataclasses

from autopart.ep_ops import EPComm, localize_experts


def localize_expert_chunks(chunks, expert_params: dict, ep: int, ep_rank: int, ep_group) -> list:
    """Each chunk holding an MoE layer with this ep rank's own copy of its experts (dim 0, E/ep
    of them) and its EPComm bound to the ep group; other chunks unchanged."""
    if ep == 1 or not expert_params:
        return list(chunks)
    out = []
    for chunk in chunks:
        if not any(isinstance(m, EPComm) for m in chunk.gm.modules()):
            out.append(chunk)
            continue
        gm = localize_experts(chunk.gm, expert_params, ep, ep_rank, copy=True)
        for module in gm.modules():
            if isinstance(module, EPComm):
                module.bind(ep_group, ep_rank)
        out.append(dataclasses.replace(chunk, gm=gm))
    return out
