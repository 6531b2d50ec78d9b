"""gather_parameters (zero=3): every node that reads a parameter runs between its group's gather
and release, every output of such a node re-gathers the group in the backward, a recomputed
region counts as a reader of the parameters passed to it, and what the pass cannot keep right
(the zero-bubble schedules' split backward) is refused. Which groups stay gathered past the
forward: the loss chunk's last ones always (free), more under a memory budget, as many as the
memory model says fit."""
from __future__ import annotations

import pytest
import torch

import autopart
from autopart.ops.zero import gather_params, regather_on_backward, release_params
from examples.gpt import GPT, GPTConfig, lm_loss


def _compile(microbatches_: int = 2, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=128, block_size=16))
    x = torch.randint(0, 128, (4, 16))
    return model, autopart.compile(model, autopart.Mesh(dp=2, **kw.pop("mesh", {})), (x,),
                                   loss_fn=lm_loss, target=x, microbatches=microbatches_, **kw)


def _check_chunk(gm, params: set[str]) -> dict:
    """Walk the program: which group is held at each node; return {group: readers}."""
    shards = gm.param_shards
    group_of = {name: g for g, names in enumerate(shards.groups) for name in names}
    held, readers, hooked = set(), {}, set()
    for node in gm.graph.nodes:
        if node.target is gather_params:
            held.add(node.args[1])
        elif node.target is release_params:
            assert node.kwargs.get("after", "forward") == shards.after[node.args[1]]
            if node.kwargs.get("after", "forward") == "forward":
                held.discard(node.args[1])
        elif node.target is regather_on_backward:
            hooked.add((node.args[0], node.args[2]))
        elif node.op == "call_function":
            for a in node.all_input_nodes:
                if a.op == "get_attr" and a.target in params:
                    g = group_of[a.target]
                    assert g in held, f"{node.name} reads {a.target} outside group {g}'s gather"
                    readers.setdefault(g, []).append(node)
    kept = {g for g, after in enumerate(shards.after) if after != "forward"}
    assert held == kept, f"groups {held - kept} never released"
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
    assert c.program.param_groups[0][2] == ("transformer.h.0", "forward")
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


def _kept(c) -> dict[str, str]:
    return {label: after for rows in c.program.param_groups.values() for label, after in rows
            if after != "forward"}


def test_the_loss_chunks_last_groups_stay_gathered_for_its_backward():
    """Without a budget only what costs no byte is kept: the groups the loss chunk releases after
    its last gather (the final norm; the token embedding tied to the output layer, read at both
    ends of the forward anyway). Its backward starts with them: freeing them would gather them
    again at once. The program says so where it would free them."""
    _, c = _compile(zero=3)
    assert _kept(c) == {"transformer.wte.weight": "backward",
                        "transformer.ln_f.bias, transformer.ln_f.weight": "backward"}
    code = c.programs[0].chunks[0].code
    assert code.count("after = 'backward'") == 2
    assert c.passes[-1].report == {"chunk 0": {"forward": 3, "backward": 2}}
    rows = c.to_json()["param_groups"]
    assert [g["freed_after"] for g in rows[0]["groups"]] == [
        "backward", "forward", "forward", "forward", "backward"]
    assert ("chunk 0: 5 groups; 2 kept to the backward: transformer.wte.weight, "
            "(transformer.ln_f.bias, transformer.ln_f.weight); 3 freed after the forward"
            ) in c.explain()
    _, pp = _compile(zero=3, mesh=dict(pp=2), microbatches_=2)
    assert _kept(pp) == {"transformer.wte.weight": "backward"}       # the last chunk only
    assert pp.program.param_groups[1][-1] == ("transformer.wte.weight", "backward")


def test_a_budget_keeps_the_most_groups_the_memory_model_says_fit():
    """Under memory_budget the pass keeps, per pipeline rank, every group for the step when that
    fits and there are several microbatches (one gather per step instead of two per microbatch),
    else the most groups to the backward, last first; the memory table (which the budget check
    reads) stays within the budget at each, and keeping more never costs fewer bytes."""
    _, free = _compile(zero=3)
    _, whole = _compile(zero=3, memory_budget=10**9)
    assert set(_kept(whole).values()) == {"step"}
    assert len(_kept(whole)) == len(whole.program.param_groups[0])
    assert "after = 'step'" in whole.programs[0].chunks[0].code
    assert whole.memory[0]["params"] > free.memory[0]["params"]
    # one microbatch: nothing to keep across; every group to its backward instead
    _, one = _compile(zero=3, memory_budget=10**9, microbatches_=1)
    assert set(_kept(one).values()) == {"backward"} and len(_kept(one)) == 5
    # a budget between: more than the free keeps, fewer than all, and within it
    budget = (free.memory[0]["total"] + whole.memory[0]["total"]) // 2
    _, mid = _compile(zero=3, memory_budget=budget)
    assert set(_kept(free)) < set(_kept(mid)) and set(_kept(mid).values()) == {"backward"}
    assert mid.memory[0]["total"] <= budget
    # pipelines: each rank decides for its own chunks
    _, pp = _compile(zero=3, mesh=dict(pp=2), microbatches_=2, memory_budget=10**9)
    assert {after for rows in pp.program.param_groups.values() for _, after in rows} == {"step"}
