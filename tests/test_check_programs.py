"""The compile-time program checker (autopart/check_programs.py): every distinct rank program runs
forward and backward on fake tensors before compile returns; a program that cannot run is an
AutopartError naming the node, the user's source line, the pass and the shapes."""
from __future__ import annotations

import pytest
import torch

import autopart
from autopart.check_programs import check_rank_programs
from autopart.ops import tp as tp_ops
from examples.gpt import GPT, config, lm_loss

aten = torch.ops.aten


def _compiled(mesh, **kw):
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 16))
    return autopart.compile(GPT(config("tiny,n_layer=2")), mesh, (x,), loss_fn=lm_loss,
                            target=x, **kw)


def _break_a_view(compiled, chunk: int = 0):
    """Make the first head-split view of a chunk ask for one head too many."""
    gm = compiled.program.chunks[chunk].gm
    view = next(n for n in gm.graph.nodes if n.target is aten.view.default and len(n.args[1]) == 4)
    sizes = list(view.args[1])
    sizes[2] += 1
    view.args = (view.args[0], sizes)
    gm.recompile()
    return view.name


@pytest.mark.parametrize("mesh", [autopart.Mesh(pp=2), autopart.Mesh(tp=2),
                                  autopart.Mesh(pp=2, tp=2, dp=2)], ids=str)
def test_compiled_programs_pass(mesh):
    report = check_rank_programs(_compiled(mesh, microbatches=2))
    assert report["checked"] == mesh.pp and report["skipped"] == []


def test_wrong_view_names_node_source_pass_and_shapes():
    compiled = _compiled(autopart.Mesh(pp=2), microbatches=2)
    name = _break_a_view(compiled)
    with pytest.raises(autopart.AutopartError) as err:
        check_rank_programs(compiled)
    text = str(err.value)
    assert f"{name} (aten.view.default)" in text
    assert "pipeline rank 0, chunk 0" in text
    assert "examples/gpt.py" in text                    # the user's source line
    assert "produced by: emit_rank_programs" in text
    assert "float32[2, 16, 64]" in text                 # the view's input: microbatch 2, seq 16
    assert "shape '[2, 16, 5, 16]' is invalid for input of size 2048" in text
    assert "While executing" not in text


def test_wrong_view_on_a_shard_blames_split_tensor_parallel():
    compiled = _compiled(autopart.Mesh(tp=2))
    _break_a_view(compiled)
    with pytest.raises(autopart.AutopartError, match="produced by: split_tensor_parallel"):
        check_rank_programs(compiled)


def test_collectives_have_their_real_output_shapes_on_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    comm = tp_ops.TPComm(4, 1, shape_only=True)
    with FakeTensorMode():
        x = torch.empty(2, 8, 6)
        assert tp_ops.gather_from_tp(x, 1, comm).shape == (2, 32, 6)
        assert tp_ops.reduce_scatter_tp(x, 1, comm).shape == (2, 2, 6)
        assert tp_ops.scatter_to_tp(x, 2, comm).shape == (2, 8, 2)
        assert tp_ops.reduce_from_tp(x, comm).shape == x.shape
    with pytest.raises(RuntimeError, match="not bound"):    # a real program still refuses
        tp_ops.reduce_from_tp(torch.ones(2), tp_ops.TPComm(2))


def test_compile_runs_the_checker():
    compiled = _compiled(autopart.Mesh(pp=2), microbatches=2)
    assert compiled.check["checked"] == 2


def test_the_check_counts_the_saved_bytes_the_memory_table_reads():
    """One fake run per distinct chunk serves the check and the memory table: the table makes no
    run of its own, and what it reads equals memory.chunk_activations' separate (CPU) run."""
    from autopart.memory import chunk_activations, local_shaper
    compiled = _compiled(autopart.Mesh(pp=2, tp=2), microbatches=2)
    runs = compiled.activation_runs
    assert compiled.check["checked"] == 2 and runs.runs == 0
    b, s = compiled.plan.microbatch_size, compiled.program.seq_len
    local = local_shaper(compiled.program, compiled.plan.mesh)
    for rank in (0, 2):                         # pipeline ranks 0 and 1 (tp rank 0)
        for c, acts in compiled.memory.activations(rank).items():
            alone = chunk_activations(compiled.program.chunks[c], compiled.program, b, s, local)
            assert (acts.saved, acts.per_layer, acts.sends) == \
                (alone.saved, alone.per_layer, alone.sends)
    assert runs.runs == 0                       # the table reused the check's runs


@torch.fx.wrap
def _fails_with_grad_off(x):
    torch._C._set_grad_enabled(False)    # as a higher-order op left half run does
    raise RuntimeError("an op that fails")


def test_a_fake_run_that_fails_leaves_grad_mode_on():
    """HF's rotary embedding runs under wrap_with_set_grad_enabled; a fake run failing in such a
    region once left grad mode off for the user's first real step (its backward then failed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopart.memory import SavedCounter

    class M(torch.nn.Module):
        def forward(self, x):
            return _fails_with_grad_off(x)
    gm = torch.fx.symbolic_trace(M())
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="an op that fails"):
        SavedCounter(gm, mode, {}, 1, 1, lambda name, shape: shape, set()).count(torch.empty(2))
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("mesh", [autopart.Mesh(dp=2, ep=2), autopart.Mesh(tp=2),
                                  autopart.Mesh(pp=2)], ids=str)
def test_bf16_programs_check_under_autocast_as_the_runtime_runs_them(mesh):
    """precision="bf16": the check runs each program under the runtime's autocast; export's fp32
    dtype assertions are relaxed as the runtime relaxes them (an expert einsum, tp, a meta model)."""
    from examples.switch import SwitchGPT
    from examples.switch import config as switch_config
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 16))
    if mesh.ep > 1:     # tests/workers/common.py's Switch: forward(idx, targets) returns the loss
        model = SwitchGPT(switch_config("tiny,n_layer=4,n_embd=32,d_ff=64,vocab_size=128,"
                                        "block_size=16,group_size=16"))
        x, kw = (x, x), {}
    else:
        with autopart.meta_device():
            model = GPT(config("tiny,n_layer=2"))
        kw = dict(loss_fn=lm_loss, target=x.to("meta"))
        x = x.to("meta")
    compiled = autopart.compile(model, mesh, x if isinstance(x, tuple) else (x,), precision="bf16",
                                microbatches=2 if mesh.pp > 1 else 1, **kw)
    assert compiled.check["skipped"] == [] or mesh.ep > 1
    assert compiled.memory[0]["activations"] > 0


def test_a_meta_model_is_checked_on_its_inputs_device():
    """A model built on the meta device for ranks on GPUs (the GPU smoke's "meta model" row on
    an H100): parallelize traces it as if on CUDA, so the chunks' inputs are CUDA fakes; the
    check made the meta weights CPU fakes, then meta ones, and both met the CUDA inputs in the
    first op ("found two different devices meta, cuda:0"): parallelize refused a program that
    trains. The meta weights go where the inputs are; the CPU when those are meta too. A
    CPU-only torch aborts on autograd over CUDA fakes, so this checks where the runner puts
    the weights; the smoke's row runs the whole program on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from autopart.check_programs import _FakeRunner
    with autopart.meta_device():
        model = GPT(config("tiny,n_layer=2"))
    x = torch.randint(0, 256, (4, 16), device="meta")
    compiled = autopart.compile(model, autopart.Mesh(), (x,), loss_fn=lm_loss, target=x)
    chunk, program = compiled.program.chunks[0], compiled.program

    def runner(materialize=True):
        return _FakeRunner(chunk, program, 4, 16, lambda name, shape: shape, materialize)
    assert runner().home == torch.device("cpu")         # meta inputs: a CPU program
    assert runner()._device(torch.device("meta")) == torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        for ph in chunk.gm.graph.find_nodes(op="placeholder"):
            val = ph.meta.get("val")
            if isinstance(val, torch.Tensor):
                ph.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device="cuda:0")
    ours = runner()
    with ours.mode:                                     # as check() runs it
        weight = ours.fetch_attr("transformer.wte.weight")
    assert weight.device == torch.device("cuda", 0) and ours.moved
    assert ours.device_type == "cuda"                   # autocast applies there
    assert runner(materialize=False)._device(torch.device("meta")).type == "meta"
