"""gather_parameters (zero=3): every node that reads a parameter runs between its group's gather
and release, every output of such a node re-gathers the group in the backward, a recomputed
region counts as a reader of the parameters passed to it, and what the pass cannot keep right
(the zero-bubble schedules' split backward) is refused."""
from __future__ import annotations

import pytest
import torch

import autopart
from autopart.ops.zero import gather_params, regather_on_backward, release_params
from examples.gpt import GPT, GPTConfig, lm_loss


def _compile(**kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=128, block_size=16))
    x = torch.randint(0, 128, (4, 16))
    return model, autopart.compile(model, autopart.Mesh(dp=2, **kw.pop("mesh", {})), (x,),
                                   loss_fn=lm_loss, target=x, microbatches=2, **kw)


def _check_chunk(gm, params: set[str]) -> dict:
    """Walk the program: which group is held at each node; return {group: readers}."""
    shards = gm.param_shards
    group_of = {name: g for g, names in enumerate(shards.groups) for name in names}
    held, readers, hooked = set(), {}, set()
    for node in gm.graph.nodes:
        if node.target is gather_params:
            held.add(node.args[1])
        elif node.target is release_params:
            held.discard(node.args[1])
        elif node.target is regather_on_backward:
            hooked.add((node.args[0], node.args[2]))
        elif node.op == "call_function":
            for a in node.all_input_nodes:
                if a.op == "get_attr" and a.target in params:
                    g = group_of[a.target]
                    assert g in held, f"{node.name} reads {a.target} outside group {g}'s gather"
                    readers.setdefault(g, []).append(node)
    assert not held, f"groups {held} never released"
    views = {torch.ops.aten.t.default, torch.ops.aten.view.default,
             torch.ops.aten.transpose.int}
    checked = 0
    for g, nodes in readers.items():
        for node in nodes:
            if isinstance(node.meta.get("val"), torch.Tensor) and node.target not in views:
                assert (node, g) in hooked, f"{node.name}'s backward does not re-gather group {g}"
                checked += 1
    assert checked >= len(readers)
    return readers


def test_every_reader_runs_between_gather_and_release():
    model, c = _compile(zero=3)
    params = {n for n, _ in model.named_parameters()}
    gm = c.programs[0].chunks[0].gm
    groups = gm.param_shards.groups
    # one group per layer, the embeddings and the final norm (weight and bias) on their own
    assert [len(g) for g in groups] == [1, 1, 12, 12, 2]
    assert sorted(n for g in groups for n in g) == sorted(params)
    readers = _check_chunk(gm, params)
    assert set(readers) == set(range(len(groups)))
    assert c.program.param_groups[0][2] == "transformer.h.0"
    assert "gather_params" in c.programs[0].chunks[0].code


def test_a_recomputed_region_reads_its_parameters_gathered():
    model, c = _compile(zero=3, recompute="full")
    gm = c.programs[0].chunks[0].gm
    calls = [n for n in gm.graph.nodes if n.target is torch.utils.checkpoint.checkpoint]
    assert len(calls) == 2
    readers = _check_chunk(gm, {n for n, _ in model.named_parameters()})
    assert all(any(call in nodes for nodes in readers.values()) for call in calls)


def test_lower_levels_leave_the_program_alone():
    _, c = _compile(zero=2)
    assert c.program.param_groups is None or c.program.param_groups == {}
    assert not hasattr(c.programs[0].chunks[0].gm, "param_shards")


def test_zero3_refuses_a_split_backward_schedule():
    with pytest.raises(autopart.AutopartError, match=r"(?s)zero=3 with schedule='zb-v'.*remedy"):
        _compile(zero=3, mesh=dict(pp=2), schedule="zb-v", virtual_stages=2)


def test_only_parameters_read_by_matmuls_are_gathered_in_bf16():
    """Under precision="bf16" a group's all-gather moved bf16 for every parameter: a norm's
    weight or an embedding (read in fp32 under autocast, as the bf16 recipe reads them) then saw
    its bf16 rounding (zero=3 gpt dp=2 bf16: step-1 update 4e-3 off the recipe, as far as fp32
    is). Only the parameters every reader of which is an op autocast runs in bf16 (the example
    GPT's linears: attention and MLP weights and biases) are marked; the layer norms, position
    embedding and the token embedding tied to the output layer (read by embedding) are not."""
    model, c = _compile(zero=3, precision="bf16")
    reduced = set(c.programs[0].chunks[0].gm.param_shards.reduced)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    want = {f"{m}.{p}" for m in linears for p in ("weight", "bias")
            if getattr(model.get_submodule(m), p, None) is not None} - {"lm_head.weight"}
    assert reduced == want, (sorted(reduced ^ want))
    assert not any("ln" in n or "wte" in n or "wpe" in n for n in reduced)
