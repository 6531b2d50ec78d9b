"""Local batches: which part of the global batch each rank reads, and train_step's tensors cut to it.

The global batch is `global_batch` rows; data-parallel replica d trains rows [d*R, (d+1)*R)
(R = global_batch / dp, in microbatch order); under context parallelism a rank of cp index c
trains sequence chunks c and 2*cp-1-c of the 2*cp equal chunks (the causal load balance of
autopart/ops/cp.py shard_sequence) of every input whose dim 1 is the sequence. A rank reads an
input's values only if one of its chunk programs uses more than its shape: a middle pipeline
stage reads none (its chunks take the sequence length only), the last stage what the loss reads.
`BatchShard` says all that for one rank; `LocalInputs` turns what train_step was given (the global
batch, this rank's share, or None where the rank reads nothing) into this rank's share.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopart.errors import AutopartError
from autopart.ops import aten_groups as G

# ops that read a tensor's shape, not its values: an input used only by them needs no data
SHAPE_ONLY = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
              torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default}


@dataclass(frozen=True)
class BatchShard:
    """The part of the global batch one rank's train_step reads (`pm.batch_shard`).

    `rows`: the global row indices (dim 0 of the global batch) it needs, in the order it needs
    them; `seq_chunks`: which of the `seq_chunks_total` equal chunks of the sequence (dim 1 of
    every input captured with a symbolic sequence) it needs, in order: under cp, (c, 2*cp-1-c)
    of 2*cp; without cp, (0,) of 1. `needs_inputs`: it reads the values of some model input
    (positional train_step tensors); `needs_targets`: it reads the target's (train_step's
    `target=`). `reads`: the names (the compiled program's inputs, target last) of the tensors
    it reads; the others it may pass as None. `rank` is the global rank. Stable: a loader
    yields for each rank `pm.local_batch(...)` of the global batch, built from these fields."""
    rank: int
    rows: tuple[int, ...]
    seq_chunks: tuple[int, ...]
    seq_chunks_total: int
    needs_inputs: bool
    needs_targets: bool
    reads: tuple[str, ...] = ()

    @property
    def local_rows(self) -> int:
        """How many rows of the global batch this rank's share holds."""
        return len(self.rows)

    def positions(self, length: int) -> list[int]:
        """The global sequence positions this rank's share holds, in order, for a global
        sequence of `length` (which seq_chunks_total must divide)."""
        if length % self.seq_chunks_total:
            raise AutopartError(f"a sequence of {length} positions does not cut into "
                                f"{self.seq_chunks_total} equal chunks.\n  remedy: pad it to a "
                                f"multiple of {self.seq_chunks_total} (padding labels -100)")
        c = length // self.seq_chunks_total
        return [i * c + p for i in self.seq_chunks for p in range(c)]

    def cut(self, tensor: torch.Tensor, sequence: bool) -> torch.Tensor:
        """This rank's share of a global tensor: its rows (dim 0) and, when `sequence` (dim 1
        is the sequence), its sequence chunks."""
        if tensor.dim() == 0 or tensor.shape[0] < max(self.rows, default=-1) + 1:
            raise AutopartError(f"cannot cut rows {self.rows[0]}..{self.rows[-1]} of a tensor "
                                f"of shape {tuple(tensor.shape)}: pass the global batch")
        lo = self.rows[0]
        contiguous = self.rows == tuple(range(lo, lo + len(self.rows)))
        out = tensor[lo:lo + len(self.rows)] if contiguous else tensor[list(self.rows)]
        if sequence and self.seq_chunks_total > 1:
            n = out.shape[1]
            if n % self.seq_chunks_total:
                self.positions(n)       # raises, naming the remedy
            c = n // self.seq_chunks_total
            out = torch.cat([out.narrow(1, i * c, c) for i in self.seq_chunks], 1)
        return out


def data_reads(gm: fx.GraphModule, names) -> set[str]:
    """The inputs among `names` whose values `gm` uses (not only their shape)."""
    return {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name in names
            and any(u.op != "call_function" or u.target not in SHAPE_ONLY for u in n.users)}


def pipeline_reads(compiled) -> dict[int, set[str]]:
    """pp rank -> the inputs whose values its chunks read; the last rank also what the token
    count reads (passes/weigh_loss_by_tokens.py: it counts there)."""
    plan, program = compiled.plan, compiled.program
    out: dict[int, set[str]] = {p: set() for p in range(plan.mesh.pp)}
    for c in program.chunks:
        out[plan.chunk_ranks[c.chunk]] |= data_reads(c.gm, c.inputs)
    if program.loss_count is not None:
        out[plan.last_rank] |= set(program.loss_count.inputs)
    return out


def batch_shard(compiled, rank: int) -> BatchShard:
    """Rank `rank`'s BatchShard of `compiled` (an autopart Compiled)."""
    plan, mesh = compiled.plan, compiled.plan.mesh
    coords = mesh.coords(rank)
    local = plan.global_batch // mesh.dp
    names = list(compiled.program.inputs)
    reads = pipeline_reads(compiled)[coords["pp"]]
    target = names[-1] if has_target(names) else None
    cp, c = mesh.cp, coords["cp"]
    chunks = (c, 2 * cp - 1 - c) if cp > 1 else (0,)
    return BatchShard(rank, tuple(range(coords["dp"] * local, (coords["dp"] + 1) * local)),
                      chunks, mesh.sequence_chunks if cp > 1 else 1,
                      any(n in reads for n in names if n != target),
                      target is not None and target in reads,
                      tuple(n for n in names if n in reads))


def has_target(names) -> bool:
    """Whether the compiled inputs end with the loss's target (capture names it 'target')."""
    return bool(names) and names[-1] == "target"




# -- train_step's tensors -> this rank's share ----------------------------------------------------

@dataclass
class Given:
    """train_step's tensors resolved (LocalInputs.resolve): `values` name -> this rank's share
    (None: a tensor the rank does not read, filled by a stand-in of the right shape once the
    sequence length is known); `length`: the global sequence length the tensors given carry
    (None if none carries one); `whole`: name -> the global tensors given, for the batch
    check."""
    values: dict
    length: int | None
    local: bool
    whole: dict
    ids: tuple = ()     # IdRange per input of embedding ids: checked in the step's one read


@dataclass(frozen=True)
class IdRange:
    """The smallest and largest id of a train_step input fed straight to embeddings (`tables`:
    (table name, rows) pairs), as tensors, never read in a step that passes: the step runs on
    the ids clamped into the tables (`clamp`), whether they were out of range rides the step's
    one all-reduce of [loss, flags] (runtime/state.py step_results), and only when it says so
    is the step thrown away and a rank whose ids are out of range reads them, for the message."""
    name: str
    tables: tuple
    low: torch.Tensor
    high: torch.Tensor

    @property
    def rows(self) -> int:
        """The rows of the smallest table the ids index."""
        return min(r for _, r in self.tables)

    def out_of_range(self) -> torch.Tensor:
        """1 (int64, a 0-dim tensor beside the ids) when an id indexes past a table; no host read."""
        return ((self.low < 0) | (self.high >= self.rows)).to(torch.int64)

    def clamp(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (this input's share, on the device) clamped into [0, rows): a step given ids
        out of range computes on these instead of indexing past a table (on CUDA an
        out-of-bounds index is a device-side assert, and on CPU an IndexError on one rank
        only), and is then refused on every rank (runtime/parallel_model.py)."""
        return ids.clamp(0, self.rows - 1)

    def error(self) -> AutopartError | None:
        """The refusal naming the table, the ids and the remedy (reads the two ids)."""
        low, high = int(self.low), int(self.high)
        for table, rows in self.tables:
            if low < 0 or high >= rows:
                return AutopartError(
                    f"train_step input {self.name!r} holds ids from {low} to {high}, but it "
                    f"indexes the embedding table {table}, which has {rows} rows.\n  remedy: "
                    f"use ids in [0, {rows}) (the model's vocabulary), or build the model "
                    f"with at least {high + 1} rows")
        return None


def ids_out_of_range(ids: tuple, device) -> torch.Tensor | None:
    """How many of `ids` (IdRanges) index past a table: an int64 0-dim tensor on `device`
    (None where there are none), for the step's one all-reduce; no host read."""
    if not ids:
        return None
    return torch.stack([r.out_of_range().to(device) for r in ids]).sum()


class LocalInputs:
    """Resolves what one rank's train_step was given against its BatchShard and the compiled
    input specs (autopart/capture.py InputSpec)."""

    def __init__(self, shard: BatchShard, names: list[str], specs: tuple, global_batch: int,
                 cp: int, chunk_inputs: set[str]):
        self.shard, self.names, self.specs = shard, list(names), specs
        self.global_batch, self.cp, self.chunk_inputs = global_batch, cp, chunk_inputs
        self.n_inputs = len(names) - has_target(names)

    def on_sequence(self, i: int) -> bool:
        """Is dim 1 of input `i` the sequence (captured symbolic)?"""
        return i < len(self.specs) and 1 in self.specs[i].dynamic

    def values(self, inputs: tuple, target) -> list:
        """train_step's positional tensors and target as one list in the compiled order (the
        target last, as capture names it): all of them; or no positional ones (a rank that reads
        no input); or all but the target, left out."""
        names = self.names
        values = list(inputs) + ([target] if target is not None else [])
        if not inputs:
            values = [None] * (len(names) - len(values)) + values
        elif target is None and len(values) == len(names) - 1 and has_target(names):
            values.append(None)
        if len(values) != len(names):
            raise AutopartError(
                f"train_step got {len(values)} tensors (inputs and target) but the model was "
                f"compiled with {len(names)}: {names}.\n  remedy: pass the inputs positionally "
                "(None, or none at all, where this rank reads none: pm.batch_shard.reads) and "
                "the target as target=")
        return values

    def check_types(self, values: list) -> None:
        for name, v in zip(self.names, values):
            if v is not None and not isinstance(v, torch.Tensor):
                raise AutopartError(f"train_step input {name!r} is a {type(v).__name__}, not a "
                                    "tensor: pass tensors shaped as the example batch (or None "
                                    "where this rank reads none: pm.batch_shard.reads)")

    def resolve(self, values: list, local: bool | None) -> Given:
        """Each tensor's share, after checking it is the global batch or this rank's share."""
        shard, rank = self.shard, self.shard.rank
        modes = {True, False} if local is None else {local}
        for i, (name, v) in enumerate(zip(self.names, values)):
            if v is None:
                if name in shard.reads:
                    raise AutopartError(
                        f"train_step on rank {rank}: input {name!r} is None, but this rank's "
                        f"chunks read it (pm.batch_shard.reads = {list(shard.reads)}).\n  "
                        f"remedy: pass its share, pm.local_batch(...) of the global batch, or "
                        "the global batch")
                continue
            modes &= self._modes(i, name, v, local)
        if not modes:
            raise AutopartError(
                f"train_step on rank {rank}: some tensors are the global batch and others this "
                f"rank's share ({self._sizes(values)}).\n  remedy: pass all of them alike")
        is_local = (True in modes and False not in modes) if len(modes) == 1 else False
        out, length = {}, None
        for i, (name, v) in enumerate(zip(self.names, values)):
            if v is None:
                if name in self.chunk_inputs:
                    out[name] = None
                continue
            seq = self.on_sequence(i) and self.cp > 1
            n = None if v.dim() < 2 or not self.on_sequence(i) else \
                int(v.shape[1]) * (self.cp if is_local else 1)
            if n is not None and length is not None and n != length:
                raise AutopartError(f"train_step on rank {rank}: the tensors carry sequences of "
                                    f"different lengths ({self._sizes(values)}).\n  remedy: "
                                    "cut them to one length")
            length = n if n is not None else length
            out[name] = v if is_local else shard.cut(v, seq)
        whole = {} if is_local else {n: v for n, v in zip(self.names, values) if v is not None}
        return Given(out, length, is_local, whole)

    def _modes(self, i: int, name: str, v: torch.Tensor, local: bool | None) -> set:
        """Which readings of `v` fit: False (the global batch), True (this rank's share)."""
        shard, rows = self.shard, v.shape[0] if v.dim() else None
        fits = set()
        G, R = self.global_batch, shard.local_rows
        seq, cp = self.on_sequence(i) and self.cp > 1, self.cp
        n, most = (int(v.shape[1]), self.specs[i].shape[1]) if seq else (0, 0)
        if rows == G and (not seq or n % (2 * cp) == 0):
            fits.add(False)
        if rows == R and (not seq or (n % 2 == 0 and n * cp <= most)):
            fits.add(True)
        if local is not None:
            fits &= {local}
        if not fits:
            raise AutopartError(self._wrong_size(name, v, local, seq))
        if G == R and not seq:
            return {True, False}        # dp=1, no cp: the share is the global batch
        return fits

    def _wrong_size(self, name: str, v: torch.Tensor, local, seq: bool) -> str:
        shard, cp = self.shard, self.cp
        rows = v.shape[0] if v.dim() else "none (a scalar)"
        what = {None: "", True: " (local=True: this rank's share)",
                False: " (local=False: the global batch)"}[local]
        share = (f"rank {shard.rank}'s share is {shard.local_rows} rows (rows {shard.rows[0]}.."
                 f"{shard.rows[-1]})" + (f" and sequence chunks {shard.seq_chunks} of "
                                         f"{shard.seq_chunks_total}" if seq else ""))
        return (f"train_step input {name!r} has batch {rows}{what}, but the model was compiled "
                f"for the global batch {self.global_batch}"
                + (f" of a sequence cut into 2*cp = {2 * cp} equal chunks" if seq else "")
                + f", and {share} (shape {tuple(v.shape)} fits neither).\n  remedy: pass the global batch, or pm.local_batch(...) of "
                "it" + (f"; pad the sequence to a multiple of {2 * cp} (padding labels -100)"
                        if seq else ""))

    def _sizes(self, values) -> str:
        return ", ".join(f"{n} {tuple(v.shape)}" for n, v in zip(self.names, values)
                         if isinstance(v, torch.Tensor))

    def fill(self, given: Given, length: int | None, device) -> dict:
        """Given's values on `device`, with a zero-stride stand-in (no memory) of this rank's
        share's shape for each tensor it was not given: its chunks read only its shape."""
        out = {}
        for i, name in enumerate(self.names):
            if name not in given.values:
                continue
            v = given.values[name]
            if v is None:
                spec = self.specs[i]
                shape = list(spec.shape)
                shape[0] = self.shard.local_rows
                if self.on_sequence(i):
                    if length is None:
                        raise AutopartError(
                            f"train_step on rank {self.shard.rank}: no tensor says the sequence "
                            f"length {name!r} has.\n  remedy: pass {name!r} (its share)")
                    shape[1] = length // self.cp
                dtype = torch.long if spec.integer else torch.float32
                v = torch.zeros((), dtype=dtype, device=device).expand(shape)
            out[name] = v.to(device)
        return out


# -- what the ranks agree on each step: refusals, the token count and the sequence length --------

aten = torch.ops.aten
# ops of a token count that is a sum over elements, so the ranks' counts of their shares add up
ELEMENTWISE_COUNT = G.RESHAPES | G.TRANSPOSES | G.UNSQUEEZES | G.ALIASES | G.COPIES | {
    aten.ne.Scalar, aten.eq.Scalar, aten.ne.Tensor, aten.eq.Tensor,
    aten.sum.default, aten._to_copy.default, aten.to.dtype,
    aten.mul.Tensor, aten.logical_and.default, aten.logical_not.default,
    aten.ge.Scalar, aten.lt.Scalar, aten.gt.Scalar, aten.le.Scalar,
    aten.flatten.using_ints}


def count_not_elementwise(counter):
    """The first node of `counter`'s graph (a TokenCount) that is not an elementwise op, a view
    or the sum, or None: the counts of a sequence's chunks then need not add up to its count."""
    return next((n for n in counter.gm.graph.nodes if n.op == "call_function"
                 and n.target not in ELEMENTWISE_COUNT), None)


def share_count(counter, values: dict, microbatch: int) -> torch.Tensor:
    """The tokens `counter` (a TokenCount) counts in `values` (name -> this rank's share, or
    its rows of the whole sequence), microbatch by microbatch as the programs see them. A count
    of the values (`labels != -100`) is an int64 0-dim tensor beside them, never read on the
    host: summed over the ranks and turned into the loss scale on the device
    (runtime/parallel_model.py). A count that is a function of its inputs' shapes alone (by
    dataflow: `counts_values`) is an int, counted (and read) once per shape and kept: the
    ranks sum it among the host values agree agrees on."""
    tensors = [values[n] for n in counter.inputs]
    if _counts_values(counter.gm):
        return _count(counter, tensors, microbatch)
    key = (microbatch, *((tuple(t.shape), t.dtype, t.device) for t in tensors))
    kept = _SHAPE_COUNTS.setdefault(counter.gm, {})
    if key not in kept:
        kept[key] = int(_count(counter, tensors, microbatch))   # once per shape
    return kept[key]


def _count(counter, tensors: list, microbatch: int) -> torch.Tensor:
    rows = tensors[0].shape[0]
    with torch.no_grad():
        counts = [counter.gm(*(t[k:k + microbatch] for t in tensors)).reshape(())
                  for k in range(0, rows, microbatch)]
        return torch.stack(counts).to(torch.int64).sum()


# ops whose output depends on their tensor arguments' shapes (and dtypes), not their values
METADATA_ONLY = SHAPE_ONLY | G.NEW_LIKE | {aten.ones_like.default, aten.zeros_like.default,
                                          aten.empty_like.default, aten.full_like.default}
# counter program -> {(microbatch, its inputs' shapes): the count}, for counts of shapes alone
_SHAPE_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_VALUED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def counts_values(gm: fx.GraphModule) -> bool:
    """Whether `gm`'s output depends on its inputs' values, not only their shapes: a value
    flows from a placeholder through every op but those of METADATA_ONLY (a mask of
    ones_like(labels) counts the same for any labels of that shape; `labels != -100` does not)."""
    valued: set = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            return any(a in valued for a in n.all_input_nodes)
        if n.op == "placeholder" or (any(a in valued for a in n.all_input_nodes) and not (
                n.op == "call_function" and n.target in METADATA_ONLY)):
            valued.add(n)
    return True


def _counts_values(gm: fx.GraphModule) -> bool:
    if gm not in _VALUED:
        _VALUED[gm] = counts_values(gm)
    return _VALUED[gm]


def agree(count: int, length: int | None, refused: Exception | None, group,
          step: int) -> tuple[int, int | None]:
    """One all-reduce of host integers over `group` (every rank; a CPU group: RankGroups.host,
    Gloo), before the step runs and reading no device value: whether a rank refused its
    tensors (`refused`, its error: then every rank raises, naming it, rather than leave the
    others waiting in the step's first collective), the token counts known on the host (`count`:
    a count of the batch's shapes alone, share_count; 0 elsewhere) summed, and the one sequence
    length the ranks that know one were given (an error naming the ranks if they differ). What
    lives on the device (a count of the labels' values, the embedding ids' range) stays there:
    runtime/parallel_model.py train_step."""
    import torch.distributed as dist
    n = length or 0
    bad, total, known, s, s2 = host_sum(
        [int(refused is not None), int(count), int(length is not None), n, n * n], group)
    if bad:
        refuse(refused, group, step)
    if not known:
        return total, None
    if known * s2 != s * s:      # equal only when every length is the same (Cauchy-Schwarz)
        lengths: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(lengths, length, group=group)
        by: dict = {}
        for r, v in enumerate(lengths):
            if v is not None:
                by.setdefault(v, []).append(r)
        raise AutopartError(
            "train_step: the ranks were given sequences of different lengths ("
            + "; ".join(f"ranks {rs}: {v} positions" for v, rs in sorted(by.items())) +
            ").\n  remedy: one global batch has one sequence length: give every rank its "
            "share of the same global batch (pm.local_batch)")
    return total, s // known


def host_sum(values: list[int], group) -> list[int]:
    """`values` (host integers) summed over `group` (None: this rank alone): one all-reduce of
    a CPU tensor made here from them, over a CPU group (Gloo), read back. It holds no device
    value, so reading it waits on no device stream: not a host sync of the step."""
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.int64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.tolist()


def device_loss_scale(count, group, device) -> torch.Tensor:
    """1 / the token count summed over `group` (every rank; `count`: this rank's share, a
    device tensor of share_count, or 0 where it counts none), or 0 if none counts: a float32
    0-dim tensor on `device`, computed there (one all-reduce on the device, no host read). The
    same float32 as the host's 1.0 / count: the quotient is taken in float64, then rounded."""
    import torch.distributed as dist
    t = torch.as_tensor(count, dtype=torch.int64).to(device).reshape(1).clone()
    if group is not None:
        dist.all_reduce(t, group=group)
    total = t.reshape(()).double()
    return torch.where(total > 0, 1.0 / total.clamp(min=1), 0.0).float()


def refuse(refused: Exception | None, group, step: int) -> None:
    """Raise on every rank: its own error where it refused, else the refusing ranks' errors."""
    import torch.distributed as dist
    errors: list = [None] * (dist.get_world_size(group) if group is not None else 1)
    if group is not None:
        dist.all_gather_object(errors, None if refused is None else str(refused), group=group)
    if refused is not None:
        raise refused
    bad = {r: e for r, e in enumerate(errors) if e is not None}
    raise AutopartError(
        f"train_step (step {step}): rank(s) {sorted(bad)} refused the tensors they were given, "
        "so every rank stops here (nothing moved):\n"
        + "\n".join(f"rank {r}: {e}" for r, e in sorted(bad.items())))


__all__ = ["BatchShard", "Given", "IdRange", "LocalInputs", "agree", "counts_values", "batch_shard",
           "count_not_elementwise", "data_reads", "device_loss_scale", "host_sum",
           "ids_out_of_range", "pipeline_reads", "refuse", "share_count"]
