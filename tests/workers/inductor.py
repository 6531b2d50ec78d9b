"""Rank functions for tests/test_inductor.py: the shared equivalence harness
(tests/workers/equivalence.py) run with `parallelize(..., compile=True)`, plus what this rank's
Inductor compiled."""
from __future__ import annotations

import traceback
from dataclasses import dataclass

from tests.workers.common import Case
from tests.workers.equivalence import equivalence


@dataclass(frozen=True)
class CompiledCase(Case):
    """A Case with what parallelize takes that Case has no field for."""
    recompute: str = "none"


def compiled_cases(rank: int, world: int, cases: list) -> list[dict]:
    """equivalence.run_cases with every parallelize compiling its programs with Inductor; each
    result also carries this rank's CompileReport and torch's own count of AOTAutograd
    compilations (one per artifact, cache hit or not)."""
    import autopart
    from torch._dynamo.utils import counters

    made, extra = [], {}
    plain = autopart.parallelize

    def parallelize(*args, **kwargs):
        pm = plain(*args, compile=True, **extra, **kwargs)
        made.append(pm)
        return pm

    autopart.parallelize = parallelize     # this rank process only runs these cases
    out = []
    for case in cases:
        extra.clear()
        if getattr(case, "recompute", "none") != "none":
            extra["recompute"] = case.recompute
        before = counters["aot_autograd"]["total"]
        try:
            result = equivalence(case, rank)
        except Exception:  # noqa: BLE001  (reported by the test process, per case)
            out.append({"case": case.name, "rank": rank,
                        "problems": [f"raised on rank {rank}:\n{traceback.format_exc()}"]})
            break
        report = made[-1].inductor.report
        result.update(artifacts=report.artifacts, segments=report.segments,
                      compile_seconds=report.seconds, fallbacks=dict(report.fallbacks),
                      aot_compiles=counters["aot_autograd"]["total"] - before,
                      explain=made[-1].explain().splitlines()[-1])
        out.append(result)
    return out
