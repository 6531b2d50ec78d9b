"""Rank functions for tests/test_memory_scale.py: models built on the meta device, initialized
from scratch or loaded from a checkpoint of the plain model, trained against the plain model.

The plain reference is built here from its definition (a real model seeded like the checkpoint
the test process wrote, or autopart.materialize of a meta model for from-scratch runs) and
trained with the same torch optimizer on the same batch; the rank returns plain data (problems,
bytes) and the test process asserts on it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from tests.workers.common import each_case, ATOL, RTOL, SWITCH_SPECS, _compare, gpt_config, hf_loss


@dataclass(frozen=True)
class MetaCase:
    name: str
    model: str = "gpt"           # gpt | switch | llama (Hugging Face LlamaForCausalLM)
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    microbatches: int = 2
    source: str = ""             # checkpoint the test process wrote; "" = from scratch only
    steps: int = 3
    optim: str = "sgd"           # sgd (momentum) | adamw
    zero: int = 0
    gather_to: int = -1          # >= 0: after training, full_state_dict(rank=gather_to) checked
    count_allocs: bool = False   # record the largest tensor allocated in parallelize / training

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp


def construct(case: MetaCase) -> tuple[nn.Module, object]:
    """(model, loss_fn) built under the current device context (meta or real)."""
    if case.model in ("gpt", "gpt-wide"):
        import dataclasses
        from examples.gpt import GPT, lm_loss
        cfg = gpt_config(4)
        if case.model == "gpt-wide":   # weights larger than any activation of the test batch
            cfg = dataclasses.replace(cfg, n_layer=2, n_embd=256)
        if case.optim == "adamw":
            # Key biases have exactly-zero true gradients (softmax ignores a shift of the scores),
            # so Adam turns their round-off into updates of up to +-lr in any two runs that sum
            # in different orders: without biases the comparison tests the optimizer, not that.
            cfg = dataclasses.replace(cfg, bias=False)
        return GPT(cfg), lm_loss
    if case.model == "switch":
        from examples.switch import SwitchGPT, config
        return SwitchGPT(config(SWITCH_SPECS["switch"])), None
    if case.model == "llama":
        import transformers
        transformers.logging.set_verbosity_error()
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=False, use_cache=False)
        return transformers.LlamaForCausalLM(cfg), hf_loss
    raise ValueError(case.model)


def plain(case: MetaCase, seed: int = 0) -> nn.Module:
    """The plain model whose checkpoint the test saved: real weights, seeded."""
    torch.manual_seed(seed)
    return construct(case)[0]


def batch(case: MetaCase):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 128, (8, 16), generator=g)
    y = torch.randint(0, 128, (8, 16), generator=g)
    if case.model == "switch":        # the model takes the target and returns its own loss
        return (x, y), None
    return (x,), y


def save_checkpoint(case: MetaCase, path: str, kind: str) -> None:
    """The plain model's weights as `kind`: safetensors | torch | hf (save_pretrained dir)."""
    model = plain(case)
    if kind == "hf":
        model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    elif kind == "safetensors":
        from safetensors.torch import save_model
        save_model(model, path)          # keeps one name of a tied pair
    else:
        torch.save(model.state_dict(), path)


def held_bytes(pm) -> int:
    """Bytes of the distinct storages of every tensor this rank's programs hold (measured from
    the tensors, not from autopart's accounting: a view of a full tensor counts in full)."""
    seen, total = set(), 0
    for c in pm.program.chunks:
        for t in list(c.gm.parameters()) + list(c.gm.buffers()):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _optimizer(case: MetaCase, params):
    if case.optim == "adamw":       # tolerance: tests/workers/equivalence._param_atol
        return torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)
    return torch.optim.SGD, dict(lr=0.1, momentum=0.9)


def run(rank: int, world: int, case: MetaCase) -> dict:
    """Build `case` on meta, check its from-scratch init against autopart.materialize, load the
    checkpoint (if any), train `case.steps` steps beside the plain model; report what differs."""
    import autopart
    from tests.workers.common import _local_view
    problems: list[str] = []
    with torch.device("meta"):
        meta_model, loss_fn = construct(case)
    inputs, target = batch(case)
    mesh = autopart.Mesh(pp=case.pp, dp=case.dp, tp=case.tp, ep=case.ep)
    init_fn = meta_model._init_weights if case.model == "llama" else None
    kw = dict(zero=case.zero) if case.zero else {}
    allocs = {"parallelize": LargestAlloc(), "train": LargestAlloc()}
    with allocs["parallelize"] if case.count_allocs else contextlib.nullcontext():
        pm = autopart.parallelize(meta_model, mesh, inputs, loss_fn=loss_fn, target=target,
                                  microbatches=case.microbatches, seed=3, init_fn=init_fn,
                                  timeout=timedelta(seconds=120), **kw)
    mine = _local_view(pm, rank)
    if any(t.device.type != "meta" for t in meta_model.state_dict().values()):
        problems.append("parallelize materialized tensors of the user's meta model")
    # from scratch: exactly autopart.materialize of the same model and seed
    with torch.device("meta"):
        ref_meta, _ = construct(case)
    scratch = autopart.materialize(ref_meta, seed=3, init_fn=init_fn)
    ref_params = dict(scratch.named_parameters())
    for name, p in pm.named_parameters():
        if not torch.equal(p.detach(), mine(name, ref_params[name].detach())):
            problems.append(f"from-scratch {name} differs from autopart.materialize")
    expected = sum(mine(n, t).numel() * t.element_size()
                   for n, t in _rank_state(pm, scratch).items())
    measured = held_bytes(pm)
    if measured != expected:
        problems.append(f"rank {rank} holds {measured} bytes of tensors, its share is {expected}")
    ref = scratch
    cls, kw = _optimizer(case, None)
    with allocs["train"] if case.count_allocs else contextlib.nullcontext():
        if case.source:
            pm.load_pretrained(case.source)
        opt = pm.optimizer(cls, **kw)
        losses = []
        for _ in range(case.steps):
            losses.append(pm.train_step(*inputs, target=target))
            opt.step(), opt.zero_grad()
    if case.source:
        ref = plain(case)
    ref_params = {n: p for n, p in ref.named_parameters()}
    ref_opt = cls(ref.parameters(), **kw)
    for step, loss in enumerate(losses, 1):
        out = ref(*inputs)
        ref_loss = loss_fn(out, target) if loss_fn is not None else out
        ref_loss.backward()
        _compare(f"step {step} loss", loss, ref_loss, RTOL, ATOL, problems)
        ref_opt.step(), ref_opt.zero_grad()
    if case.zero:      # a torch optimizer over pm.parameters() would step with slices of .grad
        from autopart.errors import AutopartError
        pm.train_step(*inputs, target=target)
        try:
            torch.optim.SGD(pm.parameters(), lr=0.1).step()
            problems.append("zero=1: a user optimizer over pm.parameters() stepped without error")
        except AutopartError as e:
            if "pm.optimizer" not in str(e):
                problems.append(f"zero=1 user optimizer error lacks the remedy: {e}")
        opt.zero_grad()
    # Adam moves an element whose gradient is within round-off of zero (summed in another order:
    # reduce-scatter vs one process) by an arbitrary fraction of lr: measured 9.4e-5 on 1 of 4096
    # elements at lr=1e-3. A missed or doubled step moves nearly every element by ~lr = 1e-3.
    atol = 2e-4 if case.optim == "adamw" else ATOL
    for name, p in pm.named_parameters():
        _compare(f"{name} after {case.steps} steps", p, mine(name, ref_params[name]), RTOL, atol,
                 problems)
    out = {"problems": problems, "held": measured, "expected": expected,
           "state_bytes": _optimizer_state_bytes(opt),
           "largest_alloc": {k: a.largest for k, a in allocs.items()},
           "full_bytes": {n: p.numel() * p.element_size() for n, p in ref.named_parameters()},
           "tp_sharded": sorted(pm.compiled.plan.tp_shards)}
    if case.gather_to >= 0:
        out.update(_check_gather(pm, ref, case.gather_to, atol, problems))
    return out


def _check_gather(pm, ref: nn.Module, dst: int, atol: float, problems: list) -> dict:
    """full_state_dict(rank=dst) and full_state_dict_iter(dst) against the plain model's state
    dict; the largest tensor each allocated on this rank (measured by LargestAlloc)."""
    expected = ref.state_dict()
    as_dict, streamed = LargestAlloc(), LargestAlloc()
    with as_dict:
        full = pm.full_state_dict(rank=dst)
    keys, largest_yielded, it = [], 0, pm.full_state_dict_iter(dst)
    while True:
        with streamed:          # counting what the iterator allocates, not the comparison
            item = next(it, None)
        if item is None:
            break
        key, t = item
        _compare(f"streamed {key}", t, expected[key], RTOL, atol, problems)
        keys.append(key)
        largest_yielded = max(largest_yielded, t.numel() * t.element_size())
    if pm.rank == dst:
        if list(full) != list(expected) or keys != list(expected):
            problems.append(f"gathered keys {list(full)} / streamed {keys} are not the plain "
                            f"model's {list(expected)}")
        for key, t in full.items():
            _compare(f"gathered {key}", t, expected[key], RTOL, atol, problems)
    elif full or keys:
        problems.append(f"rank {pm.rank} is not rank {dst} but got {len(full)} + {len(keys)} "
                        "tensors")
    return {"gather_alloc": as_dict.largest, "stream_alloc": streamed.largest,
            "largest_yielded": largest_yielded}


class LargestAlloc(TorchDispatchMode):
    """The bytes of the largest storage any aten op created while active (an op's output whose
    storage none of its inputs has: views and in-place results allocate nothing), and `total`,
    those bytes summed (freed or not). Counted by the dispatcher, below autopart's code; fake and
    meta tensors (compilation) are not memory."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not is_fake(t) and t.device.type != "meta" \
                    and _ptr(t) not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
                self.total += t.untyped_storage().nbytes()
        return out


def _ptr(t: torch.Tensor) -> int:
    return 0 if is_fake(t) or t.device.type == "meta" else t.untyped_storage().data_ptr()


def _rank_state(pm, model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's tensors this rank holds (by the program's names)."""
    sd = dict(model.named_parameters())
    sd.update(dict(model.named_buffers()))
    names = {n for c in pm.program.chunks
             for n, _ in list(c.gm.named_parameters()) + list(c.gm.named_buffers())}
    canon = {a: i.name for i in list(pm.compiled.program.params.values())
             + list(pm.compiled.program.buffers.values()) for a in (i.name, *i.aliases)}
    return {canon.get(k, k): v for k, v in sd.items() if canon.get(k, k) in names}


def _optimizer_state_bytes(opt) -> int:
    seen, total = set(), 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.untyped_storage().data_ptr() not in seen:
                    seen.add(v.untyped_storage().data_ptr())
                    total += v.untyped_storage().nbytes()
    return total


def run_cases(rank: int, world: int, cases: list) -> list[dict]:
    return each_case(run, rank, world, cases)
