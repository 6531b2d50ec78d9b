"""Rank functions for the recomputation and memory-model tests (spawned; module level so the rank
processes can import them).

`recompute_bitwise`: the same model trained with recompute none and with selective/full gives
bitwise-equal losses, gradients and parameters (dropout on: torch's checkpoint replays the RNG).

`measure_memory`: what the process keeps during a real training step, measured, beside what
`compiled.memory[rank]` predicted:
  activations  the peak of bytes autograd keeps for backward: torch.autograd.graph.saved_tensors_hooks
               over the whole train_step, each storage counted once while any saved reference to
               it is alive (weights excluded), plus, while a recomputed region reruns in backward,
               the storages its rerun saves (counted by a hook pushed on top of checkpoint's own,
               delegating to it), plus what the split I/W programs of zero-bubble schedules keep
               outside autograd (the executor's ctx.saved from F to I and ctx.for_weight from I
               to W, counted while the executor holds them: _Held). Why hooks, not the
               profiler's memory events: the hooks count exactly what backward needs, and not the transient temporaries (gradient buffers,
               matmul outputs) that come and go inside one op, which the model does not claim;
  state        the storages of the rank's parameters and buffers, their .grad, and every tensor
               in the optimizer's state, after the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MemCase:
    name: str
    model: str = "gpt"            # gpt | hf | hf-eager (matmul-softmax-matmul attention)
    pp: int = 1
    dp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 4
    batch: int = 8
    seq: int = 16
    recompute: str = "none"
    optimizer: str = "adam"
    n_layer: int = 4
    dropout: float = 0.0
    sequence_parallel: bool = False
    zero: int = 0
    precision: str = "fp32"

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp


def build(case: MemCase, seed: int = 0):
    torch.manual_seed(seed)
    if case.model == "gpt":
        from examples.gpt import GPT, GPTConfig, lm_loss
        cfg = GPTConfig(n_layer=case.n_layer, n_head=4, n_embd=32, vocab_size=128,
                        block_size=case.seq, dropout=case.dropout)
        model, loss_fn, vocab = GPT(cfg), lm_loss, 128
    else:
        import transformers
        from tests.workers.common import hf_loss
        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(n_layer=case.n_layer, n_embd=64, n_head=4, vocab_size=256,
                                      n_positions=64, resid_pdrop=case.dropout,
                                      embd_pdrop=case.dropout, attn_pdrop=case.dropout,
                                      bos_token_id=0, eos_token_id=0)
        if case.model == "hf-eager":
            cfg._attn_implementation = "eager"
        model, loss_fn, vocab = transformers.GPT2LMHeadModel(cfg), hf_loss, 256
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
    y = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
    return model, loss_fn, x, y


def _parallelize(case: MemCase, recompute: str | None = None):
    import autopart
    model, loss_fn, x, y = build(case)
    mesh = autopart.Mesh(pp=case.pp, dp=case.dp, tp=case.tp)
    pm = autopart.parallelize(model, mesh, (x,), loss_fn=loss_fn, target=y,
                              microbatches=case.microbatches, schedule=case.schedule,
                              virtual_stages=case.virtual_stages,
                              sequence_parallel=case.sequence_parallel,
                              recompute=recompute or case.recompute, optimizer=case.optimizer,
                              timeout=timedelta(seconds=120), zero=case.zero,
                              **({"precision": case.precision} if case.precision != "fp32" else {}))
    return pm, x, y


def _optimizer(kind: str, params):
    params = list(params)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


# -- bitwise equality with the run without recomputation ----------------------------------------

def _train(case: MemCase, recompute: str, steps: int = 2) -> dict:
    pm, x, y = _parallelize(case, recompute)
    opt = _optimizer(case.optimizer, pm.parameters())
    torch.manual_seed(1234)          # the same dropout stream for every run
    losses, grads = [], {}
    for step in range(steps):
        losses.append(pm.train_step(x, target=y).detach().clone())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
        opt.step(), opt.zero_grad()
    regions = sum(1 for c in pm.program.chunks for n in c.gm.graph.nodes
                  if n.op == "call_function" and n.target is torch.utils.checkpoint.checkpoint)
    return {"losses": losses, "grads": grads, "regions": regions,
            "params": {n: p.detach().clone() for n, p in pm.named_parameters()}}


def recompute_bitwise(rank: int, world: int, cases: list) -> list[dict]:
    """Per case and mode: what differs bitwise from recompute='none' (nothing, when correct)."""
    out = []
    for case, modes in cases:
        ref = _train(case, "none")
        for mode in modes:
            got = _train(case, mode)
            problems = []
            for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                if not torch.equal(a, b):
                    problems.append(f"step {i + 1} loss {float(a)!r} != {float(b)!r}")
            for what in ("grads", "params"):
                if set(got[what]) != set(ref[what]):
                    problems.append(f"{what}: names differ")
                for n, t in ref[what].items():
                    if n in got[what] and not torch.equal(got[what][n], t):
                        err = (got[what][n] - t).abs().max().item()
                        problems.append(f"{what} {n} differs (max {err:.3g})")
            out.append({"case": case.name, "mode": mode, "rank": rank, "problems": problems,
                        "regions": got["regions"], "loss": float(ref["losses"][0])})
    return out


# -- measured memory -----------------------------------------------------------------------------

class _Live:
    """Bytes of storages alive through saved references, and their peak."""

    def __init__(self, weights: set):
        self.weights, self.refs, self.size = weights, {}, {}
        self.live = self.peak = 0

    def add(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if not key or key in self.weights:
            return None
        if key not in self.refs:
            self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        return key

    def drop(self, key) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.size.pop(key)
            del self.refs[key]


class _Saved:
    """What the pack hook hands autograd: the tensor, and its storage released when dropped."""
    __slots__ = ("t", "key", "live")

    def __init__(self, t, live: _Live):
        self.t, self.live, self.key = t, live, live.add(t)

    def __del__(self):
        if self.key is not None:
            self.live.drop(self.key)


class _CountRerun(nn.Module):
    """Wraps a recomputed region: when checkpoint reruns it in backward, pushes a pack hook on top
    of checkpoint's own (delegating to it) that counts the storages the rerun saves, and records
    live + those as a candidate peak."""

    def __init__(self, inner: nn.Module, live: _Live):
        super().__init__()
        self.inner, self.live = inner, live

    def forward(self, *args):
        if torch._C._current_graph_task_id() == -1:          # the forward pass: as it is
            return self.inner(*args)
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        held = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        extra = {}

        def count(t):
            key = t.untyped_storage().data_ptr()
            if key and key not in held and key not in self.live.weights:
                extra[key] = t.untyped_storage().nbytes()
            return pack(t)
        torch._C._autograd._push_saved_tensors_default_hooks(count, unpack)
        try:
            return self.inner(*args)
        finally:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.live.peak = max(self.live.peak, self.live.live + sum(extra.values()))


class _Held(dict):
    """The executor's ctx.saved or ctx.for_weight under measurement: while it holds a
    microbatch's values, their storages count as live (split programs run with autograd off and
    keep what backward reads here, where the saved-tensor hooks cannot see it)."""

    def __init__(self, live: _Live):
        super().__init__()
        self.live, self.held = live, {}

    def __setitem__(self, key, value) -> None:
        self._release(key)
        super().__setitem__(key, value)
        tensors = [t for t in (value or ()) if isinstance(t, torch.Tensor)]
        self.held[key] = [k for k in map(self.live.add, tensors) if k is not None]

    def pop(self, key, *default):
        self._release(key)
        return super().pop(key, *default)

    def _release(self, key) -> None:
        for k in self.held.pop(key, ()):
            self.live.drop(k)


def _instrument_split(live: _Live):
    """Make every StepContext's saved / for_weight a _Held (patches runtime/step.py's
    run_actions for the duration of the returned context)."""
    from unittest import mock

    import autopart.runtime.step as step

    run = step.run_actions

    def counted(actions, ctx):
        ctx.saved, ctx.for_weight = _Held(live), _Held(live)
        return run(actions, ctx)
    return mock.patch.object(step, "run_actions", counted)


def _instrument_reruns(pm, live: _Live) -> None:
    from autopart.runtime.executable import executable
    for c in pm.program.chunks:
        fast = executable(c.gm)
        for name, sub in list(fast.named_children()):
            if isinstance(sub, torch.fx.GraphModule) and "recompute_" in name:
                setattr(fast, name, _CountRerun(sub, live))


def _storages(tensors) -> int:
    return sum(_storage_map(tensors).values())


def measure_memory(rank: int, world: int, cases: list) -> list[dict]:
    out = []
    for case in cases:
        pm, x, y = _parallelize(case)
        opt = _optimizer(case.optimizer, pm.parameters())
        pm.train_step(x, target=y)                 # step 1: the optimizer's state exists after
        opt.step(), opt.zero_grad(set_to_none=True)
        held = [t for c in pm.program.chunks for t in list(c.gm.parameters()) + list(c.gm.buffers())]
        live = _Live({t.untyped_storage().data_ptr() for t in held})
        _instrument_reruns(pm, live)
        from autopart.runtime.executor import PATHS
        PATHS.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, live), lambda s: s.t), \
                _instrument_split(live):
            pm.train_step(x, target=y)
        measured = {
            "params": _storages(held),
            "grads": _storages(p.grad for p in pm.parameters()),
            "optimizer": _storages(v for st in opt.state.values() for v in st.values()),
            "activations": live.peak}
        out.append({"case": case.name, "rank": rank, "measured": measured,
                    "predicted": pm.compiled.memory[rank],
                    "coords": pm.coords,
                    "split": sum(n for (path, _), n in PATHS.items() if path == "split")})
        opt.step(), opt.zero_grad(set_to_none=True)
    return out


def measure_state(rank: int, world: int, cases: list) -> list[dict]:
    """After a step: the bytes of the distinct storages of this rank's parameters and buffers,
    their .grad, the tensors the optimizer steps that are not parameters (master copies) and
    every tensor in its state (pm.optimizer(torch.optim.Adam): with zero=1 the distributed
    optimizer), beside compiled.memory[rank]'s prediction of each."""
    out = []
    for case in cases:
        pm, x, y = _parallelize(case)
        opt = pm.optimizer(torch.optim.Adam, lr=1e-3)
        pm.train_step(x, target=y)                 # step 1 makes the optimizer's state
        opt.step(), opt.zero_grad()
        pm.train_step(x, target=y)
        held = _storage_map(t for c in pm.program.chunks
                            for t in list(c.gm.parameters()) + list(c.gm.buffers()))
        stepped = _storage_map(p for g in opt.param_groups for p in g["params"])
        measured = {"params": sum(held.values()),
                    "grads": _storages(p.grad for p in pm.parameters()),
                    "master": sum(v for k, v in stepped.items() if k not in held),
                    "optimizer": _storages(v for st in opt.state.values() for v in st.values())}
        out.append({"case": case.name, "rank": rank, "measured": measured,
                    "predicted": {k: pm.compiled.memory[rank][k] for k in measured}})
        opt.step(), opt.zero_grad()
    return out


def _storage_map(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor) and t.numel()}


def saved_per_layer(rank: int, world: int, n_layer: int = 4, seq: int = 64, batch: int = 2,
                    hidden: int = 64, heads: int = 4) -> dict:
    """Measured bytes autograd keeps per layer of the example GPT for none/selective/full
    (pp=1): the saved bytes of an n_layer model minus those of a 1-layer one, over n_layer - 1."""
    import autopart
    from examples.gpt import GPT, GPTConfig, lm_loss
    out = {}
    for mode in ("none", "selective", "full"):
        peaks = {}
        for layers in (1, n_layer):
            torch.manual_seed(0)
            cfg = GPTConfig(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=128,
                            block_size=seq)
            x = torch.randint(0, 128, (batch, seq))
            pm = autopart.parallelize(GPT(cfg), autopart.Mesh(), (x,), loss_fn=lm_loss, target=x,
                                      recompute=mode, timeout=timedelta(seconds=60))
            held = list(pm.parameters())
            live = _Live({t.untyped_storage().data_ptr() for t in held})
            with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, live),
                                                          lambda s: s.t):
                pm.train_step(x, target=x)
            peaks[layers] = live.peak
        out[mode] = (peaks[n_layer] - peaks[1]) / (n_layer - 1)
    return out


__all__ = ["MemCase", "build", "recompute_bitwise", "measure_memory", "saved_per_layer"]
