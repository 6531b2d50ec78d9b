"""The gradient reducer: after a step's backward, each rank's gradients become those of the plain
model's loss over the global batch; and the global gradient norm over every shard.

Reductions, in order:
  sequence-parallel  replicated weights that saw only a sequence shard (norms, biases): sum over tp
  tied               a parameter used by chunks on several pipeline ranks: sum over those ranks
  data-parallel      dense gradients: sum over the dp replicas (the loss was scaled by
                     1/(microbatches * dp), so the sum is the mean)
  expert             an expert's gradient already holds every token of its ep group: sum over
                     the dp/ep ranks holding the same experts only

Overlap with the backward: a gradient whose only reduction is the data-parallel or the
expert sum goes into a bucket of about `bucket_bytes` (25 MiB, DDP's bucket_cap_mb), filled in
the order the backward finishes the gradients, and each bucket's all-reduce is posted
(async_op) as soon as all its gradients are final for the step: after the last backward action
(B, or W for split schedules) of the last microbatch of every chunk on this rank that reads
them. Where autograd accumulates (a fused B), a post-accumulate-grad hook marks each gradient as
it lands, so buckets go out while that backward still runs (a pp=1 model overlaps too); where
the executor accumulates (split programs, W by autograd.grad) the bucket is marked after the
action. Buckets are posted in one fixed order, the same on every replica. The executor waits on
every bucket at the end of its action list (StepBuckets.finish); `reduce` then does the rest as
before: the sequence-parallel and tied sums, and the data-parallel sum of those gradients (a
sum over tp or pp first, so that they add up in the same order as without overlap). zero=1 and
zero=2 reduce-scatter instead, in buckets that are ranges of the replicas' slices
(runtime/sharding.py, runtime/buckets.py): zero=1 once per step as above, zero=2 after every
backward action of the bucket's chunk; the ranges the step's buckets did not cover (parameters
summed over tp or pp first) are reduce-scattered by `reduce`.

`all_reduce` is injectable so the reducer is tested without processes.
"""
from __future__ import annotations

import itertools
import math
import numbers
from typing import Callable

import torch
import torch.distributed as dist

from autopart.errors import AutopartError
from autopart.ir import META_LAYER, Plan
from autopart.runtime.buckets import Bucket, BucketLayout, StepBuckets, copy_back, in_a_bucket

BUCKET_BYTES = 25 * 2 ** 20     # gradient bytes per overlapped all-reduce (DDP's bucket_cap_mb)


def all_reduce_flat(grads: list[torch.Tensor], group, all_reduce: Callable = dist.all_reduce) -> None:
    """Sum `grads` over `group` in one all-reduce (nothing to do without a group)."""
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, group=group)
    copy_back(flat, grads)


def final_points(actions, chunks: dict) -> dict[str, tuple[int, int]]:
    """{name: (index of the last backward action, B or W, of a chunk on this rank reading it;
    its place from the end of that chunk's parameters)}: when its gradient is final for the
    step, in the order the backward finishes them (the last-read weights first)."""
    last = {a.chunk: i for i, a in enumerate(actions) if a.kind in ("B", "W")}
    final: dict[str, tuple[int, int]] = {}
    for c, chunk in chunks.items():
        if c in last:
            for k, name in enumerate(reversed(_use_order(chunk))):
                final[name] = max(final.get(name, (-1, 0)), (last[c], k))
    return final


def _use_order(chunk) -> list[str]:
    """`chunk.params` in the order its forward first reads them (the first user of each
    get_attr), those it reads some other way last, by name. (chunk.params is sorted by name:
    as a backward order it kept every bucket waiting for the embedding, read first.)"""
    first = _first_readers(chunk)
    end = len(first) and max(at for at, _ in first.values()) + 1
    return sorted(chunk.params, key=lambda n: (first.get(n, (end, None))[0], n))


def _first_readers(chunk) -> dict[str, tuple[int, object]]:
    """{name: (graph position, node) of the first node of `chunk`'s graph reading it}."""
    graph = getattr(getattr(chunk, "gm", None), "graph", None)
    if graph is None:
        return {}
    wanted, first = set(chunk.params), {}
    pos = {node: i for i, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in wanted:
            at = min(((pos[u], u) for u in node.users), default=(pos[node], node),
                     key=lambda x: x[0])
            first[node.target] = min(first.get(node.target, at), at, key=lambda x: x[0])
    return first


def layer_groups(chunk) -> dict[str, str]:
    """{name: the group its gradient is reduce-scattered with}: the layer (the dataflow mark
    analysis.detect_layers leaves, META_LAYER, as runtime/compiled.py reads it) of the first node
    reading it, as passes/gather_parameters.py groups zero=3's gathers; a parameter first read
    outside every layer (an embedding, a final norm), or by a node a later pass made without the
    mark, by the node's name, so that node's parameters go together."""
    layers = set(getattr(chunk, "layers", ()) or ())

    def group(node):
        layer = node.meta.get(META_LAYER)
        return layer if layer is not None and layer in layers else node.name
    return {name: group(node) for name, (_, node) in _first_readers(chunk).items()}


def reduce_groups(actions, chunks: dict, early) -> list[tuple[int, str, list[str]]]:
    """(action index, group label, names) per zero reduce-scatter group of this rank, in the
    order the groups become final: the names for which `early(name)` (their only reduction is
    their replicas' sum) with the same final action (final_points: the last backward of the
    last microbatch of their chunk) and the same layer group (layer_groups), neighbours in that
    order. What GradientReducer.shard lays out and explain() shows."""
    final = final_points(actions, chunks)
    labels = {c: layer_groups(chunk) for c, chunk in chunks.items()}

    def group(name):
        i = final[name][0]
        return i, labels[actions[i].chunk].get(name, "")
    names = sorted((n for n in final if early(n)), key=final.__getitem__)
    return [(i, label, list(run)) for (i, label), run in itertools.groupby(names, key=group)]


class GradientReducer:
    """Reduces and measures the gradients of one rank's parameters (`params`: plain name ->
    Parameter) over the process groups in `groups` (a RankGroups)."""

    def __init__(self, plan: Plan, params: dict[str, torch.nn.Parameter], groups, coords: dict,
                 device: torch.device, all_reduce: Callable = dist.all_reduce,
                 bucket_bytes: int | None = None):
        self.plan, self.params, self.groups, self.coords = plan, params, groups, coords
        self.device, self.all_reduce = device, all_reduce
        # read when the buckets are first laid out; the module's BUCKET_BYTES when not given
        # (tests set it to cut a small model into several buckets)
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        # zero=1, 2: (dense, experts) ShardLayouts (runtime/sharding.py); their gradients are
        # reduce-scattered over the replicas instead of all-reduced
        self.zero, self.zero_layouts = 0, ()
        self._layout: BucketLayout | None = None    # the buckets, laid out on the first step
        self._running: StepBuckets | None = None    # the step whose buckets the hooks fill

    def overlap(self, actions, chunks: dict, trace=None) -> StepBuckets | None:
        """This step's buckets, to be driven by the executor over `actions` (this rank's list)
        and `chunks` (chunk index -> ChunkProgram); None when no gradient can go early."""
        if self._layout is None:
            final = final_points(actions, chunks)
            self._layout = self._lay_out_shards(actions, final) if self.zero_layouts else \
                self._lay_out(final)
            for p in {id(p): p for b in self._layout.buckets for p in b.params}.values():
                p.register_post_accumulate_grad_hook(self._landed)
        self._running = None
        if not self._layout.buckets:
            return None
        self._running = StepBuckets(self._layout, self.all_reduce, trace)
        return self._running

    def shard(self, zero: int, bucket_size: int, actions, chunks: dict) -> None:
        """ZeRO: lay out the dense parameters over the dp replicas and the expert parameters over
        the ranks holding the same experts (runtime/sharding.py), each in the order the backward
        finishes them (`actions`, `chunks` as in `overlap`), one segment per chunk, and last
        those that need a sum over tp or pp first; each parameter marked as sharded."""
        from autopart.runtime.optimizer import manage
        from autopart.runtime.sharding import ShardLayout
        trainable = [n for n, p in self.params.items() if p.requires_grad]
        layouts = []
        for experts, group in ((False, self.groups.dp), (True, self.groups.ep_replica)):
            names = [n for n in trainable if (n in self.plan.ep_shards) == experts]
            mine = set(names)
            groups = reduce_groups(actions, chunks,
                                   lambda n: n in mine and self._sum_group(n) is not None)
            early = [n for _, _, run in groups for n in run]
            late = sorted(set(names) - set(early))
            # the optimizer's buckets: a chunk's parameters; the reduce-scatters': a layer group's
            chunk_of = [actions[i].chunk for i, _, run in groups for _ in run]
            segments = [len(list(run)) for _, run in itertools.groupby(chunk_of)] + [len(late)]
            if names:
                layouts.append(ShardLayout(self.params, early + late, group, bucket_size,
                                           segments, early=len(early),
                                           groups=[len(run) for _, _, run in groups] +
                                           [len(late)]))
        manage(p for lay in layouts for p in lay.params)
        self.zero, self.zero_layouts, self._layout = zero, tuple(layouts), None

    def _landed(self, p: torch.Tensor) -> None:
        if self._running is not None:
            self._running.landed(p)

    def _lay_out(self, final: dict) -> BucketLayout:
        """zero=0: buckets of the gradients whose only reduction is their replicas' sum, in
        the order they become final, one bucket per group and dtype open at a time."""
        layout, open_buckets = BucketLayout(), {}
        for name in sorted((n for n in final if self._sum_group(n) is not None),
                           key=final.__getitem__):
            p, group = self.params[name], self._sum_group(name)
            key = (id(group), p.dtype, p.device)
            bucket = open_buckets.get(key)
            if bucket is None or bucket.nbytes + p.nbytes > self.bucket_bytes:
                bucket = open_buckets[key] = Bucket(group, len(layout.buckets))
                layout.buckets.append(bucket)
            bucket.add(name, p)
            layout.buckets_of[id(p)] = [bucket.index]
            layout.final_after.setdefault(final[name][0], []).append(p)
        return layout

    def _lay_out_shards(self, actions, final: dict) -> BucketLayout:
        """zero=1, 2: a bucket per range of each ShardLayout's early part (the parameters whose
        only reduction is their replicas' sum, laid out first by `shard`).
        zero=1 posts a bucket once its parameters are final for the step; zero=2 after every
        backward action of its chunk (`window_after`)."""
        layout, by_chunk = BucketLayout(), {}
        for lay in self.zero_layouts:
            for s, e in lay.reduce_ranges:
                if e > lay.early or s == e:
                    continue
                bucket = Bucket(lay.group, len(layout.buckets), shards=(lay, s, e))
                for i, _, _, _ in lay.pieces(s, e):
                    bucket.add(lay.names[i], lay.params[i])
                layout.place(bucket)
                chunk = actions[final[bucket.names[-1]][0]].chunk
                by_chunk.setdefault(chunk, []).append(bucket)
        for chunk, buckets in by_chunk.items():
            params = list({id(p): p for b in buckets for p in b.params}.values())
            for i, a in enumerate(actions):
                if self.zero >= 2 and a.chunk == chunk and a.kind in ("B", "W"):
                    layout.final_after[i] = params
                    layout.window_after[i] = [b.index for b in buckets]
            if self.zero < 2:
                for p, name in ((p, n) for b in buckets for p, n in zip(b.params, b.names)):
                    layout.final_after.setdefault(final[name][0], []).append(p)
        return layout

    def _sum_group(self, name: str):
        """The group of the one sum `name`'s gradient needs when that is all it needs (the
        data-parallel or the expert sum), else None (also for a frozen or foreign name)."""
        p, groups = self.params.get(name), self.groups
        if p is None or not p.requires_grad or name in groups.shared or \
                (name in self.plan.sp_grad_reduce and groups.tp is not None):
            return None
        return groups.ep_replica if name in self.plan.ep_shards else groups.dp

    def reduce(self) -> None:
        """Turn this step's local gradients into the plain model's (see the module docstring);
        what the step's buckets summed already (StepBuckets) is left as it is."""
        plan, groups = self.plan, self.groups
        running, self._running = self._running, None
        done = running.layout.buckets if running is not None else []
        all_reduce_flat([self.params[n].grad for n in sorted(plan.sp_grad_reduce)
                         if n in self.params and self.params[n].grad is not None],
                        groups.tp, self.all_reduce)
        for name, group in groups.shared.items():
            p = self.params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.all_reduce(p.grad, group=group)
        if self.zero_layouts:
            self._reduce_scatter_rest({(id(b.shards[0]), b.shards[1]) for b in done
                                       if self.zero == 1})
            return
        done = {n for b in done for n in b.names}
        left = [(n, p.grad) for n, p in self.params.items() if p.grad is not None and n not in done]
        all_reduce_flat([g for n, g in left if n not in plan.ep_shards], groups.dp, self.all_reduce)
        all_reduce_flat([g for n, g in left if n in plan.ep_shards], groups.ep_replica,
                        self.all_reduce)

    def _reduce_scatter_rest(self, done: set) -> None:
        """The ZeRO ranges the step's buckets did not reduce and that hold a gradient, one at a
        time; then zero=1 keeps only this rank's chunks of `.grad`, zero=2 only the slice."""
        for lay in self.zero_layouts:
            for s, e in lay.reduce_ranges:
                if (id(lay), s) in done or \
                        all(lay.params[i].grad is None for i, _, _, _ in lay.pieces(s, e)):
                    continue
                _, mine, _ = lay.post_reduce_scatter(s, e, async_op=False)
                lay.take_reduced(s, mine, keep_full=self.zero == 1)
                del mine    # before the next range's: one bucket alive at a time
            if self.zero == 1:
                lay.keep_own()
            else:
                for p in lay.params:
                    p.grad = None

    def named_grads(self) -> dict[str, torch.Tensor]:
        """{name: this rank's gradient of it}: `.grad`, or under zero=2 this rank's part of the
        reduced gradient (a view of the slice; none where the rank owns no element)."""
        if self.zero >= 2:
            return {n: g for lay in self.zero_layouts for n, g in lay.grad_views().items()}
        return {n: p.grad for n, p in self.params.items() if p.grad is not None}

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's gradients as the health check reads them: `.grad`, or under zero=2 each
        layout's reduced slice whole (one tensor; named_grads' views are parts of it, and the rest
        is zero padding)."""
        if self.zero >= 2:
            return [lay.grad for lay in self.zero_layouts if lay.grad is not None]
        return [p.grad for p in self.params.values() if p.grad is not None]

    def set_aside(self) -> tuple:
        """What the gradients hold before a step (a train_step not yet zeroed, as after two
        loss.backward() calls), taken out: it was reduced then, and reducing it again would
        count it once per replica or stage sharing it. `add_back` returns it after the step."""
        # a gradient that is a view of a bucket's buffer is copied out: this step's reduction
        # writes the buffer (runtime/buckets.py bucket_views)
        earlier = ({n: p.grad.clone() if in_a_bucket(p.grad, self._layout) else p.grad
                    for n, p in self.params.items() if p.grad is not None},
                   [lay.grad for lay in self.zero_layouts])
        for p in self.params.values():
            p.grad = None
        for lay in self.zero_layouts:
            lay.grad = None
        return earlier

    def add_back(self, earlier: tuple) -> None:
        grads, slices = earlier
        for name, grad in grads.items():
            p = self.params[name]
            p.grad = grad if p.grad is None else grad.add_(p.grad)
        for lay, grad in zip(self.zero_layouts, slices):
            if grad is not None:
                lay.grad = grad if lay.grad is None else grad.add_(lay.grad)

    def drop_grads(self) -> None:
        """Forget every gradient (a skipped step)."""
        for p in self.params.values():
            p.grad = None
        for lay in self.zero_layouts:
            lay.grad = None

    def global_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient: every shard counted once (a tied parameter
        on its first chunk's rank, a replicated weight on tp rank 0, experts over ep). One
        _foreach_norm per kind, the per-tensor norms combined in float64; no host sync."""
        plan, pp, tp = self.plan, self.coords["pp"], self.coords["tp"]
        dense, experts = [], []
        for name, grad in self.named_grads().items():
            owner = plan.chunk_ranks[plan.shared_params[name][0]] if name in plan.shared_params \
                else pp
            if owner == pp and (name in plan.tp_shards or tp == 0):
                (experts if name in plan.ep_shards else dense).append(grad)
        sq, sq_experts = self._sum_of_squares(dense), self._sum_of_squares(experts)
        if self.zero_layouts:   # zero=1, 2: each replica holds the gradient of its slice only
            if self.groups.dp is not None:
                self.all_reduce(sq, group=self.groups.dp)
            if self.groups.ep_replica is not None:
                self.all_reduce(sq_experts, group=self.groups.ep_replica)
        if self.groups.ep is not None:      # each ep rank holds 1/ep of the experts
            self.all_reduce(sq_experts, group=self.groups.ep)
        sq += sq_experts
        if self.groups.model is not None:
            self.all_reduce(sq, group=self.groups.model)
        return sq.sqrt().float()

    def _sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the squared elements of `grads`, float64, on this rank's device."""
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch._foreach_norm(grads)
        return torch.stack([n.to(torch.float64) for n in norms]).square().sum()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so the global norm is at most `max_norm`; return the norm. The
        factor min(1, max_norm / (norm + 1e-6)) stays on the device, as in
        torch.nn.utils.clip_grad_norm_: no host sync."""
        max_norm = check_max_norm(max_norm)     # on every rank, before the norm's collectives
        norm = self.global_norm()
        grads = list(self.named_grads().values())
        if grads:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef)
        return norm


def check_max_norm(max_norm) -> float:
    """`max_norm` as a float; an AutopartError unless it is a positive finite number (a negative
    one would flip every gradient's sign, nan or inf would clip nothing or zero everything)."""
    value = None
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1 and \
            not max_norm.dtype.is_complex and max_norm.dtype != torch.bool:
        value = float(max_norm)
    elif isinstance(max_norm, numbers.Real) and not isinstance(max_norm, bool):
        value = float(max_norm)
    if value is None or not math.isfinite(value) or value <= 0:
        raise AutopartError(
            f"clip_grad_norm_(max_norm={max_norm!r}): max_norm must be a positive finite number"
            f"{'' if value is None else f', got {value}'} (the largest global gradient norm to "
            "keep).\n  remedy: pass e.g. pm.clip_grad_norm_(1.0); leave the call out to not clip")
    return value
