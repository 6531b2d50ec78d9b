"""FP8 linears with dynamic scaling, as graph ops (passes/fp8_linears.py inserts them).

    fp8_linear      y = x @ w.T (+ b): three FP8 GEMMs (forward, input gradient, weight gradient)
    fp8_linear_tp   the same on a tensor-parallel shard: the amaxes over a split dim are
                    max-all-reduced over tp first, so every rank scales with the global amax
    fp8_gather_linear_sp  fp8_linear_tp of a column-parallel linear under sequence parallelism:
                    x's sequence shard cast to e4m3 (global scale), then all-gathered in FP8
    fp8_weight_amaxes_tp   the global amaxes of a chunk's tensor-parallel FP8 weights, in one
                    max all-reduce at the chunk's start (the linears then take them as w_amax)

The recipes (torchao Float8Linear's; docs/precision.md):

  tensorwise   one scale per tensor, scale = max(e4m3) / amax (fp32, computed in fp64 as torchao
               does). Forward: x (cast to bf16 first, as autocast would) and w (the fp32 master)
               in e4m3. Backward: grad_output in e5m2 (more range, gradients need it), times the
               forward's e4m3 w (input gradient) and e4m3 x (weight gradient).
  rowwise      one scale per row of each GEMM operand along the dim it contracts, rounded down
               to a power of 2; every operand e4m3 (torchao's ROWWISE recipe). Each backward GEMM
               contracts another dim, so x and w are kept in high precision and recast there.

Every GEMM accumulates in fp32 and comes out in bf16, the weight gradient too (as torchao's;
CUDA's rowwise kernel has no other output type), which autograd adds into the fp32 .grad. The
bias is added in bf16 after the GEMM, as torchao adds it. On CUDA the kernel also needs every
GEMM dim a multiple of 16: the weight's sides (fp8_linears' "small" rule) and the tokens of a
microbatch.

Under tensor parallelism a scale reduced over a dim that is split over tp needs the global amax:
one max all-reduce per linear in forward and one in backward, of every amax that needs it at
once (`k_split`: the contracted dim is split, a row-parallel linear; `n_split`: the output
features are, a column-parallel one). Tensorwise: x's amax when k_split, w's when either, the
gradient's when n_split. Rowwise: a row's amax spans the contracted dim only, so forward reduces
when k_split and the input-gradient GEMM (contracting the output features) when n_split; the
weight-gradient GEMM contracts the tokens, never split, and needs none.

A weight's amax over tp needs no activation: passes/fp8_linears.py reduces those of a whole
chunk in one all-reduce at its start (fp8_weight_amaxes_tp) and hands each linear its own as
`w_amax`, so a linear's own all-reduces carry only activations' amaxes (x's when k_split, in
forward; the gradient's when n_split, in backward). Each linear takes exactly one weight amax
over tp: tensorwise the whole tensor's (forward; backward reuses its scale), rowwise the rows'
over K when k_split (forward) or the columns' over N when n_split (the input-gradient GEMM).

Under zero=3 (tensorwise) a weight read only by FP8 linears (gathered_in_fp8) is cast before
its all-gather: runtime/param_shards.py max-all-reduces the slices' amaxes (over the replicas,
then over tp for a shard), casts each slice with the whole weight's scale and gathers the e4m3
bytes; the linear then reads that weight and scale (`hold_in_fp8`'s owner) in place of casting
w, in forward and, re-gathered, in backward (the recipe's "forward's e4m3 w": the same bits).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils.weak import WeakIdKeyDictionary

from autopart.ops import tp as tp_ops
from autopart.ops.registry import register

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12                    # torchao's floor under an amax (an all-zero tensor scales finitely)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """max(dtype) / amax in fp32 (computed in fp64), rounded down to a power of 2 if `pow2`."""
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * scale, saturated to dtype's range, in dtype."""
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype)


def scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """a @ b from FP8 operands and their scales (the inverse of to_fp8's), a row-major and b
    column-major as CUDA's kernel requires (the CPU's takes either). Outside autocast: CPU
    autocast runs _scaled_mm in its lower-precision list and rounds the fp32 scales to bf16."""
    with torch.autocast(a.device.type, enabled=False):
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(),
                                scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(),
                                out_dtype=out_dtype)


# zero=3: parameter -> the runtime's ShardedParameters that gathers it in FP8 (hold_in_fp8), both
# weakly: the owner holds its parameters, so a strong value would keep every entry alive
_HELD = WeakIdKeyDictionary()


def hold_in_fp8(params, owner) -> None:
    """The FP8 linears read `params`' weights from `owner.fp8_weight(p)` ((e4m3 weight, scale),
    or None while not gathered in FP8: then they cast w as usual)."""
    for p in params:
        _HELD[p] = weakref.ref(owner)


def _gathered(w: torch.Tensor, w_out_dim: int):
    """For w gathered in FP8 now: a function giving (its e4m3 w[N, K], scale), which backward
    calls again (after the re-gather); else None."""
    owner = _HELD[w]() if w in _HELD else None
    if owner is None or owner.fp8_weight(w) is None:
        return None

    def fetch():
        held = owner.fp8_weight(w)
        if held is None:
            raise RuntimeError(f"zero=3: the FP8 weight of shape {tuple(w.shape)} is not "
                               "gathered where its linear's backward reads it (the program "
                               "must re-gather it: passes/gather_parameters.py)")
        w8, scale = held
        return (w8 if w_out_dim == 0 else w8.t()), scale
    # w[K, N] reaches the op as is (a view of a parameter without storage cannot be made): its
    # gradient is transposed back
    fetch.flip = w_out_dim == 1
    return fetch


def _max_over_tp(amaxes: list, comm) -> list:
    """The amaxes max-all-reduced over tp in one collective (flattened and split back)."""
    if not amaxes:
        return amaxes
    comm._check()
    flat = torch.cat([a.reshape(-1) for a in amaxes])
    if comm.moves_data:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=comm.group)
    return [part.reshape(a.shape) for part, a in zip(flat.split([a.numel() for a in amaxes]),
                                                         amaxes)]


def _reduced(amaxes: list, reduce: list, comm) -> list:
    """`amaxes` with those flagged in `reduce` replaced by their max over tp."""
    picked = _max_over_tp([a for a, r in zip(amaxes, reduce) if r and comm is not None], comm)
    it = iter(picked)
    return [next(it) if r and comm is not None else a for a, r in zip(amaxes, reduce)]


def _amax(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    a = t.abs()
    return (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()


class _Fp8Linear(torch.autograd.Function):
    """y[M, N] = x[M, K] @ w[N, K].T in FP8 (2-D x; the op reshapes)."""

    @staticmethod
    def forward(ctx, x, w, scaling, k_split, n_split, comm, w_amax, fetch=None):
        x = x.to(torch.bfloat16)
        if fetch is not None:       # zero=3: w gathered as e4m3 with the whole weight's scale
            return _forward_gathered(ctx, x, fetch, k_split, n_split, comm)
        rowwise = scaling == "rowwise"
        dim = 1 if rowwise else None
        # a row's amax spans K only (rowwise); a tensor's spans every split dim (tensorwise)
        w_split = k_split if rowwise else k_split or n_split
        if w_amax is not None and w_split:      # reduced at the chunk's start with the others
            (ax,), aw = _reduced([_amax(x, dim)], [k_split], comm), w_amax
        else:
            ax, aw = _reduced([_amax(x, dim), _amax(w, dim)], [k_split, w_split], comm)
        sx, sw = amax_to_scale(ax, E4M3, rowwise), amax_to_scale(aw, E4M3, rowwise)
        x8, w8 = to_fp8(x, sx, E4M3), to_fp8(w, sw, E4M3)
        ctx.scaling, ctx.n_split, ctx.comm, ctx.fetch = scaling, n_split, comm, None
        if rowwise:     # recast along the backward GEMMs' contracted dims
            # rowwise and n_split: w_amax is w's columns' over N, the input-gradient GEMM's
            ctx.save_for_backward(x, w, *([w_amax] if w_amax is not None and n_split else []))
        else:
            ctx.save_for_backward(x8, w8, sx, sw)
        return scaled_mm(x8, w8.t(), sx, sw.t() if rowwise else sw, torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
        if ctx.scaling == "rowwise":
            x, w, *w_amax = ctx.saved_tensors
            return (*_rowwise_grads(g, x, w, ctx.n_split, ctx.comm, *w_amax),
                    None, None, None, None, None, None)
        if ctx.fetch is not None:       # zero=3: the re-gathered e4m3 w, the forward's bits
            (x8, sx), (w8, sw) = ctx.saved_tensors, ctx.fetch()
        else:
            x8, w8, sx, sw = ctx.saved_tensors
        (ag,) = _reduced([_amax(g, None)], [ctx.n_split], ctx.comm)
        sg = amax_to_scale(ag, E5M2, False)
        g8 = to_fp8(g, sg, E5M2)
        grad_x = scaled_mm(g8, w8, sg, sw, torch.bfloat16)
        grad_w = scaled_mm(g8.t(), x8, sg, sx, torch.bfloat16)
        return grad_x, _oriented(grad_w, ctx.fetch), None, None, None, None, None, None


def _oriented(grad_w: torch.Tensor, fetch) -> torch.Tensor:
    """grad_w[N, K] as the op's w input has it (zero=3's FP8 weight w[K, N] comes untransposed)."""
    return grad_w.t() if fetch is not None and fetch.flip else grad_w


def _forward_gathered(ctx, x, fetch, k_split: bool, n_split: bool, comm):
    """The tensorwise forward with w as zero=3 gathered it (e4m3, the whole weight's scale):
    only x's amax is reduced here (over tp when its contracted dim is split). Backward fetches
    w again (saving the gathered weight would keep it past its release)."""
    (ax,) = _reduced([_amax(x, None)], [k_split], comm)
    sx = amax_to_scale(ax, E4M3, False)
    x8, (w8, sw) = to_fp8(x, sx, E4M3), fetch()
    ctx.scaling, ctx.n_split, ctx.comm, ctx.fetch = "tensorwise", n_split, comm, fetch
    ctx.save_for_backward(x8, sx)
    return scaled_mm(x8, w8.t(), sx, sw, torch.bfloat16)


def _rowwise_grads(g, x, w, n_split: bool, comm, w_amax=None):
    """(grad_x, grad_w) of the rowwise recipe: g @ w scales g's rows and w's columns over the
    output features (split over tp when n_split; w's given as w_amax when batched); g.T @ x
    scales both over the tokens."""
    if w_amax is not None:
        (ag,), aw = _reduced([_amax(g, 1)], [n_split], comm), w_amax
    else:
        ag, aw = _reduced([_amax(g, 1), _amax(w, 0)], [n_split, n_split], comm)
    sg, sw = amax_to_scale(ag, E4M3, True), amax_to_scale(aw, E4M3, True)
    grad_x = scaled_mm(to_fp8(g, sg, E4M3), to_fp8(w, sw, E4M3), sg, sw, torch.bfloat16)
    sgt, sx = amax_to_scale(_amax(g, 0), E4M3, True), amax_to_scale(_amax(x, 0), E4M3, True)
    grad_w = scaled_mm(to_fp8(g, sgt, E4M3).t(), to_fp8(x, sx, E4M3), sgt.t(), sx, torch.bfloat16)
    return grad_x, grad_w


class _Fp8GatherLinear(torch.autograd.Function):
    """y = all_gather(x, dim) @ w.T, tensorwise, on a column-parallel shard under sequence
    parallelism (ops/tp.py's gather_linear_sp in FP8): x's amax is reduced over tp (the sequence
    is split), its shard cast to e4m3 and all-gathered as FP8, half bf16's bytes (casting then
    gathering is bitwise gathering then casting: the cast is elementwise and the scale global).
    Backward re-gathers the FP8 shard for the weight gradient (kept: only the shard, 1 byte an
    element) and reduce-scatters the input gradient along the sequence."""

    @staticmethod
    def forward(ctx, x, w, dim, comm, w_amax, fetch=None):
        x = x.to(torch.bfloat16)
        if fetch is not None:       # zero=3: w gathered in e4m3 (whole weight's scale)
            (ax,) = _max_over_tp([_amax(x, None)], comm)
            sx = amax_to_scale(ax, E4M3, False)
            x8, (w8, sw) = to_fp8(x, sx, E4M3), fetch()
            ctx.save_for_backward(x8, sx)
        else:
            if w_amax is None:
                ax, aw = _max_over_tp([_amax(x, None), _amax(w, None)], comm)
            else:
                (ax,), aw = _max_over_tp([_amax(x, None)], comm), w_amax
            sx, sw = amax_to_scale(ax, E4M3, False), amax_to_scale(aw, E4M3, False)
            x8, w8 = to_fp8(x, sx, E4M3), to_fp8(w, sw, E4M3)
            ctx.save_for_backward(x8, w8, sx, sw)
        ctx.dim, ctx.comm, ctx.fetch = dim, comm, fetch
        full = _gather_fp8(x8, dim, comm)
        y = scaled_mm(full.reshape(-1, full.shape[-1]), w8.t(), sx, sw, torch.bfloat16)
        return y.reshape(*full.shape[:-1], w8.shape[0])

    @staticmethod
    def backward(ctx, g):
        if ctx.fetch is not None:
            (x8, sx), (w8, sw) = ctx.saved_tensors, ctx.fetch()
        else:
            x8, w8, sx, sw = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        (ag,) = _max_over_tp([_amax(g2, None)], ctx.comm)     # the output features are split
        sg = amax_to_scale(ag, E5M2, False)
        g8 = to_fp8(g2, sg, E5M2)
        gathering = tp_ops._start_all_gather(x8.view(torch.uint8), ctx.dim, ctx.comm)
        grad_full = scaled_mm(g8, w8, sg, sw, torch.bfloat16).reshape(*g.shape[:-1], -1)
        full = tp_ops._finish(*gathering).view(E4M3)
        scattering = tp_ops._start_reduce_scatter(grad_full, ctx.dim, ctx.comm)
        grad_w = scaled_mm(g8.t(), full.reshape(-1, full.shape[-1]), sg, sx, torch.bfloat16)
        return tp_ops._finish(*scattering), _oriented(grad_w, ctx.fetch), None, None, None, None


def _gather_fp8(x8: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """x8 all-gathered along `dim` over tp, as its bytes (a collective's dtype need not be FP8)."""
    return tp_ops._all_gather(x8.view(torch.uint8), dim, comm).view(x8.dtype)


def _apply(x, w, b, scaling, w_out_dim, k_split, n_split, comm, w_amax=None):
    # scaling: Config.fp8_scaling's value, checked where the user wrote it (autopart/config.py;
    # zero=3 gathers in FP8 for tensorwise only)
    fetch = _gathered(w, w_out_dim)
    w = w if w_out_dim == 0 or fetch is not None else w.t()
    y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), w, scaling, k_split, n_split, comm, w_amax,
                         fetch)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if b is None else y + b.to(y.dtype)


def fp8_linear(x, w, b, scaling: str = "tensorwise", w_out_dim: int = 0):
    """linear(x, w, b) in FP8 (w[N, K]; w_out_dim=1: w[K, N], as mm and addmm take it)."""
    return _apply(x, w, b, scaling, w_out_dim, False, False, None)


def fp8_linear_tp(x, w, b, scaling: str, w_out_dim: int, k_split: bool, n_split: bool, comm,
                  w_amax=None):
    """fp8_linear on a tensor-parallel shard: the amaxes over a split dim are the global ones
    (the weight's given as `w_amax` when fp8_weight_amaxes_tp reduced it already)."""
    return _apply(x, w, b, scaling, w_out_dim, k_split, n_split, comm, w_amax)


def fp8_gather_linear_sp(x, w, b, scaling: str, w_out_dim: int, k_split: bool, n_split: bool,
                         comm, w_amax=None, *, seq_dim: int):
    """gather_linear_sp(x, w, b, seq_dim, comm) in FP8, tensorwise (fp8_linear_tp's arguments:
    a column-parallel linear, so k_split False and n_split True; rowwise is refused at
    compile: autopart/compiler.py)."""
    fetch = _gathered(w, w_out_dim)
    w = w if w_out_dim == 0 or fetch is not None else w.t()
    y = _Fp8GatherLinear.apply(x, w, seq_dim, comm, w_amax, fetch)
    return y if b is None else y + b.to(y.dtype)


def weight_amax_over_tp(scaling: str, k_split: bool, n_split: bool) -> tuple[bool, int | None]:
    """(whether a linear's weight amax is reduced over tp, the dim of w[N, K] that amax
    reduces: None for the whole tensor)."""
    if scaling == "tensorwise":
        return k_split or n_split, None
    return k_split or n_split, 1 if k_split else 0


def fp8_weight_amaxes_tp(weights: list, out_dims: list, dims: list, comm) -> tuple:
    """The global amaxes of `weights` (w[N, K], or w[K, N] where out_dims says 1), each over
    `dims`' dim of w[N, K] (None: the whole tensor), in one max all-reduce over tp. No autograd:
    a scale is a constant of the GEMM it scales, as in the recipe."""
    with torch.no_grad():
        amaxes = [_amax(w if o == 0 else w.t(), d) for w, o, d in zip(weights, out_dims, dims)]
        return tuple(_max_over_tp(amaxes, comm))


def max_over_tp(amaxes: list, comm) -> list:
    """`amaxes` max-all-reduced over `comm`'s tp group in one collective (the runtime's
    zero=3 FP8 gathers reduce a tp shard's weight amax with it)."""
    return _max_over_tp(amaxes, comm)


LINEARS = (fp8_linear, fp8_linear_tp, fp8_gather_linear_sp)     # (x, w, b, scaling, w_out_dim, ...)


def gathered_in_fp8(gm: fx.GraphModule) -> tuple[dict[str, str | None], set[str]]:
    """zero=3, by dataflow: ({parameter: the get_attr of its TPComm when its amax spans tp, else
    None} for those `gm` reads only as the weight of tensorwise FP8 linears, directly or in a
    recomputed region's body (a checkpoint call's), {the parameters it reads otherwise}). A
    parameter in both (over a rank's chunks) is gathered in fp32."""
    found: dict[str, str | None] = {}
    read: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(_target(gm, node.target), nn.Parameter):
            comms = _weight_reads(gm, node, lambda n: n)
            if comms is None:
                read.add(node.target)
            else:
                found.setdefault(node.target, next((c for c in comms if c), None))
    return {k: v for k, v in found.items() if k not in read}, read


def _weight_reads(gm: fx.GraphModule, node: fx.Node, outer) -> list | None:
    """Per read of `node`, the get_attr target of the tp comm its FP8 linear reduces over (None:
    no split); None if a read is not an FP8 linear's weight. `outer` maps a region body's
    placeholder to the caller's node (the identity at the chunk's top)."""
    out: list = []
    for user in node.users:
        a = user.args
        if user.target is torch.utils.checkpoint.checkpoint and node not in a[:1]:
            body = _target(gm, a[0].target)
            holes = [n for n in body.graph.nodes if n.op == "placeholder"]
            for hole, arg in zip(holes, a[1:]):
                inner = _weight_reads(body, hole, lambda n: outer(a[1 + holes.index(n)])
                                      if n.op == "placeholder" else n) if arg is node else []
                if inner is None:
                    return None
                out += inner
        elif user.target in LINEARS and a[1] is node and a[3] == "tensorwise" and \
                node not in (a[0], a[2]):
            split = user.target is not fp8_linear and (a[5] or a[6])
            out.append(outer(a[7]).target if split else None)
        else:
            return None
    return out


def _target(gm: nn.Module, target: str):
    owner, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(owner), leaf, None)


register(fp8_linear, kind="local", axis="fp8", namespace="autopart.fp8_ops")
register(fp8_linear_tp, fp8_gather_linear_sp, fp8_weight_amaxes_tp, kind="collective", axis="tp",
         namespace="autopart.fp8_ops")
