"""The packed documents' ids a train_step is given, checked: each document one run per row.

A model that masks attention by `doc[:, :, None] == doc[:, None, :]` (split_context_parallel
records the input in `ContextParallelPlan.documents`; without a cp axis compile finds it by the
same proof, passes/split_context_parallel/documents.py, so every axis checks it) joins every
token of one id into one document. A row whose ids come back to an earlier document (0, 0, 1, 1, 0) is then almost
surely a packing bug: the last tokens would attend to the first document's as if it went on,
while the positions restart. It is refused before anything runs, naming the input, the rank,
the row and the positions. Cost: one sort of the (batch, seq) ids and one small copy.

The property holds for any of a row's pieces put together in order, so a rank's own share
(its rows, and under cp its two sequence chunks) is checked alike.
"""
from __future__ import annotations

import torch

from autopart.errors import AutopartError


def check_document_ids(documents: tuple, names: list, values: list, rank: int) -> None:
    """Refuse a tensor of `documents` (input names) in which an id forms two runs in a row."""
    for name, v in zip(names, values):
        if name not in documents or not isinstance(v, torch.Tensor) or v.dim() != 2 or \
                v.shape[1] < 2:
            continue
        found = _reused(v)
        if found is None:
            continue
        row, doc, first, again, between = found
        raise AutopartError(
            f"train_step input {name!r} (packed documents' ids, rank {rank}): row {row} holds "
            f"document {doc} at position {first} and again at position {again}, after "
            f"document {between}; the attention mask doc[:, :, None] == doc[:, None, :] would "
            "join the two runs into one document.\n  remedy: number the documents of each row "
            "in order, each its own id (e.g. torch.cumsum(starts, dim=1) of the positions where "
            "a document starts), padding one id of its own")


def _reused(doc: torch.Tensor):
    """(row, id, its first position, the start of its second run, the id just before that) of
    the first row in which an id forms two runs, or None."""
    change = doc[:, 1:] != doc[:, :-1]
    runs = 1 + change.sum(1)
    ordered = doc.sort(1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(1)
    bad = (runs != distinct).nonzero()
    if not bad.numel():
        return None
    row = int(bad[0, 0])
    ids = doc[row].tolist()
    seen = {}
    for i, d in enumerate(ids):
        if d in seen and ids[i - 1] != d:
            return row, d, seen[d], i, ids[i - 1]
        seen.setdefault(d, i)
    return None
