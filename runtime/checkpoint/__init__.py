"""Sharded checkpoints of a ParallelModel on torch.distributed.checkpoint (DCP).

    autopart.runtime.checkpoint.save(pm, "ckpt/step100", optimizer=opt, extra={"step": 100})
    extra = autopart.runtime.checkpoint.load(pm, "ckpt/step100", optimizer=opt)  # any mesh
    # one process, no process group: the plain model's state dict as safetensors
    autopart.runtime.checkpoint.export("ckpt/step100", "out/")

Every tensor is stored under the plain model's canonical name with its global shape; each rank
writes only its own pieces of it, as chunks with global offsets (DCP's chunk metadata). A
tensor-parallel shard of a fused weight (q|k|v) is one chunk per section, since it is several
separate slices of the full tensor; an expert shard is rows of dim 0. Replicas (data-parallel
copies, both holders of a tied weight) offer the same chunk and DCP's save planner keeps one
writer per chunk. On load each rank asks for its own chunks and DCP reads whatever saved chunks
overlap them, so a checkpoint saved on one mesh loads on any other.

Keys: `model/<name>`, `optim/state/<name>/<key>` (sharded like the parameter when it has the
parameter's shape: momentum, Adam moments; else stored whole: `step`), `optim/param_groups`
(hyperparameters), `rng/<rank>/cpu` (and `/cuda`), `extra`. A zero=1 ZeroOptimizer's flat slices
are saved in this same per-parameter form (gathered per replica group) and loaded by cutting each
rank's slice out of it, so a checkpoint loads across a change of zero level too.

A save writes into a temporary directory beside `path`; after every rank finished (DCP's final
collective, then a gather of each rank's file checksums) rank 0 writes the completion marker
`.autopart_complete` (JSON: mesh, world size, keys, the model's names and global shapes and a
digest of them, each file's size and CRC-32) and only then moves the directory to `path`. A save
that dies on any rank leaves `path` as it was.

The package, one job per module: `geometry.py` (a tensor as this rank's pieces), `planners.py`
(DCP planners for those pieces), `held.py` (what a rank contributes: model, optimizer, RNG),
`saving.py`, `checks.py` (marker and files), `loading.py`, `zero_state.py` (zero=1's flat slices),
`exporting.py` (one process: the plain model's safetensors), `peers.py` (a rank lost during save or
load, named)."""
from __future__ import annotations

import torch.distributed.checkpoint as dcp  # noqa: F401  (checkpoint.dcp, as before the split)

from .checks import check_files
from .exporting import export, read_full_state_dict, read_marker, summary
from .geometry import MARKER, Slices, layout
from .loading import load
from .planners import _LoadPlanner, _SavePlanner  # noqa: F401  (tests use them)
from .saving import save

__all__ = ["save", "load", "export", "read_full_state_dict", "read_marker", "check_files",
           "layout", "Slices", "MARKER", "summary"]
