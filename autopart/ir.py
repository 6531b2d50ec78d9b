"""The IR: the types the compiler and the runtime share, as plain printable data.

`Program` is the compiler's state: the captured graph plus one typed field per decision, each
filled by the pass that makes it (see the pass list in autopart/compiler.py). Passes read and
write these fields, the runtime reads the `Plan` and the `ChunkProgram`s; this module imports no
pass, no runtime module and nothing that calls torch.distributed.

Node metadata that passes leave on the graph uses the keys below (one place, not strings spread
over modules).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, TYPE_CHECKING

import sympy
import torch
import torch.fx as fx

from autopart.config import Config

if TYPE_CHECKING:
    from autopart.mesh import Mesh

# The symbols every symbolic size is written in: microbatch rows and sequence length.
BATCH, SEQ = sympy.Symbol("b", positive=True, integer=True), sympy.Symbol("s", positive=True, integer=True)

# node.meta keys written by passes.
META_TP = "tp"            # split_tensor_parallel: the node's placement over tp (Shard/Replicate/Partial)
META_EP = "ep"            # shard_experts: EP_LOCAL on nodes that compute on this rank's experts only
EP_LOCAL = "local experts"
META_LAYER = "autopart_layer"  # analysis.detect_layers: the Layer.path of the node's layer, or None


# precision -> the dtype of compute and of floating transfers (None: as compiled, fp32); bf16
# runs each step under torch.autocast to it (runtime/step.py), and the memory model counts so;
# fp8 is bf16 but for the linears passes/fp8_linears.py turns into FP8 GEMMs
REDUCED_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def graph_module(root, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """A GraphModule whose Python code is made on first use (`.code`, printing, a call), not
    when it is built: passes build whole-model and per-chunk modules that a 3072-rank compile
    never runs, and generating and compiling their code was a second or more of it. torch's own
    lazy GraphModule, as Inductor uses it."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    return _LazyGraphModule(root, graph, class_name=class_name)


def copied_graph(gm: fx.GraphModule) -> tuple[fx.Graph, dict]:
    """A copy of `gm`'s graph, output included, and the map from its nodes to the copy's: for
    passes that edit a few nodes and must leave the input program as it was."""
    graph, env = fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, env))
    return graph, env


def sym_shape(val, symbols: dict) -> tuple:
    """A FakeTensor's shape as sympy expressions in b and s."""
    dims = tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in val.shape)
    return _sym_shape(dims, tuple(symbols.items()))


@functools.lru_cache(maxsize=1 << 12)
def _sym_shape(dims: tuple, symbols: tuple) -> tuple:
    # cached: a 1T compile asks ~10k times for a few hundred distinct shapes
    table = dict(symbols)
    return tuple(sympy.Integer(d) if isinstance(d, int) else sympy.sympify(d).xreplace(table)
                 for d in dims)


@dataclass(frozen=True)
class TensorInfo:
    """Name, shape (sympy, in b and s), dtype and aliases of a parameter or buffer."""
    name: str
    shape: tuple
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()      # other names of the same tensor (tied weights)
    requires_grad: bool = True
    persistent: bool = True

    @property
    def numel(self) -> int:
        return int(sympy.prod(self.shape)) if self.shape else 1


# -- decisions of the passes ---------------------------------------------------------------------

@dataclass(frozen=True)
class ParamShard:
    """How a parameter is cut over one mesh axis: `dim` split into `sections` (fused q|k|v
    weights have three), each rank taking the same 1/size slice of every section. An expert
    shard is ParamShard(0, (E,)): E/ep whole experts a rank."""
    dim: int
    sections: tuple             # global section sizes along dim; each is split over the axis


@dataclass(frozen=True)
class ContextParallelPlan:
    """split_context_parallel's decisions: the attention kernel, the cores it replaced (output
    node name -> "causal", "full" or "window w"), the position sources it rewrote, and the
    sequence lengths (the captured one and each rank's)."""
    cp: int
    attention: str = "ring"
    cores: tuple = ()               # ((node name, "causal" | "full" | "window w"), ...)
    positions: tuple = ()           # node names of the aranges and table slices rewritten
    seq_len: int | None = None      # the whole sequence, S
    local_seq_len: int | None = None   # each rank's share, S / cp
    islands: tuple = ()             # names of the mixing ops inside proved token islands
    documents: tuple = ()           # inputs of packed documents' ids the cores mask by


@dataclass
class TensorParallelPlan:
    """split_tensor_parallel's decisions."""
    tp: int
    sequence_parallel: bool
    column: dict = field(default_factory=dict)      # linear node -> sections of its output
    row: set = field(default_factory=set)           # linear nodes reduced after
    vocab_loss: set = field(default_factory=set)    # cross-entropy nodes made vocab-parallel
    vocab_embedding: set = field(default_factory=set)
    scatters: dict = field(default_factory=dict)    # (consumer, input) -> dim sliced locally
    # (consumer, input) -> the sections (along that dim) of which a rank takes 1/tp each
    scatter_sections: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)      # param name -> ParamShard
    placements: dict = field(default_factory=dict)  # node name -> placement (original graph)
    sp_grad_reduce: set = field(default_factory=set)  # replicated params with partial grads (SP)
    seq_shards: dict = field(default_factory=dict)  # node -> sequence dim it runs sharded on (SP)
    gathers: dict = field(default_factory=dict)     # (consumer, input) -> dim all-gathered first
    # (consumer, input): a replicated value with a gradient read by an op on a tp shard (a
    # per-head norm's weight); read through copy_to_tp, whose backward sums the shares over tp
    partial_grads: set = field(default_factory=set)
    skipped: list = field(default_factory=list)     # (linear, reason) left replicated
    expert_matmuls: frozenset = frozenset()         # expert matmuls taken as linears (ETP)


@dataclass(frozen=True)
class MoELayer:
    """One mixture-of-experts layer as shard_experts found it."""
    name: str                    # module path of its expert matmuls ('' if unknown)
    num_experts: int
    experts_per_rank: int
    matmuls: tuple               # expert matmul node names
    entries: tuple               # dispatched tensors (node names), all-to-all'd to the experts
    exits: tuple                 # expert outputs, all-to-all'd back
    params: tuple                # expert-sharded parameters (dim 0)
    router: str | None           # the router's weight parameter
    routing: tuple               # routing ops found (e.g. ('one_hot', 'argmax'))
    capacity: int | None         # tokens per expert per routing group (None: dropless/not found)
    group_size: int | None       # tokens per routing group (None: per-token routing/not found);
                                 # a microbatch shard must hold whole groups
    tokens_per_expert: str       # rows per expert per rank per microbatch, in b (and s); for
                                 # sorted rows: all rows of the rank (data-dependent per expert)
    a2a_bytes: str               # forward bytes one rank sends per microbatch (same in backward);
                                 # sorted rows: the expectation under balanced routing
    a2a_bytes_at_capture: int    # a2a_bytes at the captured batch size
    source: str
    layout: str = "experts-major"     # or "sorted-rows"


@dataclass
class ExpertPlan:
    """shard_experts' decisions."""
    ep: int
    layers: list = field(default_factory=list)       # MoELayer
    params: dict = field(default_factory=dict)       # param name -> ParamShard(0, (E,))
    skipped: list = field(default_factory=list)      # (node, reason): expert-shaped, not MoE

    def as_dict(self) -> dict:
        return {"ep": self.ep, "params": {k: {"dim": v.dim, "experts": v.sections[0],
                                               "per_rank": v.sections[0] // self.ep}
                                           for k, v in self.params.items()},
                "layers": [vars(layer) for layer in self.layers], "skipped": self.skipped}


@dataclass(frozen=True)
class NodeCost:
    """analyze_costs: one node's forward work, symbolic in b and s, per rank."""
    flops: sympy.Expr        # forward FLOPs
    out_bytes: sympy.Expr    # bytes of the node's outputs that are new memory (0 for views)
    bytes_moved: sympy.Expr  # inputs read + outputs written

    @property
    def fwd_bwd_flops(self) -> sympy.Expr:
        return 3 * self.flops   # backward costs twice the forward (two matmuls per matmul)


@dataclass(frozen=True)
class StagePlan:
    """cut_pipeline_stages' decisions: which chunk computes each node, what crosses each cut."""
    num_chunks: int
    chunk_ranks: tuple[int, ...]          # chunk k -> pipeline rank (from the schedule)
    chunk_of: dict[str, int]              # compute node -> chunk
    replicated: tuple[str, ...]           # input-derived nodes, recomputed where needed
    crossings: tuple[tuple[str, ...], ...]  # crossings[k]: values sent from chunk k to k+1
    shared_params: dict[str, tuple[int, ...]]  # param name -> chunks using it (more than one)
    chunk_layers: tuple[tuple[str, ...], ...]  # layer paths (whole or part) in each chunk
    chunk_cost: tuple[float, ...]          # forward+backward FLOPs per microbatch-sample

    def rank_of_chunk(self, chunk: int) -> int:
        return self.chunk_ranks[chunk]


@dataclass
class Fp8Plan:
    """fp8_linears' decisions (precision="fp8"): which linears run as FP8 GEMMs, and how."""
    scaling: str                                     # tensorwise | rowwise (autopart/ops/fp8.py)
    layers: str                                      # auto | all (fp8_linears' rule)
    # linear node -> (k_split, n_split): its contracted / output dim is split over tp, so the
    # amaxes over it are max-all-reduced over tp
    converted: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)         # linear node -> why it stays bf16


@dataclass
class RecomputePlan:
    """recompute_activations' decisions: per (chunk, layer) what reruns in backward.

    `choices[(chunk, layer)]` is "none", "selective" (the attention core only) or "full" (the
    whole layer keeps only its inputs); `regions[chunk]` maps each checkpointed submodule of that
    chunk's program to (layer, kind, node names it holds). The memory options live here too so the
    memory model (autopart.memory) sees the same ones the pass decided under."""
    mode: str                                        # what was asked: none|selective|full|auto
    choices: dict = field(default_factory=dict)      # (chunk, layer path) -> none|selective|full
    regions: dict = field(default_factory=dict)      # chunk -> {submodule: (layer, kind, nodes)}
    skipped: list = field(default_factory=list)      # (chunk, layer, reason) left as is
    optimizer: str = "adam"                          # sgd | sgd-momentum | adam
    budget: int | None = None                        # bytes per rank, or None
    recompute_flops: dict = field(default_factory=dict)  # chunk -> extra forward FLOPs (sympy)
    zero: int = 0                                    # ZeRO level the state is counted at
    precision: str = "fp32"                          # bf16: activations counted under autocast


@dataclass(frozen=True)
class Boundary:
    """A tensor crossing into or out of a chunk: its name, symbolic shape, dtype, peer."""
    name: str
    shape: tuple                 # sympy expressions in b and s
    dtype: torch.dtype
    peer_rank: int
    peer_chunk: int

    @property
    def differentiable(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def concrete_shape(self, b: int, s: int | None) -> tuple[int, ...]:
        return tuple(int(sympy.sympify(d).subs({BATCH: b, SEQ: s or 1})) for d in self.shape)


@dataclass
class ChunkProgram:
    """The program one pipeline rank runs for one model chunk (emit_rank_programs)."""
    chunk: int
    rank: int
    gm: fx.GraphModule
    recvs: tuple[Boundary, ...]          # placeholders, in order, first
    inputs: tuple[str, ...]              # then these user inputs, by name
    sends: tuple[Boundary, ...]          # outputs, in order (empty on the last chunk)
    is_last: bool
    layers: tuple[str, ...] = ()
    params: tuple[str, ...] = field(default=())
    backward: SplitBackward | None = None    # split_backward (schedules with I/W actions)
    # overlap_experts: two microbatches' forwards interleaved, expert all-to-alls posted and
    # waited behind the other microbatch's compute (inputs a's then b's, outputs likewise)
    paired: fx.GraphModule | None = None
    # overlap_experts: the forward cut after each posted all-to-all, so that the runtime can run
    # one microbatch's forward between another's backward posts (combined F&B)
    segments: tuple[ForwardSegment, ...] | None = None

    @property
    def code(self) -> str:
        head = f"# chunk {self.chunk} on pipeline rank {self.rank}"
        if self.layers:
            head += ": " + (self.layers[0] if len(self.layers) == 1
                            else f"{self.layers[0]} .. {self.layers[-1]}")
        text = head + "\n" + self.gm.code.strip() + "\n"
        if self.paired is not None:
            text += (f"# chunk {self.chunk}, two microbatches a and b (overlap_experts: each "
                     "ep_wait after the other's compute)\n" + self.paired.code.strip() + "\n")
        return text + self.backward.code if self.backward is not None else text


@dataclass(frozen=True)
class ForwardSegment:
    """One piece of a chunk's forward (overlap_experts forward_segments): a program that takes
    the values named `inputs` (the chunk's placeholders, or outputs of earlier segments) and
    returns those named `outputs`; `pending`: which outputs are posted all-to-alls (Pending);
    `drops`: the inputs no later segment reads. The last segment returns the chunk's outputs."""
    gm: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    pending: tuple[str, ...] = ()
    drops: tuple[str, ...] = ()


@dataclass
class SplitBackward:
    """split_backward: one chunk's backward as two compile-time programs (Qi et al. 2024).

    `forward` is the chunk's forward returning (outputs..., saved...); `input_grad` (I) takes
    (saved[i] for i in saved_for_input..., grads of outputs[j] for j in grad_outputs...) and
    returns (a gradient or None per received tensor..., shared...); `weight_grad` (W) takes
    (saved[i] for i in saved_for_weight..., shared...) and returns the gradients of `params`.
    What I and W both need is computed once, in I. The three are traced at microbatch shape
    `shape` = (b, s). `fallback` says why this chunk has no graphs (the runtime then runs I as
    autograd.grad w.r.t. the inputs, retaining the graph, and W w.r.t. the parameters)."""
    forward: fx.GraphModule | None = None
    input_grad: fx.GraphModule | None = None
    weight_grad: fx.GraphModule | None = None
    num_outputs: int = 0
    saved_for_input: tuple[int, ...] = ()
    saved_for_weight: tuple[int, ...] = ()
    grad_outputs: tuple[int, ...] = ()
    params: tuple[str, ...] = ()
    shape: tuple = ()
    fallback: str | None = None

    @property
    def code(self) -> str:
        if self.fallback:
            return f"# backward split at run time by autograd: {self.fallback}\n"
        parts = [("forward, returning (outputs..., saved...)", self.forward),
                 ("input gradient (I)", self.input_grad), ("weight gradient (W)", self.weight_grad)]
        return "".join(f"# {what}, traced at (b, s) = {self.shape}\n{gm.code.strip()}\n"
                       for what, gm in parts)


@dataclass
class Program:
    """The whole model as one graph plus what the passes have decided about it so far.

    The fields after `dynamic` are None until the pass that provides them has run."""
    gm: fx.GraphModule
    params: dict[str, TensorInfo]            # canonical name -> info (trainable parameters)
    buffers: dict[str, TensorInfo]           # buffers, frozen parameters and lifted constants
    inputs: list[str]                        # user input placeholder names, target last if any
    batch_size: int                          # the global batch the model was captured with
    seq_len: int | None
    dynamic: bool                            # sizes are symbolic in b (and s)
    symbols: dict = field(default_factory=dict)   # capture: export's size symbols -> b, s
    stats: tuple[str, ...] = ()              # capture: names of the statistics outputs
    ep: ExpertPlan | None = None             # shard_experts
    tp: TensorParallelPlan | None = None     # split_tensor_parallel
    cp_islands: tuple | None = None          # prove_token_islands: names of the nodes of regions
                                             # proved position-wise (cp > 1)
    cp: ContextParallelPlan | None = None    # split_context_parallel
    costs: dict[str, NodeCost] | None = None  # analyze_costs: node name -> cost
    stages: StagePlan | None = None          # cut_pipeline_stages
    chunks: tuple[ChunkProgram, ...] | None = None  # emit_rank_programs
    recompute: RecomputePlan | None = None   # recompute_activations
    split_backward: dict | None = None       # split_backward: chunk -> "graphs" or why autograd
    fp8: Fp8Plan | None = None               # fp8_linears (precision="fp8")
    param_groups: dict | None = None         # gather_parameters (zero=3): chunk -> [(label, freed after)]
    overlap: dict | None = None              # overlap_collectives: fused copy_to_tp -> its linears
    loss_rule: str | None = None             # weigh_loss_by_tokens: how microbatch losses combine
    loss_count: Any = None                   # weigh_loss_by_tokens: a TokenCount, or None

    def replace(self, **changes) -> "Program":
        return dataclasses.replace(self, **changes)


# -- what compile hands the runtime ----------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """What was decided, as plain printable data. The options are `config`'s, read from there
    (config.schedule, config.microbatches, config.precision, ...), never copied beside it."""
    mesh: "Mesh"
    config: Config                          # the options it was compiled with (config.py)
    global_batch: int
    microbatch_size: int
    chunk_ranks: tuple[int, ...]           # chunk k -> pipeline rank
    chunk_layers: tuple[tuple[str, ...], ...]
    shared_params: dict[str, tuple[int, ...]]
    tp_shards: dict = field(default_factory=dict)   # param name -> ParamShard (tensor parallel)
    ep_shards: dict = field(default_factory=dict)   # expert param name -> ParamShard(0, (E,))
    sp_grad_reduce: frozenset = frozenset()  # replicated params whose grads sum over tp (SP)
    stats: tuple[str, ...] = ()             # names of the statistics outputs, summed per step
    loss_rule: str = ""                     # how the microbatch losses make the global loss

    @property
    def loss_scale(self) -> float:
        """Each microbatch loss is scaled by this so that summing over microbatches and
        data-parallel replicas gives the global-batch mean."""
        return 1.0 / (self.config.microbatches * self.mesh.dp * self.mesh.cp)

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last chunk: it computes the loss."""
        return self.chunk_ranks[-1]


@dataclass
class RankProgram:
    """Everything one global rank runs: its chunks, in chunk order."""
    rank: int
    coords: dict[str, int]
    chunks: tuple[ChunkProgram, ...]

    @property
    def code(self) -> str:
        return "\n".join(c.code for c in self.chunks)

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by the plain model's names (each tensor once)."""
        out: dict[str, torch.Tensor] = {}
        for c in self.chunks:
            for name in c.params:
                out.setdefault(name, c.gm.get_parameter(name))
        return out
