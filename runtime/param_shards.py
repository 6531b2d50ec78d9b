"""ZeRO-3 at run time: a parameter holds its full values only while a layer uses it.

A rank keeps its slice of every parameter in its ShardLayout's `store` (runtime/sharding.py: the
chunk of each parameter it owns, end to end, in the parameters' dtype). Each parameter keeps its
Parameter object (autograd, the optimizer's bookkeeping and the programs' get_attr see the same
tensor) and one full-shaped tensor whose storage is resized to nothing between uses, as FSDP
does; meanwhile the parameter's `.data` is its 1-D slice in the store (FSDP1's use_orig_params
views), so reading `pm.parameters()` between steps gives this rank's share, never freed memory.
The programs call `gather` / `release` where passes/gather_parameters.py put them
(autopart/ops/zero.py); the backward frees a group once all its gradients have been accumulated
(a post-accumulate-grad hook).

Swapping `.data` keeps the parameter's version counter (torch's set_data), and filling writes
into the full tensor, whose counter autograd does not check: autograd saved the parameter (or a
view of its full tensor) in the forward, and the refilled values are the ones it saved. Each
gather posts the next group's all-gather
asynchronously (the prefetch), waited when that group is gathered, released or the step ends.
Under precision="bf16" the all-gather moves bf16 for the parameters read only by ops that
autocast runs in bf16 (matmuls, convolutions, attention: the bf16 rounding of the fp32 slice is
what they compute with anyway), fp32 for the others (norms, embeddings: the bf16 recipe reads
them in fp32). FSDP2's MixedPrecisionPolicy casts every parameter: a recipe of its own.

Under precision="fp8" (tensorwise) the weights read only as FP8 linears' weights
(autopart/ops/fp8.gathered_in_fp8) are cast before their all-gather: each rank takes the amax
of its own slices, one max all-reduce over the replicas (and, for a tensor-parallel shard, one
over tp) of every such weight the gather posts gives the whole weight's amax, each rank casts
its slices to e4m3 with that scale (autopart/ops/fp8.py's, bitwise the recipe's cast of the whole
weight: the cast is elementwise, the scale global) and the all-gather moves the FP8 bytes, 1 an
element. The parameter then holds a full-shaped fp32 tensor with no storage (autograd's input,
whose gradient it takes: nothing reads its values) and the FP8 op reads the e4m3 weight and its
scale from here (`fp8_weight`), in forward and again in backward (re-gathered, to the same bits:
the slices change only at the optimizer step).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from autopart.ops import fp8 as fp8_ops

_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
FULL, REDUCED, FP8 = 0, 1, 2        # how a parameter is all-gathered (ShardedParameters._kind)


class ShardedParameters:
    """The zero=3 parameters of `layouts` (ShardLayouts): their slices, and which are held."""

    def __init__(self, layouts, gather_dtype: torch.dtype | None = None, filled: bool = True,
                 reduced: set[int] | None = None, fp8: dict | None = None):
        """`filled`: the parameters hold values to slice (a model built on a real device); a
        meta model's parameters are allocated but unfilled, never read (their pages are never
        touched: reading them would commit the whole rank share once), and the store starts
        empty for a load or an init to write (`writers`). `gather_dtype` applies to the
        parameters in `reduced` (ids) only: those read only by ops autocast runs in it. `fp8`:
        id -> the tp group (TPComm, or None) of the weights gathered in FP8 (module docstring)."""
        self.layouts, self.gather_dtype = list(layouts), gather_dtype
        self.reduced = reduced if reduced is not None else set()
        self.fp8 = fp8 if fp8 is not None else {}
        self.fp8_on = True                 # off: gathered() fills the fp32 values
        self.fp8_held: dict[int, tuple] = {}    # id(p) -> (its whole e4m3 weight, scale)
        self.fp8_data: dict[int, torch.Tensor] = {}     # id(p) -> its e4m3 tensor (reused)
        self.where = {id(p): (lay, i) for lay in self.layouts for i, p in enumerate(lay.params)}
        self.data = {id(lay): [p.data for p in lay.params] for lay in self.layouts}   # full
        self.held: set[int] = set()        # ids of parameters whose storage holds full values
        self.pending: dict[int, tuple] = {}     # id(p) -> its posted all-gather (prefetch)
        self.gathers = 0                   # all-gathers run (tests, explain)
        self._groups: dict[int, list[list]] = {}    # id(p) -> the groups holding it
        self._landed: dict[int, set[int]] = {}      # id(group) -> ids of gradients landed
        self.views: dict[int, list[torch.Tensor]] = {}     # the parameters between uses
        for lay in self.layouts:
            lay.store = lay.slice_of(self.data[id(lay)], lay.dtype) if filled else \
                torch.empty(lay.shard, dtype=lay.dtype, device=lay.device)
            lay.sharded = self
            self.views[id(lay)] = [lay.store[lay.offsets[i]:lay.offsets[i] + hi - lo]
                                   for i, (lo, hi) in enumerate(map(lay.own, range(len(lay.params))))]
        self.held = {id(p) for lay in self.layouts for p in lay.params}
        self.release(p for lay in self.layouts for p in lay.params)
        fp8_ops.hold_in_fp8([p for lay in self.layouts for p in lay.params if id(p) in self.fp8],
                            self)

    # -- the programs' ops -------------------------------------------------------------------
    def gather(self, params, next_group=None) -> None:
        """Fill `params` (those not held) with every replica's slices; then post `next_group`'s."""
        todo = [p for p in params if id(p) in self.where and id(p) not in self.held]
        if todo:
            self._finish(self._post([p for p in todo if id(p) not in self.pending]))
            self._finish({id(p): self.pending.pop(id(p)) for p in todo if id(p) in self.pending})
        if next_group is not None:
            self._post(p for p in next_group if id(p) in self.where and
                       id(p) not in self.held and id(p) not in self.pending)

    def release(self, params) -> None:
        """Free the storage of `params` (their slices stay in the store)."""
        for p in params:
            if id(p) not in self.where:
                continue
            if id(p) in self.pending:
                self._finish({id(p): self.pending.pop(id(p))})
            self.held.discard(id(p))
            if self.fp8_held.pop(id(p), None) is not None:
                self.fp8_data[id(p)].untyped_storage().resize_(0)
            lay, i = self.where[id(p)]
            full = self.data[id(lay)][i]
            p.data = self.views[id(lay)][i]
            if _releasable(full):
                full.untyped_storage().resize_(0)

    def fp8_weight(self, p: torch.Tensor) -> tuple | None:
        """(p's whole weight in e4m3, its scale) while p is gathered in FP8, else None."""
        return self.fp8_held.get(id(p))

    def settle(self) -> None:
        """Wait for every prefetch still posted."""
        posted, self.pending = self.pending, {}
        self._finish(posted)

    def end_step(self) -> None:
        """The step's forwards and backwards are done: wait for the prefetches and free what is
        still gathered (the groups kept for the step, a group with no trainable parameter)."""
        self.settle()
        self.release([p for lay in self.layouts for p in lay.params if id(p) in self.held])

    # -- the backward: free a group once its gradients are in ----------------------------------
    def watch(self, groups: list[list]) -> None:
        """Free each of `groups` (lists of Parameters) when the backward accumulated the gradient
        of each of its trainable parameters (not the groups kept for the step: end_step)."""
        for group in groups:
            for p in group:
                if p.requires_grad and id(p) in self.where:
                    if id(p) not in self._groups:
                        p.register_post_accumulate_grad_hook(self._landed_hook)
                    self._groups.setdefault(id(p), []).append(group)

    def _landed_hook(self, p: torch.Tensor) -> None:
        for group in self._groups.get(id(p), ()):
            landed = self._landed.setdefault(id(group), set())
            landed.add(id(p))
            if all(id(q) in landed for q in group if q.requires_grad and id(q) in self.where):
                landed.clear()
                self.release(group)

    # -- outside the step --------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self):
        """Every parameter full for the block (collective): a state dict, a save; in fp32 (those
        held in FP8 are released first, then gathered in fp32)."""
        every = [p for lay in self.layouts for p in lay.params]
        self.release([p for p in every if id(p) in self.fp8_held or
                      (id(p) in self.fp8 and id(p) in self.pending)])
        self.fp8_on = False
        try:
            self.gather(every)
            yield
        finally:
            self.release(every)
            self.fp8_on = True

    @contextlib.contextmanager
    def filling(self):
        """Every parameter allocated (not gathered: local) for the block to overwrite whole (a
        load, init_weights); then this rank's slices taken from them and the storage freed."""
        for lay in self.layouts:
            for p, full in zip(lay.params, self.data[id(lay)]):
                _allocate(full)
                p.data = full
                self.held.add(id(p))
        try:
            yield
        finally:
            self.take_slices()

    def writers(self) -> dict[int, "SliceWriter"]:
        """id(parameter) -> the SliceWriter a load or an init fills it through."""
        return {id(p): SliceWriter(lay.shapes[i], p.dtype, self.views[id(lay)][i], *lay.own(i))
                for lay in self.layouts for i, p in enumerate(lay.params)}

    def take_slices(self) -> None:
        """The store = this rank's slices of the parameters as they are; then free them."""
        for lay in self.layouts:
            with torch.no_grad():
                lay.read(self.data[id(lay)], lay.index, 0, lay.store)
        self.release(p for lay in self.layouts for p in lay.params)

    def updated(self) -> None:
        """The optimizer stepped the store: what a parameter holds is stale."""
        self.settle()
        self.release(p for lay in self.layouts for p in lay.params)

    # -- the all-gathers -----------------------------------------------------------------------
    def _post(self, params) -> dict[int, tuple]:
        """Post the all-gathers of `params`: one per run of neighbours in a layout's slice
        gathered in one dtype (FP8 weights first max-all-reduce their amaxes, in one batch)."""
        posted: dict[int, tuple] = {}
        by_layout: dict[int, list[int]] = {}
        for p in params:
            lay, i = self.where[id(p)]
            by_layout.setdefault(id(lay), []).append(i)
        for lay in self.layouts:
            kinds = [self._kind(q) for q in lay.params]
            runs = _runs(sorted(set(by_layout.get(id(lay), ()))), kinds)
            scales = self._fp8_scales(lay, [i for first, last in runs if kinds[first] == FP8
                                            for i in range(first, last)])
            for first, last in runs:
                entry = self._post_run(lay, first, last, kinds[first], scales)
                for i in range(first, last):
                    posted[id(lay.params[i])] = entry
        self.pending.update(posted)
        return posted

    def _kind(self, p) -> int:
        """How p is gathered: FP8 (cast first), REDUCED (in gather_dtype, if any) or FULL."""
        if id(p) in self.fp8 and self.fp8_on:
            return FP8
        return REDUCED if id(p) in self.reduced else FULL

    def _fp8_scales(self, lay, indices: list[int]) -> dict[int, torch.Tensor]:
        """Parameter index -> the e4m3 scale of its whole weight: the amaxes of this rank's
        slices, max-all-reduced over the replicas in one collective, then those of tp shards
        over their tp group (one per group), as the recipe's amax of the whole tensor."""
        if not indices:
            return {}
        with torch.no_grad():
            local = torch.stack([lay.store[lay.offsets[i]:lay.offsets[i + 1]].abs().amax()
                                 .float() for i in indices])
        if lay.group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=lay.group)
        amax = dict(zip(indices, local))
        by_comm: dict[int, tuple] = {}
        for i in indices:
            comm = self.fp8[id(lay.params[i])]
            if comm is not None:
                by_comm.setdefault(id(comm), (comm, []))[1].append(i)
        for comm, shared in by_comm.values():
            amax.update(zip(shared, fp8_ops.max_over_tp([amax[i] for i in shared], comm)))
        return {i: fp8_ops.amax_to_scale(a, fp8_ops.E4M3, False) for i, a in amax.items()}

    def _post_run(self, lay, first: int, last: int, kind: int, scales: dict) -> tuple:
        s, e = lay.offsets[first], lay.offsets[last]
        piece = lay.store[s:e]
        if kind == FP8:     # each parameter's slice with its whole weight's scale, as bytes
            piece = torch.cat([fp8_ops.to_fp8(lay.store[lay.offsets[i]:lay.offsets[i + 1]],
                                              scales[i], fp8_ops.E4M3).view(torch.uint8)
                               for i in range(first, last)])
        elif kind == REDUCED and self.gather_dtype is not None and piece.is_floating_point():
            piece = piece.to(self.gather_dtype)
        full = torch.empty(lay.size * (e - s), dtype=piece.dtype, device=piece.device)
        work = None
        if lay.group is None:
            full.copy_(piece)
        else:
            work = _all_gather_into(full, piece.contiguous(), group=lay.group, async_op=True)
        self.gathers += 1
        return (lay, first, last, full, work, scales if kind == FP8 else None)

    def _finish(self, posted: dict[int, tuple]) -> None:
        """Wait for posted all-gathers and write every replica's slices into the parameters
        (an FP8 run: into their e4m3 weights; the parameters get full shapes, no storage)."""
        for entry in {id(e): e for e in posted.values()}.values():
            lay, first, last, full, work, scales = entry
            if work is not None:
                work.wait()
            s, n = lay.offsets[first], lay.offsets[last] - lay.offsets[first]
            data = self.data[id(lay)]
            into = data if scales is None else self._fp8_targets(lay, first, last)
            if scales is not None:
                full = full.view(fp8_ops.E4M3)
            for i in range(first, last):
                _allocate(into[i])
            with torch.no_grad():
                for k in range(lay.size):
                    lay.write(full[k * n:(k + 1) * n], k, s, into)
            for i in range(first, last):
                p = lay.params[i]
                p.data = data[i]
                if scales is not None:
                    self.fp8_held[id(p)] = (into[i], scales[i])
                self.pending.pop(id(p), None)
                self.held.add(id(p))

    def _fp8_targets(self, lay, first: int, last: int) -> list:
        """Per parameter of the layout, its e4m3 tensor for [first, last) (None elsewhere)."""
        out = [None] * len(lay.params)
        for i in range(first, last):
            p = lay.params[i]
            if id(p) not in self.fp8_data:
                self.fp8_data[id(p)] = torch.empty(lay.shapes[i], dtype=fp8_ops.E4M3,
                                                   device=lay.device)
            out[i] = self.fp8_data[id(p)]
        return out


class SliceWriter:
    """Stands for a zero=3 parameter while `load_pretrained` or `init_weights` fills it: it has
    the parameter's (rank-local) shape and dtype, and `copy_(full)` keeps only this rank's
    elements, written into its slice of the store. Nothing full-sized is allocated for it: the
    filler's one tensor at a time is all (FSDP2 loads a sharded state dict the same way)."""

    def __init__(self, shape, dtype: torch.dtype, into: torch.Tensor, lo: int, hi: int):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, into.device
        self.into, self.lo, self.hi = into, lo, hi

    def copy_(self, full: torch.Tensor) -> "SliceWriter":
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(f"a tensor of shape {tuple(full.shape)} for a parameter of shape "
                             f"{tuple(self.shape)}")
        with torch.no_grad():
            self.into.copy_(full.reshape(-1)[self.lo:self.hi])
        return self

    def detach(self) -> "SliceWriter":
        return self


def shard_parameters(layouts, chunks, precision: str, filled: bool = True) -> ShardedParameters:
    """zero=3: hold the parameters of `layouts` as slices and bind each chunk program's
    `param_shards` (passes/gather_parameters.py) to them. `filled`: see ShardedParameters."""
    from autopart.ops.zero import ParamShards
    reduced = {id(_attr(c.gm, name)) for c in chunks
               if isinstance(getattr(c.gm, "param_shards", None), ParamShards)
               for name in c.gm.param_shards.reduced}
    sharded = ShardedParameters(layouts, torch.bfloat16 if precision == "bf16" else None, filled,
                                reduced, _fp8_weights(chunks) if precision == "fp8" else {})
    for chunk in chunks:
        shards = getattr(chunk.gm, "param_shards", None)
        if isinstance(shards, ParamShards):
            groups = [[_attr(chunk.gm, name) for name in names] for names in shards.groups]
            shards.bind(sharded, groups)
            sharded.watch([g for g, after in zip(groups, shards.after) if after != "step"])
    return sharded


def _fp8_weights(chunks) -> dict[int, object]:
    """id(parameter) -> its tp group (TPComm, None: whole over tp) for the parameters every
    chunk reads only as tensorwise FP8 linears' weights (autopart/ops/fp8.gathered_in_fp8)."""
    fp8, other = {}, set()
    for chunk in chunks:
        found, read = fp8_ops.gathered_in_fp8(chunk.gm)
        for name, comm in found.items():
            fp8[id(_attr(chunk.gm, name))] = None if comm is None else _attr(chunk.gm, comm)
        other |= {id(_attr(chunk.gm, name)) for name in read}
    return {k: v for k, v in fp8.items() if k not in other}


def _attr(module: torch.nn.Module, target: str) -> torch.Tensor:
    owner, _, leaf = target.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def _runs(indices: list[int], kinds: list[int]) -> list[tuple[int, int]]:
    """[first, last) ranges of consecutive `indices` (sorted) whose `kinds` (how they are
    gathered: FULL, REDUCED, FP8) are the same: one all-gather moves one dtype."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i and kinds[out[-1][0]] == kinds[i]:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _releasable(full: torch.Tensor) -> bool:
    """Whether `full` owns its whole storage (a view into a shared buffer keeps it)."""
    return full.storage_offset() == 0 and full.is_contiguous() and \
        full.untyped_storage().nbytes() in (0, full.numel() * full.element_size())


def _allocate(full: torch.Tensor) -> None:
    nbytes = full.numel() * full.element_size()
    storage = full.untyped_storage()
    if storage.nbytes() < nbytes:
        storage.resize_(nbytes)


__all__ = ["ShardedParameters", "SliceWriter", "shard_parameters"]
