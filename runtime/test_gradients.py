"""The gradient reducer without processes: a recording all-reduce stands in for the groups."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autopart.config import Config
from autopart.ir import ParamShard, Plan
from autopart.mesh import Mesh
from autopart.runtime.gradients import GradientReducer, all_reduce_flat


def _plan(mesh, **kw) -> Plan:
    base = dict(mesh=mesh, config=Config(microbatches=2), global_batch=8, microbatch_size=2,
                chunk_ranks=tuple(range(mesh.pp)), chunk_layers=(), shared_params={})
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


# -- buckets overlapped with the backward (StepBuckets) --------------------------------------------

class AsyncRecorder(Recorder):
    """Recorder whose async calls return a work; the sum lands when the work is waited on (as
    with NCCL, whose wait orders the stream after it)."""

    def __call__(self, tensor, group=None, async_op=False):
        if not async_op:
            return super().__call__(tensor, group)
        self.calls.append((group, tensor.numel(), "async"))
        return SimpleNamespace(wait=lambda: tensor.mul_(2))


def _overlapped(params, shared=None, bucket_bytes=None, **plan_kw):
    plan = _plan(Mesh(pp=2, dp=2), shared_params={n: (0, 1) for n in shared or {}}, **plan_kw)
    groups = SimpleNamespace(tp=None, dp="DP", ep_replica=None, ep=None, model=None,
                             shared=dict(shared or {}))
    rec = AsyncRecorder()
    return GradientReducer(plan, params, groups, {"pp": 0, "dp": 0, "tp": 0},
                           torch.device("cpu"), all_reduce=rec, bucket_bytes=bucket_bytes), rec


def _run(steps, actions):
    """Drive `steps` (StepBuckets) over `actions` as the executor does, with no compute."""
    for i, _ in enumerate(actions):
        steps.before(i)
        steps.after(i)
    steps.finish(lambda work, what: work.wait())


def test_buckets_go_out_as_their_last_backward_ends_and_reduce_skips_them():
    from autopart.schedule import Action
    # chunk 0 reads a, b; chunk 2 (same rank, V placement) reads c and b: b is final after
    # chunk 0's last B, which comes after chunk 2's. tied sums over pp first: not overlapped
    params = {n: _param([0.0] * 4, [1.0] * 4) for n in "abct"}
    reducer, rec = _overlapped(params, shared={"t": "PP"}, bucket_bytes=32)
    chunks = {0: SimpleNamespace(params=("a", "b", "t")), 2: SimpleNamespace(params=("c", "b"))}
    actions = [Action(0, "F", 0), Action(2, "F", 0), Action(2, "B", 0), Action(0, "B", 0)]
    steps = reducer.overlap(actions, chunks)
    # final in the order c (chunk 2's B), then b and a (chunk 0's B: the reverse of its order)
    assert [b.names for b in reducer._layout.buckets] == [["c", "b"], ["a"]]
    for i in range(3):
        steps.before(i)
        steps.after(i)
    assert rec.calls == []                            # c's bucket waits for b
    steps.before(3)
    steps.after(3)
    assert rec.calls == [("DP", 8, "async"), ("DP", 4, "async")]
    steps.finish(lambda work, what: work.wait())
    assert all(params[n].grad.tolist() == [2.0] * 4 for n in "abc")
    reducer.reduce()                                  # the tied sum, then its dp sum
    assert rec.calls[2:] == [("PP", 4), ("DP", 4)]
    assert all(params[n].grad.tolist() == [2.0] * 4 for n in "abc")
    assert params["t"].grad.tolist() == [4.0] * 4


def test_a_gradient_the_step_did_not_produce_stays_none():
    from autopart.schedule import Action
    params = {"a": _param([0.0], [1.0]), "unused": torch.nn.Parameter(torch.zeros(2))}
    reducer, rec = _overlapped(params)
    _run(reducer.overlap([Action(0, "F", 0), Action(0, "B", 0)],
                         {0: SimpleNamespace(params=("a", "unused"))}),
         [None, None])
    # the bucket's layout is fixed (a's range and unused's, zeroed), the same on every replica
    assert rec.calls == [("DP", 3, "async")]
    assert params["unused"].grad is None and params["a"].grad.tolist() == [2.0]
    reducer.reduce()
    assert len(rec.calls) == 1


def test_gradients_are_views_of_the_bucket_summed_in_place():
    """zero=0's buckets as DDP's gradient_as_bucket_view: after the step every gradient of a
    bucket is a view of its one buffer (the tensor the all-reduce summed: no concatenation, no
    copy back). A second train_step before zero_grad adds to what the first left, which the
    buffer's next sum must not overwrite (set_aside copies it out)."""
    from autopart.schedule import Action
    params = {n: _param([0.0] * 3, [1.0] * 3) for n in "ab"}
    reducer, rec = _overlapped(params)
    actions = [Action(0, "F", 0), Action(0, "B", 0)]
    chunks = {0: SimpleNamespace(params=("a", "b"))}
    _run(reducer.overlap(actions, chunks), actions)
    flat = reducer._layout.buckets[0].flat
    assert rec.calls == [("DP", 6, "async")]
    for p in params.values():
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert p.grad.tolist() == [2.0] * 3
    earlier = reducer.set_aside()                     # no zero_grad: the next step adds
    for p in params.values():
        p.grad = torch.full((3,), 3.0)
    _run(reducer.overlap(actions, chunks), actions)
    reducer.add_back(earlier)
    assert [p.grad.tolist() for p in params.values()] == [[2.0 + 6.0] * 3] * 2


def test_autograd_hook_posts_a_bucket_while_the_backward_runs():
    from autopart.schedule import Action
    first, last = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    reducer, rec = _overlapped({"first": first, "last": last}, bucket_bytes=16)   # one each
    steps = reducer.overlap([Action(0, "F", 0), Action(0, "B", 0)],
                            {0: SimpleNamespace(params=("first", "last"))})
    seen_in_backward = []

    def probe(grad):        # runs in the backward, after last's gradient and before first's
        seen_in_backward.append(list(rec.calls))
        return grad

    mid = first * 3.0
    mid.register_hook(probe)
    loss = (mid * last).sum()
    steps.before(1)
    loss.backward()
    steps.after(1)
    steps.finish(lambda work, what: work.wait())
    assert seen_in_backward == [[("DP", 4, "async")]]     # last's bucket, during the backward
    assert rec.calls == [("DP", 4, "async"), ("DP", 4, "async")]
    assert last.grad.tolist() == [6.0] * 4 and first.grad.tolist() == [6.0] * 4


def test_no_buckets_without_replicas():
    from autopart.schedule import Action
    params = {"a": _param([0.0], [1.0])}
    reducer, _ = _overlapped(params)
    reducer.groups.dp = None
    assert reducer.overlap([Action(0, "B", 0)], {0: SimpleNamespace(params=("a",))}) is None


# -- clipping on the device -------------------------------------------------------------------------

def test_clip_matches_torch_without_a_host_sync(monkeypatch):
    torch.manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 7)]
    for p in plain:
        p.grad = torch.randn_like(p)
    params = {f"p{i}": torch.nn.Parameter(p.detach().clone()) for i, p in enumerate(plain)}
    for p, q in zip(plain, params.values()):
        q.grad = p.grad.clone()
    plan = _plan(Mesh())
    groups = SimpleNamespace(tp=None, dp=None, ep_replica=None, ep=None, model=None, shared={})
    reducer = GradientReducer(plan, params, groups, {"pp": 0, "dp": 0, "tp": 0},
                              torch.device("cpu"))
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(_n))
    norm = reducer.clip_(0.5)
    monkeypatch.undo()
    expected = torch.nn.utils.clip_grad_norm_(plain, 0.5)
    assert torch.allclose(norm, expected, rtol=1e-6)
    for p, q in zip(plain, params.values()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-6, atol=0)
