"""The device mesh: named parallel axes, validated, printable. No process-global state."""
from __future__ import annotations

from dataclasses import dataclass

from autopart.errors import AutopartError

AXES = ("pp", "dp", "cp", "tp")  # rank order: pp outermost, tp innermost (Megatron's order)


def sequence_chunks(cp: int) -> int:
    """The equal chunks context parallelism cuts a sequence into, which its length must divide
    by: 2*cp (causal load balancing: rank i holds chunks i and 2*cp-1-i, autopart/ops/cp.py).
    Mesh.sequence_chunks for a mesh; this for code handed the cp size alone (the ops, a pass)."""
    return 2 * cp


@dataclass(frozen=True)
class Mesh:
    """`Mesh(dp=2, pp=2, tp=2)`: 8 ranks. rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i.

    `ep` shards experts over data-parallel ranks (GShard), so it divides `dp` and adds no ranks.
    `cp` shards the sequence (context parallelism): its ranks hold the same parameters, as data-
    parallel replicas do, and their gradients are reduced together (`replicas` = dp * cp).

    >>> m = Mesh(dp=2, pp=2)
    >>> m.world_size, m.coords(3)
    (4, {'pp': 1, 'dp': 1, 'cp': 0, 'tp': 0})
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "tp", "ep", "cp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AutopartError(f"Mesh axis {axis}={value!r} must be a positive integer")
        if self.dp % self.ep:
            ok = [d for d in range(1, self.dp + 1) if self.dp % d == 0]
            raise AutopartError(
                f"Mesh ep={self.ep} must divide dp={self.dp}: experts are sharded over data-parallel "
                f"ranks (GShard). Use ep in {ok}, or raise dp to a multiple of {self.ep}.")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters and reducing their gradients together: dp * cp."""
        return self.dp * self.cp

    @property
    def sequence_chunks(self) -> int:
        """What the sequence length divides by under this mesh's cp: 2*cp (sequence_chunks)."""
        return sequence_chunks(self.cp)

    def coords(self, rank: int) -> dict[str, int]:
        """The (pp, dp, cp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise AutopartError(f"rank {rank} is outside a mesh of {self.world_size} ranks ({self})")
        return {"pp": rank // (self.dp * self.cp * self.tp),
                "dp": rank // (self.cp * self.tp) % self.dp,
                "cp": rank // self.tp % self.cp, "tp": rank % self.tp}

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at the given coordinates."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks that differ from `rank` only along `axis` (the process group for that
        axis); axis "dp" spans dp x cp, the ranks whose gradients are reduced together (their
        parameters are the same: context-parallel ranks are replicas with other tokens), and
        "dp_only" the data-parallel axis alone."""
        c = self.coords(rank)
        if axis == "dp":
            return tuple(self.rank(**{**c, "dp": d, "cp": k})
                         for d in range(self.dp) for k in range(self.cp))
        axis = "dp" if axis == "dp_only" else axis
        return tuple(self.rank(**{**c, axis: i}) for i in range(getattr(self, axis)))

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every process group along `axis`, each once, in rank order."""
        return sorted({self.group(axis, r) for r in range(self.world_size)})

    # Expert parallelism shards experts over data-parallel ranks (GShard): each group of ep
    # consecutive dp indices (same dp // ep) exchanges tokens, and its member with dp % ep = e
    # holds experts e*E/ep .. (e+1)*E/ep - 1.
    def ep_rank(self, rank: int) -> int:
        """The expert-parallel index of a global rank: which slice of the experts it holds."""
        return self.coords(rank)["dp"] % self.ep

    def ep_groups(self) -> list[tuple[int, ...]]:
        """Expert-parallel groups: for each (pp, tp), the ep consecutive dp indices with the same
        dp // ep (empty when ep = 1)."""
        if self.ep == 1:
            return []
        return [tuple(self.rank(pp=p, dp=g * self.ep + e, tp=t, cp=k) for e in range(self.ep))
                for p in range(self.pp) for t in range(self.tp) for k in range(self.cp)
                for g in range(self.dp // self.ep)]

    def ep_replica_groups(self) -> list[tuple[int, ...]]:
        """Ranks holding the same experts: same (pp, tp, dp % ep), one per ep group."""
        return [tuple(self.rank(pp=p, dp=g * self.ep + e, tp=t, cp=k)
                      for g in range(self.dp // self.ep) for k in range(self.cp))
                for p in range(self.pp) for t in range(self.tp) for e in range(self.ep)]

    def replica_groups(self) -> list[tuple[int, ...]]:
        """Ranks holding one whole model replica (the same dp and cp index): pp x tp ranks each."""
        return [tuple(r for r in range(self.world_size)
                      if (self.coords(r)["dp"], self.coords(r)["cp"]) == (d, k))
                for d in range(self.dp) for k in range(self.cp)]

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        """`"dp=2,pp=4"` -> Mesh(dp=2, pp=4)."""
        if not isinstance(text, str):
            raise AutopartError(f"Mesh.parse takes a string like 'dp=2,pp=4', not a "
                                f"{type(text).__name__}")
        sizes = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("dp", "pp", "tp", "ep", "cp") or not value.isdigit():
                raise AutopartError(f"bad mesh item {item!r} in {text!r}: write e.g. "
                                    "dp=2,pp=4,tp=2 (axes: pp, dp, cp, tp, ep)")
            if key in sizes:
                raise AutopartError(f"mesh {text!r} gives {key} twice ({key}={sizes[key]} and "
                                    f"{item}): give each axis once")
            sizes[key] = int(value)
        return cls(**sizes)

    @classmethod
    def from_device_mesh(cls, device_mesh, ep: int = 1) -> "Mesh":
        """From a torch DeviceMesh whose dimension names are among pp, dp, tp (any missing is 1)."""
        names = device_mesh.mesh_dim_names
        if not names or any(n not in AXES for n in names):
            raise AutopartError(
                f"DeviceMesh dimension names {names} must be among {AXES}; build it with "
                "init_device_mesh(device, shape, mesh_dim_names=('pp', 'dp', 'cp', 'tp'))")
        order = [AXES.index(n) for n in names]
        if order != sorted(order):
            raise AutopartError(f"DeviceMesh dims {names} must be in the order pp, dp, cp, tp "
                                "(tp innermost)")
        sizes = dict(zip(names, device_mesh.mesh.shape))
        return cls(**{k: int(v) for k, v in sizes.items()}, ep=ep)

    def __str__(self) -> str:
        extra = (f", cp={self.cp}" if self.cp > 1 else "") + (f", ep={self.ep}" if self.ep > 1 else "")
        return f"Mesh(pp={self.pp}, dp={self.dp}, tp={self.tp}{extra}; {self.world_size} ranks)"
