"""analyze_costs: costs are per rank after sharding, and autopart's own collectives cost no
compute (they used to be costed as elementwise work when recognised by a module string)."""
from __future__ import annotations

import torch

from autopart.analysis import evaluate
from autopart.capture import capture
from autopart.ops import op_info
from autopart.passes.analyze_costs import analyze_costs
from autopart.passes.shard_experts import shard_experts
from autopart.passes.split_tensor_parallel import split_tensor_parallel
from examples.gpt import GPT, config, lm_loss
from examples.switch import SwitchGPT
from examples.switch import config as switch_config
from examples.switch import example_inputs


def _gpt_program():
    x = torch.randint(0, 256, (2, 64))
    return capture(GPT(config("tiny,n_layer=2")), (x,), loss_fn=lm_loss, target=x)


def test_a_linear_split_over_tp_costs_half_per_rank():
    program = _gpt_program()
    whole, _ = analyze_costs(program)
    split, report = analyze_costs(split_tensor_parallel(program, tp=2)[0])
    assert report["nodes"] == len(split.costs)
    # the MLP's first linear (column-parallel, n_embd -> 4*n_embd): 2 * b*s * n_embd * 4*n_embd
    # FLOPs, halved per rank
    b, s, h = 1, 64, 64
    nodes = {n.name: n for n in program.gm.graph.nodes}
    name = next(n for n in split.tp.column if nodes[n].meta["val"].shape[-1] == 4 * h)
    assert evaluate(whole.costs[name].flops, b, s) == 2 * b * s * h * 4 * h
    assert evaluate(split.costs[name].flops, b, s) == b * s * h * 4 * h


def test_collectives_cost_no_compute():
    program, _ = split_tensor_parallel(_gpt_program(), tp=2)
    costs = analyze_costs(program)[0].costs
    comm = [n for n in program.gm.graph.nodes
            if n.op == "call_function" and op_info(n.target) is not None]
    assert comm, "the tp pass inserted collectives"
    assert all(costs[n.name].flops == 0 and costs[n.name].bytes_moved == 0 for n in comm)


def test_expert_all_to_alls_cost_no_compute():
    cfg = switch_config("tiny,n_layer=2")
    program, _ = shard_experts(capture(SwitchGPT(cfg), example_inputs(cfg, 2)), ep=2)
    program, _ = split_tensor_parallel(program, tp=1)
    costs = analyze_costs(program)[0].costs
    a2a = [n for n in program.gm.graph.nodes if n.op == "call_function"
           and op_info(n.target) is not None and op_info(n.target).axis == "ep"
           and op_info(n.target).communicates]
    assert {op_info(n.target).name for n in a2a} >= {"dispatch_to_experts", "combine_from_experts"}
    assert all(costs[n.name].flops == 0 for n in a2a)
