"""cut_pipeline_stages: balanced, complete cuts at residual-stream points; tied weights; errors.

The pass is called directly on a captured, analysed program (no schedule, no runtime).
"""
from __future__ import annotations

import pytest
import torch

from autopart.analysis import analyze, detect_layers, evaluate
from autopart.capture import capture
from autopart.config import Config
from autopart.errors import AutopartError
from autopart.passes import cut_pipeline_stages as cps
from autopart.schedule import make_schedule
from examples.gpt import GPT, config, lm_loss

torch.manual_seed(0)


def _captured(model, seq=64, batch=2):
    x = torch.randint(0, 256, (batch, seq))
    program = capture(model, (x,), loss_fn=lm_loss, target=x)
    return program, analyze(program)


@pytest.fixture(scope="module")
def gpt7():
    """A tiny GPT with an uneven (prime) layer count."""
    return _captured(GPT(config("tiny,n_layer=7")))


def _cut(program, costs, pp, v=1, mbs=1):
    schedule = make_schedule("interleaved-1f1b" if v > 1 else "1f1b", pp, pp, v)
    out, report = cps.cut_pipeline_stages(program.replace(costs=costs),
                                          chunk_ranks=schedule.chunk_ranks, microbatch_size=mbs)
    return out.stages, report


def _check_complete(program, plan):
    """Every compute node in exactly one chunk, chunks contiguous and in graph order, every
    layer's nodes in one chunk or two adjacent ones, every chunk holding part of a layer."""
    graph = program.gm.graph
    replicated = set(plan.replicated)
    compute = [n for n in graph.nodes if n.op == "call_function" and n.name not in replicated]
    assert set(plan.chunk_of) == {n.name for n in compute}
    order = [plan.chunk_of[n.name] for n in compute]
    assert order == sorted(order), "chunks are contiguous runs in graph order"
    assert sorted(set(order)) == list(range(plan.num_chunks)), "no chunk is empty"
    # Replicated nodes (recomputed in every chunk that needs them) read no trainable parameter.
    params = {n.name for n in graph.nodes if n.op == "get_attr" and n.target in program.params}
    for n in graph.nodes:
        if n.name in replicated:
            assert not any(a.name in params for a in n.all_input_nodes), n.name
    layers = detect_layers(program)
    seen = []
    for layer in layers:
        chunks = sorted({plan.chunk_of[n] for n in layer.nodes if n in plan.chunk_of})
        assert chunks, f"{layer.path} has no computation in any chunk"
        assert chunks == list(range(chunks[0], chunks[-1] + 1)) and len(chunks) <= 2, (
            f"{layer.path} spread over chunks {chunks}")
        seen.append(layer.path)
    flat = [p for c in plan.chunk_layers for p in c]
    assert sorted(set(flat), key=flat.index) == seen, "every layer listed, in order"
    assert len(flat) - len(set(flat)) <= plan.num_chunks - 1, "a layer repeats only where a cut splits it"
    assert all(plan.chunk_layers), "every chunk holds (part of) a layer"


def _segments(program, costs, plan, mbs=1):
    """Costs between consecutive candidate cut points, as the pass sees them."""
    replicated = set(plan.replicated)
    compute = [n for n in program.gm.graph.nodes
               if n.op == "call_function" and n.name not in replicated]
    cost = [max(evaluate(costs[n.name].fwd_bwd_flops, mbs, program.seq_len), 1.0) for n in compute]
    last = cps._last_uses(compute)
    cross = cps._crossing_bytes(compute, last, [cps._bytes(n, program, mbs, program.seq_len)
                                                for n in compute])
    cands, _ = cps._cut_candidates(compute, cost, cross, detect_layers(program))
    edges = [0, *cands, len(compute)]
    return [sum(cost[a:b]) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("pp,v", [(2, 1), (3, 1), (4, 1), (7, 1), (2, 2), (3, 2), (2, 3)])
def test_cut_is_complete_and_balanced(gpt7, pp, v):
    program, costs = gpt7
    plan, report = _cut(program, costs, pp, v)
    assert plan.num_chunks == pp * v
    assert [plan.rank_of_chunk(c) for c in range(pp * v)] == [c % pp for c in range(pp * v)]
    _check_complete(program, plan)
    # Balance. The pass minimizes the largest chunk over partitions at the candidate points (the
    # gaps where only the residual stream is live), so the classic bound for an optimal linear
    # partition holds: max chunk <= mean + largest segment between two consecutive candidates
    # (greedily closing each chunk once it reaches the mean already achieves that). Here the
    # segments are half layers (attention / MLP), so 7 layers in up to 7 chunks stay within
    # ~1.5x of the mean; in practice far closer (1.06 for pp=2, 1.30 at 6 chunks).
    mean = sum(plan.chunk_cost) / plan.num_chunks
    worst = max(plan.chunk_cost)
    segments = _segments(program, costs, plan)
    assert worst <= mean + max(segments) + 1e-6 * mean
    assert worst / mean == pytest.approx(report["max_over_mean_cost"])
    assert worst / mean < 1.5
    assert abs(sum(plan.chunk_cost) - sum(segments)) <= 1e-9 * sum(segments)


def test_each_cut_sends_only_the_residual_stream(gpt7):
    program, costs = gpt7
    plan, _ = _cut(program, costs, 4)
    nodes = {n.name: n for n in program.gm.graph.nodes}
    h = 64
    for crossing in plan.crossings:
        assert len(crossing) == 1, crossing
        val = nodes[crossing[0]].meta["val"]
        assert val.dim() == 3 and val.shape[-1] == h and val.dtype == torch.float32


def test_whole_layers_when_they_divide_evenly():
    program, costs = _captured(GPT(config("tiny,n_layer=4")))
    plan, _ = _cut(program, costs, 4)
    assert plan.chunk_layers == tuple((f"transformer.h.{i}",) for i in range(4))


def test_fewer_layers_than_chunks_is_an_error(gpt7):
    program, costs = gpt7
    with pytest.raises(AutopartError) as e:
        _cut(program, costs, 4, 2)
    msg = str(e.value)
    assert "7 layers" in msg and "transformer.h.0 .. transformer.h.6" in msg
    assert "= 8 pipeline chunks" in msg and "pp*virtual_stages <= 7" in msg


def test_one_chunk_is_the_whole_model(gpt7):
    program, costs = gpt7
    plan, _ = _cut(program, costs, 1)
    assert set(plan.chunk_of.values()) == {0} and plan.crossings == () and plan.shared_params == {}


def test_tied_embedding_is_shared_between_first_and_last_chunk(gpt7):
    program, costs = gpt7
    for pp, v in [(2, 1), (3, 2)]:
        plan, report = _cut(program, costs, pp, v)
        assert plan.shared_params == {"transformer.wte.weight": (0, pp * v - 1)}
        assert report["shared_params"] == plan.shared_params
    untied, ucosts = _captured(GPT(config("tiny,n_layer=2,tie_weights=false")))
    plan, _ = _cut(untied, ucosts, 2)
    assert plan.shared_params == {}


@pytest.fixture(scope="module")
def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    x = torch.randint(0, 256, (2, 32))
    program = capture(model, (x,), loss_fn=_hf_loss, target=x)
    return program, analyze(program)


def _hf_loss(out, target):
    return lm_loss(out.logits, target)


@pytest.mark.parametrize("pp", [2, 4])
def test_hf_gpt2_cut_at_the_residual_stream(hf_gpt2, pp):
    """transformers 5.x builds the causal mask from the input inside forward (arange / le /
    expand, traced by torch.export): those nodes depend on the input only, so every chunk
    recomputes them and the cut still carries just the residual stream."""
    program, costs = hf_gpt2
    plan, _ = _cut(program, costs, pp)
    _check_complete(program, plan)
    assert plan.chunk_layers == tuple(tuple(f"transformer.h.{i}" for i in range(c * 4 // pp, (c + 1) * 4 // pp))
                                      for c in range(pp))
    nodes = {n.name: n for n in program.gm.graph.nodes}
    for crossing in plan.crossings:
        assert len(crossing) == 1
        assert tuple(nodes[crossing[0]].meta["val"].shape[1:]) == (32, 64)
    mask_ops = [n for n in plan.replicated if nodes[n].target is torch.ops.aten.le.Tensor]
    assert mask_ops, "the causal mask comparison is recomputed, not sent"
    assert plan.shared_params == {"transformer.wte.weight": (0, pp - 1)}
    assert program.params["transformer.wte.weight"].aliases == ("lm_head.weight",)


def test_crossing_bytes_match_the_definition():
    """The O(n) difference-array crossing sizes equal the sum over values live across each gap,
    here with a skip connection live across the whole model (the case that made the per-gap
    listing quadratic)."""

    class Skip(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.h = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, idx):
            x0 = x = self.emb(idx)
            for layer in self.h:
                x = x + torch.relu(layer(x))
            return (x * x0).mean()

    program = capture(Skip(), (torch.randint(0, 16, (2, 5)),))
    graph = program.gm.graph
    replicated = cps._input_derived(graph)
    compute = [n for n in graph.nodes if n.op == "call_function" and n.name not in replicated]
    last = cps._last_uses(compute)
    nbytes = [cps._bytes(n, program, 2, 5) for n in compute]
    fast = cps._crossing_bytes(compute, last, nbytes)
    for g in range(len(compute) + 1):
        live = cps._crossing_at(compute, last, g)
        assert fast[g] == sum(nbytes[compute.index(n)] for n in live), g
    body = fast[2:-2]
    assert min(body) == 2 * 2 * 5 * 8 * 4, "x and the skip x0 cross every layer boundary"


class _SideTensorBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.table = torch.nn.Embedding(width, width)

    def forward(self, h, route):
        return h + torch.tanh(self.lin(h)) + self.table(route) * 0.1


class _SideTensorModel(torch.nn.Module):
    """Every block reads `route` (made from the first activations); nothing after the last block
    does, so inside the last block only h is live: less than at any boundary between blocks."""

    def __init__(self, n_layer: int = 4, width: int = 32, vocab: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_SideTensorBlock(width) for _ in range(n_layer))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x, target):
        h = self.emb(x)
        route = h.argmax(-1)
        for block in self.blocks:
            h = block(h, route)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 target.reshape(-1))


def test_side_tensor_dead_in_the_last_layer_still_leaves_cut_points():
    import autopart
    model = _SideTensorModel()
    x = torch.randint(0, 64, (4, 8))
    compiled = autopart.compile(model, autopart.Mesh(pp=4), (x, x), microbatches=4)
    assert len(compiled.plan.chunk_layers) == 4 and all(compiled.plan.chunk_layers)
    for chunk in compiled.program.chunks[:-1]:
        assert len(chunk.sends) == 2        # the residual stream and route, nothing more


# -- the memory bound --------------------------------------------------------------------------

ADAM = 4    # bytes kept per parameter byte with Adam: the parameter, its gradient, two moments
TEMPS = 2   # torch.optim.Adam's step: sqrt(exp_avg_sq) and its quotient, each parameter-sized


def _state_bytes(sizes) -> int:
    """Adam's state for parameters of `sizes` bytes, and the step's peak temporaries."""
    return ADAM * sum(sizes) + TEMPS * max(sizes, default=0)


def _state_bytes_per_chunk(program, plan) -> list[int]:
    """Adam state bytes (_state_bytes) of the parameters each chunk's ops read (a tied weight
    counts in every chunk that reads it: each holds a copy), from the graph's get_attr nodes and
    the parameters' shapes."""
    graph = program.gm.graph
    held = [set() for _ in range(plan.num_chunks)]
    for n in graph.nodes:
        if n.op == "get_attr" and n.target in program.params:
            for u in n.users:
                if u.name in plan.chunk_of:
                    held[plan.chunk_of[u.name]].add(n.target)
    size = {name: p.numel() * p.element_size() for name, p in graph.owning_module.named_parameters()}
    return [_state_bytes([size[p] for p in chunk]) for chunk in held]


def _best_whole_layer_max(model, k: int) -> int:
    """The least largest per-chunk state bytes (_state_bytes) over every cut at layer
    boundaries, by brute force from the model's modules: chunk 0 holds the embeddings, the last
    the tied head (the embedding again) and the final norm."""
    import itertools
    t = model.transformer
    sizes = lambda *mods: [p.numel() * p.element_size() for m in mods for p in m.parameters()]  # noqa: E731
    best = None
    for cuts in itertools.combinations(range(1, len(t.h)), k - 1):
        edges = [0, *cuts, len(t.h)]
        chunks = [sizes(*t.h[a:b]) for a, b in zip(edges, edges[1:])]
        chunks[0] += sizes(t.wte, t.wpe)
        chunks[-1] += sizes(t.wte, t.ln_f)
        worst = max(_state_bytes(c) for c in chunks)
        best = worst if best is None else min(best, worst)
    return best


@pytest.fixture(scope="module")
def big_vocab():
    """A GPT whose tied 4096-row embedding holds as many parameters as ~5 of its 8 layers and,
    as the lm head, costs ~5 layers of compute: the compute-only cut gives the first rank the
    embedding (nearly free to compute) beside as many layers as the others get. One microbatch
    of 1 x 4 tokens, so activations are ~1% of the bytes and parameters decide."""
    model = GPT(config("tiny,n_layer=8,n_embd=128,vocab_size=4096,block_size=8"))
    program, costs = _captured(model, seq=4, batch=2)
    return model, program.replace(costs=costs)


def _memory_cut(program, pp, weight=cps.MEMORY_WEIGHT, microbatches=1, budget=None):
    schedule = make_schedule("1f1b", pp, microbatches)
    out, report = cps.cut_pipeline_stages(program, chunk_ranks=schedule.chunk_ranks,
                                          schedule=schedule, memory_weight=weight,
                                          config=Config(memory_budget=budget))
    return out.stages, report


def test_a_budget_the_compute_cut_fits_keeps_the_compute_cut(big_vocab):
    """Without a budget the cut trades compute for memory on big_vocab (the test above); with a
    device that holds the compute-only cut's largest chunk, nothing is traded."""
    model, program = big_vocab
    compute_only, report = _memory_cut(program, 4, weight=0)
    roomy = int(max(report["chunk_memory_bytes"]) * 1.001)     # bytes, as Config holds them
    plan, report = _memory_cut(program, 4, budget=roomy)
    assert plan.chunk_of == compute_only.chunk_of
    assert report["memory_bound_bytes"] == roomy
    assert plan.chunk_of != _memory_cut(program, 4)[0].chunk_of   # the trade would have moved it


def test_a_tight_budget_gets_the_least_compute_that_fits(big_vocab):
    """A budget between the least largest chunk memory and the compute-only cut's: every chunk
    fits it (state counted from the parameters' shapes, 1% for activations) and no chunk
    computes more than under the budget-blind trade; a budget nothing fits falls back to it."""
    model, program = big_vocab
    compute_only, _ = _memory_cut(program, 4, weight=0)
    traded, _ = _memory_cut(program, 4)
    least = _best_whole_layer_max(model, 4)
    worst = max(_state_bytes_per_chunk(program, compute_only))
    budget = (least + worst) / 2
    plan, report = _memory_cut(program, 4, budget=budget)
    _check_complete(program, plan)
    assert max(_state_bytes_per_chunk(program, plan)) <= budget * 1.01
    assert max(report["chunk_memory_bytes"]) <= budget
    assert max(compute_only.chunk_cost) <= max(plan.chunk_cost) <= max(traded.chunk_cost)
    hopeless, _ = _memory_cut(program, 4, budget=least / 10)
    assert hopeless.chunk_of == traded.chunk_of


def test_memory_bound_moves_layers_off_the_embedding_rank(big_vocab):
    model, program = big_vocab
    compute_only, _ = _memory_cut(program, 4, weight=0)
    plan, report = _memory_cut(program, 4)
    _check_complete(program, plan)
    best = _best_whole_layer_max(model, 4)      # >= the least max over all candidate cuts
    old = _state_bytes_per_chunk(program, compute_only)
    new = _state_bytes_per_chunk(program, plan)
    assert max(old) == old[0] > 1.1 * best, (old, best)
    # 1% for the activations the pass also counts
    assert max(new) <= 1.1 * best * 1.01, (new, best)
    assert new[0] < old[0] and len(plan.chunk_layers[0]) < len(compute_only.chunk_layers[0])
    # within the bound, compute still balanced: no chunk past twice the mean
    assert max(plan.chunk_cost) / (sum(plan.chunk_cost) / 4) < 2.0
    assert max(plan.chunk_cost) >= max(compute_only.chunk_cost)   # it gave up some compute balance
    assert report["memory_bound_bytes"] <= 1.1 * best * 1.01


def test_memory_weight_trades_memory_for_compute(big_vocab):
    """A larger weight never buys compute balance; an infinite one gives the least largest
    chunk's memory; weight 0 the compute-only cut."""
    model, program = big_vocab
    weights = [float("inf"), 10.0, 1.0, 0.0]
    plans = [_memory_cut(program, 4, weight=w)[0] for w in weights]
    worst_cost = [max(p.chunk_cost) for p in plans]
    worst_bytes = [max(_state_bytes_per_chunk(program, p)) for p in plans]
    assert worst_cost == sorted(worst_cost, reverse=True), worst_cost
    assert worst_bytes[0] <= _best_whole_layer_max(model, 4) * 1.01, worst_bytes
    assert worst_bytes[0] < worst_bytes[-1], worst_bytes


def test_no_memory_change_when_the_compute_cut_fits(gpt7):
    """tiny's 256-row embedding and one microbatch in flight everywhere: the compute-only cut
    is within the bounds and stays."""
    program, costs = gpt7
    program = program.replace(costs=costs)
    for pp in (2, 4):
        a, _ = _memory_cut(program, pp, weight=0, microbatches=1)
        b, _ = _memory_cut(program, pp, microbatches=1)
        assert a.chunk_of == b.chunk_of


def _walked(schedule) -> list[int]:
    """Per chunk, the most microbatches alive, walking each rank's actions here: +1 at F, -1 at
    the backward that reads them last, per microbatch: its B, or its W where it is split (I then
    W). DualPipeV does both on one rank (B for some microbatches, I and W for others): a walk
    that released only at W there counted 8 of 8 microbatches alive on every rank."""
    peak, live = [0] * schedule.num_chunks, {}
    for actions in schedule.ranks:
        for a in actions:
            key = (a.chunk, a.microbatch)
            if str(a.kind) == "F":
                live[key] = True
            elif str(a.kind) in ("B", "W"):
                live.pop(key)
            alive = [c for c, _ in live]
            for c in set(alive):
                peak[c] = max(peak[c], alive.count(c))
    return peak


@pytest.mark.parametrize("name,pp,m,v", [("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("gpipe", 3, 5, 1),
                                         ("zb-h1", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2),
                                         ("zb-v", 2, 8, 2), ("dualpipe-v", 4, 8, 2)])
def test_in_flight_per_chunk_matches_the_schedule_core(name, pp, m, v):
    """Per chunk, the microbatches held at once, as the C++ core counts them: the actions walked
    here; 1F1B keeps min(pp - rank, m) on rank `rank`; for one chunk per rank, the core's
    per-rank count; with several, per rank the chunks' counts bound the rank's."""
    from autopart.schedule import in_flight, in_flight_per_chunk
    schedule = make_schedule(name, pp, m, v)
    got = in_flight_per_chunk(schedule)
    assert got == _walked(schedule)
    core = in_flight(schedule).peak_in_flight
    if name == "1f1b":
        assert got == [min(pp - r, m) for r in range(pp)]
    if name == "gpipe":
        assert got == [m] * pp
    if v == 1:
        assert tuple(got) == core
    else:
        for r in range(pp):
            mine = [got[c] for c in range(pp * v) if schedule.chunk_ranks[c] == r]
            assert max(mine) <= core[r] <= sum(mine)


def test_copies_per_byte_count_adam_and_every_zero_level():
    """The cut's state per parameter byte, from the memory table's rule (autopart/memory/state.py);
    tests/test_memory_model.py checks it against a compiled table."""
    from autopart.memory.state import copies_per_byte
    assert copies_per_byte("adam", 0, 4) == 4              # param, grad, exp_avg, exp_avg_sq
    assert copies_per_byte("sgd", 0, 1) == 2
    assert copies_per_byte("adam", 1, 2) == 2 + 3 / 2      # moments and fp32 master over dp=2
    assert copies_per_byte("adam", 2, 2) == 1 + 4 / 2      # and the gradients
    assert copies_per_byte("adam", 3, 2) == 4 / 2          # and the parameters (the fp32 master)


def test_full_recomputation_keeps_only_each_layer_input():
    """Under recompute="full" the cut's activation bytes per layer are the bytes entering it
    (recompute_activations keeps only a layer's input), not its nodes' outputs."""
    from types import SimpleNamespace
    compute = [SimpleNamespace(name=n) for n in ("emb", "a1", "b1", "c1", "a2", "b2", "head")]
    act = [10.0, 7.0, 7.0, 5.0, 7.0, 7.0, 30.0]           # each node's output bytes
    cross = [0.0, 10.0, 17.0, 15.0, 5.0, 12.0, 7.0, 30.0]  # bytes live across each gap
    layers = [SimpleNamespace(nodes={"a1", "b1", "c1"}), SimpleNamespace(nodes={"a2", "b2"})]
    assert cps._layer_inputs_only(compute, act, layers, cross) == \
        [10.0, 10.0, 0.0, 0.0, 5.0, 0.0, 30.0]


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b"])
def test_a_rank_of_several_chunks_weighs_its_memory_per_rank(name):
    """pp=2, v=2: the chunk with the most microbatches in flight shares its rank with one of the
    fewest, so per rank the compute-only cut's memory is close to balanced and no compute is
    traded for it: whole 2-layer chunks, as with memory_weight=0 (the per-chunk bound alone cut
    this GPT 1.67/2.49/3.30/2.69 GFLOP, its ranks' compute 14% apart in measurement)."""
    model = GPT(config("tiny,n_layer=8,n_embd=256,n_head=8,block_size=32,vocab_size=512"))
    program, costs = _captured(model, seq=32, batch=8)
    program = program.replace(costs=costs)
    schedule = make_schedule(name, 2, 8, 2)
    cut = {w: cps.cut_pipeline_stages(program, chunk_ranks=schedule.chunk_ranks,
                                      schedule=schedule, memory_weight=w, microbatch_size=8)
           for w in (cps.MEMORY_WEIGHT, 0.0)}
    plan, report = cut[cps.MEMORY_WEIGHT]
    assert plan.stages.chunk_layers == tuple((f"transformer.h.{i}", f"transformer.h.{i + 1}")
                                             for i in range(0, 8, 2))
    assert plan.stages.chunk_of == cut[0.0][0].stages.chunk_of
    chunk_bytes = report["chunk_memory_bytes"]
    per_rank = [sum(b for b, r in zip(chunk_bytes, schedule.chunk_ranks) if r == rank)
                for rank in (0, 1)]
    assert max(per_rank) / min(per_rank) < max(chunk_bytes) / min(chunk_bytes)


def _per_rank(report, chunk_ranks) -> dict[int, float]:
    held: dict[int, float] = {}
    for b, r in zip(report["chunk_memory_bytes"], chunk_ranks):
        held[r] = held.get(r, 0.0) + b
    return held


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_a_budget_bounds_each_rank_not_each_chunk(big_vocab, name):
    """memory_budget is bytes per device: a rank of two chunks (pp=2, v=2) holds both. A budget
    every chunk of the compute-only cut fits but its fullest rank does not moves layers until
    every rank fits (a per-chunk check kept the compute-only cut, its rank over budget)."""
    model, program = big_vocab
    schedule = make_schedule(name, 2, 4, 2)

    def cut(**kw):
        out, report = cps.cut_pipeline_stages(program, chunk_ranks=schedule.chunk_ranks,
                                              schedule=schedule, **kw)
        return out.stages, report
    compute_only, report = cut(memory_weight=0)
    held = _per_rank(report, schedule.chunk_ranks)
    budget = 0.97 * max(held.values())
    assert max(report["chunk_memory_bytes"]) < budget     # a per-chunk check would pass it
    plan, report = cut(config=Config(memory_budget=budget))
    _check_complete(program, plan)
    assert plan.chunk_of != compute_only.chunk_of
    assert max(_per_rank(report, schedule.chunk_ranks).values()) <= budget
