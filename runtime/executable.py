"""The chunk programs as the executor calls them: the same graphs, cheaper calls.

runtime/executor.py interprets a rank's actions; this module lowers each program it runs to a
fast callable (flat attributes, Python bindings for hot ATen overloads, the bf16 casts before
tensor-parallel collectives, the boxed convention and in-program gradient accumulation of the
split programs), built once per GraphModule. `print(program.code)` still shows the emitted one.
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from autopart.ops import aten_groups as G
from autopart.ops import op_info

# Calling an ATen overload from Python (torch.ops.aten.linear.default) costs a few microseconds more
# than the Python binding of the same op, and `self.transformer.h.0.attn.c_attn.weight` is five
# nn.Module.__getattr__ calls: at microbatch size 1 that is a third of a chunk's forward. So each
# chunk runs a copy of its GraphModule whose parameters are flat attributes (the same Parameter
# objects, so gradients land where the printed program says) and whose ops listed in _BINDINGS call
# the binding with the same schema. `print(program.code)` still shows the emitted program.
_aten = torch.ops.aten
_BINDINGS = {   # overload -> Python binding taking the same arguments (checked in test_executor)
    _aten.linear.default: torch._C._nn.linear,
    _aten.layer_norm.default: torch.layer_norm,
    _aten.view.default: torch.Tensor.view,
    _aten.reshape.default: torch.reshape,
    _aten.transpose.int: torch.transpose,
    _aten.add.Tensor: torch.add,
    _aten.mul.Tensor: torch.mul,
    _aten.split.Tensor: torch._C._VariableFunctions.split,
    _aten.scaled_dot_product_attention.default: torch._C._nn.scaled_dot_product_attention,
    _aten.gelu.default: torch._C._nn.gelu,
    _aten.embedding.default: torch.embedding,
    _aten.dropout.default: torch.dropout,
    _aten.sym_size.int: torch.Tensor.size,
}
_EXECUTABLE: "weakref.WeakKeyDictionary[fx.GraphModule, dict]" = weakref.WeakKeyDictionary()


def _cast_before(node: fx.Node) -> bool:
    """Whether, under bf16, `node`'s input is cast before it: an op whose output feeds a linear
    (the registry's `before_linear`, autopart/ops/registry.py), except when a custom op reads it
    (Hugging Face's grouped matmul of an expert split over tp): autocast leaves custom ops
    alone, so it would meet a bf16 input and fp32 weights."""
    info = op_info(node.target)
    if info is None or not info.before_linear:
        return False
    return not any(isinstance(u.target, torch._ops.OpOverload) and u.target.namespace != "aten"
                   for u in node.users)


def _cast_floating(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x


def executable(gm: fx.GraphModule, owner: fx.GraphModule | None = None,
               autocast: torch.dtype | None = None,
               accumulate: tuple[str, ...] | None = None) -> fx.GraphModule:
    """The copy of `gm` the executor runs (built on first use, once per GraphModule). With
    `owner` (the chunk's forward program, as this rank holds it: its own shards, on its device),
    attributes are read from `owner` where it has them, so a split program uses the chunk's
    very parameters. `autocast` (bf16): the copy runs under autocast to it (precision="bf16"),
    so export's dtype assertions, which hold for the traced fp32 dtypes only, check device and
    layout only, and the tensor-parallel ops that feed a linear get its input already cast
    (the registry's `before_linear`), so that their collectives carry bf16 too.

    A split program (one with an `owner`: split_backward's forward, I and W) is called boxed,
    with its inputs in one list that it empties (_Boxed). `accumulate` (W: the parameter names of
    its outputs, in order): the copy adds each gradient into its parameter's .grad right after
    the gradient's last use in the program and returns nothing, as autograd's AccumulateGrad
    does during a fused backward, instead of holding every weight gradient until the end."""
    if owner is None:
        fast = _EXECUTABLE.setdefault(gm, {}).get(autocast)
        if fast is None:
            fast = _EXECUTABLE[gm][autocast] = _fast_copy(gm, gm, autocast)
        return fast
    per_owner = _EXECUTABLE_OF.setdefault(owner, {})
    fast = per_owner.get((id(gm), autocast))
    if fast is None:
        fast = _fast_copy(gm, owner, autocast)
        if accumulate is not None:
            _accumulate_in_program(fast, [_attr(owner, n) for n in accumulate])
        fast.graph.set_codegen(_Boxed())
        fast.recompile()
        per_owner[(id(gm), autocast)] = fast
    return fast


class _Boxed(fx.graph.CodeGen):
    """`forward(self, args)`: the inputs come in one list, which the program empties once it has
    named them, so that each input is freed after its last use in the program (FX's code drops
    every value after its last use; a caller's argument tuple would hold the inputs to the end).
    AOTAutograd calls its compiled graphs the same way (torch.fx.graph._BoxedCodeGen). Measured
    on a W program of 4 GPT layers (n_embd=256, 256 tokens): the unboxed call kept ~11 MB more
    alive, which the allocator took back from the OS on every call (2.6-3.0 thousand page
    faults, 10% of the program's time)."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, **kwargs):
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        lines = [f"def {self._func_name}(self, args){maybe_return_annotation}:"]
        if names:
            lines += [f"    {', '.join(names)}, = args", "    args.clear()"]
        return "\n".join(lines)


def _accumulate_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Add `grad` into param.grad as autograd's AccumulateGrad does outside grad mode (the first
    gradient is taken as it is)."""
    if grad is None:
        return
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad += grad


def _accumulate_in_program(gm: fx.GraphModule, params: list) -> None:
    """Rewrite W's executable copy: each output gradient is added into its parameter's .grad
    after its last use (not at once after it is made: a first gradient is kept as .grad itself,
    and a later in-place add must not change a value the program still reads)."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    order = {n: i for i, n in enumerate(graph.nodes)}
    places = [(i, grad, param, max((u for u in grad.users if u is not output),
                                   key=order.__getitem__, default=grad))
              for i, (grad, param) in enumerate(zip(output.args[0], params))
              if isinstance(grad, fx.Node)]
    for i, grad, param, last in places:
        name = f"_grad_of_{i}"
        gm.register_parameter(name, param)
        with graph.inserting_after(last):
            holder = graph.get_attr(name)
        with graph.inserting_after(holder):
            graph.call_function(_accumulate_grad, (holder, grad))
    output.args = (None,)
    graph.lint()


_EXECUTABLE_OF: "weakref.WeakKeyDictionary[fx.GraphModule, dict]" = weakref.WeakKeyDictionary()


def _fast_copy(gm: fx.GraphModule, owner: fx.GraphModule,
               autocast: torch.dtype | None = None) -> fx.GraphModule:
    root, graph, env, flat_of = torch.nn.Module(), fx.Graph(), {}, {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            flat = flat_of.get(node.target)
            if flat is None:
                flat = flat_of[node.target] = f"_{len(flat_of)}_" + node.target.replace(".", "_")
                value = _attr(owner, node.target)
                if value is None:
                    value = _attr(gm, node.target)
                if isinstance(value, torch.nn.Parameter):
                    root.register_parameter(flat, value)
                elif isinstance(value, torch.Tensor):
                    root.register_buffer(flat, value)
                elif isinstance(value, fx.GraphModule):   # a recomputed region: fast too
                    setattr(root, flat, _fast_copy(value, value, autocast))
                else:
                    setattr(root, flat, value)      # a submodule (higher-order op body)
            env[node] = graph.get_attr(flat)
        else:
            if autocast is not None and _cast_before(node):
                # autocast would cast x to bf16 inside the linear, after the op: the op's
                # collectives (copy_to_tp's backward all-reduce, the sequence-parallel gathers)
                # would move fp32. Cast before it, to the value the linear reads anyway.
                x = env[node.args[0]]
                env[node.args[0]] = graph.call_function(_cast_floating, (x, autocast))
            env[node] = graph.node_copy(node, env.__getitem__)
            if owner is not gm and env[node].kwargs.get("device") == torch.device("meta"):
                # a split program traced from a meta-device model: make its tensors where the
                # chunk's parameters now live
                env[node].update_kwarg("device", _device_of(owner))
            if node.op == "call_function" and node.target in _BINDINGS:
                env[node].target = _BINDINGS[node.target]
            if autocast is not None and node.target in G.CHECKS:
                env[node].update_kwarg("dtype", None)
    graph.lint()
    return fx.GraphModule(root, graph, class_name=f"{type(gm).__name__}Executable")


def _attr(module: torch.nn.Module, target: str):
    owner, _, leaf = target.rpartition(".")
    try:
        return getattr(module.get_submodule(owner), leaf)
    except AttributeError:
        return None


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


__all__ = ["executable"]
