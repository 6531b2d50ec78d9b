"""A rank lost during save or load, named, as train_step names it (runtime/step_watch.py).

When a rank dies in the middle of save or load, the others fail in whatever collective they were
in (DCP's gather of the plans, say) with the transport's own words: Gloo's "Connection closed by
peer [127.0.0.1]:6061", which names no rank. So a rank whose save or load fails publishes that in
the c10d store the ranks share and reads the others' for a short while, as train_step does: the
ranks that said nothing are dead or stuck elsewhere, and the error names them, the phase and a
remedy. When every rank reports (a bad checkpoint refused everywhere, a disk full on one rank
that DCP told all of them), no peer is lost and the original error stands unchanged.
"""
from __future__ import annotations

import itertools
import time
from contextlib import contextmanager

from torch.distributed.checkpoint.api import CheckpointException

from autopart.runtime.step_watch import PeerFailure, watch_for

# every rank calls save and load in the same order (they are collective), so the n-th call is the
# same one on every rank: its store keys never mix with an earlier failed call's
_CALLS = itertools.count()

REMEDY = {
    "save": "restart every rank and resume from the last complete checkpoint: a save that fails "
            "on any rank leaves {path} as it was (the partial one is in a temporary directory "
            "beside it, removed by the next save there)",
    "load": "restart every rank and load again: load never changes {path}",
}


@contextmanager
def peers_named(pm, what: str, path):
    """Around the collectives of save or load (`what`) of `pm` to `path`: an error that some
    other rank did not report too becomes a PeerFailure naming this rank, the phase, the silent
    ranks and a remedy."""
    call, started = next(_CALLS), time.monotonic()
    try:
        yield
    except (Exception, CheckpointException) as error:      # DCP's is a BaseException
        if isinstance(error, PeerFailure):
            raise
        named = _lost_peers(pm, what, path, error, call, time.monotonic() - started)
        if named is None:
            raise
        raise PeerFailure(named) from error


def _lost_peers(pm, what: str, path, error: BaseException, call: int,
                seconds: float) -> str | None:
    """The report naming the ranks that did not report a failure of this call; None when every
    rank did (or there is no store, or no other rank)."""
    groups = getattr(pm, "_groups", None)
    if groups is None or groups.mesh.world_size < 2:
        return None
    watch = watch_for(groups, groups.rank)
    watch.step = f"{what}{call}"             # the store keys of this call
    text = str(error).strip()
    head = (f"{what}: rank {groups.rank} failed after {seconds:.1f} s: {type(error).__name__}: "
            f"{text.splitlines()[0][:300] if text else ''}")
    watch._publish(head)
    lines = watch._others()
    if not any(line.startswith("no report from") for line in lines):
        return None
    lines = [line.replace("outside the step", f"outside {what}") for line in lines]
    return "\n  ".join([head, *lines, "remedy: " + REMEDY[what].format(path=path)])
