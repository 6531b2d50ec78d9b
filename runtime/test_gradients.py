"""The gradient reducer without processes: a recording all-reduce stands in for the groups."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autopart.ir import ParamShard, Plan
from autopart.mesh import Mesh
from autopart.runtime.gradients import GradientReducer, all_reduce_flat


def _plan(mesh, **kw) -> Plan:
    base = dict(mesh=mesh, schedule="1f1b", microbatches=2, virtual_stages=1, global_batch=8,
                microbatch_size=2, chunk_ranks=tuple(range(mesh.pp)), chunk_layers=(),
                shared_params={})
    return Plan(**{**base, **kw})


class Recorder:
    """An all_reduce that doubles the tensor (as if two ranks held the same values) and records
    which group each call used."""

    def __init__(self):
        self.calls = []

    def __call__(self, tensor, group=None):
        self.calls.append((group, tensor.numel()))
        tensor.mul_(2)


def _param(values, grad):
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))
    p.grad = torch.tensor(grad, dtype=torch.float32)
    return p


def test_reduce_sums_each_kind_over_its_own_group():
    plan = _plan(Mesh(dp=2, tp=2, ep=2), sp_grad_reduce=frozenset({"norm"}),
                 ep_shards={"experts": ParamShard(0, (4,))}, shared_params={})
    params = {"norm": _param([1.0], [1.0]), "dense": _param([1.0, 2.0], [3.0, 4.0]),
              "experts": _param([1.0], [5.0])}
    groups = SimpleNamespace(tp="TP", dp="DP", ep_replica="EPR", ep="EP", model="MODEL",
                             shared={})
    rec = Recorder()
    GradientReducer(plan, params, groups, {"pp": 0, "dp": 0, "tp": 0}, torch.device("cpu"),
                    all_reduce=rec).reduce()
    # sequence-parallel norm: over tp, then with the dense ones over dp; experts over replicas
    assert rec.calls == [("TP", 1), ("DP", 3), ("EPR", 1)]
    assert params["norm"].grad.tolist() == [4.0]          # tp then dp
    assert params["dense"].grad.tolist() == [6.0, 8.0]
    assert params["experts"].grad.tolist() == [10.0]


def test_tied_parameter_sums_over_its_stages_even_without_a_local_gradient():
    plan = _plan(Mesh(pp=2), shared_params={"wte": (0, 1)})
    params = {"wte": torch.nn.Parameter(torch.ones(3))}       # no grad on this rank this step
    groups = SimpleNamespace(tp=None, dp=None, ep_replica=None, ep=None, model=None,
                             shared={"wte": "PP01"})
    rec = Recorder()
    GradientReducer(plan, params, groups, {"pp": 1, "dp": 0, "tp": 0}, torch.device("cpu"),
                    all_reduce=rec).reduce()
    assert rec.calls == [("PP01", 3)] and params["wte"].grad.tolist() == [0.0, 0.0, 0.0]


def test_global_norm_counts_each_shard_once():
    # tp rank 1: its tensor shard counts, the replicated weight is counted by tp rank 0 only; a
    # tied weight counts on the rank of its first chunk only (pp rank 0 here, this is pp 1)
    plan = _plan(Mesh(pp=2, tp=2), tp_shards={"w": ParamShard(0, (4,))},
                 shared_params={"tied": (0, 1)})
    params = {"w": _param([0.0, 0.0], [3.0, 4.0]), "replicated": _param([0.0], [12.0]),
              "tied": _param([0.0], [100.0])}
    groups = SimpleNamespace(ep=None, model=None, shared={})
    norm = GradientReducer(plan, params, groups, {"pp": 1, "dp": 0, "tp": 1},
                           torch.device("cpu")).global_norm()
    assert norm.item() == pytest.approx(5.0)


def test_all_reduce_flat_without_a_group_does_nothing():
    g = torch.ones(2)
    all_reduce_flat([g], None, all_reduce=lambda *a, **k: pytest.fail("no group, no call"))
    assert g.tolist() == [1.0, 1.0]
