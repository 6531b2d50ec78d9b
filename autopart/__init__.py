"""autopart: compile a plain PyTorch model into a distributed training program."""
from autopart import _C  # noqa: F401  (the C++ core must import, or nothing works)

__version__ = "0.1.0"
