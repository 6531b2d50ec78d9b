"""The ATen op table: the groups of ATen overloads that passes, the cost and memory models and the
executor recognise, each written once (tinygrad's op groups, in the same spirit).

A pass that needs "the views" or "the softmaxes" takes them from here, composing groups where
its question is wider (`RESHAPES | TRANSPOSES`), so a new spelling of an op (an overload export
starts to emit) is added in one place. Groups are frozensets of `OpOverload`s (and
`operator.getitem` where a group says so); maps keep the argument index a pass reads.
autopart's own ops (collectives, markers) are not here: autopart/ops/registry.py holds them.
"""
from __future__ import annotations

import operator

import torch

aten = torch.ops.aten

# -- shape and memory: no arithmetic -----------------------------------------------------------
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
TRANSPOSES = frozenset({aten.transpose.int, aten.permute.default, aten.t.default})
BROADCASTS = frozenset({aten.expand.default})
UNSQUEEZES = frozenset({aten.unsqueeze.default, aten.squeeze.dim})
SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
SLICES = frozenset({aten.slice.Tensor, aten.select.int})
ALIASES = frozenset({aten.alias.default, aten.detach.default})
COPIES = frozenset({aten.clone.default, aten.contiguous.default})
CASTS = frozenset({aten._to_copy.default, aten.to.dtype, aten.type_as.default})
NEW_LIKE = frozenset({aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
                      aten.new_full.default})
ARANGES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
# ops whose output aliases their input's storage (and getitem of a split's tuple): a parameter
# read through them is still the parameter (a linear written as x @ w.t())
ALIASING = (RESHAPES | TRANSPOSES | BROADCASTS | UNSQUEEZES | SLICES | SPLITS | ALIASES
            | {aten.squeeze.dims, aten.unbind.int, operator.getitem})

# -- arithmetic --------------------------------------------------------------------------------
MATMULS_BATCHED = frozenset({aten.bmm.default, aten.matmul.default})
MATMULS = MATMULS_BATCHED | {aten.mm.default}
LINEARS = frozenset({aten.linear.default, aten.mm.default, aten.addmm.default,
                     aten.matmul.default})
SCALES = frozenset({aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar})
SOFTMAXES = frozenset({aten.softmax.int, aten._softmax.default})
LOG_SOFTMAXES = frozenset({aten.log_softmax.int, aten._log_softmax.default})
SDPAS = frozenset({aten.scaled_dot_product_attention.default,
                   aten._scaled_dot_product_flash_attention_for_cpu.default,
                   aten._scaled_dot_product_flash_attention.default,
                   aten._scaled_dot_product_efficient_attention.default})
NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
CONVS = frozenset({aten.convolution.default, aten.conv1d.default, aten.conv2d.default})
INPLACE_ARITH = frozenset({aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor,
                           aten.div_.Tensor, aten.add_.Scalar, aten.sub_.Scalar,
                           aten.mul_.Scalar, aten.div_.Scalar, aten.copy_.default})
# ops that act on each element independently (a shard passes through unchanged)
ELEMENTWISE = COPIES | ALIASES | CASTS | frozenset({
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.pow.Tensor_Scalar,
    aten.add.Scalar, aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.rsub.Scalar,
    aten.tanh.default, aten.gelu.default, aten.silu.default, aten.relu.default,
    aten.sigmoid.default, aten.neg.default, aten.exp.default, aten.erf.default,
    aten.dropout.default, aten.masked_fill.Scalar, aten.where.self, aten.sqrt.default,
    aten.rsqrt.default, aten.abs.default, aten.log.default, aten.pow.Tensor_Tensor,
    aten.maximum.default, aten.minimum.default, aten.clamp.default, aten.square.default,
    aten.reciprocal.default, aten.lift_fresh_copy.default, aten.to.dtype_layout, aten.to.device,
    aten.cos.default, aten.sin.default, aten.masked_fill.Tensor, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.log1p.default, aten.expm1.default, aten.leaky_relu.default,
    aten.hardtanh.default, aten.mish.default, aten.softplus.default, aten.clamp_min.default,
    aten.clamp_max.default, aten.eq.Scalar, aten.ne.Scalar, aten.gt.Scalar, aten.lt.Scalar,
    aten.ge.Scalar, aten.le.Scalar, aten.logical_not.default, aten.bitwise_not.default})
# ops autocast runs in the reduced precision on CPU and CUDA alike, casting every floating input
# (weight and bias too)
AUTOCAST_REDUCED = LINEARS | MATMULS_BATCHED | frozenset({
    aten.baddbmm.default, aten.addbmm.default, aten.conv1d.default, aten.conv2d.default,
    aten.conv3d.default, aten.convolution.default, aten._convolution.default,
    aten.prelu.default, aten.scaled_dot_product_attention.default})

# -- losses --------------------------------------------------------------------------------------
# op -> (index of its reduction argument, index of its ignore_index argument)
TOKEN_MEANS = {aten.cross_entropy_loss.default: (3, 4), aten.nll_loss.default: (3, 4),
               aten.nll_loss_nd.default: (3, 4), aten.nll_loss_forward.default: (3, 4)}

CHECKS = frozenset({aten._assert_tensor_metadata.default})


__all__ = ["ALIASES", "ALIASING", "ARANGES", "AUTOCAST_REDUCED", "BROADCASTS", "CASTS", "CHECKS",
           "CONVS", "COPIES", "ELEMENTWISE", "INPLACE_ARITH", "LINEARS", "LOG_SOFTMAXES",
           "MATMULS", "MATMULS_BATCHED", "NEW_LIKE", "NORMS", "RESHAPES", "SCALES", "SDPAS",
           "SLICES", "SOFTMAXES", "SPLITS", "TOKEN_MEANS", "TRANSPOSES", "UNSQUEEZES"]
