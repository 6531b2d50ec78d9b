"""How far two equally valid bf16 recipes differ, per parameter: the noise that
tests/workers/precision.py `PARAM_BOUNDS` is set from. Plain torch in one process, no autopart.

The base is the recipe tests/workers/precision.py writes out (`reference_step`: autocast bf16
per microbatch, fp32 loss, gradients and SGD). Each variant changes one thing the recipe leaves
open, as a parallel run does:
  cut       the hidden state rounded to bf16 (and its gradient) entering the third of four
            layers, as a bf16 pipeline transfer does
  chunks    microbatches of twice the rows: other GEMM shapes, which bf16 kernels block
            differently, and another order of the fp32 sums
  splitk    every matmul as two halves over its inner dimension, each rounded to bf16 and
            summed in bf16: what a row-parallel tp layer does before its all-reduce
  fp32attn  attention's scores, softmax and output in fp32 from the bf16 q, k, v: what
            context parallelism's ring attention does
  compiled  the model through torch.compile (Inductor's fused bf16 kernels round elsewhere)
and `fp32` is the plain fp32 model (the gap the guard measures, not a bf16 recipe). For each,
the largest relative error over the parameters, ||variant - base|| / ||base|| per parameter, of
the step-1 gradient and of the parameters' change over 3 SGD steps (lr 0.1).

    python -m tests.workers.recipe_noise c-gpt-tied c-hf-gpt2-tied c-hf-mixtral-untied
    python -m tests.workers.recipe_noise --compiled c-gpt-tied c-hf-gpt2-tied
"""
from __future__ import annotations

import contextlib
import copy
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tests.workers.common import build
from tests.workers.precision import _WireRound, _rel, reference_step


class SplitK(TorchFunctionMode):
    """F.linear and torch.addmm (HF's Conv1D) as two bf16 halves over K, added in bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (F.linear, torch.addmm):
            return func(*args, **kwargs)
        if func is F.linear:
            x, w, b = args[0], args[1].t(), args[2] if len(args) > 2 else kwargs.get("bias")
        else:
            b, x, w = args[:3]
        k = x.shape[-1] // 2
        with torch._C.DisableTorchFunction():
            y = torch.matmul(x[..., :k], w[:k]) + torch.matmul(x[..., k:], w[k:])
            return y if b is None else y + b.to(y.dtype)


class Fp32Attention(TorchFunctionMode):
    """scaled_dot_product_attention in fp32 from its (bf16) inputs, its output back in bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        with torch._C.DisableTorchFunction(), torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), *args[3:],
                                                 **kwargs)
        return out.to(q.dtype)


def _train(model, data, microbatch: int, variant: str, steps: int = 3):
    """(step-1 gradients, change over `steps` steps) by name, under the recipe's `variant`."""
    loss_fn, inputs, target = data
    m = copy.deepcopy(model)
    if variant == "cut":     # the layer that starts the second half (4 layers: the third)
        blocks = [mod for mod in m.modules() if isinstance(mod, torch.nn.ModuleList)][0]
        blocks[len(blocks) // 2].register_forward_pre_hook(
            lambda mod, a: (_WireRound.apply(a[0]), *a[1:]))
    run = torch.compile(m) if variant == "compiled" else m
    mode = {"splitk": SplitK, "fp32attn": Fp32Attention}.get(variant)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    first = {n: p.detach().clone() for n, p in m.named_parameters()}
    for step in range(steps):
        if variant == "fp32":
            loss_fn(m(*inputs), target).backward()
        else:
            with mode() if mode else contextlib.nullcontext():
                reference_step(run, inputs, target, loss_fn, microbatch, "cpu")
        if step == 0:
            grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                     for n, p in m.named_parameters()}
        opt.step(), opt.zero_grad()
    return grads, {n: p.detach() - first[n] for n, p in m.named_parameters()}


def noise(model_name: str, variants: list[str], ignored: str = "", dp: int = 1) -> dict:
    """{variant: (grad max, its parameter, update max, its parameter)} for one matrix model
    at 4 microbatches per replica (the microbatch the matrix's reference uses)."""
    from tests.composition import CCase
    case = CCase(name="noise", model=model_name, pp=2, dp=dp, microbatches=4, ignored=ignored)
    model, loss_fn, inputs, target = build(case)
    mbs = case.batch // (dp * case.microbatches)
    base = _train(model, (loss_fn, inputs, target), mbs, "base")
    out = {}
    for v in variants:
        got = _train(model, (loss_fn, inputs, target), mbs * 2 if v == "chunks" else mbs, v)
        errs = [{n: _rel([a[n]], [b[n]]) for n in b} for a, b in zip(got, base)]
        worst = [max(e, key=e.get) for e in errs]
        out[v] = (errs[0][worst[0]], worst[0], errs[1][worst[1]], worst[1])
    return out


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    compiled = "--compiled" in argv
    variants = ["compiled", "fp32"] if compiled else ["cut", "chunks", "splitk", "fp32attn",
                                                      "fp32"]
    for name in (a for a in argv if not a.startswith("--")):
        for ignored, dp in (("", 1), ("uneven", 2)):
            for v, (g, gn, u, un) in noise(name, variants, ignored, dp).items():
                print(f"{name} {'ignored' if ignored else 'all'} dp{dp} {v:9s} grad max {g:.3g} "
                      f"({gn})  update max {u:.3g} ({un})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
