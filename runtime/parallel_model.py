"""This rank's ParallelModel, which trains the emitted programs on real processes (made by
autopart/api.py `parallelize`, the front door: the runtime imports no compiler).

A ParallelModel is three parts over one rank's program: the StepDriver (runs this rank's
schedule), the GradientReducer (turns local gradients into the plain model's, global norm) and
the StateGatherer (global loss, statistics and state dict).
"""
from __future__ import annotations

import weakref
from contextlib import nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn as nn

from autopart.errors import AutopartError
from autopart.materialize import RankWeights, initial_state
from autopart.mesh import Mesh
from autopart.runtime.executor import posts_never_wait
from autopart.runtime.gradients import GradientReducer
from autopart.runtime.param_shards import shard_parameters
from autopart.runtime.groups import (RankGroups, bind_comms, build_groups, check_same_batch,
                                     check_same_program)
from autopart.runtime import nonfinite
from autopart.runtime.state import StateGatherer
from autopart.schedule_lowering import hoist_receives
from autopart.runtime.batches import (BatchShard, agree, batch_shard, count_not_elementwise,
                                      counts_values, device_loss_scale, ids_out_of_range,
                                      refuse, share_count)
from autopart.runtime.step import StepDriver
from autopart.runtime.step_watch import watch_for
from autopart.runtime.trace import Recorder

if TYPE_CHECKING:     # the runtime runs what the compiler made; it never calls the compiler
    from autopart.compiler import Compiled

DEFAULT_TIMEOUT = timedelta(minutes=5)


class ParallelModel:
    """This rank's share of a parallelized model. Build it with `autopart.parallelize`."""

    def __init__(self, compiled: Compiled, rank: int, device: torch.device, timeout: timedelta,
                 key_order: list[str], extra_state: dict[str, torch.Tensor],
                 weights: RankWeights | None = None, trace: str | None = None):
        self.compiled = compiled
        config = compiled.config    # the run's options, checked (autopart/config.py)
        zero, compile = config.zero, config.compile
        self.nonfinite = config.nonfinite
        self.steps = 0                  # train_steps run: errors name the step
        self.skipped_steps: list[int] = []
        plan = compiled.plan
        self.mesh: Mesh = plan.mesh
        self.rank = rank
        self.coords = self.mesh.coords(rank)
        self.ep_rank = self.mesh.ep_rank(rank)
        self.device = device
        self._groups: RankGroups = build_groups(self.mesh, plan, timeout)
        check_same_program(compiled.digest(), self._groups, compiled.traced)
        # this rank's own copies of its weight shards, its comms bound to its groups
        self.program = compiled.programs.instantiate(rank)
        bind_comms(self.program.chunks, self._groups)
        # a meta-device model: this rank allocates its shards only, filled later by exactly one
        # of load_pretrained, load or init_weights; these names (global) hold no values yet
        self._weights = weights
        self._unfilled: dict[str, str] = {}    # name -> why autopart cannot compute it, or ""
        if weights is not None:
            self._unfilled = weights.allocate(self.program, plan, device, extra_state)
        else:
            for c in self.program.chunks:
                c.gm.to(device)
        self.inductor = None    # compile=True: the SegmentCompiler (runtime/compiled.py)
        if compile:             # each distinct layer compiled once, on its first microbatch
            from autopart.runtime.compiled import SegmentCompiler, compile_rank_program
            self.inductor = SegmentCompiler(cudagraphs=compile == "cudagraphs")
            self.program = compile_rank_program(self.program, self.inductor)
        self._params = self.program.parameters()
        # receives posted before the computes that precede their use, where provably safe; under
        # Gloo's contract (a work per operation, posts that never wait) with up to two receive
        # buffers waiting ahead of their use
        actions = hoist_receives(compiled.schedule, independent_posts=posts_never_wait(device)
                                 ).ranks[self.coords["pp"]]
        self._trace = Recorder(trace, rank, self.mesh.world_size) if trace else None
        self.batch_shard: BatchShard = batch_shard(compiled, rank)
        self._step = StepDriver(plan, self.program, actions, compiled.program.inputs,
                                self._groups.pp, device, trace=self._trace,
                                input_specs=compiled.input_specs, shard=self.batch_shard)
        self._grads = GradientReducer(plan, self._params, self._groups, self.coords, device)
        self._step.reducer = self._grads    # its buckets go out during the backward
        self._step.documents = compiled.program.cp.documents if compiled.program.cp else ()
        # a failure names the step, the action and the peer, also where NCCL would only hang
        self._step.watch = watch_for(self._groups, rank)
        self.zero = zero
        if zero:   # ZeRO-1/2: gradients reduce-scattered, optimizer state 1/dp (runtime/optimizer.py)
            from autopart.runtime.optimizer import DEFAULT_BUCKET_SIZE
            self._grads.shard(zero, config.zero_bucket_size or DEFAULT_BUCKET_SIZE, actions,
                              self._step.chunks)
        self._sharded = None    # zero=3: the parameters held as slices (runtime/param_shards.py)
        if zero == 3:
            self._sharded = shard_parameters(self._grads.zero_layouts, self.program.chunks,
                                             config.precision, filled=weights is None)
        self._state = StateGatherer(plan, compiled.program, self.program, self._groups, device,
                                    key_order, extra_state)
        # a model returning (loss, {name: tensor}): after each train_step, the tensors summed over
        # the microbatches and data-parallel replicas of the global batch, on every rank
        self.last_stats: dict[str, torch.Tensor] = {}
        self._zero_optimizers = weakref.WeakSet()     # pm.optimizer's, zero=1: see load()
        # the sequence length of the last batch checked alike on every rank (train_step)
        self._batch_length: tuple | None = None
        # the same on every rank: the token count reads the labels' values (summed and inverted
        # on the device each step), and some input indexes an embedding (its ids' range rides
        # the step's one host read, runtime/state.py step_results)
        counter = compiled.program.loss_count
        self._count_on_device = counter is not None and counts_values(counter.gm)
        self._reads_ids = any(s.embeddings for s in compiled.input_specs)

    # -- training ---------------------------------------------------------------------------
    def train_step(self, *inputs: torch.Tensor | None, target: torch.Tensor | None = None,
                   local: bool | None = None) -> torch.Tensor:
        """Forward and backward over the global batch; returns its mean loss on every rank.

        Each tensor is either the global batch (identical on every rank) or this rank's share
        of it, `pm.local_batch(...)` (its rows and, under cp, sequence chunks:
        `pm.batch_shard`); a rank passes None (or no inputs at all) for a tensor it does not
        read (not in `pm.batch_shard.reads`: a middle pipeline stage reads none, the last only
        what the loss reads). `local=None` tells the two apart by the shapes, and where they
        cannot (cp > 1 with dp = 1, a sequence both cut and whole could have) takes the global
        batch; `local=True` / `False` says which.

        Leaves fully reduced gradients in `.grad` of this rank's parameters, as loss.backward()
        would on the plain model (zero=1: in this rank's elements of them; zero=2: in the
        optimizer's slices only, `.grad` stays None); it neither steps nor zeroes (the
        optimizer does)."""
        # Reduce this step's gradients only. What .grad already holds (a train_step not yet zeroed,
        # as after two loss.backward() calls) was reduced then; reducing it again would count it
        # once per replica or per stage sharing it. It is added back after the reduction.
        self._require_filled("train_step")
        try:            # refused before any .grad moves, on every rank alike (_agree)
            given, refused = self._step.check_inputs(inputs, target, local), None
        except AutopartError as e:
            given, refused = None, e
        scale, length = self._agree(given, refused)
        relearn = (length,) != self._batch_length
        every = self.compiled.config.batch_check_every
        if relearn or (self.steps + 1) % every == 0:   # one all-gather of hashes
            check_same_batch(given, self._groups, self.steps + 1)
            self._batch_length = (length,)
        batch = self._step.replica_rows(given, length)
        for ids in given.ids:    # never index past a table: a step given such ids is refused
            if batch.get(ids.name) is not None:     # below, after it ran
                batch[ids.name] = ids.clamp(batch[ids.name])
        earlier = self._grads.set_aside()
        self.steps += 1
        with self._step.watch.watching(self.steps):
            ctx = self._step.run(batch, self.steps, loss_scale=scale)
            batch.clear()   # the step's watch keeps ctx, whose microbatch closure reads this
            # dict, until the next step: let go of the clamped ids' copy now
            if self._sharded is not None:
                self._sharded.end_step()
            if self._trace is not None:
                self._trace.end_step()
            self._grads.reduce()
            check = None if self.nonfinite == "ignore" else self._grads.local_grads()
            loss, stats, flagged, bad_ids = self._state.step_results(
                ctx.losses, scale, ctx.stats, check, relearn,
                ids_out_of_range(given.ids, self.device), self._reads_ids)
            if bad_ids:         # in every nonfinite mode: the step is thrown away, below
                self._grads.drop_grads()
            else:
                self.last_stats = stats
            if flagged and not bad_ids:
                mine = nonfinite.local_problems(ctx.losses, self._grads.named_grads(),
                                                self.coords["pp"])
                report = nonfinite.gather_report(self.steps, mine, self.rank, self._groups.world)
                if nonfinite.handle(report, self.nonfinite, self._grads.drop_grads):
                    self.skipped_steps.append(self.steps)
        self._grads.add_back(earlier)
        if bad_ids:         # as if refused before it ran: .grad and the step count as they were
            self.steps -= 1
            refuse(next((e for e in (r.error() for r in given.ids) if e is not None), None),
                   self._groups.host, self.steps + 1)
        return loss

    def _agree(self, given, refused) -> tuple[float | torch.Tensor, int | None]:
        """(each microbatch loss's factor, the global batch's sequence length), or every rank
        raises if one refused its tensors: one all-reduce of host values (runtime/batches.py
        agree, over the CPU group). The token count is the sum of each share's, counted by the
        last stage's tp rank 0 of each (dp, cp) share: a count of the batch's shapes alone
        (an int, counted once per shape) is summed there and inverted on the host; a count of
        the labels' values stays on the device (one all-reduce there, device_loss_scale) and
        the factor is a 0-dim tensor, never read on the host."""
        plan, counter = self.compiled.plan, self.compiled.program.loss_count
        count = 0
        if refused is None and counter is not None and self.coords["pp"] == plan.last_rank \
                and self.coords["tp"] == 0:
            try:
                count = self._count(counter, given)
            except AutopartError as e:
                refused = e
        on_device = self._count_on_device
        total, length = agree(0 if on_device else count,
                              given.length if given is not None else None, refused,
                              self._groups.host, self.steps + 1)
        if counter is None:
            return plan.loss_scale, length
        if on_device:
            return device_loss_scale(count, self._groups.world, self.device), length
        return (1.0 / total if total else 0.0), length

    def _count(self, counter, given):
        """This rank's share of the token count. Under cp a count that is not elementwise (it
        reads the sequence through another op) is the cp rank 0's alone, over the whole
        sequence of its rows: it must be given the global batch."""
        mbs = self.compiled.plan.microbatch_size
        odd = count_not_elementwise(counter) if self.mesh.cp > 1 else None
        if odd is None:
            return share_count(counter, given.values, mbs)
        if self.coords["cp"]:
            return 0
        if not all(n in given.whole for n in counter.inputs):
            raise AutopartError(
                f"train_step on rank {self.rank}: the token-weighted loss counts its tokens "
                f"through {odd.target} ({odd}), which needs the whole sequence, but this rank "
                "was given its sequence chunks only.\n  remedy: give the last pipeline stage's "
                f"cp rank 0 the global batch's {', '.join(counter.inputs)}, or count the "
                "tokens elementwise (shift the labels in the data, not in the loss)")
        rows = {n: self.batch_shard.cut(given.whole[n], False) for n in counter.inputs}
        return share_count(counter, rows, mbs)

    def local_batch(self, *tensors: torch.Tensor, target: torch.Tensor | None = None
                    ) -> tuple[tuple, torch.Tensor | None]:
        """This rank's share of a global batch, as train_step takes it: `(inputs, target)`
        where each tensor is cut to `pm.batch_shard`'s rows (dim 0) and, under cp, its
        sequence chunks (dim 1, for the inputs captured with a symbolic sequence), and is None
        where this rank does not read it (not in `batch_shard.reads`). The tensors are in
        train_step's order (the model's inputs, then target=); views where the cut allows.

            inputs, target = pm.local_batch(tokens, target=labels)   # the global batch
            loss = pm.train_step(*inputs, target=target)             # this rank's share only

        A data loader that feeds each rank its own share must yield exactly this."""
        step = self._step.local
        values = step.values(tensors, target)
        shard, out = self.batch_shard, []
        for i, (name, v) in enumerate(zip(step.names, values)):
            if v is None or name not in shard.reads:
                out.append(None)
                continue
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or \
                    v.shape[0] != self.compiled.plan.global_batch:
                raise AutopartError(
                    f"local_batch: {name!r} is not the global batch "
                    f"({self.compiled.plan.global_batch} rows): "
                    f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}.\n"
                    "  remedy: pass the global batch; local_batch cuts this rank's share of it")
            out.append(shard.cut(v, step.on_sequence(i) and self.mesh.cp > 1))
        n = step.n_inputs
        return tuple(out[:n]), (out[n] if len(out) > n else None)

    # -- parameters -------------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the plain model's names, each once."""
        return iter(self._params.items())

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self._params.values())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over all shards, each shared parameter counted once."""
        return self._grads.clip_(max_norm)

    def full_state_dict(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The plain model's complete state dict (every key, full shapes), on every rank; with
        `rank=r` on global rank r only, gathered one tensor at a time (the other ranks return {}
        and never hold a full tensor). Collective: every rank calls it with the same `rank`."""
        self._require_filled("full_state_dict")
        if rank is None:
            with self._all_gathered():
                return self._state.full_state_dict()
        return dict(self.full_state_dict_iter(rank))

    def full_state_dict_iter(self, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, full tensor) pairs of the plain model's state dict, yielded on global rank
        `rank` one at a time (a tied tensor once per key), so a caller can write each out
        without ever holding the whole model; the other ranks yield nothing. Collective: every
        rank must exhaust it.

            for name, t in pm.full_state_dict_iter(0):    # on every rank
                out[name] = t.numpy()                     # runs on rank 0 only"""
        if not isinstance(rank, int) or not 0 <= rank < self.mesh.world_size:
            raise AutopartError(f"full_state_dict: rank={rank!r} is not a rank of this "
                                f"{self.mesh.world_size}-rank mesh ({self.mesh}).\n  remedy: a "
                                f"global rank in 0..{self.mesh.world_size - 1}, or rank=None "
                                "for every rank")
        self._require_filled("full_state_dict_iter")
        return self._gathered_iter(self._state.full_state_dict_iter, rank)

    def _gathered_iter(self, fn, *args):
        with self._all_gathered():
            yield from fn(*args)

    def _all_gathered(self):
        """zero=3: every parameter full for the block (collective); otherwise nothing."""
        return self._sharded.gathered() if self._sharded is not None else nullcontext()

    def _filling(self):
        """zero=3: every parameter allocated for a load to overwrite, then sliced again."""
        return self._sharded.filling() if self._sharded is not None else nullcontext()

    def load_pretrained(self, source) -> None:
        """Overwrite this rank's shards with their slices of a checkpoint: a state dict, a
        torch.save file, a .safetensors file or a Hugging Face model directory (sharded
        safetensors with model.safetensors.index.json). Each rank reads only its slices
        (autopart/runtime/pretrained.py)."""
        from autopart.runtime.pretrained import load_pretrained
        filled = load_pretrained(self, source)      # zero=3: into the slices (held_tensors)
        self._filled(filled)
        self._reload_masters()

    def init_weights(self, seed: int = 0, init_fn: Callable | None = None) -> None:
        """Fill this rank's shards from scratch: exactly its slices of what
        `autopart.materialize(model, seed, init_fn)` gives the plain model (the model's own
        initialization, found as autopart/materialize.py says, unless `init_fn` is given).
        Not collective: each rank initializes the modules it holds a slice of."""
        if self._weights is None:
            raise AutopartError(
                "init_weights: this ParallelModel was built from a model with real weights, "
                "which it already holds.\n  remedy: build the model on the meta device "
                "(autopart.meta_device()) to initialize it in parallelize's ranks")
        from autopart.runtime.pretrained import held_tensors
        plan = self.compiled.plan
        self._weights.fill(held_tensors(self), plan, self.program, self.device, seed=seed,
                           init_fn=init_fn)          # zero=3: into the slices (held_tensors)
        extra = self._state.extra_state
        extra.update(initial_state(self._weights.model, list(extra), seed=seed, init_fn=init_fn))
        self._unfilled = {}
        self._reload_masters()

    def _filled(self, names) -> None:
        self._unfilled = {n: why for n, why in self._unfilled.items() if n not in names}

    def _require_filled(self, what: str) -> None:
        """Refuse to use weights that were never filled (a meta model's, before a load or
        init_weights). The set is the same on every rank, so all ranks refuse alike."""
        if not self._unfilled:
            return
        why = next((w for w in self._unfilled.values() if w), "")
        if why:       # a buffer no load fills and autopart cannot compute
            raise AutopartError(f"{what}: {why}")
        names = sorted(self._unfilled)
        raise AutopartError(
            f"{what}: {len(names)} tensor(s) of this model built on the meta device hold no "
            f"values yet ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): "
            "parallelize allocated them unfilled.\n  remedy: fill them first with one of "
            "pm.load_pretrained(path) (the plain model's weights: safetensors, torch.save, a "
            "Hugging Face or DCP directory), pm.load(path) (an autopart checkpoint) or "
            "pm.init_weights(seed=0) (from scratch)")

    def optimizer(self, cls, **kwargs):
        """The optimizer for this rank's parameters: `cls(pm.parameters(), **kwargs)`, or with
        zero=1 a distributed optimizer keeping `cls`'s state for this rank's 1/dp slice
        (runtime/optimizer.py). One built before `load` / `load_pretrained` takes its fp32
        slices again from the loaded parameters (or, handed to `load`, the saved state).

            opt = pm.optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)"""
        self._require_filled("optimizer")
        if not self.zero:
            return cls(self.parameters(), **kwargs)
        from autopart.runtime.optimizer import ZeroOptimizer
        opt = ZeroOptimizer(list(self._grads.zero_layouts), cls, **kwargs)
        self._zero_optimizers.add(opt)
        return opt

    def _reload_masters(self, except_for=None) -> None:
        """After the parameters were loaded: ZeRO optimizers built earlier and not handed to
        the load take their fp32 slices again, or their next step would undo the load."""
        for opt in list(self._zero_optimizers):
            if opt is not except_for:
                opt.reload_master()

    def explain(self) -> str:
        text = self.compiled.explain()
        if self.inductor is not None:   # compile=True: this rank's Inductor seconds so far
            text += "\n" + self.inductor.report.line()
        return text

    def save(self, path, optimizer=None, extra: dict | None = None, **kwargs) -> dict:
        """Save this model's shards, `optimizer`'s state, RNG states and `extra` to the checkpoint
        directory `path` (collective; atomic). See autopart/runtime/checkpoint/."""
        self._require_filled("save")
        from autopart.runtime.checkpoint import save
        with self._all_gathered():
            return save(self, path, optimizer=optimizer, extra=extra, **kwargs)

    def load(self, path, optimizer=None, **kwargs) -> dict:
        """Load a checkpoint saved on any mesh into this model (in place) and `optimizer`;
        returns its `extra` dict (collective). See autopart/runtime/checkpoint/."""
        from autopart.runtime.checkpoint import load
        with self._filling():
            extra = load(self, path, optimizer=optimizer, **kwargs)
        program = self.compiled.program    # every parameter and persistent buffer was read
        self._filled({i.name for i in program.params.values()} |
                     {i.name for i in program.buffers.values() if i.persistent})
        # (zero=3: `optimizer` too, whose masters were read from the store before it was filled)
        self._reload_masters(except_for=None if self._sharded is not None else optimizer)
        return extra


__all__ = ["ParallelModel", "DEFAULT_TIMEOUT"]
