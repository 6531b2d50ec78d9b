"""Which expert all-to-alls autopart's runtime hides behind other compute, for the cost model.

`ExpertOverlap` is a mixin of cost.CostModel: under ep with overlap on, the runtime runs two
microbatches' forwards (or backwards) as one program (`pairs_microbatches`), or, under the
interleaved 1F1B, a forward beside another microbatch's backward (`combines_forward_backward`);
`experts_overlapped` is the fraction of microbatch-chunks whose all-to-alls so run behind another's
compute, which part_times prices. The mixin reads the host's runtime and microbatches; the rules
mirror autopart/compiler.py's functions of the same names.
"""
from __future__ import annotations


class ExpertOverlap:
    """Mixin of CostModel: which layouts' expert all-to-alls run behind another microbatch. Each
    method takes a cost.Layout (not imported here: cost.py imports this module)."""

    def combines_forward_backward(self, lay) -> bool:
        """Whether autopart's runtime runs interleaved 1F1B's steady-state forwards beside the
        backward of another microbatch next to them, each side's all-to-alls behind the other's
        compute (autopart/compiler.py combines_forward_backward)."""
        return (self.runtime == "autopart" and lay.ep > 1 and lay.zero != 3 and lay.pp > 1
                and lay.schedule == "interleaved-1f1b")

    def experts_overlapped(self, lay) -> float:
        """The fraction of microbatch-chunks whose all-to-alls run behind another's compute: all
        when pairs_microbatches; under combines_forward_backward the steady state's on the first
        rank, whose (v - 1) * pp + 2 * (pp - 1) warmup forwards (Megatron's) and as many
        cooldown backwards run alone."""
        if self.pairs_microbatches(lay):
            return 1.0
        if not self.combines_forward_backward(lay):
            return 0.0
        total = self.microbatches(lay) * lay.virtual_stages
        warmup = (lay.virtual_stages - 1) * lay.pp + 2 * (lay.pp - 1)
        return max(0, total - warmup) / total

    def pairs_microbatches(self, lay) -> bool:
        """Whether autopart's runtime runs the microbatches two at a time, each pair's expert
        all-to-alls behind the other's compute (autopart/compiler.py pairs_microbatches)."""
        m = self.microbatches(lay)
        return (self.runtime == "autopart" and lay.ep > 1 and m % 2 == 0 and lay.zero != 3
                and lay.schedule in ("1f1b", "gpipe", "interleaved-1f1b")
                and not self.combines_forward_backward(lay)
                and (lay.schedule != "interleaved-1f1b" or (m // 2) % lay.pp == 0))
