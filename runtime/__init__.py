"""autopart.runtime: execute the emitted per-rank programs over torch.distributed."""
from autopart.runtime.parallel_model import ParallelModel, parallelize

__all__ = ["ParallelModel", "parallelize"]
