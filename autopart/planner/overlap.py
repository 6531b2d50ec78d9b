"""What the data-parallel and ZeRO collectives leave exposed after the compute they overlap.

Both runtimes post the gradients' reduction in buckets while the backward still runs
(runtime/gradients.py: 25 MiB buckets at zero=0, ranges of 40M elements at zero >= 1; Megatron-LM's
--overlap-grad-reduce the same), so a collective of `comm` seconds overlapped with a window of
`window` seconds of compute is exposed for

    max(tail, comm - window),   tail = comm * min(1, bucket / bytes)

the last bucket at least, which starts only when the window's last gradient is final. Per level:

    zero=0  gradient all-reduce        behind the last microbatch's backward
    zero=1  gradient reduce-scatter    behind the last microbatch's backward; the parameter
            all-gather after the optimizer step: exposed under autopart's runtime (it gathers in
            step()), behind the next step's first forward under Megatron-LM's
            (--overlap-param-gather)
    zero=2  a reduce-scatter per microbatch, each behind that microbatch's backward; the all-gather
            as zero=1
    zero=3  per microbatch the forward's parameter gathers behind the forward and the backward's
            gathers and reduce-scatter behind the backward (passes/gather_parameters.py
            prefetches one layer ahead, FSDP2 as well): the first layer's gather is the tail

The windows are one microbatch's forward and backward on the fullest pipeline rank (all its
chunks). The notes say which overlap each term assumed; `autopart plan --explain-cost` prints them.
"""
from __future__ import annotations

BUCKET_BYTES = {0: 25 * 2 ** 20}      # zero=0 (DDP's bucket_cap_mb); zero >= 1: BUCKET_ELEMENTS
BUCKET_ELEMENTS = 40_000_000          # Megatron-LM's bucket_size, autopart's zero_bucket_size default


# all-reduces' worth of traffic a step at each ZeRO level: zero=2 reduce-scatters per microbatch,
# zero=3 also gathers twice per microbatch (each half an all-reduce)
_ZERO_TRAFFIC = {0: lambda m: 1.0, 1: lambda m: 1.0, 2: lambda m: (m + 1) / 2, 3: lambda m: 3 * m / 2}


def exposed(comm: float, nbytes: float, window: float, bucket: float) -> float:
    """Seconds of a `comm`-second collective of `nbytes` left after `window` seconds of compute."""
    if comm <= 0:
        return 0.0
    tail = comm * min(1.0, bucket / nbytes) if nbytes > 0 else comm
    return max(tail, comm - window)


def data_parallel_terms(zero: int, allreduce: float, grad_bytes: float, param_ratio: float,
                        microbatches: int, fwd_window: float, bwd_window: float, layers: int,
                        runtime: str) -> tuple[dict, dict]:
    """({term: exposed seconds}, {term: the overlap it assumes}) of the data-parallel traffic.
    `allreduce`: seconds of a ring all-reduce of the gradients (`grad_bytes`); a reduce-scatter or
    an all-gather moves half of it, the all-gather of parameters `param_ratio` of that (bf16
    parameters, fp32 gradients: 1/2)."""
    if runtime == "megatron-2021":       # the paper's runtime: reduced after the last backward
        return {"dp_allreduce": allreduce * _ZERO_TRAFFIC[zero](microbatches)}, {
            "dp_allreduce": "after the last backward, not overlapped (Megatron-LM 2021)"}
    half = allreduce / 2
    gather = half * param_ratio
    bucket = BUCKET_BYTES.get(zero, BUCKET_ELEMENTS * 4)     # fp32 gradient elements
    terms, notes = {}, {}
    if zero == 0:
        terms["dp_allreduce"] = exposed(allreduce, grad_bytes, bwd_window, bucket)
        notes["dp_allreduce"] = "gradient all-reduce in buckets behind the last microbatch's backward"
    elif zero in (1, 2):
        per = microbatches if zero == 2 else 1
        terms["dp_reduce_scatter"] = per * exposed(half, grad_bytes, bwd_window, bucket)
        notes["dp_reduce_scatter"] = ("gradient reduce-scatter in buckets behind "
                                      + ("each microbatch's backward" if zero == 2 else
                                         "the last microbatch's backward"))
        if runtime == "megatron":
            terms["dp_param_allgather"] = exposed(gather, grad_bytes * param_ratio, fwd_window, bucket)
            notes["dp_param_allgather"] = "parameter all-gather behind the next step's first forward"
        else:
            terms["dp_param_allgather"] = gather
            notes["dp_param_allgather"] = "parameter all-gather after the optimizer step, not overlapped"
    else:
        first = 1.0 / max(layers, 1)             # the first layer's gather: nothing to hide behind
        fwd = exposed(gather, 1.0, fwd_window, first)
        bwd = exposed(gather + half, 1.0, bwd_window, first)
        terms["zero3_gathers"] = microbatches * fwd
        terms["dp_reduce_scatter"] = microbatches * bwd
        notes["zero3_gathers"] = "each microbatch's parameter all-gathers, a layer ahead, behind its forward"
        notes["dp_reduce_scatter"] = ("each microbatch's backward gathers and gradient reduce-scatter "
                                      "behind its backward")
    return terms, notes


__all__ = ["exposed", "data_parallel_terms", "BUCKET_BYTES", "BUCKET_ELEMENTS"]
