"""overlap_experts: each chunk with expert all-to-alls gets a paired program (two microbatches,
each all-to-all posted async and waited on after the other microbatch's compute), and compile()
pairs the schedule's microbatches. Equality with the plain model on real ranks, under Gloo and
NCCL's contract: tests/test_ep_overlap.py. Here, in one process: where the waits sit in the
emitted graph, the order a run posts, computes and waits (forward and backward) with a stand-in
all-to-all, the paired program's losses and gradients against the unpaired program's, explain(),
and overlap=False. Fast tier: python -m pytest -m "not full" passes/test_overlap_experts.py
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

import autopart
from autopart.ops import ep_async
from autopart.runtime.executable import executable

aten = torch.ops.aten
SWITCH = "tiny,n_layer=4,n_embd=32,d_ff=64,vocab_size=128,block_size=16,group_size=16"
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


@pytest.fixture(scope="module")
def compiled():
    return {overlap: _compile(overlap) for overlap in (True, False)}


def _compile(overlap: bool):
    from examples.switch import SwitchGPT, config
    torch.manual_seed(0)
    idx = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopart.compile(SwitchGPT(config(SWITCH)), autopart.Mesh(dp=2, ep=2), (idx, idx),
                                microbatches=2, overlap=overlap)


def _microbatch_of(graph: fx.Graph) -> dict:
    """Each node -> the set of microbatches ("a", "b") whose placeholders it reads."""
    of: dict = {}
    for n in graph.nodes:
        of[n] = {n.name[0]} if n.op == "placeholder" else \
            set().union(*(of[a] for a in n.all_input_nodes)) if n.all_input_nodes else set()
    return of


def test_each_wait_sits_after_the_other_microbatchs_compute(compiled):
    """In the emitted paired graph, between each start and its ep_wait there is compute of the
    other microbatch and none of the waiting one's that reads the result; with overlap=False
    there is no paired program and the schedule runs F0 B0 F1 B1."""
    chunk = compiled[True].programs[0].chunks[0]
    graph = chunk.paired.graph
    of, order = _microbatch_of(graph), {n: i for i, n in enumerate(graph.nodes)}
    waits = [n for n in graph.nodes if n.target is ep_async.ep_wait]
    assert len(waits) == 2 * 2 * 2, len(waits)      # 2 MoE layers x dispatch, combine x a, b
    for w in waits:
        start = w.args[0]
        assert start.target in ep_async.STARTS and of[w] == of[start] and len(of[w]) == 1
        between = [n for n in graph.nodes if order[start] < order[n] < order[w]
                   and n.op == "call_function" and n.target in (aten.bmm.default,
                                                                aten.linear.default)]
        others = [n for n in between if of[n] and of[n] != of[w]]
        assert others, f"nothing of the other microbatch between {start.name} and {w.name}"
    assert "dispatch_to_experts(" not in chunk.paired.code       # every all-to-all split
    assert [str(a) for a in compiled[True].schedule.ranks[0]] == ["0F0", "0F1", "0B0", "0B1"]
    off = compiled[False]
    assert off.programs[0].chunks[0].paired is None
    assert [str(a) for a in off.schedule.ranks[0]] == ["0F0", "0B0", "0F1", "0B1"]


def test_explain_shows_where_the_waits_sit(compiled):
    text = compiled[True].explain()
    assert "all-to-alls overlapped across microbatch pairs" in text, text
    assert text.count("chunk 0  a: wait") == 4 and text.count("chunk 0  b: wait") == 4, text
    assert "all-to-alls not overlapped (overlap=False)" in compiled[False].explain()
    assert "ep_wait(" in compiled[True].programs[0].chunks[0].code


class _Peers:
    """torch.distributed.all_to_all_single on an ep group of 2 whose peer holds the same
    tensors (block i of the output is this rank's block 0). Logs posts and waits."""

    def __init__(self, log: list):
        self.log, self.count = log, 0

    def __call__(self, out, x, output_split_sizes=None, input_split_sizes=None, group=None,
                 async_op=False):
        first = x[:input_split_sizes[0]] if input_split_sizes else x.chunk(2)[0]
        sizes = output_split_sizes or [out.shape[0] // 2] * 2
        assert all(s == first.shape[0] for s in sizes)
        out.copy_(torch.cat([first] * len(sizes)))
        if not async_op:
            self.log.append("all_to_all")
            return None
        self.count += 1
        k, log = self.count, self.log
        log.append(f"post {k}")

        class Work:
            def wait(self):
                log.append(f"wait {k}")
        return Work()


class _Matmuls(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.log.append("mm")
        return func(*args, **(kwargs or {}))


def _run(chunk, paired: bool, inputs: list) -> tuple[list, dict]:
    """The paired program on both microbatches, or the chunk's program on each; losses and
    the parameters' gradients of their sum."""
    params = dict(chunk.gm.named_parameters())
    for p in params.values():
        p.grad = None
    if paired:
        out = executable(chunk.paired, chunk.gm)([t for mb in inputs for t in mb])
        losses = [out[0], out[len(out) // 2]]
    else:
        losses = [executable(chunk.gm)(*mb)[0] for mb in inputs]
    sum(losses).backward()
    return [x.detach() for x in losses], {n: p.grad.clone() for n, p in params.items()
                                          if p.grad is not None}


def _rank0_with_stand_in(compiled, seed: int, monkeypatch) -> tuple:
    """Rank 0's chunk, two microbatches' inputs, and the log that the stand-in all-to-all
    (installed here) and _Matmuls write."""
    chunk = compiled.programs.instantiate(0).chunks[0]
    chunk.gm.get_submodule("ep_comm").bind(object(), 0)
    g = torch.Generator().manual_seed(seed)
    inputs = [[torch.randint(0, 128, (2, 16), generator=g) for _ in chunk.inputs]
              for _ in range(2)]
    log: list[str] = []
    monkeypatch.setattr(dist, "all_to_all_single", _Peers(log))
    return chunk, inputs, log


def test_a_run_posts_computes_then_waits_and_equals_the_unpaired_program(compiled, monkeypatch):
    """Rank 0's paired program with a stand-in all-to-all: every post, forward and backward, is
    followed by matmuls before its wait (the unpaired program posts and waits at once), and its
    losses and gradients are the unpaired program's."""
    chunk, inputs, log = _rank0_with_stand_in(compiled[True], 2, monkeypatch)
    with _Matmuls(log):
        got = _run(chunk, True, inputs)
    posts = [e for e in log if e.startswith("post")]
    assert len(posts) == 2 * 2 * 2 * 2, log     # forward and backward, as the test above
    for p in posts:
        k = p.split()[1]
        between = log[log.index(p) + 1:log.index(f"wait {k}")]
        assert "mm" in between, f"nothing computed between post {k} and its wait: {log}"
    log.clear()
    want = _run(chunk, False, inputs)
    assert "post 1" not in log and "all_to_all" in log
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.isfinite(a)
    assert got[1].keys() == want[1].keys() and got[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-5, atol=1e-6)


def test_a_combined_forward_and_backward_hide_each_others_all_to_alls(compiled, monkeypatch):
    """The chunk's forward cut after each post (forward_segments), run as the runtime runs a
    combined pair (runtime/compute.py forward_backward: F1 beside B0, with a stand-in
    all-to-all): every post of either side, the backward's gradient all-to-alls and the
    forward's, is followed by matmuls before its wait; a forward run alone posts and waits
    with nothing between (no other work to run); losses and gradients are the plain
    program's."""
    import dataclasses

    from autopart.passes.overlap_experts import forward_segments
    from autopart.runtime import compute
    from autopart.schedule import Action
    chunk, inputs, log = _rank0_with_stand_in(compiled[False], 3, monkeypatch)
    want = _run(chunk, False, inputs)
    segmented = dataclasses.replace(chunk, segments=forward_segments(chunk.gm))
    assert len(segmented.segments) == 2 * 2 + 1      # cut after each of 4 posts
    for p in chunk.gm.parameters():
        p.grad = None
    ctx = compute.StepContext(chunks={0: segmented}, peer=None, batch=2, seq=16,
                         device=torch.device("cpu"), loss_scale=1.0,
                         microbatch=lambda m: dict(zip(chunk.inputs, inputs[m])))
    log.clear()
    with _Matmuls(log):
        compute.forward(Action(0, "F", 0), ctx)
        alone = list(log)
        log.clear()
        compute.forward_backward(Action(0, "F", 1), Action(0, "B", 0), ctx)
        combined = list(log)
        compute.backward(Action(0, "B", 1), ctx)
    _assert_between(alone, expect_mm=False, posts=4)
    _assert_between(combined, expect_mm=True, posts=8)       # F1's 4 and B0's 4
    params = dict(chunk.gm.named_parameters())
    got = {n: p.grad for n, p in params.items() if p.grad is not None}
    assert got.keys() == want[1].keys() and got
    for a, b in zip(ctx.losses, want[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.isfinite(a)
    for name in want[1]:
        torch.testing.assert_close(got[name], want[1][name], rtol=1e-5, atol=1e-6)


def _assert_between(log: list[str], expect_mm: bool, posts: int) -> None:
    """Each post in `log` is waited on in `log`, with matmuls between (or none)."""
    found = [e for e in log if e.startswith("post")]
    assert len(found) == posts, log
    for p in found:
        k = p.split()[1]
        between = log[log.index(p) + 1:log.index(f"wait {k}")]
        assert ("mm" in between) == expect_mm, (p, log)


def test_under_interleaved_pp_compile_cuts_the_forwards_and_keeps_the_schedule():
    """pp=2 x dp=2, ep=2, interleaved-1f1b: the schedule is the configured one (not pairs), every
    chunk holding all-to-alls has segments whose pieces end at a post, and explain() names the
    first forward next to another microbatch's backward; overlap=False: no segments."""
    from examples.switch import SwitchGPT, config

    from autopart.schedule import make_schedule
    idx = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    runs = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[overlap] = autopart.compile(SwitchGPT(config(SWITCH)),
                                             autopart.Mesh(pp=2, dp=2, ep=2), (idx, idx),
                                             microbatches=4, overlap=overlap,
                                             schedule="interleaved-1f1b", virtual_stages=2)
    on, off = runs[True], runs[False]
    plain = make_schedule("interleaved-1f1b", 2, 4, 2).ranks
    assert on.schedule.ranks == plain and off.schedule.ranks == plain
    chunks = list(on.program.chunks)
    assert all(c.paired is None for c in chunks)
    cut = [c for c in chunks if c.segments is not None]
    assert cut and all(c.segments is None for c in off.program.chunks)
    for c in cut:
        assert all(s.pending for s in c.segments[:-1]) and not c.segments[-1].pending
    text = on.explain()
    assert "combined 1F1B" in text and "(first: 0F2 2B0)" in text, text
