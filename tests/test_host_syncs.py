"""At most one host read of a device value per training step (issue 52, item 3), on a real
2-rank Gloo train_step of the tiny GPT with ignored labels (-100: the token count reads the
labels' values), each followed by an SGD step.

What is counted (tests/workers/host_syncs.py `Reads`): every call, on any tensor, of
`item`, `tolist`, `__bool__`, `__float__`, `__int__`, `__index__` (what `int(t)`, `float(t)`,
`if t:` and indexing by a tensor call), `numpy` and `cpu`, during a steady train_step (the
batch shapes of the step before). Reads made by C++ inside an op (`nonzero`, a tensor passed
where torch takes a Python number) are not seen. The one function allowed to read a tensor
that holds no device value is runtime/batches.py `host_sum`: it all-reduces host integers
(whether a rank refused its tensors, the sequence length) in a CPU tensor it made, over the
CPU group (Gloo; beside NCCL, a Gloo group of its own), so it never waits on a device; its
reads are counted apart and must be of CPU tensors, one per step.

Before this change a steady step read two device values under the default nonfinite="raise":
before it ran, the all-reduced [refused, token count, length, ...] (runtime/batches.py agree,
which held the token count and the embedding ids' range, both device values), and after it the
reduced [loss, non-finite flags]. Now the token count stays on the device (the loss scale is a
0-dim device tensor), the ids' range rides the [loss, flags, ids] all-reduce after the step, and
the step reads that one buffer once, in every nonfinite mode (the ids must be judged before the
optimizer steps).

The ids out of range on one rank are still refused on every rank with the message of before
(the rank given them names the input, the table, the ids and the remedy; the other rank names
the refusing rank), and nothing moves: the gradients and the step count are as before the
step, and an optimizer step after it leaves the parameters unchanged. That ignored labels still
give the plain model's loss and parameters is tests/test_token_loss.py's equivalence.

Fast tier: python -m pytest -m "not full" tests/test_host_syncs.py
"""
from __future__ import annotations

import math

import pytest

from tests.workers.host_syncs import STEADY_STEPS, host_sync_cases

STEP_READ = "tolist at state.py (step_results)"     # the reduced [loss, flags, ids out of range]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from autopart.runtime.launch import spawn
    return spawn(host_sync_cases, 2, timeout=420, pg_timeout=120)


def _case(ranks, name: str) -> list[dict]:
    out = [r[name] if name in r else {"raised": f"not reached: {r}"} for r in ranks]
    for r in out:
        assert "raised" not in r, r["raised"]
    return out


@pytest.mark.parametrize("name", ["dp2-raise", "dp2-skip", "dp2-ignore", "pp2-raise"])
def test_a_steady_step_reads_one_device_value(ranks, name):
    """Exactly one read of a device value per steady step on every rank (the step's verdict),
    under the default nonfinite="raise" and the other modes; the host values' agreement before
    the step reads its CPU tensor once."""
    for rank, r in enumerate(_case(ranks, name)):
        assert len(r["steps"]) == STEADY_STEPS
        for i, step in enumerate(r["steps"]):
            assert step["device"] == [STEP_READ], (name, rank, i, step["device"])
            assert step["host"] == [("tolist", "cpu")], (name, rank, i, step["host"])
            assert math.isfinite(step["loss"])
    losses = [[s["loss"] for s in r["steps"]] for r in _case(ranks, name)]
    assert losses[0] == losses[1], f"the ranks disagree on the loss: {losses}"
    assert losses[0][0] > losses[0][-1], f"SGD did not lower the loss: {losses[0]}"


@pytest.mark.parametrize("name", ["ids-raise", "ids-skip", "ids-ignore"])
def test_ids_out_of_range_on_one_rank_are_refused_on_every_rank_with_nothing_moved(ranks, name):
    r0, r1 = _case(ranks, name)
    assert r1["error"] is not None and r0["error"] is not None, (r0, r1)
    for words in ("train_step input 'idx' holds ids from 0 to 300, but it indexes the "
                  "embedding table transformer.wte.weight, which has 256 rows",
                  "use ids in [0, 256) (the model's vocabulary)", "at least 301 rows"):
        assert words in r1["error"], r1["error"]
        assert words in r0["error"], r0["error"]        # rank 1's error, quoted
    assert "rank(s) [1] refused the tensors they were given" in r0["error"], r0["error"]
    assert "(nothing moved)" in r0["error"]
    for r in (r0, r1):
        assert r["same_grads"] and r["same_params"], r
        assert r["steps"][0] == r["steps"][1] == 2, r["steps"]
        assert r["skipped"] == [], "an ids refusal is no skipped step"
        assert math.isfinite(r["after"])
    assert r0["after"] == r1["after"]


@pytest.mark.parametrize("count", [0, 1, 3, 7, 10, 49, 96, 1000, 12345, 2 ** 31 + 11])
def test_the_device_loss_scale_is_the_hosts_float(count):
    """The loss scale computed on the device (runtime/batches.py device_loss_scale, one rank:
    no group) multiplies a float32 loss exactly as the host's 1.0 / count did (0 for none)."""
    import torch
    from autopart.runtime.batches import device_loss_scale
    scale = device_loss_scale(torch.tensor(count), None, torch.device("cpu"))
    assert scale.dtype == torch.float32 and scale.dim() == 0
    host = 1.0 / count if count else 0.0
    loss = torch.tensor([2.7182817, 0.1, 123.456, 1e-8], dtype=torch.float32)
    assert torch.equal(loss * scale, loss * host)
    assert torch.equal(device_loss_scale(count, None, torch.device("cpu")), scale)   # an int
