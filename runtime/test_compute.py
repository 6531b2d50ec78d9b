"""The compute actions (runtime/compute.py) on one chunk, without a schedule or processes: the
split programs, boxed, with W adding into .grad, leave what the fused forward and autograd's
backward leave. Whole steps through the executor are in runtime/test_executor.py."""
from __future__ import annotations

import torch

import autopart
from autopart.runtime import compute
from autopart.runtime.executable import executable
from autopart.runtime.compute import StepContext


def _split_ctx(chunk, mbs: int, seq: int, loss_scale: float) -> StepContext:
    return StepContext(chunks={chunk.chunk: chunk}, peer=None, microbatch=None, batch=mbs,
                       seq=seq, device=torch.device("cpu"), loss_scale=loss_scale)


def test_split_programs_are_boxed_and_w_accumulates_like_autograd():
    """The executor runs split_backward's programs boxed (their input list is emptied, so each
    input can be freed after its last use) and W adds each gradient into .grad itself: two
    microbatches through F, I, W leave in .grad, bit for bit, what the fused forward and
    autograd's backward leave, and the received tensors' gradients are the same."""
    from examples.gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=128, block_size=16))
    tokens, targets = torch.randint(0, 128, (8, 16)), torch.randint(0, 128, (8, 16))
    compiled = autopart.compile(model, autopart.Mesh(pp=2), (tokens,), loss_fn=lm_loss,
                                target=targets, microbatches=4, schedule="zb-h1")
    A = type("A", (), {})
    for chunk in (c for p in compiled.programs.values() for c in p.chunks):
        assert chunk.backward.fallback is None
        params = dict(chunk.gm.named_parameters())
        g = torch.Generator().manual_seed(chunk.chunk)
        feed = {"idx": tokens[:2], "target": targets[:2]}
        mbs = [([torch.randn(r.concrete_shape(2, 16), generator=g) for r in chunk.recvs],
                [] if chunk.is_last else [torch.randn(s.concrete_shape(2, 16), generator=g)
                                          for s in chunk.sends if s.differentiable])
               for _ in range(2)]
        results = []
        for path in ("fused", "split"):
            for p in params.values():
                p.grad = None
            ctx, in_grads = _split_ctx(chunk, 2, 16, 0.25), []
            ctx.microbatch = lambda i: feed
            for m, (recvs, grads) in enumerate(mbs):
                key = (chunk.chunk, m)
                ctx.acts[key] = [r.clone() for r in recvs]
                if grads:
                    ctx.grads_in[key] = list(grads)
                for kind in ("F", "B") if path == "fused" else ("F", "I", "W"):
                    action = A()
                    action.chunk, action.microbatch, action.kind = chunk.chunk, m, kind
                    {"fused": {"F": compute.forward, "B": compute.backward},
                     "split": {"F": compute.forward_split, "I": compute.input_grad_split,
                               "W": compute.weight_grad_split}}[path][kind](action, ctx)
                in_grads.append(ctx.grads_out.pop(key, []))
            assert not ctx.for_weight and not ctx.saved
            results.append(({n: p.grad.clone() for n, p in params.items() if p.grad is not None},
                            in_grads))
        (fused_p, fused_in), (split_p, split_in) = results
        assert fused_p.keys() == split_p.keys() and fused_p, f"chunk {chunk.chunk}"
        for n in fused_p:
            assert torch.equal(fused_p[n], split_p[n]), f"chunk {chunk.chunk}: {n}"
        for a, b in zip(sum(fused_in, []), sum(split_in, [])):
            assert torch.equal(a, b), f"chunk {chunk.chunk}: an input gradient"
        w = executable(chunk.backward.weight_grad, chunk.gm,
                                accumulate=chunk.backward.params)
        assert "args.clear()" in w.code and "_accumulate_grad" in w.code and \
            "return None" in w.code
