"""The inputs of packed documents' ids, found without a cp axis.

Under cp, split_context_parallel proves each attention core's mask by value and records the
inputs that hide other documents' keys (`doc[:, :, None] == doc[:, None, :]`) in
ContextParallelPlan.documents; train_step then checks that each document is one run of its row
(runtime/document_ids.py). Without cp nothing is rewritten, but the same ids are read by the
same mask, and a row that comes back to an earlier id joins two documents there too: the same
proof (masks.py, on the plain captured program) finds them so that the runtime checks them on
every axis. A mask it cannot prove adds none: without cp it is not refused, only not checked.
"""
from __future__ import annotations

from autopart.errors import AutopartError
from autopart.ir import Program

from .find import find_cores
from .masks import NotProvable, _visible, input_reads


def document_inputs(program: Program) -> tuple[str, ...]:
    """Names of the inputs the attention cores' masks read as packed documents' ids, sorted."""
    if program.seq_len is None:
        return ()
    inputs = set(program.inputs)
    try:
        cores = find_cores(program)
    except AutopartError:       # (attention dropout: refused under cp only)
        return ()
    found = set()
    for core in cores:
        if not any(input_reads(mask, inputs) for mask, _ in core.masks):
            continue            # positions and sizes only: no ids to check
        try:
            _visible(core, program.gm, inputs, program.seq_len)
        except (NotProvable, AutopartError):
            continue
        if core.doc_ids is not None:
            found.add(core.doc_ids.name)
    return tuple(sorted(found))
