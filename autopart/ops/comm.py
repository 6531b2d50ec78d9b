"""The process group a parallel program's collectives run over, held by the program itself.

Each program holds one of these per parallel axis (`self.tp_comm`, `self.ep_comm`); the runtime
binds it to this rank's group, so no group lives in process-global state."""
from __future__ import annotations

import torch.nn as nn


class GroupComm(nn.Module):
    """Size of the group, this rank's index in it, and (once bound) the process group."""

    axis = "parallel"              # named in the error an unbound program raises
    unbound_ok_when_alone = False  # may a group of one run unbound?

    def __init__(self, size: int, rank: int = 0, shape_only: bool = False):
        super().__init__()
        self.size, self.rank, self.group = size, rank, None
        # shape_only: collectives make outputs of the right shape and move no data (the
        # compile-time program checker runs programs on fake tensors, with no process group)
        self.shape_only = shape_only

    @property
    def moves_data(self) -> bool:
        return not self.shape_only

    def bind(self, group, rank: int) -> "GroupComm":
        self.group, self.rank = group, rank
        return self

    def extra_repr(self) -> str:
        return f"size={self.size}, rank={self.rank}, bound={self.group is not None}"

    def _check(self) -> None:
        if self.shape_only:
            return
        if self.group is None and not (self.unbound_ok_when_alone and self.size == 1):
            raise RuntimeError(f"this {self.axis} program is not bound to a process group: run "
                               "it through autopart.parallelize, not directly")
