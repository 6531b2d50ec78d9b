"""The planner knows issue 52's expert all-to-all overlap (passes/overlap_experts.py): under
autopart's runtime, with ep > 1 and an even number of microbatches, each all-to-all is hidden up
to the other microbatch's compute of the part, and the pipeline runs microbatches / 2 units of
two (its bubble, and twice the activations in flight per unit). Megatron-LM's runtime is priced
as before. Fast tier: python -m pytest tests/test_planner_ep_overlap.py
"""
from __future__ import annotations

from pathlib import Path

import pytest

from autopart.planner.cluster import PRESETS
from autopart.planner.cost import CostModel, Layout
from autopart.planner.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent
SELENE = PRESETS["a100-80gb-selene"]


@pytest.fixture(scope="module")
def profile():
    return load_profile(str(ROOT / "examples" / "switch.py") + ":SwitchGPT", "tiny")


def test_the_all_to_all_is_hidden_up_to_the_other_microbatchs_compute(profile):
    model = CostModel(profile, SELENE, 16)
    part = profile.parts[(1, 2)]["layer"]
    f, b, comm = model.part_times(part, 1, 1, 2)
    pf, pb, pcomm = model.part_times(part, 1, 1, 2, paired=True)
    a2a = comm / 2                      # the part's only communication at tp=1: two all-to-alls
    assert a2a > 0 and pcomm == comm
    assert pf == pytest.approx(f - a2a + max(0.0, a2a - (f - a2a)))
    assert pb == pytest.approx(b - a2a + max(0.0, a2a - (b - a2a)))
    assert pf < f and pb < b


def test_a_paired_layout_steps_faster_at_pp1_and_holds_twice_the_microbatches_per_unit(profile):
    model = CostModel(profile, SELENE, 16)
    lay = Layout(1, 1, 2, 2, ep=2, recompute="none")         # 4 microbatches per replica
    assert model.pairs_microbatches(lay)
    paired = model.estimate(lay)
    model.pairs_microbatches = lambda lay: False              # the same layout, not paired
    plain = model.estimate(lay)
    assert paired.step_time < plain.step_time
    assert paired.memory["activations"] >= plain.memory["activations"]
    assert not CostModel(profile, SELENE, 6).pairs_microbatches(Layout(1, 1, 2, 1, ep=2))  # m=3
    megatron = CostModel(profile, SELENE, 16, runtime="megatron")
    assert not megatron.pairs_microbatches(lay)


def test_under_interleaved_pp_the_steady_states_all_to_alls_are_hidden(profile):
    """pp > 1 with the interleaved 1F1B: forwards beside other microbatches' backwards
    (combines_forward_backward), not pairs; the steady state's share hidden (8 microbatches x 2
    chunks, rank 0's (2 - 1) * 2 + 2 * (2 - 1) = 4 warmup forwards alone); the same activations
    as the same layout with nothing overlapped, and a faster step."""
    model = CostModel(profile, SELENE, 32)
    lay = Layout(1, 2, 2, 2, virtual_stages=2, schedule="interleaved-1f1b", ep=2,
                 recompute="none")                       # pp=2, 8 microbatches per replica
    assert model.combines_forward_backward(lay) and not model.pairs_microbatches(lay)
    assert model.experts_overlapped(lay) == pytest.approx((16 - 4) / 16)
    combined = model.estimate(lay)
    model.combines_forward_backward = lambda lay: False
    model.pairs_microbatches = lambda lay: False
    plain = model.estimate(lay)
    assert combined.step_time < plain.step_time
    assert combined.memory["activations"] == plain.memory["activations"]
    assert not model.combines_forward_backward(Layout(1, 2, 2, 2, ep=2))     # 1f1b: pairs
    assert not CostModel(profile, SELENE, 32, runtime="megatron").combines_forward_backward(lay)
