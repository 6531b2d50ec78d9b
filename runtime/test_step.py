"""The step driver without processes: this replica's rows of the global batch."""
from __future__ import annotations


import pytest
import torch

from autopart.config import Config
from autopart.errors import AutopartError
from autopart.ir import Plan, RankProgram
from autopart.mesh import Mesh
from autopart.runtime.step import StepDriver


def _plan(mesh, **kw) -> Plan:
    base = dict(mesh=mesh, config=Config(microbatches=2), global_batch=8, microbatch_size=2,
                chunk_ranks=tuple(range(mesh.pp)), chunk_layers=(), shared_params={})
    return Plan(**{**base, **kw})


def test_step_driver_takes_this_replicas_rows():
    mesh = Mesh(dp=2)
    plan = _plan(mesh)
    driver = StepDriver(plan, RankProgram(1, mesh.coords(1), ()), [], ["idx", "target"], None,
                        torch.device("cpu"))
    x = torch.arange(8).reshape(8, 1)
    rows = driver.replica_rows(driver.check_inputs((x,), x + 100))
    assert rows["idx"].flatten().tolist() == [4, 5, 6, 7]
    assert rows["target"].flatten().tolist() == [104, 105, 106, 107]
    # this rank's share (rows 4..7) is taken as it is
    rows = driver.replica_rows(driver.check_inputs((x[4:],), x[4:] + 100))
    assert rows["target"].flatten().tolist() == [104, 105, 106, 107]
    with pytest.raises(AutopartError, match="compiled for the global batch 8"):
        driver.check_inputs((x[:3],), x[:3])
    with pytest.raises(AutopartError, match="'target' is None, but this rank's chunks read it"):
        driver.check_inputs((x,), None)
    with pytest.raises(AutopartError, match="got 3 tensors"):
        driver.check_inputs((x, x, x), None)
