"""ZeRO-1 in buckets (runtime/optimizer.py, parallelize(..., zero_bucket_size=)): with buckets
much smaller than a rank's parameters, dp=2 zero=1 AdamW equals the plain model and optimizer,
and the memory the gradient reduction and opt.step allocate is about one bucket beside the
1/dp slice, as the dispatcher sees tensors created and torch frees them (LiveBytes), not a copy
of the rank's whole parameter set.

Expected values come from the plain model's parameter shapes: n elements, the slice
ceil(n / 2), buckets of zero_bucket_size // 2 elements of each slice.
"""
from __future__ import annotations

import copy
import math
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import autopart

BUCKET = 2 * 3001       # elements per collective: 3001 of each slice (a prime: pieces cross params)
DP, STEPS, RTOL, ATOL = 2, 3, 1e-5, 1e-5
ADAMW = dict(lr=1e-3, weight_decay=0.1)


def build():
    from examples.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=16))
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, lm_loss, x


class LiveBytes(TorchDispatchMode):
    """The peak, above the start, of the bytes of the storages that aten ops create while
    active and that are still alive: an op's output whose storage none of its inputs has is new
    (views and in-place results allocate nothing); it stops counting when torch frees the
    storage (a finalizer on its Python object, which lives exactly as long as the storage).
    Counted by the dispatcher, below autopart's code. Not counted: buffers a collective's
    backend allocates inside the op (Gloo copies a reduce-scatter's input)."""

    def __init__(self, active: bool = True):
        super().__init__()
        self.live = self.peak = 0
        self.active = active        # False: count nothing new (frees of what was counted still)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.active:
            return out
        inputs = {t.untyped_storage().data_ptr()
                  for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                storage = t.untyped_storage()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage.nbytes())
        return out

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


def peak_allocated(fn) -> int:
    with LiveBytes() as counter:
        fn()
    return counter.peak


class CountReduceScatter:
    """The input size of every dist.reduce_scatter_tensor call (the ZeRO-1 gradient buckets)."""

    def __enter__(self):
        self.sizes, self.saved = [], dist.reduce_scatter_tensor

        def counted(output, input, *args, **kwargs):
            self.sizes.append(input.numel())
            return self.saved(output, input, *args, **kwargs)
        dist.reduce_scatter_tensor = counted
        return self

    def __exit__(self, *exc):
        dist.reduce_scatter_tensor = self.saved


class BucketBytes(LiveBytes):
    """LiveBytes of what ShardLayout.post_reduce_scatter allocates (a bucket's input, a copy of
    its range of every replica's slice), alive at once over a whole train_step: the buckets
    posted during the backward and not yet waited on."""

    def __enter__(self):
        from autopart.runtime.sharding import ShardLayout
        self.saved = post = ShardLayout.post_reduce_scatter

        def counted(layout, *args, **kwargs):
            self.active = True
            try:
                return post(layout, *args, **kwargs)
            finally:
                self.active = False
        ShardLayout.post_reduce_scatter = counted
        self.active = False
        return super().__enter__()

    def __exit__(self, *exc):
        from autopart.runtime.sharding import ShardLayout
        ShardLayout.post_reduce_scatter = self.saved
        return super().__exit__(*exc)


def train(rank: int, world: int) -> dict:
    """STEPS AdamW steps, zero=1 in buckets of BUCKET elements and plain; what differs, and the
    peak bytes allocated by each step's gradient reduction and opt.step."""
    from tests.workers.common import _compare, _local_view
    model, loss_fn, x = build()
    ref = copy.deepcopy(model)
    pm = autopart.parallelize(model, autopart.Mesh(dp=DP), (x,), loss_fn=loss_fn, target=x,
                              zero=1, zero_bucket_size=BUCKET, timeout=timedelta(seconds=120))
    opt, ref_opt = pm.optimizer(torch.optim.AdamW, **ADAMW), \
        torch.optim.AdamW(ref.parameters(), **ADAMW)
    mine, ref_params = _local_view(pm, rank), dict(ref.named_parameters())
    peaks = {"reduce": [], "step": []}
    problems: list[str] = []
    with CountReduceScatter() as calls:
        for step in range(1, STEPS + 1):
            with BucketBytes() as counter:
                loss = pm.train_step(x, target=x)
            peaks["reduce"].append(counter.peak)
            ref_loss = loss_fn(ref(x), x)
            ref_loss.backward()
            _compare(f"step {step} loss", loss, ref_loss, RTOL, 1e-6, problems)
            peaks["step"].append(peak_allocated(opt.step))
            ref_opt.step()
            for name, p in pm.named_parameters():
                _compare(f"step {step} {name}", p, mine(name, ref_params[name]), RTOL, ATOL,
                         problems)
            opt.zero_grad(), ref_opt.zero_grad()
    return {"problems": problems, "peaks": peaks, "calls": calls.sizes}


@pytest.mark.full       # one 2-rank spawn, ~16 s
def test_buckets_equal_plain_and_bound_the_transient_memory():
    from autopart.runtime.launch import spawn
    from autopart.runtime.buckets import IN_FLIGHT
    model, _, _ = build()
    n = sum(p.numel() for p in model.parameters())     # the tied lm_head counted once
    shard = sum(math.ceil(p.numel() / DP) for p in model.parameters())   # a chunk of each
    piece = BUCKET // DP                                # of each slice per bucket
    buckets = math.ceil(shard / piece)
    assert buckets >= 10                                # many buckets, or nothing is tested
    bucket_bytes = 4 * DP * piece                       # one collective's fp32 buffer
    for r in spawn(train, DP, timeout=300):
        print(r["peaks"], "bucket", bucket_bytes, "shard", 4 * shard, "n", 4 * n)
        assert not r["problems"], "\n".join(r["problems"])
        # each step: one reduce-scatter per bucket of each layer group (its slice elements cut
        # in pieces), of DP pieces, in the order the backward finishes the groups
        assert r["calls"] == STEPS * reduce_scatter_sizes(model, piece), r["calls"]
        # a bucket's DP pieces copied from the gradients, reduce-scattered in place, posted
        # during the backward: at most IN_FLIGHT of them alive at once (the first ZeRO-1
        # built the rank's whole flat gradient, 4 * n bytes, and more)
        for peak in r["peaks"]["reduce"]:
            assert 0 < peak <= IN_FLIGHT * bucket_bytes, (peak, bucket_bytes, 4 * n)
        # step 1 allocates AdamW's two moments (8 bytes per slice element); every step, one
        # bucket at a time: its piece's fp32 gradient with AdamW's temporaries (a few pieces),
        # then the all-gather's bucket
        transient = 2 * bucket_bytes
        assert r["peaks"]["step"][0] <= 8 * shard + transient + bucket_bytes, (r["peaks"], shard)
        for peak in r["peaks"]["step"][1:]:
            assert 0 < peak <= transient, (peak, shard, bucket_bytes)


def reduce_scatter_sizes(model, piece: int) -> list[int]:
    """The input sizes of a step's reduce-scatters: each layer group's slice (a chunk of each
    of its parameters) cut in pieces of at most `piece` elements, DP pieces each."""
    from tests.test_zero_groups import expected_groups
    numel = {n: p.numel() for n, p in model.named_parameters()}
    sizes = []
    for group in expected_groups():
        n = sum(math.ceil(numel[name] / DP) for name in group)
        sizes += [DP * min(piece, n - s) for s in range(0, n, piece)]
    return sizes


def test_one_rank_buckets_equal_plain(single_process_group):
    """No spawn (the fast tier): one rank, zero=1 in buckets of 1000 elements: AdamW runs over
    one tensor per bucket, views of the slice, and each bucket's update is written back into
    the parameters it crosses; 2 steps equal the plain AdamW's, the per-parameter state
    (gather_state_by_parameter, what checkpoints store) equals the plain AdamW's, and a third
    step after reloading the slices (load_slices: each bucket its own `step` counter) too."""
    model, loss_fn, x = build()
    ref = copy.deepcopy(model)
    pm = autopart.parallelize(model, autopart.Mesh(), (x,), loss_fn=loss_fn, target=x, zero=1,
                              zero_bucket_size=1000, timeout=timedelta(seconds=60))
    opt, ref_opt = pm.optimizer(torch.optim.AdamW, **ADAMW), \
        torch.optim.AdamW(ref.parameters(), **ADAMW)
    n = sum(p.numel() for p in ref.parameters())
    assert len(opt.param_groups[0]["params"]) == math.ceil(n / 1000)
    ref_params = dict(ref.named_parameters())
    for _ in range(2):
        pm.train_step(x, target=x)
        loss_fn(ref(x), x).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        for name, p in pm.named_parameters():
            torch.testing.assert_close(p, ref_params[name], rtol=RTOL, atol=ATOL)
    by_name = opt.gather_state_by_parameter()
    for name, p in ref_params.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(by_name[name][key], ref_opt.state[p][key],
                                       rtol=1e-4, atol=1e-9)
        assert float(by_name[name]["step"]) == 2
    opt.load_slices([opt.slice_state(i) for i in range(len(opt.layouts))])
    assert all(float(st["step"]) == 2 for st in opt.state.values())
    pm.train_step(x, target=x)          # a third step from the reloaded state
    loss_fn(ref(x), x).backward()
    opt.step(), ref_opt.step()
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=RTOL, atol=ATOL)


def test_bad_bucket_size_names_the_remedy():
    model, loss_fn, x = build()
    mesh = autopart.Mesh(dp=2)
    with pytest.raises(autopart.AutopartError, match=r"zero_bucket_size=0.*\n  remedy: an int"):
        autopart.parallelize(model, mesh, (x,), loss_fn=loss_fn, target=x, zero=1,
                             zero_bucket_size=0)
    with pytest.raises(autopart.AutopartError, match=r"zero=0 has none.*\n  remedy: pass zero=1"):
        autopart.parallelize(model, mesh, (x,), loss_fn=loss_fn, target=x, zero_bucket_size=4096)
