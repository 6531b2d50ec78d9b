"""Python's cyclic garbage collector, paused while autopart compiles or plans.

Compiling a 128-layer model makes millions of small objects (fx nodes, sympy expressions, fake
tensors) that stay alive until the compile returns. The collector walks them again and again as
they accumulate, which was 1.4-1.9 s of the 13-14 s (CPU) that compiling megatron-1t for 3072
ranks took, and frees next to nothing. mypy raises its thresholds for the same reason. The
collector is on again (if it was) when the outermost paused call returns; the cycles made
meanwhile go at its next pass.
"""
from __future__ import annotations

import functools
import gc


def gc_paused(fn):
    """Run `fn` with the cyclic collector off (reference counting still frees most objects)."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return paused


__all__ = ["gc_paused"]
