"""Graph markers for pipeline point-to-point transfers.

The runtime moves tensors between ranks with batched isend/irecv at the times the schedule
gives; these identity functions mark, inside each rank's program, where a received tensor enters
and where a tensor to send leaves, so `print(program.code)` shows every transfer and tests can
count them. They are no-ops at run time: the transfer itself is the schedule's SEND/RECV action.
"""
from __future__ import annotations

import torch

from autopart.ops.registry import register


def recv(tensor: torch.Tensor, src: int, chunk: int) -> torch.Tensor:
    """`tensor` arrives from pipeline rank `src`, where chunk `chunk` produced it."""
    return tensor


def send(tensor: torch.Tensor, dst: int, chunk: int) -> torch.Tensor:
    """`tensor` leaves for pipeline rank `dst`, where chunk `chunk` consumes it."""
    return tensor


register(recv, send, kind="p2p", axis="pp", namespace="autopart.p2p")
