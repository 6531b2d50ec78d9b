"""The state gatherer without processes: every rank's part assembled into the plain state."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from autopart.config import Config
from autopart.ir import ParamShard, Plan, RankProgram
from autopart.localize import shard_tensor
from autopart.mesh import Mesh
from autopart.runtime.state import StateGatherer


def _plan(mesh, **kw) -> Plan:
    base = dict(mesh=mesh, config=Config(microbatches=2), global_batch=8, microbatch_size=2,
                chunk_ranks=tuple(range(mesh.pp)), chunk_layers=(), shared_params={})
    return Plan(**{**base, **kw})


def test_state_gatherer_reassembles_tensor_and_expert_shards():
    mesh = Mesh(dp=2, tp=2, ep=2)
    qkv = torch.arange(24.0).reshape(6, 4)       # three sections of 2 rows: q | k | v
    experts = torch.arange(8.0).reshape(4, 2)
    plan = _plan(mesh, tp_shards={"qkv": ParamShard(0, (2, 2, 2))},
                 ep_shards={"experts": ParamShard(0, (4,))})
    parts = []
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        part = {}
        if c["dp"] == 0:
            part["qkv"] = shard_tensor(qkv, 0, (2, 2, 2), 2, c["tp"])
        if c["dp"] < mesh.ep:
            part["experts"] = experts.chunk(2)[mesh.ep_rank(rank)]
        parts.append(part)
    info = SimpleNamespace
    program = SimpleNamespace(params={"qkv": info(name="qkv", aliases=(), persistent=True),
                                      "experts": info(name="experts", aliases=("alias",),
                                                      persistent=True)}, buffers={})
    mine = RankProgram(0, mesh.coords(0), ())
    gatherer = StateGatherer(plan, program, mine, None, torch.device("cpu"),
                             ["qkv", "experts", "alias"], {})
    out = gatherer.assemble(parts)
    assert list(out) == ["qkv", "experts", "alias"]
    assert torch.equal(out["qkv"], qkv) and torch.equal(out["experts"], experts)
    assert out["alias"] is out["experts"]


