"""autopart's ops layer: differentiable collectives and pipeline markers that rank programs call.

    autopart.ops.tp     tensor-parallel collectives (Megatron's f/g, sequence-parallel ones,
                        vocabulary-parallel embedding and cross-entropy), with TPComm
    autopart.ops.ep     expert-parallel all-to-alls, with EPComm
    autopart.ops.p2p    pipeline send/receive markers (identity at run time)
    autopart.ops.fp8    FP8 linears with dynamic scaling (tensorwise, rowwise)
    autopart.ops.zero   ZeRO-3's parameter all-gathers and frees, with ParamShards
    autopart.ops.comm   GroupComm: the process group a program's collectives run over
    autopart.ops.registry  which function is which op (kind, axis), looked up by identity
    autopart.ops.aten_groups  the ATen op groups (views, casts, matmuls, softmaxes...), written once

Imported by passes (which insert the ops) and by the runtime (which binds their groups); imports
no pass and no runtime module.
"""
from autopart.ops import comm, ep, fp8, p2p, registry, tp, zero
from autopart.ops.registry import OpInfo, is_autopart_op, op_info

__all__ = ["OpInfo", "comm", "ep", "fp8", "is_autopart_op", "op_info", "p2p", "registry", "tp", "zero"]
