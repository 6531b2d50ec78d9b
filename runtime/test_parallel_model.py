"""ParallelModel's API on real processes: train_step's contract (the global batch in, the
global mean loss out on every rank, reduced gradients left in .grad, no optimizer step), its
errors, parameters and named_parameters, program / explain, and full_state_dict with state beyond
trainable weights (frozen layers, buffers, a parameter forward never reads).

Numerical equivalence for every mesh and schedule is tests/test_equivalence.py; the executor
alone (threads, no processes) is runtime/test_executor.py.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import autopart
from autopart.runtime.launch import spawn
from tests.workers.common import Case, Extras, build
from tests.workers.equivalence import api_checks, equivalence


@pytest.fixture(scope="module")
def pp2():
    return spawn(api_checks, 2, timeout=300, pg_timeout=120)


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one Gloo rank in this process."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_train_step_returns_the_same_global_loss_on_every_rank(pp2):
    assert pp2[0]["loss"] == pp2[1]["loss"], "ranks disagree on the loss"
    assert pp2[0]["loss_shape"] == ()
    model, loss_fn, inputs, target = build(Case("api", model="extras"))
    with torch.no_grad():
        plain = float(loss_fn(model(*inputs), target))
    assert pp2[0]["loss"] == pytest.approx(plain, rel=1e-5)


def test_train_step_leaves_gradients_and_does_not_step(pp2):
    for r in pp2:
        assert r["params_unchanged"], f"rank {r['rank']}: train_step changed parameters"
        assert r["grads"] and all(r["grads"].values()), r["grads"]


@pytest.mark.parametrize("what,expected", [
    ("batch", "has batch 4, but the model was compiled for the global batch 8"),
    # the first stage reads no target: it names the last stage's refusal
    ("arity", "input 'target' is None, but this rank's chunks read it"),
    ("extra", "got 3 tensors (inputs and target) but the model was compiled with 2"),
])
def test_train_step_rejects_inputs_it_was_not_compiled_for(pp2, what, expected):
    for r in pp2:
        assert r["errors"][what].startswith("AutopartError: "), r["errors"][what]
        assert expected in r["errors"][what]


def test_parameters_are_this_ranks_share_under_plain_names(pp2):
    names = [set(r["grads"]) for r in pp2]
    assert not names[0] & names[1], "pp=2 without tied weights: no parameter on both ranks"
    trainable = set(pp2[0]["model_names"]) - {"frozen.weight", "frozen.bias"}
    assert names[0] | names[1] == trainable - {"unused.weight", "unused.bias"}
    assert all(r["named_is_parameters"] for r in pp2)


def test_program_and_explain(pp2):
    for rank, r in enumerate(pp2):
        assert r["chunks"] == [rank]
        assert f"# chunk {rank} on pipeline rank {rank}" in r["code"]
        assert "autopart_p2p_" in r["code"], "the transfers show in the rank's program"
        assert "schedule=1f1b" in r["explain"] and "Mesh(pp=2" in r["explain"]
    plan = [[line for line in r["explain"].splitlines() if not line.startswith("passes:")]
            for r in pp2]
    assert plan[0] == plan[1], "every rank explains the same plan (timings aside)"


def test_full_state_dict_has_every_key_on_every_rank(pp2):
    for r in pp2:
        assert r["state_keys"] == r["plain_state_keys"]
    assert "scale" in pp2[0]["state_keys"] and "shift" not in pp2[0]["state_keys"]
    assert "unused.weight" in pp2[0]["state_keys"] and "frozen.weight" in pp2[0]["state_keys"]


def test_extras_model_equals_plain_with_gradient_accumulation(one_rank):
    result = equivalence(Case("extras-pp1-m2", model="extras", microbatches=2, accumulate=2), 0)
    assert not result["problems"], "\n".join(result["problems"])


def test_parallelize_needs_a_process_group():
    assert not dist.is_initialized()
    model, loss_fn, inputs, target = build(Case("x", model="extras"))
    with pytest.raises(autopart.AutopartError, match="init_process_group"):
        autopart.parallelize(model, autopart.Mesh(), inputs, loss_fn=loss_fn, target=target)


def test_parallelize_of_a_meta_model_names_the_buffers_it_cannot_compute(one_rank):
    """A meta-device model is materialized rank by rank (autopart/materialize.py), which needs its
    buffers' values: Extras computes `scale` and `shift` in its constructor, next to children with
    parameters, so autopart cannot rebuild them and must say so, naming them and the remedy (a
    bare "meta device" would match any meta error, e.g. a missing reset_parameters). From
    scratch (seed=) at once; weights left to a later load, at the first train_step if no load
    filled them (persistent buffers come from a checkpoint)."""
    _, loss_fn, inputs, target = build(Case("x", model="extras"))
    with torch.device("meta"):
        model = Extras()
    message = (r"cannot compute the buffers \['scale', 'shift'\] of Extras at '<root>' on "
               r"the meta device: .*it has children with parameters, which a rebuild would "
               r"allocate too\..*remedy: .*pass init_fn=\.\.\. that fills it$")
    with pytest.raises(autopart.AutopartError, match="(?s)^" + message):
        autopart.parallelize(model, autopart.Mesh(), inputs, loss_fn=loss_fn, target=target,
                             seed=0)
    pm = autopart.parallelize(model, autopart.Mesh(), inputs, loss_fn=loss_fn, target=target)
    with pytest.raises(autopart.AutopartError, match="(?s)^train_step: " + message):
        pm.train_step(*inputs, target=target)
