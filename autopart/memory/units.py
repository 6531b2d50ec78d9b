"""The model's units and options: state kinds, optimizer states, ZeRO levels (byte sizes are
parsed and printed by autopart/config.py: parse_bytes, fmt_bytes)."""
from __future__ import annotations

from autopart.config import choices


KEYS = ("params", "grads", "master", "optimizer", "activations", "buffers", "total")
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2}   # param-sized tensors per parameter
# written once, in autopart/config.py. 1: optimizer state and fp32 master slice sharded over dp
# (ZeRO-1); 2: the gradients too (ZeRO-2); 3: the parameters too (ZeRO-3)
ZERO_LEVELS = choices("zero")
ADAM_STEP = 4               # torch.optim.Adam's `step`: one fp32 scalar per tensor it steps
# Parameter-sized temporaries of one parameter's step: Adam's sqrt(v) and sqrt(v) / c (denom);
# SGD's momentum update is in place. With ZeRO-1 the step runs on buckets (runtime/optimizer.py).
STEP_TEMPORARIES = {"sgd": 0, "sgd-momentum": 0, "adam": 2}
