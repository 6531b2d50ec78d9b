"""Rank functions for the zero-bubble tests (tests/test_zero_bubble.py), importable by spawned ranks.

`zb_cases` runs the shared equivalence check (tests/workers/equivalence.equivalence: losses,
first-step gradients, clipped norm and parameters after 3 steps against the plain model) for each
case; the first case can also write a trace, which the test reads. Each result also says how the
rank's compute actions ran ("paths": runtime.executor.PATHS, "split F": n, "autograd W": n, ...).
"""
from __future__ import annotations

import os
import traceback

from tests.workers.common import Case
from tests.workers.equivalence import equivalence


def zb_cases(rank: int, world: int, cases: list[Case], trace: str | None = None) -> list[dict]:
    """Every case in turn; a case that raises stops the rest (a peer may be stuck in it). With
    `trace`, the first case also records its 3 steps there (AUTOPART_TRACE, as a user would)."""
    out = []
    for i, case in enumerate(cases):
        if trace and i == 0:
            os.environ["AUTOPART_TRACE"] = trace
        from autopart.runtime import executor
        executor.PATHS.clear()
        try:
            out.append(equivalence(case, rank))
            # how each compute action ran (compile-time split programs or autograd)
            out[-1]["paths"] = {f"{path} {kind}": n for (path, kind), n in executor.PATHS.items()}
        except Exception:  # noqa: BLE001  (reported by the test process, per case)
            out.append({"case": case.name, "rank": rank,
                        "problems": [f"raised on rank {rank}:\n{traceback.format_exc()}"]})
            out += [{"case": c.name, "rank": rank, "problems": [f"not run: {case.name} failed"]}
                    for c in cases[i + 1:]]
            break
        finally:
            os.environ.pop("AUTOPART_TRACE", None)
    return out
