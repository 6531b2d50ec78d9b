"""Process groups for one rank, built from the Mesh. Held by the ParallelModel, never global.

torch.distributed.new_group must be called by every rank for every group in the same order, so
each builder walks all groups of the mesh and keeps the one containing this rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from autopart.errors import AutopartError
from autopart.ir import Plan
from autopart.mesh import Mesh
from autopart.ops.comm import GroupComm
from autopart.ops.cp import CPComm
from autopart.ops.ep import EPComm
from autopart.ops.tp import TPComm


@dataclass
class RankGroups:
    rank: int
    mesh: Mesh
    world: object       # every rank, with this model's timeout (the default group may have another)
    dp: object          # ranks holding the same chunks (data-parallel replicas, x cp)
    pp: object          # ranks of one pipeline (same dp and tp coordinates)
    shared: dict        # param name -> group of ranks whose chunks share it (tied weights)
    tp: object = None   # ranks splitting the same layers (tensor parallelism)
    model: object = None  # ranks holding one whole model replica (same dp): pp x tp
    ep: object = None     # ranks exchanging tokens for their experts: same pp, tp, dp // ep
    ep_replica: object = None  # ranks holding the same experts: same pp, tp, dp % ep
    timeout: timedelta | None = None   # the model's, which `world` was made with
    cp: object = None     # ranks sharing one sequence (context parallelism): same pp, dp, tp
    # every rank, for host values only (CPU tensors: Gloo): `world` itself where it is Gloo, a
    # Gloo group of the same ranks and timeout beside an NCCL world, so that agreeing on host
    # facts (runtime/batches.py agree) never waits on a device stream
    host: object = None


def barrier(group=None) -> None:
    """`dist.barrier` on `group` (the default one if None). Under NCCL it names this rank's
    device, the current one (`init_process_group` set it to cuda:LOCAL_RANK): without
    `device_ids` torch guesses that same device and warns on every barrier."""
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def build_groups(mesh: Mesh, plan: Plan, timeout: timedelta) -> RankGroups:
    """Create every group of `mesh` collectively; return this rank's."""
    if not dist.is_initialized():
        raise AutopartError("autopart.parallelize needs an initialized process group: call "
                            "torch.distributed.init_process_group (torchrun sets the environment)")
    check_world_size(mesh)
    # Ranks finish compiling at different times (seconds apart on a loaded machine); creating a
    # group waits for every member only as long as the group's own (short) timeout, so first meet
    # on the default group, whose timeout is the launcher's.
    barrier()
    rank = dist.get_rank()
    world = _mine([tuple(range(mesh.world_size))], rank, timeout)
    dp = _mine(mesh.groups("dp"), rank, timeout)
    pp = _mine(mesh.groups("pp"), rank, timeout)
    tp = _mine(mesh.groups("tp"), rank, timeout)
    model = _mine(mesh.replica_groups(), rank, timeout)
    ep = _mine(mesh.ep_groups(), rank, timeout)
    ep_replica = _mine(mesh.ep_replica_groups(), rank, timeout) if mesh.ep > 1 else None
    cp = _mine(mesh.groups("cp"), rank, timeout) if mesh.cp > 1 else None
    host = world if world is None or "gloo" in dist.get_backend(world) else \
        _mine([tuple(range(mesh.world_size))], rank, timeout, backend="gloo")
    shared = {}
    for name in sorted(plan.shared_params):
        pp_ranks = sorted({plan.chunk_ranks[c] for c in plan.shared_params[name]})
        if len(pp_ranks) < 2:
            continue        # all its chunks are on one rank: .grad accumulates there already
        groups = sorted({tuple(mesh.rank(**{**mesh.coords(r), "pp": p}) for p in pp_ranks)
                         for r in range(mesh.world_size)})
        group = _mine(groups, rank, timeout)
        if group is not None:
            shared[name] = group
    return RankGroups(rank, mesh, world, dp, pp, shared, tp, model, ep, ep_replica, timeout, cp,
                      host)


def enter_together(groups: RankGroups, what: str) -> None:
    """Wait, within the model's timeout, until every rank entered the collective `what` (save,
    load), and name the ranks that did not: a rank that never calls it would otherwise leave
    the others blocked in the first collective for the default group's timeout (30 minutes by
    torch's default). A monitored barrier (Gloo); NCCL has none, and its groups' own timeout
    (this model's) bounds the wait there."""
    if dist.get_backend(groups.world) != "gloo":
        return
    try:
        dist.monitored_barrier(group=groups.world, timeout=groups.timeout, wait_all_ranks=True)
    except RuntimeError as e:
        found = re.search(r"Ranks? ([\d, ]+) failed to pass", str(e))   # Gloo's wording
        missing = sorted(int(r) for r in re.findall(r"\d+", found.group(1))) if found else []
        who = f"rank(s) {missing}" if missing else "some rank"
        raise AutopartError(
            f"{what}: {who} did not enter it within {groups.timeout.total_seconds():.0f} s "
            f"(parallelize's timeout); every rank must call {what} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:300]}).\n  remedy: call pm.{what}(...) on every rank, "
            "not only on rank 0 (rank 0 alone writes the marker; the others write their "
            "shards)") from e


def _differing(digest: str, groups: RankGroups, verb: str) -> str:
    """'' when every rank's `digest` is the same (one all-gather), else which ranks hold which:
    'ranks [0] <verb> ab12; ranks [1] <verb> cd34'."""
    digests: list = [None] * groups.mesh.world_size
    dist.all_gather_object(digests, digest, group=groups.world)
    if len(set(digests)) == 1:
        return ""
    by_digest: dict[str, list[int]] = {}
    for rank, d in enumerate(digests):
        by_digest.setdefault(d, []).append(rank)
    return "; ".join(f"ranks {ranks} {verb} {d}" for d, ranks in by_digest.items())


def batch_digest(values: list) -> str:
    """A short hash of the train_step tensors' shapes, dtypes and bytes (copied to the host)."""
    import hashlib
    h = hashlib.sha1()
    for v in values:
        h.update(f"{tuple(v.shape)}{v.dtype}".encode())
        h.update(v.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check_same_batch(given, groups: RankGroups, step: int) -> None:
    """Raise on every rank, naming the ranks that differ, unless (one all-gather of hashes) the
    ranks that train the same share (same dp and cp coordinates: tp and pipeline peers) were
    given the same values of each tensor they hold, and the ranks given the global batch the
    same one. `given`: runtime/batches.py Given."""
    coords = groups.mesh.coords(groups.rank)
    mine = (coords["dp"], coords["cp"], {n: batch_digest([v]) for n, v in given.values.items()
                                          if v is not None},
            {n: batch_digest([v]) for n, v in given.whole.items()})
    every: list = [None] * groups.mesh.world_size
    dist.all_gather_object(every, mine, group=groups.world)
    whole: dict = {}
    for rank, (_, _, _, digests) in enumerate(every):
        for name, d in digests.items():
            whole.setdefault(name, {}).setdefault(d, []).append(rank)
    seen = next((seen for seen in whole.values() if len(seen) > 1), None)
    if seen is not None:
        parts = "; ".join(f"ranks {ranks} passed batch {d}" for d, ranks in seen.items())
        hint = (" If these are each rank's own share (under cp with dp=1 the shapes cannot "
                "tell), pass train_step(..., local=True)." if groups.mesh.cp > 1 else "")
        raise AutopartError(
            f"train_step (step {step}) was given different global batches on different ranks "
            f"({parts}).\n  remedy: pass the same whole global batch on every rank (load it "
            "with the same seed and order everywhere), or each rank its own share "
            "(pm.local_batch, pm.batch_shard); autopart gives each data-parallel replica and "
            f"microbatch its share.{hint}")
    _check_same_shares(every, step)


def _check_same_shares(every: list, step: int) -> None:
    """Raise unless the ranks of one (dp, cp) share hold the same digest of each tensor."""
    by: dict = {}
    for rank, (dp, cp, digests, _) in enumerate(every):
        for name, d in digests.items():
            by.setdefault((dp, cp, name), {}).setdefault(d, []).append(rank)
    for (dp, cp, name), seen in by.items():
        if len(seen) > 1:
            parts = "; ".join(f"ranks {ranks} hold {d}" for d, ranks in seen.items())
            raise AutopartError(
                f"train_step (step {step}): the ranks of data-parallel replica {dp}, "
                f"context-parallel rank {cp} (tensor-parallel and pipeline peers, which train "
                f"the same share of the batch) were given different values of {name!r} "
                f"({parts}).\n  remedy: give every rank of one (dp, cp) coordinate the same "
                "share: pm.batch_shard (its rows and seq_chunks depend on dp and cp alone), "
                "pm.local_batch(...) of one global batch, read with the same seed and order")


def check_same_program(digest: str, groups: RankGroups, traced: str = "") -> None:
    """Raise on every rank, naming which ranks differ, unless all compiled the same program;
    `traced` (the captured graph's hash, Compiled.traced) tells the two causes apart."""
    parts = _differing(digest, groups, "compiled")
    if not parts:
        return
    captured = _differing(traced, groups, "traced") if traced else ""
    if captured:
        cause = (f"They traced different forwards ({captured}), before any pass ran: "
                 "parallelize gives every rank rank 0's capture, but a rank whose model or "
                 "example inputs differ from rank 0's (parameter names, shapes or dtypes; input "
                 "shapes or dtypes) traces its own.\n  remedy: every rank must build the same "
                 "model and pass example inputs of the same shapes (a forward whose ops depend "
                 "on the process, such as a loop over a set in PYTHONHASHSEED's order, needs "
                 "nothing: the ranks compile rank 0's capture)")
    else:
        cause = ("They traced the same forward (rank 0's capture), so what differs is how it "
                 "was compiled.\n  remedy: pass the same parallelize options (mesh, "
                 "microbatches, schedule, recompute, memory_budget, zero, precision, ...) on "
                 "every rank, and run one autopart and torch version everywhere; if they are "
                 "the same, a compiler pass depends on the process: please report it with this "
                 "message")
    raise AutopartError(f"the ranks compiled different programs ({parts}). {cause}")


def bind_comms(chunks, groups: RankGroups) -> None:
    """Bind each program's comm modules to this rank's process group of their axis."""
    mine = {TPComm: (groups.tp, groups.mesh.coords(groups.rank)["tp"]),
            EPComm: (groups.ep, groups.mesh.ep_rank(groups.rank)),
            CPComm: (groups.cp, groups.mesh.coords(groups.rank)["cp"])}
    for chunk in chunks:
        for module in chunk.gm.modules():
            if isinstance(module, GroupComm):
                module.bind(*mine[type(module)])


def check_world_size(mesh: Mesh) -> None:
    """Raise, on every rank alike, unless the process group has exactly the mesh's ranks."""
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise AutopartError(
            f"{mesh} needs {mesh.world_size} processes but the process group has {world}.\n"
            f"  remedy: launch {mesh.world_size} processes (torchrun --nproc-per-node "
            f"{mesh.world_size}), or choose a mesh whose pp*dp*cp*tp = {world}")


def _mine(groups: list[tuple[int, ...]], rank: int, timeout: timedelta, backend=None):
    mine = None
    for ranks in groups:
        g = dist.new_group(list(ranks), timeout=timeout, backend=backend) if len(ranks) > 1 \
            else None
        if rank in ranks:
            mine = g
    return mine
