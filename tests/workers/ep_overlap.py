"""Rank functions of tests/test_ep_overlap.py: the equivalence harness
(tests/workers/equivalence.py) on cases that set overlap=, each result with how this process's computes ran
(runtime/executor.py PATHS: "paired F" counts the forwards run by a paired program)."""
from __future__ import annotations

from dataclasses import dataclass

from tests.workers.common import Case
from tests.workers import equivalence
from tests.workers.nccl_contract import under_contract


@dataclass(frozen=True)
class OCase(Case):
    """An equivalence case with the overlap option (autopart.Config.overlap) set."""
    overlap: bool = True
    contract: bool = False      # run under NCCL's contract (installed from this case on)

    def options(self) -> dict:
        return {"overlap": self.overlap}


def run_overlap(rank: int, world: int, cases: list) -> list[dict]:
    """equivalence.run_cases, a case at a time, each result with "paths": {"paired F": n, ...}."""
    from autopart.runtime.executor import PATHS
    out: list[dict] = []
    for i, case in enumerate(cases):
        PATHS.clear()
        results = equivalence.run_cases(rank, world, [case])
        for r in results:
            r["paths"] = {f"{how} {kind}": n for (how, kind), n in PATHS.items()}
        out += results
        if any(p.startswith("raised on rank") for r in results for p in r["problems"]):
            out += [{"case": c.name, "rank": rank, "problems": ["not run: an earlier case "
                                                                "failed"]} for c in cases[i + 1:]]
            break
    return out


def run_cases(rank: int, world: int, cases: list) -> list[dict]:
    """run_overlap on each case, the ones with contract=True under NCCL's contract
    (tests/nccl_contract.py; list them last: it stays installed in the process)."""
    out: list[dict] = []
    for case in cases:
        fn = under_contract if case.contract else (lambda f, *a: f(*a))
        out += fn(run_overlap, rank, world, [case])
        if any(p.startswith(("raised on rank", "not run")) for r in out for p in r["problems"]):
            break
    return out
