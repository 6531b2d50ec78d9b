"""autopart.runtime: execute the emitted per-rank programs over torch.distributed.

`autopart.parallelize` (autopart/api.py) builds a ParallelModel; the runtime never calls the
compiler. `autopart.runtime.parallelize` still names the front door, imported when asked.
"""
from autopart.runtime.parallel_model import ParallelModel

__all__ = ["ParallelModel", "parallelize"]


def __getattr__(name: str):
    if name == "parallelize":        # the front door, without a runtime -> compiler import
        from autopart.api import parallelize
        return parallelize
    raise AttributeError(f"module 'autopart.runtime' has no attribute {name!r}")
