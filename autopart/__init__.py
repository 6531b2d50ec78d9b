"""autopart: compile a plain PyTorch model into a distributed training program.

    mesh = autopart.Mesh(dp=2, pp=2)
    config = autopart.Config(microbatches=4)                   # every option, checked here
    compiled = autopart.compile(model, mesh, (tokens,))        # inspect, no processes needed
    pm = autopart.parallelize(model, mesh, (tokens,), ...)     # train, under torch.distributed
    report = autopart.verify(build, mesh, (tokens,), ...)      # rehearse: layout vs plain model
"""
from autopart import _C  # noqa: F401  (the C++ core must import, or nothing works)
from autopart.compiler import Compiled, Plan, RankProgram, compile
from autopart.config import Config
from autopart.errors import AutopartError
from autopart.mesh import Mesh
from autopart.materialize import materialize, meta_device
from autopart.api import parallelize
from autopart.runtime import ParallelModel
from autopart.runtime.batches import BatchShard
from autopart.verification import VerifyReport, verify
from autopart._version import __version__
__all__ = ["AutopartError", "BatchShard", "Compiled", "Config", "Mesh", "ParallelModel", "Plan",
           "RankProgram",
           "VerifyReport",
           "compile", "materialize", "meta_device", "parallelize", "verify"]
