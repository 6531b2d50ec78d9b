"""Capture: torch.export of the user's model (and loss) into one fx graph of ATen ops.

Every node keeps node.meta["val"] (a FakeTensor whose sizes are symbolic in batch and sequence
length where the model allows it), node.meta["nn_module_stack"] (the user's module paths) and
node.meta["stack_trace"] (the user's source line). Parameters and buffers become get_attr nodes
under the plain model's names, so every later program names them as the user does.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import re
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim

from autopart import layer_reuse as layer_reuse_mod
from autopart.errors import AutopartError, node_error
from autopart.ir import BATCH, SEQ, Program, TensorInfo
from autopart.vmap_regions import fold_vmap_regions



class _WithLoss(nn.Module):
    """model(*inputs) then loss_fn(output, target): the loss becomes part of the graph."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, has_target: bool):
        super().__init__()
        self.model, self.loss_fn, self.has_target = model, loss_fn, has_target
        self.stat_names = _Names()          # filled while tracing (export may copy the module)

    def forward(self, *args):
        inputs, target = (args[:-1], args[-1]) if self.has_target else (args, None)
        out = self.model(*inputs)
        if out is None:
            raise AutopartError(f"{type(self.model).__name__}.forward returned None: it must return "
                                "the loss, or the output that loss_fn turns into the loss")
        if self.loss_fn is not None:
            loss = self.loss_fn(out, target) if self.has_target else self.loss_fn(out)
            return _check_scalar(loss, "loss_fn returned")
        stats = _stats_of(out)
        if stats:       # (loss, {name: tensor}): the tensors become extra graph outputs
            self.stat_names[:] = list(stats)
            return (_as_loss(out), *stats.values())
        return _as_loss(out)


def _as_loss(out):
    if isinstance(out, torch.Tensor):
        return _check_scalar(out, "the model returned")
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not isinstance(loss, torch.Tensor):
        raise AutopartError(
            f"the model returned {type(out).__name__}, not a loss; pass loss_fn=... to turn its "
            "output (and the target) into a scalar loss")
    return _check_scalar(loss, f"the model returned {type(out).__name__} whose loss is")


class _Names(list):
    """A list that copies to itself, so what a traced copy of the wrapper records is seen."""

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


def _stats_of(out) -> dict:
    """A model returning (loss, {name: tensor}) reports training statistics beside its loss
    (routing counts, say): kept as graph outputs, summed over the global batch by the runtime."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict) and out[1] \
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in out[1].items()):
        return dict(out[1])
    return {}


def _example_shape(t: torch.Tensor) -> tuple:
    # During export sizes are symbols (s33); show the example input's sizes instead.
    return tuple(d.node.hint if isinstance(d, torch.SymInt) and getattr(d.node, "hint", None)
                 is not None else d for d in t.shape)


def _check_scalar(loss, what: str):
    # A pipeline backpropagates from one number per microbatch: logits are not a loss.
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.dtype.is_floating_point:
        desc = (f"a {loss.dtype} tensor of shape {_example_shape(loss)}" if isinstance(loss, torch.Tensor)
                else f"a {type(loss).__name__}")
        raise AutopartError(
            f"{what} {desc}, not a scalar loss.\n  remedy: pass loss_fn=... (and target=...) "
            "turning the model's output into a scalar loss, e.g. "
            "loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())")
    return loss


def capture(model: nn.Module, example_inputs: tuple, *, loss_fn: Callable | None = None,
            target: torch.Tensor | None = None, layer_reuse: bool | None = None,
            device: torch.device | None = None) -> Program:
    """Export `model` (with `loss_fn` applied) on one global batch into a Program.

    `device` (a meta-device model): trace as if its tensors were on `device` (fake tensors), so
    Python code that branches on a tensor's device (Hugging Face's MoE kernels choose CPU or CUDA
    code) takes the branch the ranks will run, not the meta device's. The Program still holds
    the meta tensors.

    With `layer_reuse` (default: on unless AUTOPART_LAYER_REUSE=0) a model whose layers repeat
    is traced with two of them and the others spliced in (autopart/layer_reuse.py): the same
    Program as tracing every layer, in a fraction of the time.

    >>> from examples.gpt import GPT, lm_loss
    >>> import torch
    >>> p = capture(GPT("tiny"), (torch.zeros(2, 64, dtype=torch.long),), loss_fn=lm_loss,
    ...             target=torch.zeros(2, 64, dtype=torch.long))
    >>> p.inputs
    ['idx', 'target']
    """
    args = tuple(example_inputs) + ((target,) if target is not None else ())
    _check_inputs(args)
    wrapper = _WithLoss(model, loss_fn, target is not None)
    args = tuple(a.clone() if a.device.type != "meta" else a.detach() for a in args)  # distinct objects
    names = _input_names(model, len(example_inputs)) + (["target"] if target is not None else [])

    def trace() -> Program:       # the model as it is when called (layer reuse shortens it)
        if device is None or not any(t.is_meta for t in model.parameters()):
            ep, dynamic = _export(wrapper, args)
        else:
            twin, fake_args = _fake_twin(model, args, device)
            wrapper.model = twin
            try:
                ep, dynamic = _export(wrapper, fake_args)
            finally:
                wrapper.model = model
        return _to_program(ep, model, args, dynamic, names)

    program = layer_reuse_mod.capture_reusing(model, trace) \
        if layer_reuse_mod.enabled(layer_reuse) else None
    program = program if program is not None else trace()
    # graph outputs 1.. (output 0 is the loss)
    return program.replace(stats=tuple(wrapper.stat_names))


def _input_names(model: nn.Module, n: int) -> list[str]:
    """The model's own forward() argument names for the first n inputs (for readable code)."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"input_{i}" for i in range(len(names), n)]


def _fake_twin(model: nn.Module, args: tuple, device) -> tuple[nn.Module, tuple]:
    """A copy of the meta `model`, and `args`, as fake tensors on `device` (one fake tensor per
    meta tensor: ties stay ties); export traces under their fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    twin, made = copy.deepcopy(model), {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        def fake(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        for m in twin.modules():
            for table in (m._parameters, m._buffers):
                for k, v in table.items():
                    if v is None or not v.is_meta:
                        continue
                    if id(v) not in made:
                        made[id(v)] = (nn.Parameter(fake(v), requires_grad=v.requires_grad)
                                       if isinstance(v, nn.Parameter) else fake(v))
                    table[k] = made[id(v)]
        fake_args = tuple(fake(a) if a.is_meta else a for a in args)
    return twin, fake_args


def _check_inputs(args: tuple) -> None:
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            raise AutopartError(f"example input {i} is a {type(a).__name__}; autopart takes tensors "
                                "whose dim 0 is the batch (wrap other arguments in the model)")
        if a.dim() == 0:
            raise AutopartError(f"example input {i} is a scalar; inputs need a batch dimension (dim 0)")


def _export(wrapper: nn.Module, args: tuple):
    """Export with symbolic batch (and sequence) sizes when the model allows, else static."""
    batch = Dim("b")
    seq_size = args[0].shape[1] if args[0].dim() > 1 else None
    seq = Dim("s", max=seq_size) if seq_size and seq_size > 1 else None

    def spec(a):
        d = {0: batch} if a.shape[0] > 1 else {}
        if seq is not None and a.dim() > 1 and a.shape[1] == seq_size:
            d[1] = seq
        return d or None

    attempts = [((tuple(spec(a) for a in args),), True), (None, False)]
    if seq is not None:  # some models tie the sequence to a fixed size: keep only the batch symbolic
        seq_static = (tuple(({0: batch} if a.shape[0] > 1 else None) for a in args),)
        attempts.insert(1, (seq_static, True))
    last_error, printed, frozen = None, "", [False]
    for dyn, dynamic in attempts:
        out = io.StringIO()
        try:
            # torch prints the partial graph and logs warnings on some failures: the error below
            # says what matters (with the user's line, read from that print when needed)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
                    _quiet("torch.fx.experimental.symbolic_shapes"):
                ep = _export_frozen_if_needed(wrapper, args, dyn, frozen)
            return ep, dynamic and args[0].shape[0] > 1
        except AutopartError:
            raise                 # ours, from inside forward (e.g. no loss): already explained
        except Exception as e:  # noqa: BLE001  (any export failure: try the next, report the last)
            last_error, printed = e, out.getvalue()
            if not _is_shape_error(e):
                break
    raise _capture_error(last_error, printed) from last_error


def _export_frozen_if_needed(wrapper: nn.Module, args: tuple, dyn, frozen: list):
    """torch.export.export; again with the parameters not requiring grad when torch's
    flex_attention front end refused them on the CPU ("does not support backward on CPU": it
    has no fused CPU backward, torch/nn/attention/flex_attention.py _validate_device), and so
    at once in later attempts (`frozen[0]` set). The graph is the same (export records no
    autograd); the op it holds, torch.ops.higher_order.flex_attention, runs forward and
    backward on the CPU by its dense reference, which is what the ranks then call."""
    if not frozen[0]:
        try:
            return torch.export.export(wrapper, args, dynamic_shapes=dyn, strict=False)
        except NotImplementedError as e:
            if "does not support backward on CPU" not in str(e):
                raise
        frozen[0] = True
    grads = [(p, p.requires_grad) for p in wrapper.parameters()]
    try:
        for p, _ in grads:
            p.requires_grad_(False)
        return torch.export.export(wrapper, args, dynamic_shapes=dyn, strict=False)
    finally:
        for p, g in grads:
            p.requires_grad_(g)


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _is_shape_error(e: Exception) -> bool:
    text = f"{type(e).__name__}: {e}"
    if "data-dependent" in text or "DataDependent" in text:
        return False    # control flow on tensor values: a static export fails the same way
    if _raised_in_symbolic_sizes(e):
        return True
    return any(k in text for k in ("Constraint", "constraint", "specializ", "guard", "Dim", "dynamic"))


def _raised_in_symbolic_sizes(e: Exception) -> bool:
    """Raised by torch's own code for symbolic sizes (torch 2.13 fails to trace a
    flex_attention mask_mod that indexes a tensor by batch and query with both sizes symbolic:
    "TypeError: mul expected 2 arguments, got 3" in proxy_tensor._build_proxy_for_sym_expr);
    fewer symbolic sizes may go through."""
    tb = traceback.extract_tb(e.__traceback__)
    return bool(tb) and tb[-1].filename.endswith(("fx/experimental/proxy_tensor.py",
                                                  "fx/experimental/sym_node.py"))


def _user_source(e: Exception, printed: str) -> str:
    """The user's file:line where the capture failed: the innermost traceback frame outside
    torch and autopart, else the last `# File:` line of the graph torch printed."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/torch/" not in f.filename and "/autopart/" not in f.filename
              and "/site-packages/" not in f.filename]
    if frames:
        f = frames[-1]
        return f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "")
    found = re.findall(r"# File: (\S+?):(\d+) in (\S+), code: (.*)", printed)
    if found:
        path, line, fn, code = found[-1]
        return f"{path}:{line} in {fn}: {code.strip()}"
    found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(e))
    user = [f for f in found if "/torch/" not in f[0] and "/autopart/" not in f[0]]
    return f"{user[-1][0]}:{user[-1][1]} in {user[-1][2]}" if user else ""


def _capture_error(e: Exception, printed: str = "") -> AutopartError:
    text = str(e)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    source = _user_source(e, printed)
    where = f"\n  source: {source}" if source else ""
    return AutopartError(f"torch.export could not capture the model: {type(e).__name__}: "
                         f"{first}{where}\n  remedy: {_remedy(e, text)}")


def _remedy(e: Exception, text: str) -> str:
    """What to do, by cause: a tracing limit, integer ids given as floats, or plain code that
    fails on the example inputs themselves."""
    if "data-dependent" in text or "DataDependent" in type(e).__name__:
        return ("the value there depends on tensor data, which a traced graph cannot branch or "
                "size on: use torch.where / torch.cond instead of a Python if on a tensor, and "
                "keep sizes independent of values (no .item()/.tolist() for a size or a slice)")
    if "'indices'" in text and ("Long, Int" in text or "scalar type" in text):
        return ("token ids used as embedding indices must be an integer tensor: pass "
                "torch.long ids (e.g. x.long()), not floats")
    tracer = type(e).__module__.startswith(("torch._dynamo", "torch.export", "torch.fx",
                                            "torch._export"))
    if tracer:
        return ("make forward() traceable: no data-dependent Python control flow on tensor "
                "values (use torch.where / torch.cond), no .item()/.tolist() on activations, no "
                "calls into non-PyTorch libraries. torch.fx.symbolic_trace is not needed: "
                "autopart uses torch.export.")
    return ("forward() (or loss_fn) raised this on the example inputs themselves, not because of "
            "tracing: check that model(*example_inputs) (and loss_fn(output, target)) runs, and "
            "that the inputs have the dtypes and shapes the model expects")


def _to_program(ep, model: nn.Module, args: tuple, dynamic: bool, names: list[str]) -> Program:
    """The exported graph with parameters and buffers as get_attr nodes under the plain model's
    names, user inputs named as forward() names them, and sizes renamed to b and s."""
    if ep.graph_signature.buffers_to_mutate:
        raise AutopartError(
            f"the model mutates buffers {sorted(ep.graph_signature.buffers_to_mutate.values())} "
            "in forward (e.g. BatchNorm running stats); autopart cannot yet split such state "
            "across ranks. Remedy: use LayerNorm/RMSNorm, or register the state as a "
            "non-persistent constant.")
    state = _State(ep, model)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []
    for node in ep.graph_module.graph.nodes:
        if node.op != "placeholder":
            if node.op == "get_attr":   # a submodule of a higher-order op (autocast, no_grad)
                state.attrs[node.target] = getattr(ep.graph_module, node.target)
            # renumbered per op in graph order (linear, linear_1, ...) without the gaps torch
            # leaves for nodes it dropped: the names then depend only on the graph, so a graph
            # spliced from repeated layers (autopart/layer_reuse.py) is named as the full trace
            env[node] = _copy_meta(graph.create_node(
                node.op, node.target, *fx.map_arg((node.args, node.kwargs), lambda n: env[n]),
                name=layer_reuse_mod.base_name(node.name) if node.op == "call_function"
                else node.name, type_expr=node.type), node)
        elif (attr := state.lift(node)) is not None:
            env[node] = _copy_meta(graph.get_attr(attr), node)
        else:
            env[node] = graph.placeholder(names[len(inputs)])
            env[node].meta = dict(node.meta)
            inputs.append(env[node].name)
    symbols = _symbol_map(ep.graph_module, args) if dynamic else {}
    for n in list(graph.nodes):
        _rename_meta(n, symbols)
        if n.op == "get_attr" and not n.users:
            graph.erase_node(n)      # the unused second name of a tied weight
    fold_vmap_regions(graph, state.attrs)     # flex_attention's BlockMask (vmap_regions.py)
    _check_no_state_mutation(graph)
    return Program(fx.GraphModule(state.attrs, graph), state.params, state.buffers, inputs,
                   int(args[0].shape[0]), int(args[0].shape[1]) if args[0].dim() > 1 else None,
                   dynamic, symbols)


class _State:
    """The model's parameters, buffers and constants as export lifted them to placeholders."""

    def __init__(self, ep, model: nn.Module):
        sig = ep.graph_signature
        self.constants = ep.constants
        self.aliases = _alias_table(model)
        self.to_param = {k: _strip(v) for k, v in sig.inputs_to_parameters.items()}
        self.to_buffer = {k: _strip(v) for k, v in sig.inputs_to_buffers.items()}
        self.to_const = dict(sig.inputs_to_lifted_tensor_constants)
        self.named = {**dict(model.named_buffers(remove_duplicate=False)),
                      **dict(model.named_parameters(remove_duplicate=False))}
        self.persistent = set(model.state_dict().keys())
        self.params: dict[str, TensorInfo] = {}
        self.buffers: dict[str, TensorInfo] = {}
        self.attrs: dict = {}

    def lift(self, node: fx.Node) -> str | None:
        """The attribute name a state placeholder becomes (None for a user input)."""
        name = self.to_param.get(node.name) or self.to_buffer.get(node.name)
        if name is not None:
            canon = self.aliases.get(name, name)
            tensor = self.named[canon]
            info = TensorInfo(canon, tuple(tensor.shape), tensor.dtype,
                              tuple(a for a, c in self.aliases.items() if c == canon and a != canon),
                              bool(getattr(tensor, "requires_grad", False)),
                              canon in self.persistent)
            trainable = node.name in self.to_param and info.requires_grad
            (self.params if trainable else self.buffers)[canon] = info
            self.attrs[canon] = tensor
            return canon
        if node.name in self.to_const:
            const = "_const_" + node.name
            value = self.constants[self.to_const[node.name]]
            if is_fake(value):     # traced as a meta model on fake tensors: no values either
                value = torch.empty(value.shape, dtype=value.dtype, device="meta")
            self.attrs[const] = value
            self.buffers[const] = TensorInfo(const, tuple(self.attrs[const].shape),
                                             self.attrs[const].dtype, (), False, False)
            return const
        return None


# Ops that update running statistics in place when their `training` flag (arg 5) is set, although
# their schemas do not mark running_mean / running_var (args 3, 4) as written.
_STAT_UPDATES = ("batch_norm", "instance_norm", "native_batch_norm", "_native_batch_norm_legit")


# in-place in their schema, but they change autograd metadata, not values (Hugging Face's
# DynamicCache detaches the empty tensors it makes in forward; on the meta device export lifts
# them as constants)
_METADATA_ONLY = {"detach_"}


def _check_no_state_mutation(graph: fx.Graph) -> None:
    """torch.export's training IR (the default since torch 2.5) keeps in-place updates of
    parameters and buffers inside the graph instead of listing them in buffers_to_mutate, so
    look for them: in-place ops on a get_attr, and norms that update running statistics."""
    found: dict[str, fx.Node] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target._schema.name.split("::")[-1] in _METADATA_ONLY:
            continue
        written = [a for a, spec in zip(node.args, node.target._schema.arguments)
                   if spec.alias_info is not None and spec.alias_info.is_write]
        if node.target._schema.name.split("::")[-1] in _STAT_UPDATES and len(node.args) > 5 \
                and node.args[5] is True:
            written += list(node.args[3:5])
        for a in written:
            if isinstance(a, fx.Node) and a.op == "get_attr":
                found.setdefault(a.target, node)
    if found:
        raise node_error(
            next(iter(found.values())), f"the model mutates buffers {sorted(found)} in forward "
            "(e.g. BatchNorm running stats); autopart cannot yet split such state across ranks",
            "use LayerNorm/RMSNorm, put the module in eval() mode, or register the state as a "
            "non-persistent constant")


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _alias_table(model: nn.Module) -> dict[str, str]:
    """name -> canonical name (the first name nn.Module gives the same tensor)."""
    canon: dict[int, str] = {}
    table = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        table[name] = canon.setdefault(id(t), name)
    return table


def _copy_meta(new: fx.Node, old: fx.Node) -> fx.Node:
    new.meta = dict(old.meta)
    return new


def _symbol_map(gm: fx.GraphModule, args: tuple) -> dict:
    """The export's shape symbols of input dims 0 and 1 -> our b and s."""
    mapping = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user = placeholders[len(placeholders) - len(args):]
    for node in user:
        val = node.meta.get("val")
        for dim, sym in ((0, BATCH), (1, SEQ)):
            if val is not None and val.dim() > dim and isinstance(val.shape[dim], torch.SymInt):
                mapping[val.shape[dim].node.expr] = sym
    return mapping


def _rename_meta(node: fx.Node, symbols: dict) -> None:
    stack = node.meta.get("nn_module_stack")
    if stack:
        node.meta["nn_module_stack"] = {
            k: (_strip(re.sub(r"^L\['self'\]\.?", "", path)), cls) for k, (path, cls) in stack.items()
            if _strip(re.sub(r"^L\['self'\]\.?", "", path)) not in ("", "model")}


def check_on_example(program: Program, args: tuple, whole: tuple | None = None) -> None:
    """Run the captured graph once on real example tensors (`args`: inputs then target, in the
    program's input order) and name the node that fails: an index past an embedding table (token
    ids >= the vocabulary, a sequence longer than the positions) would otherwise surface as
    torch's bare "index out of range" at the first train_step. Ids fed straight to an embedding
    are checked over `whole` (the whole example batch) when given. Meta tensors are not checked."""
    if any(a.device.type == "meta" for a in args) or \
            any(t.device.type == "meta" for t in program.gm.parameters()):
        return
    values = dict(zip(program.inputs, whole if whole is not None else args))
    for node in program.gm.graph.nodes:
        if node.target is torch.ops.aten.embedding.default and node.args[1].name in values:
            _check_ids(node, values[node.args[1].name], program)
    with torch.no_grad():
        _NamingInterpreter(program.gm).run(*args)


@dataclass(frozen=True)
class InputSpec:
    """What train_step must be given for one input (or the target), as compiled; checked on
    every step by runtime/step.py check_step_inputs."""
    name: str
    shape: tuple[int, ...]                   # the example's, the global batch first
    dynamic: tuple[int, ...]                 # dims >= 1 captured symbolic: at most shape[d]
    integer: bool
    embeddings: tuple[tuple[str, int], ...]  # (table, rows) of each embedding it indexes directly


def input_specs(program: Program, whole: tuple) -> tuple[InputSpec, ...]:
    """One InputSpec per input of the captured `program` (before any pass rewrites its
    embeddings), `whole` the example tensors in the program's input order."""
    tables: dict[str, list] = {}
    for node in program.gm.graph.nodes:
        ids = node.args[1] if node.target is torch.ops.aten.embedding.default else None
        if isinstance(ids, fx.Node) and ids.op == "placeholder" and ids.name in program.inputs:
            rows = int(node.args[0].meta["val"].shape[0])
            tables.setdefault(ids.name, []).append((str(node.args[0].target), rows))
    vals = {n.name: n.meta.get("val") for n in program.gm.graph.nodes if n.op == "placeholder"}
    out = []
    for name, t in zip(program.inputs, whole):
        val = vals.get(name)
        dynamic = tuple(d for d in range(1, t.dim()) if val is not None and d < val.dim()
                        and isinstance(val.shape[d], torch.SymInt))
        out.append(InputSpec(name, tuple(int(n) for n in t.shape), dynamic,
                             not (t.is_floating_point() or t.is_complex()),
                             tuple(tables.get(name, ()))))
    return tuple(out)


def _check_ids(node: fx.Node, ids: torch.Tensor, program: Program) -> None:
    rows = int(node.args[0].meta["val"].shape[0])
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        raise node_error(node, f"input {node.args[1].name!r} holds ids from {low} to {high}, but "
                         f"the embedding table {node.args[0].target} has {rows} rows",
                         f"use ids in [0, {rows}) (e.g. a vocabulary of at least {high + 1})")


class _NamingInterpreter(fx.Interpreter):
    """Runs the graph; a failing node becomes an AutopartError naming it and its source line.
    (fx appends its own context to whatever run_node raises, so the error is made in run.)"""

    def run_node(self, n: fx.Node):
        self.current = n
        return super().run_node(n)

    def run(self, *args):
        try:
            return super().run(*args)
        except Exception as e:  # noqa: BLE001  (any failure: say where, keep torch's first line)
            raise self._error(e) from e

    def _error(self, e: Exception) -> AutopartError:
        n = self.current
        text = str(e).strip()
        problem = f"the model fails on the example inputs: {type(e).__name__}: " \
                  f"{text.splitlines()[0] if text else ''}"
        if n.target is torch.ops.aten.embedding.default:
            rows = int(n.args[0].meta["val"].shape[0])
            problem += (f" (the table {n.args[0].target} has {rows} rows: an index computed from "
                        "the input sizes, e.g. positions of a sequence longer than the model's, "
                        "is past its end)")
        return node_error(n, problem, "give inputs the model accepts (sequence length, id range, "
                          "dtypes); model(*example_inputs) fails the same way")
