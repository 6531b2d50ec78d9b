"""overlap_collectives: copy_to_tp and its linears fused into copy_linears_tp, whose backward
all-reduces the input gradient while the weight gradients compute. Equality with the plain model
on real ranks is the tensor-parallel suites' (the pass is on by default for tp > 1); here, the
op's gradients against the unfused ops', the order of its backward, and which nodes the pass
fuses. Fast tier: python -m pytest -m "not full" passes/test_overlap_collectives.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autopart
from autopart.ops import tp as tp_ops

aten = torch.ops.aten


class _Recorded:
    """A stand-in for torch.distributed.all_reduce on a tp group of 2 whose peer holds the same
    gradient: the sum is twice it. Logs when it starts and when it is waited on."""

    def __init__(self, log: list):
        self.log = log

    def __call__(self, x, group=None, async_op=False):
        self.log.append("all_reduce started")
        x.mul_(2)
        log = self.log

        class Work:
            def wait(self):
                log.append("all_reduce waited")
        return Work() if async_op else None


class _Matmuls(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            self.log.append(f"mm {tuple(args[-2].shape)}x{tuple(args[-1].shape)}")
        return func(*args, **(kwargs or {}))


def _comm():
    return tp_ops.TPComm(2, 0).bind(object(), 0)       # bound: its collectives are patched


def _operands(seed: int, shapes: list[tuple[int, int]], bias: list[bool]):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    wb = []
    for (n, k), b in zip(shapes, bias):
        wb += [torch.randn(n, k, generator=g, requires_grad=True),
               torch.randn(n, generator=g, requires_grad=True) if b else None]
    return x, wb


@pytest.mark.parametrize("shapes,bias", [([(12, 8)], [True]),
                                         ([(6, 8), (4, 8), (4, 8)], [False, True, False])])
def test_fused_op_gives_the_unfused_ops_values_and_gradients(monkeypatch, shapes, bias):
    """Against copy_to_tp followed by F.linear per weight (autograd's own backward), both
    all-reducing through the same stand-in: outputs and every gradient equal."""
    monkeypatch.setattr(tp_ops.dist, "all_reduce", _Recorded([]))
    results = []
    for fused in (True, False):
        x, wb = _operands(0, shapes, bias)
        if fused:
            outs = tp_ops.copy_linears_tp(x, _comm(), *wb)
        else:
            shared = tp_ops.copy_to_tp(x, _comm())
            outs = [F.linear(shared, w, b) for w, b in zip(wb[0::2], wb[1::2])]
        g = torch.Generator().manual_seed(1)
        sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
        results.append([*outs, x.grad, *(t.grad for t in wb if t is not None)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.isfinite(got).all()


def test_backward_waits_for_the_all_reduce_after_the_weight_gradients(monkeypatch):
    """Megatron's order: the input gradients' matmuls, the all-reduce started, the weight
    gradients' matmuls while it runs, then the wait. The unfused ops wait before any weight
    gradient is computed (their all-reduce starts after both of the linear's matmuls)."""
    logs = {}
    for fused in (True, False):
        log: list[str] = []
        monkeypatch.setattr(tp_ops.dist, "all_reduce", _Recorded(log))
        x, wb = _operands(0, [(6, 8), (4, 8)], [True, True])
        if fused:
            outs = tp_ops.copy_linears_tp(x, _comm(), *wb)
        else:
            shared = tp_ops.copy_to_tp(x, _comm())
            outs = [F.linear(shared, w, b) for w, b in zip(wb[0::2], wb[1::2])]
        loss = sum(o.sum() for o in outs)
        with _Matmuls(log):
            loss.backward()
        logs[fused] = log
    log = logs[True]
    start, wait = log.index("all_reduce started"), log.index("all_reduce waited")
    between = log[start + 1:wait]
    assert len(between) == 2 and all(e.startswith("mm") for e in between), log
    assert all(e.startswith("mm") for e in log[:start]) and len(log[:start]) == 2, log
    plain = logs[False]
    assert plain.index("all_reduce waited") == len(plain) - 1, plain       # nothing after it


def _compile(model, tp: int, **options):
    vocab = 128
    x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return autopart.compile(model, autopart.Mesh(tp=tp), (x,), loss_fn=loss, target=x, **options)


def _llama():
    import transformers as tf

    class Logits(torch.nn.Module):           # the logits of an unmodified HF Llama
        def __init__(self):
            super().__init__()
            cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=32)
            self.inner = tf.LlamaForCausalLM(cfg)

        def forward(self, idx):
            return self.inner(input_ids=idx).logits
    torch.manual_seed(0)
    return Logits()


def test_the_pass_fuses_each_f_with_the_linears_it_feeds():
    """HF Llama at tp=2: each attention's q, k and v share one f, each MLP's gate and up
    another; all fused, no copy_to_tp left in the rank's program. overlap=False keeps them."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the head stays replicated (its own warning)
        compiled = _compile(_llama(), 2)
        off = _compile(_llama(), 2, overlap=False)
    served = sorted(len(v) for v in compiled.program.overlap.values())
    assert served.count(3) == 2 and served.count(2) == 2, compiled.program.overlap
    code = compiled.programs[0].chunks[0].gm.code
    assert "copy_to_tp(" not in code and code.count("copy_linears_tp(") == len(served)
    assert off.program.overlap is None
    assert "copy_to_tp(" in off.programs[0].chunks[0].gm.code


def test_zero_bubble_schedules_leave_the_backward_unfused():
    """Under an I/W split the weight gradients run in W, apart from the all-reduce: no fusion."""
    from examples.gpt import GPT, lm_loss
    x = torch.zeros(4, 64, dtype=torch.long)
    compiled = autopart.compile(GPT("tiny"), autopart.Mesh(tp=2, pp=2), (x,), loss_fn=lm_loss,
                                target=x, microbatches=2, schedule="zb-h1")
    assert compiled.program.overlap is None
    assert "overlap_collectives" not in [p.name for p in compiled.passes]
