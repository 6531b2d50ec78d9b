"""Layers found from the graph's repeated structure (autopart.analysis.detect_layers), never
from module paths: a model whose numbered modules are not layers and whose layers carry no
number; Hugging Face Whisper (a group of encoder layers, then a group of decoder layers that
all read the encoder's output) cut at pp=2 by cost, and trained against the plain model.

Fast tier: python -m pytest -m "not full" tests/test_layers_by_dataflow.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import autopart
from autopart.analysis import analyze, detect_layers, layer_of
from autopart.capture import capture
from autopart.passes.cut_pipeline_stages import cut_pipeline_stages
from tests.workers.common import Case
from tests.workers.equivalence import assert_all_ranks_equal_plain
from tests.workers.layers import build_whisper, run_layer_group


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), \
            nn.Linear(2 * width, width)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h))))


class _Misnamed(nn.Module):
    """The layers are alpha, beta and gamma: no number in their names. The numbered modules
    are no layers: stem.0 .. stem.3 (a Sequential of four different modules), layer1 and
    layer2 (the head's two linears, of different shapes). A reading of module paths groups
    `stem.<i>` (or `layer<i>`) as the repeated blocks."""

    def __init__(self, vocab: int = 64, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.stem = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                  nn.Linear(2 * width, width), nn.LayerNorm(width))
        self.alpha, self.beta, self.gamma = _Block(width), _Block(width), _Block(width)
        self.layer1, self.layer2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, vocab)

    def forward(self, x, target):
        h = self.gamma(self.beta(self.alpha(self.stem(self.emb(x)))))
        logits = self.layer2(torch.tanh(self.layer1(h)))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


BLOCKS = ("alpha", "beta", "gamma")


def _module_nodes(program, path: str) -> set[str]:
    """The compute nodes the user's module `path` ran (its forward, as torch.export recorded it)."""
    return {n.name for n in program.gm.graph.nodes if n.op == "call_function"
            and path in {p for p, _ in (n.meta.get("nn_module_stack") or {}).values()}}


def test_layers_are_found_where_module_names_lie():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 8))
    program = capture(_Misnamed(), (x, x))
    layers = detect_layers(program)
    assert [layer.path for layer in layers] == list(BLOCKS)
    for layer, name in zip(layers, BLOCKS):
        assert set(layer.nodes) == _module_nodes(program, name), name
    assert len({layer.signature for layer in layers}) == 1
    stem = _module_nodes(program, "stem")
    assert stem and all(layer_of(n, set(BLOCKS)) is None for n in program.gm.graph.nodes
                        if n.name in stem)
    # the cut keeps to the layers found: three chunks, one block each (nothing cut in the stem)
    out, _ = cut_pipeline_stages(program.replace(costs=analyze(program)), chunk_ranks=(0, 1, 2))
    assert out.stages.chunk_layers == tuple((name,) for name in BLOCKS)


class _Windowed(nn.Module):
    """A block of one of two kinds, as Gemma3's sliding and full attention layers: the sliding
    kind reads its input through a window (a slice), so the two kinds differ in their ops."""

    def __init__(self, width: int, sliding: bool):
        super().__init__()
        self.lin, self.sliding = nn.Linear(width, width), sliding

    def forward(self, h):
        x = torch.cat([h[:, :1] * 0, h[:, 1:]], dim=1) if self.sliding else h
        return h + torch.tanh(self.lin(x))


class _Alternating(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(_Windowed(width, sliding=i % 2 == 0) for i in range(4))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_layers_of_two_alternating_kinds_are_found_as_pairs():
    """Blocks 0 and 2 sliding, 1 and 3 full: the repeat is a pair of blocks, and the layers are
    the pairs, each starting where a block starts (no layer begins inside a block)."""
    program = capture(_Alternating(), (torch.randn(2, 8, 16),))
    layers = detect_layers(program)
    pairs = [_module_nodes(program, "blocks.0") | _module_nodes(program, "blocks.1"),
             _module_nodes(program, "blocks.2") | _module_nodes(program, "blocks.3")]
    assert [set(layer.nodes) for layer in layers] == pairs
    assert layers[0].signature == layers[1].signature


WHISPER = Case("whisper-pp2", model="whisper", pp=2, microbatches=2)


def _param_numel(model) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def test_whisper_layers_and_a_pp2_cut_by_cost():
    """Whisper's two groups of layers are found (the conv stem's conv1 and conv2 are not a
    group), and the pp=2 cut leaves neither rank more than 60% of the parameters (each chunk
    counted with every parameter its nodes read: the tied embedding in both)."""
    model, loss_fn, inputs, target = build_whisper(WHISPER)
    program = capture(model, inputs, loss_fn=loss_fn, target=target)
    layers = detect_layers(program)
    assert [layer.path for layer in layers] == \
        [f"model.model.encoder.layers.{i}" for i in range(4)] + \
        [f"model.model.decoder.layers.{i}" for i in range(4)]
    nodes, sizes = {n.name: n for n in program.gm.graph.nodes}, _param_numel(model)
    for layer in layers:        # each reads exactly the parameters of its module
        read = {a.target for n in layer.nodes for a in nodes[n].all_input_nodes
                if a.op == "get_attr" and a.target in sizes}
        assert read == {p for p in sizes if p.startswith(layer.path + ".")}, layer.path
    out, _ = cut_pipeline_stages(program.replace(costs=analyze(program)), chunk_ranks=(0, 1),
                                 microbatch_size=WHISPER.batch // WHISPER.microbatches)
    chunk_of, graph = out.stages.chunk_of, program.gm.graph
    held = [0, 0]
    for n in graph.nodes:
        if n.op == "get_attr" and n.target in sizes:
            for c in {chunk_of[u.name] for u in n.users if u.name in chunk_of}:
                held[c] += sizes[n.target]
    assert max(held) / sum(sizes.values()) <= 0.6, held


@pytest.mark.full
def test_whisper_pp2_trains_like_the_plain_model(spawn_cache):
    """3 SGD steps at pp=2 against the unmodified model (losses, first gradients, clipped norm,
    parameters), and the parameters each rank really holds: at most 60% of the model's."""
    ranks = run_layer_group(spawn_cache, ("layers-by-dataflow", 2), [WHISPER])[WHISPER.name]
    assert_all_ranks_equal_plain(WHISPER, ranks)
    total = ranks[0]["total_numel"]
    assert sum(r["held_numel"] for r in ranks) >= total
    assert max(r["held_numel"] for r in ranks) / total <= 0.6, [r["held_numel"] for r in ranks]


def test_switch_dense_and_moe_blocks_are_four_layers_each_recomputed():
    """examples/switch.py at 4 layers (tests.workers.common.SWITCH): dense blocks 0 and 2, MoE
    blocks 1 and 3. The graph repeats with a period of two blocks, yet the layers are the four
    blocks: inside each period the residual stream alone crosses where block 1 begins (as
    between periods), and there the period's first stretch (the attention: the same ops on
    the same shapes) begins again, so a dense block and an MoE block are two layers of two
    kinds, not one layer of two blocks (a block's own MLP never begins like its attention).
    Pairs would also halve the pipeline chunks a Switch model can have (pp*virtual_stages at
    most the layers). The first MoE block adds its auxiliary loss to a Python 0
    (add(aux, 0.0), where block 3 adds add(total, aux)): the two copies differ in that one
    node, which neither hides the layers nor gives the two MoE blocks one signature (they are
    not the same graph). Each layer is then recomputed on its own under recompute="full"."""
    from examples.switch import SwitchGPT, config
    from tests.workers.common import SWITCH
    torch.manual_seed(0)
    model = SwitchGPT(config(SWITCH))
    x = torch.randint(0, 128, (2, 16))
    program = capture(model, (x, x))
    layers = detect_layers(program)
    blocks = [f"transformer.h.{i}" for i in range(4)]
    assert [layer.path for layer in layers] == blocks
    named = {n.name for n in program.gm.graph.nodes if n.meta.get("nn_module_stack")
             and isinstance(n.meta.get("val"), torch.Tensor)}   # not a size both MoE blocks read
    for layer, block in zip(layers, blocks):
        assert set(layer.nodes) & named == _module_nodes(program, block) & named, block
    assert layers[0].signature == layers[2].signature != layers[1].signature
    assert layers[1].signature != layers[3].signature     # add(aux, 0.0) vs add(total, aux)
    c = autopart.compile(SwitchGPT(config(SWITCH)), autopart.Mesh(pp=2), (x, x), microbatches=2,
                         recompute="full")
    assert c.plan.chunk_layers == (tuple(blocks[:2]), tuple(blocks[2:]))
    recomputed = [[n.args[0].target for n in c.programs[r].chunks[0].gm.graph.nodes
                   if n.op == "call_function" and n.target is torch.utils.checkpoint.checkpoint]
                  for r in (0, 1)]
    assert recomputed == [[f"recompute_transformer_h_{i}" for i in (0, 1)],
                          [f"recompute_transformer_h_{i}" for i in (2, 3)]]


def test_a_piece_repeated_inside_one_layer_is_no_layer():
    """GPT-OSS with its two layers of different kinds (the sliding one slices its keys): no two
    layers repeat, so there is no group of layers. Before: its k and v projections (equal
    shapes under GQA, side by side in each layer) were reported as four 3-node layers, and the
    cut, recomputation and ZeRO-3 grouped by them. Their module names say what they are."""
    from tests.workers.family import build_family
    model, loss_fn, inputs, target = build_family(Case("gpt-oss", model="gpt-oss"))
    program = capture(model, inputs, loss_fn=loss_fn, target=target)
    nodes = {n.name: n for n in program.gm.graph.nodes}
    found = [sorted({p for x in layer.nodes for p in _module_paths(nodes[x])}) for layer in
             detect_layers(program)]
    assert not any(p.endswith(("k_proj", "v_proj")) for paths in found for p in paths), found


def _module_paths(node) -> list[str]:
    return [p for p, _ in (node.meta.get("nn_module_stack") or {}).values()]
