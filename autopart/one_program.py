"""One captured program on every rank: rank 0 runs torch.export, the others receive its graph.

A forward whose ops depend on the process (Gemma3 and ModernBERT loop over
`set(config.layer_types)`, whose order follows the string hash seed) traces differently on
different ranks, and every rank tracing on its own also spends the whole capture time. So
parallelize captures once: rank 0 captures, serializes the graph (torch.fx's GraphPickler: every
node's FakeTensor `val`, its symbolic sizes and their ShapeEnv, the user's module paths and source
lines) without the model's weights, and broadcasts it over the default process group; the other
ranks rebuild the Program around their own model's parameters and buffers, by name. The passes
after capture are functions of the graph, so every rank compiles one program; the digest check
(runtime/groups.check_same_program) stays as the safety net.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.fx._graph_pickler import GraphPickler, Options
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autopart.errors import AutopartError
from autopart.ir import Program

# node metadata that passes or error messages read; the rest (torch's bookkeeping) stays behind
_META_KEPT = {"val", "tensor_meta", "stack_trace", "nn_module_stack"}
_PROGRAM, _ERROR, _TRACE_OWN = 0, 1, 2


def program_bytes(program: Program) -> bytes:
    """`program` as bytes for `program_from_bytes`: its graph with every node's metadata, its
    fields but `gm`, and the values of the attributes that are not the model's state (lifted
    constants, the submodules of higher-order ops). Weights travel as meta tensors."""
    state = set(program.params) | {n for n, i in program.buffers.items()
                                   if not n.startswith("_const_")}
    attrs = {}
    for node in program.gm.graph.nodes:
        if node.op == "get_attr" and node.target not in attrs:
            value = _fetch(program.gm, node.target)
            attrs[node.target] = _weightless(value) if node.target in state else value
    weightless = fx.GraphModule(attrs, program.gm.graph)
    fields = {k: v for k, v in vars(program).items() if k != "gm"}
    # every op by name, custom ones too (transformers' grouped_mm_fallback): each rank built the
    # same model, so the libraries that registered them are loaded there as well
    options = Options(ops_filter=None, node_metadata_key_filter=_META_KEPT.__contains__)
    return GraphPickler.dumps((weightless, fields), options)


def program_from_bytes(data: bytes, model: nn.Module) -> Program:
    """The Program `program_bytes` wrote, its state bound to `model`'s own tensors by name (the
    canonical names capture gave them: tied weights are one tensor here too)."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    weightless, fields = GraphPickler.loads(data, mode)
    named = {**dict(model.named_buffers(remove_duplicate=False)),
             **dict(model.named_parameters(remove_duplicate=False))}
    attrs = {}
    for node in weightless.graph.nodes:
        if node.op == "get_attr" and node.target not in attrs:
            attrs[node.target] = named[node.target] if node.target in named else \
                _fetch(weightless, node.target)
    return Program(gm=fx.GraphModule(attrs, weightless.graph), **fields)


def _fetch(gm: nn.Module, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _weightless(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
        else meta


def capture_once(capture: Callable[[], Program], model: nn.Module, inputs: tuple) -> Program:
    """Collective on the default group: rank 0 runs `capture` and broadcasts what it made (or
    the error it raised, which every rank then raises); the others wait for it (`_wait`) and
    rebuild it around `model`. A rank whose model or example `inputs` differ from rank 0's
    (`fingerprint`) traces its own instead, and the digest check after compiling names the
    ranks that differ (runtime/groups.check_same_program); so does every rank when rank 0
    cannot serialize its graph (an op the pickler does not take), as before capture once."""
    device, mine = _device(), fingerprint(model, inputs)
    if dist.get_rank() == 0:
        try:
            program = capture()
        except Exception as e:  # noqa: BLE001  (every rank must hear of it, not only rank 0)
            _send(_ERROR, mine + _error_text(e).encode(), device)
            raise
        try:
            kind, data = _PROGRAM, program_bytes(program)
        except Exception:  # noqa: BLE001  (a graph the pickler refuses: each rank traces it)
            kind, data = _TRACE_OWN, b""
        _send(kind, mine + data, device)
        return program
    kind, data = _receive(device)
    if kind == _ERROR:
        raise AutopartError(data[len(mine):].decode())
    if kind == _TRACE_OWN or data[:len(mine)] != mine:
        return capture()
    return program_from_bytes(data[len(mine):], model)


def fingerprint(model: nn.Module, inputs: tuple) -> bytes:
    """16 bytes that differ between ranks whose captures would: the model's parameters and
    buffers (names, shapes, dtypes, trainable or not) and the example inputs' shapes and
    dtypes. Not devices: rank r computes on cuda:r."""
    h = hashlib.sha1()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        h.update(f"{name}{tuple(t.shape)}{t.dtype}{t.requires_grad};".encode())
    for t in inputs:
        if t is not None:
            h.update(f"{tuple(t.shape)}{t.dtype};".encode())
    return h.digest()[:16]


def _error_text(e: Exception) -> str:
    if isinstance(e, AutopartError):
        return str(e)
    return f"rank 0 could not capture the model: {type(e).__name__}: {e}"


def _device() -> torch.device:
    """Where the broadcast's tensors live: the CPU under Gloo, the rank's GPU under NCCL."""
    if "nccl" not in str(dist.get_backend()):
        return torch.device("cpu")
    from autopart.runtime.launch import rank_device
    return rank_device()


def _send(kind: int, data: bytes, device: torch.device) -> None:
    header = torch.tensor([kind, len(data)], dtype=torch.long, device=device)
    _wait(dist.broadcast(header, src=0, async_op=True))
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    _wait(dist.broadcast(body, src=0, async_op=True))


def _receive(device: torch.device) -> tuple[int, bytearray]:
    header = torch.zeros(2, dtype=torch.long, device=device)
    _wait(dist.broadcast(header, src=0, async_op=True))
    kind, size = (int(v) for v in header.tolist())
    data = bytearray(size)   # Gloo writes into it: no tensor to allocate, none to copy out of
    body = torch.frombuffer(data, dtype=torch.uint8) if device.type == "cpu" else \
        torch.empty(size, dtype=torch.uint8, device=device)
    _wait(dist.broadcast(body, src=0, async_op=True))
    return kind, data if device.type == "cpu" else bytearray(body.cpu().numpy().tobytes())


def _wait(work) -> None:
    """Wait within the default group's timeout (init_process_group's `timeout=`): rank 0's
    capture is compute, which may take minutes on a large model, not a peer's message, which
    parallelize's shorter `timeout` bounds."""
    try:
        work.wait()
    except RuntimeError as e:
        raise AutopartError(
            "the captured program did not reach every rank within the default process group's "
            "timeout: rank 0 captures the model and sends its graph to the others "
            f"({str(e).splitlines()[0][:200]}).\n  remedy: check rank 0's own error; if rank 0 "
            "is only slow to capture (a large model), pass a longer timeout= to "
            "torch.distributed.init_process_group") from e


__all__ = ["capture_once", "fingerprint", "program_bytes", "program_from_bytes"]
