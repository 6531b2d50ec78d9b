"""docs/bad-input.md's rows, tried as a new user would: each gets a clear error at compile time
that names what is wrong and what to do, never a traceback from deep inside torch.

The inputs come from tests/data/bad-inputs-tried.md (what a new user got before)."""
from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autopart
from autopart.errors import AutopartError
from examples.gpt import GPT, config, lm_loss

ROOT = Path(__file__).resolve().parent.parent
GPT_FILE = str(ROOT / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def gpt():
    return GPT(config("tiny,n_layer=2"))


def ids(*shape, high=256):
    return torch.randint(0, high, shape)


class Item(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        n = int(x.sum().item()) % 3 + 1
        return self.lin(x)[:, :n].sum()


class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x).sum()
        return self.lin(x).mean()


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask):
        return (self.lin(x) * mask).sum()


class ReturnsNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.lin(x)


def _mse(out, target):
    return ((out - target) ** 2).mean()


API_CASES = {
    # name: (call, words the message must hold)
    "mesh given as a string": (
        lambda m: autopart.compile(m, "pp=2", (ids(2, 64),), loss_fn=lm_loss, target=ids(2, 64)),
        ["Mesh.parse('pp=2')"]),
    "a lambda as the model": (
        lambda m: autopart.compile(lambda x: x, autopart.Mesh(), (ids(2, 64),)),
        ["not a torch.nn.Module"]),
    "a dict of example inputs": (
        lambda m: autopart.compile(m, autopart.Mesh(), {"idx": ids(2, 64)}),
        ["example_inputs is a dict", "tuple of tensors"]),
    "an int among the example inputs": (
        lambda m: autopart.compile(m, autopart.Mesh(), (ids(2, 64), 3)),
        ["example input 1 is a int", "only tensors"]),
    "loss_fn without target": (
        lambda m: autopart.compile(m, autopart.Mesh(), (ids(2, 64),), loss_fn=lm_loss),
        ["no target was given", "target=..."]),
    "target batch differs from the inputs'": (
        lambda m: autopart.compile(m, autopart.Mesh(), (ids(8, 64),), loss_fn=lm_loss,
                                   target=ids(4, 64)),
        ["target has batch 4", "example input 0 has 8"]),
    "sequence longer than the model's positions": (
        lambda m: autopart.compile(m, autopart.Mesh(), (ids(2, 128),), loss_fn=lm_loss,
                                   target=ids(2, 128)),
        ["transformer.wpe.weight has 64 rows", "source:", "gpt.py"]),
    "token ids past the vocabulary": (
        lambda m: autopart.compile(m, autopart.Mesh(), (torch.full((4, 64), 300),),
                                   loss_fn=lm_loss, target=ids(4, 64)),
        ["ids from 300 to 300", "256 rows", "vocabulary of at least 301"]),
    "float token ids": (
        lambda m: autopart.compile(m, autopart.Mesh(), (torch.rand(2, 64),), loss_fn=lm_loss,
                                   target=ids(2, 64)),
        ["integer tensor", "torch.long"]),
    "a CPU model with meta inputs": (
        lambda m: autopart.compile(m, autopart.Mesh(), (ids(2, 64).to("meta"),),
                                   loss_fn=lm_loss, target=ids(2, 64).to("meta")),
        ["the model is on cpu but input 0 is on meta"]),
    "forward(x, mask) given one input": (
        lambda m: autopart.compile(TwoInputs(), autopart.Mesh(), (torch.randn(2, 4),)),
        ["forward takes (x, mask)", "mask would be missing"]),
    "forward returning None with a loss_fn": (
        lambda m: autopart.compile(ReturnsNone(), autopart.Mesh(), (torch.randn(2, 4),),
                                   loss_fn=_mse, target=torch.randn(2, 4)),
        ["ReturnsNone.forward returned None"]),
    ".item() used for a size": (
        lambda m: autopart.compile(Item(), autopart.Mesh(), (torch.randn(2, 4),)),
        ["source:", "test_bad_inputs.py", ".item()", "torch.where"]),
    "if on a tensor value": (
        lambda m: autopart.compile(Branch(), autopart.Mesh(), (torch.randn(2, 4),)),
        ["source:", "if x.sum() > 0", "torch.cond"]),
    "a plain Linear cut into two stages": (
        lambda m: autopart.compile(nn.Linear(4, 4), autopart.Mesh(pp=2), (torch.randn(4, 4),),
                                   loss_fn=_mse, target=torch.randn(4, 4), microbatches=2),
        ["chunk 1", "would hold no parameters", "pp=1"]),
    "a model with no parameters": (
        lambda m: autopart.compile(nn.ReLU(), autopart.Mesh(), (torch.randn(4, 4),),
                                   loss_fn=lambda o: o.sum()),
        ["no trainable parameters"]),
    "microbatches = 0": (
        lambda m: autopart.compile(m, autopart.Mesh(), (ids(2, 64),), loss_fn=lm_loss,
                                   target=ids(2, 64), microbatches=0),
        ["microbatches=0 must be >= 1"]),
    "a mesh with an axis twice": (
        lambda m: autopart.Mesh.parse("pp=2,pp=4"), ["gives pp twice"]),
}


@pytest.mark.parametrize("name", list(API_CASES))
def test_api_bad_input_gets_a_clear_error(name, gpt):
    call, words = API_CASES[name]
    with pytest.raises(AutopartError) as e:
        call(gpt)
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{name}: {w!r} not in:\n{msg}"
    assert "Traceback" not in msg and "While executing" not in msg


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "autopart", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def _files(tmp_path: Path) -> dict[str, Path]:
    out = {"missing.py": "import torch\nimport nonexistent_module_xyz\n",
           "syntax.py": "def f(:\n",
           "logits.py": ("import torch, torch.nn as nn\n"
                         "class M(nn.Module):\n"
                         "    def __init__(s):\n"
                         "        super().__init__(); s.l = nn.Linear(8, 8)\n"
                         "    def forward(s, x): return s.l(x)\n"
                         "def example_inputs(cfg, batch, device):\n"
                         "    return (torch.randn(batch, 8, device=device),)\n")}
    for name, text in out.items():
        (tmp_path / name).write_text(text)
    return {name: tmp_path / name for name in out}


CLI_CASES = {
    "model file with a missing import": (["{missing.py}:M"],
                                         ["does not load", "nonexistent_module_xyz", "missing.py:2"]),
    "model file with a syntax error": (["{syntax.py}:M"], ["does not load", "SyntaxError"]),
    "logits and no loss function": (["{logits.py}:M"], ["not a scalar loss", "--loss-fn NAME"]),
    "a config function as the model": ([GPT_FILE + ":config", "--config", "tiny"],
                                       ["NAME must be a model class", "GPT"]),
    "heads not dividing the width": ([GPT_FILE + ":GPT", "--config", "tiny,n_head=5"],
                                     ["not divisible by n_head=5", "use n_head in"]),
    "a word that is not a boolean": ([GPT_FILE + ":GPT", "--config", "tiny,tie_weights=nope"],
                                     ["tie_weights='nope' is not a valid bool"]),
    "--microbatches 0": ([GPT_FILE + ":GPT", "--microbatches", "0"],
                         ["--microbatches 0 must be at least 1"]),
    "--mesh with an axis twice": ([GPT_FILE + ":GPT", "--mesh", "pp=2,pp=4"], ["gives pp twice"]),
    "--emit onto a file": ([GPT_FILE + ":GPT", "--emit", "{syntax.py}"],
                           ["exists and is not a directory"]),
    "--memory-budget 1.2.3GB": ([GPT_FILE + ":GPT", "--config", "tiny,n_layer=2",
                                 "--memory-budget", "1.2.3GB"],
                                ["memory_budget='1.2.3GB' (--memory-budget on the command line) "
                                 "is not a size", "'20GB', '512MiB'"]),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_bad_input_is_one_clear_line_and_exit_2(name, tmp_path):
    files = _files(tmp_path)
    args, words = CLI_CASES[name]
    for key, path in files.items():
        args = [a.replace("{" + key + "}", str(path)) for a in args]
    r = _cli("compile", *args)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    for w in words:
        assert w in r.stderr, f"{name}: {w!r} not in:\n{r.stderr[-2000:]}"
    if name == "--memory-budget 1.2.3GB":
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- option values: autopart/arguments.py check_options, before anything is traced ----------------

def _compile_with(**kw):
    x = ids(2, 64)
    return autopart.compile(GPT(config("tiny,n_layer=2")), autopart.Mesh(), (x,), loss_fn=lm_loss,
                            target=x, **kw)


def _parallelize_with(**kw):   # the option checks come before the process-group one
    x = ids(2, 64)
    return autopart.parallelize(GPT(config("tiny,n_layer=2")), autopart.Mesh(), (x,),
                                loss_fn=lm_loss, target=x, **kw)


OPTION_CASES = {
    # name: (options, words the message must hold), tried on compile and parallelize
    "sequence_parallel='no'": (dict(sequence_parallel="no"),
                               ["sequence_parallel='no' is a str, not a bool",
                                "sequence_parallel=True or sequence_parallel=False"]),
    "sequence_parallel=1": (dict(sequence_parallel=1), ["sequence_parallel=1 is a int, not a bool"]),
    "a typo'd schedule": (dict(schedule="1flb"),
                          ["schedule='1flb' is not one of 'gpipe', '1f1b', 'interleaved-1f1b'"]),
    "a typo'd recompute": (dict(recompute="ful"),
                           ["recompute='ful' is not one of 'none', 'selective', 'full', 'auto'"]),
    "a typo'd precision": (dict(precision="bf-16"),
                           ["precision='bf-16' is not one of 'fp32', 'bf16'", "remedy:"]),
    "an optimizer not counted": (dict(optimizer="adamw"),
                                 ["optimizer='adamw' is not one of 'sgd', 'sgd-momentum', 'adam'",
                                  "'adam' (Adam and AdamW)"]),
    "zero as a string": (dict(zero="1"), ["zero='1' is not one of 0, 1, 2, 3", "zero=0, 1, 2 or 3"]),
    "zero=True": (dict(zero=True), ["zero=True is not one of 0, 1, 2"]),
}
PARALLELIZE_ONLY = {
    "a typo'd nonfinite": (dict(nonfinite="warn"),
                           ["nonfinite='warn' is not one of 'raise', 'skip', 'ignore'"]),
    "compile=1": (dict(compile=1), ["compile=1 is not one of False, True, 'cudagraphs'"]),
}


# autopart.compile does not take the parallelize-only options: those run through parallelize only
@pytest.mark.parametrize("name, entry", [(n, e) for e in ("compile", "parallelize")
                                         for n in OPTION_CASES] +
                         [(n, "parallelize") for n in PARALLELIZE_ONLY])
def test_bad_option_value_names_the_option_and_the_allowed_values(name, entry):
    options, words = {**OPTION_CASES, **PARALLELIZE_ONLY}[name]
    with pytest.raises(AutopartError) as e:
        (_compile_with if entry == "compile" else _parallelize_with)(**options)
    for w in words:
        assert w in str(e.value), f"{name}: {w!r} not in:\n{e.value}"


@pytest.mark.parametrize("entry", ["compile", "parallelize"])
@pytest.mark.parametrize("budget", ["1.2.3GB", -1, float("nan"), 0, float("inf"), "lots", True])
def test_bad_memory_budget_names_the_value_and_the_accepted_forms(budget, entry):
    with pytest.raises(AutopartError) as e:
        (_compile_with if entry == "compile" else _parallelize_with)(memory_budget=budget)
    msg = str(e.value)
    assert f"memory_budget={budget!r} (--memory-budget on the command line) is not a size" in msg
    assert "'20GB', '512MiB'" in msg and "GiB" in msg


def test_memory_budget_forms_that_work():
    from autopart.memory import parse_bytes
    assert parse_bytes("20GB") == 20 * 10**9 and parse_bytes(" 1.5 GiB ") == 3 * 2**29
    assert parse_bytes("20e9") == parse_bytes(20e9) == 20 * 10**9 and parse_bytes(123) == 123


# -- pm.clip_grad_norm_: runtime/gradients.py check_max_norm, before the norm's collectives ------

def _reducer(all_reduce):
    from types import SimpleNamespace

    from autopart.ir import Plan
    from autopart.runtime.gradients import GradientReducer
    plan = Plan(mesh=autopart.Mesh(dp=2), config=autopart.Config(), global_batch=2,
                microbatch_size=1, chunk_ranks=(0,), chunk_layers=(), shared_params={})
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    groups = SimpleNamespace(ep=None, model="MODEL", shared={}, dp="DP", ep_replica=None, tp=None)
    return GradientReducer(plan, {"w": p}, groups, {"pp": 0, "dp": 0, "tp": 0},
                           torch.device("cpu"), all_reduce=all_reduce), p


@pytest.mark.parametrize("max_norm", [-1.0, 0, float("nan"), float("inf"), "1.0", None, True,
                                      torch.tensor([1.0, 2.0])])
def test_clip_grad_norm_refuses_a_max_norm_that_is_not_positive_and_finite(max_norm):
    calls = []
    reducer, p = _reducer(lambda t, group=None: calls.append(group))
    with pytest.raises(AutopartError) as e:
        reducer.clip_(max_norm)
    msg = str(e.value)
    assert f"clip_grad_norm_(max_norm={max_norm!r})" in msg
    assert "max_norm must be a positive finite number" in msg and "clip_grad_norm_(1.0)" in msg
    assert calls == [], "refused before any collective (every rank refuses alike, none waits)"
    assert p.grad.tolist() == [3.0, 4.0]


def test_clip_grad_norm_with_a_good_max_norm_clips():
    reducer, p = _reducer(lambda t, group=None: None)    # one rank's sum is its own
    assert reducer.clip_(1).item() == pytest.approx(5.0)
    assert p.grad.tolist() == pytest.approx([0.6, 0.8], rel=1e-5)
    reducer.clip_(torch.tensor(10.0))                    # a one-element tensor works too


# -- pm.optimizer with zero=1: runtime/optimizer.py check_elementwise, a probe of what cls does ---

@pytest.mark.parametrize("cls,kwargs", [(torch.optim.Adafactor, {}),
                                        (torch.optim.Adafactor, dict(lr=1e-6)),
                                        (torch.optim.LBFGS, {})])
def test_zero1_refuses_an_optimizer_that_is_not_elementwise(cls, kwargs):
    from autopart.runtime.optimizer import ZeroOptimizer
    with pytest.raises(AutopartError) as e:
        ZeroOptimizer([], cls, **kwargs)      # the probe runs before any layout is touched
    msg = str(e.value)
    assert f"zero=1 steps {cls.__name__} over flat 1-D slices" in msg
    assert f"{cls.__name__} is not" in msg
    assert f"remedy: parallelize(..., zero=0) to keep {cls.__name__}" in msg and "AdamW" in msg
    if cls is torch.optim.Adafactor:
        assert "reads the parameter's shape" in msg


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, dict(lr=3e-4, weight_decay=0.1)),
                                        (torch.optim.Adam, {}),
                                        (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                        (torch.optim.SGD, dict(lr=0.0))])
def test_zero1_accepts_an_elementwise_optimizer(cls, kwargs):
    from autopart.runtime.optimizer import check_elementwise
    state = torch.random.get_rng_state()
    check_elementwise(cls, kwargs)
    assert torch.equal(torch.random.get_rng_state(), state)


# -- load_pretrained: runtime/pretrained.py, every rank checks the checkpoint before reading ------

@pytest.mark.parametrize("as_file", [False, True])
def test_load_pretrained_refuses_entries_that_are_not_tensors(as_file, tmp_path):
    from autopart.runtime.pretrained import open_checkpoint
    source = {"lin.weight": torch.zeros(2, 2), "epoch": 3}
    if as_file:
        torch.save(source, tmp_path / "ckpt.pt")
        source = tmp_path / "ckpt.pt"
    with pytest.raises(AutopartError) as e:
        open_checkpoint(source)
    msg = str(e.value)
    assert "holds 1 entry that is not a tensor: 'epoch' (a int)" in msg
    assert "remedy: pass only the model's weights" in msg and "torch.is_tensor(v)" in msg
    nested = {"model": {"lin.weight": torch.zeros(2, 2)}, "optimizer": {}, "step": 7}
    with pytest.raises(AutopartError, match=r"(?s)3 entries that are not a tensor.*ckpt\['model'\]"):
        open_checkpoint(nested)
    assert open_checkpoint({"lin.weight": torch.zeros(2, 2)}).keys() == ["lin.weight"]


# -- pm.save: runtime/checkpoint/, extra checked in the first collective, nothing left behind ---

@pytest.fixture
def one_rank_pm(single_process_group):
    from datetime import timedelta
    x = ids(2, 64)
    return autopart.parallelize(GPT(config("tiny,n_layer=2")), autopart.Mesh(), (x,),
                                loss_fn=lm_loss, target=x, timeout=timedelta(seconds=60))


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "autopart" in p.name or p.name == "ck")


def test_save_refuses_extra_that_cannot_be_pickled_before_writing(one_rank_pm, tmp_path,
                                                                   monkeypatch):
    from autopart.runtime import checkpoint
    monkeypatch.setattr(checkpoint.dcp, "save",
                        lambda *a, **k: pytest.fail("nothing is written for a bad extra"))
    with pytest.raises(AutopartError) as e:
        one_rank_pm.save(tmp_path / "ck", extra={"step": 3, "fn": lambda: 0})
    msg = str(e.value)
    assert "extra['fn'] (a function) cannot be pickled" in msg
    assert "remedy: keep only picklable values in extra" in msg and "Traceback" not in msg
    with pytest.raises(AutopartError, match=r"save\(extra=...\) is a list, not a dict"):
        one_rank_pm.save(tmp_path / "ck", extra=[3])
    assert _leftovers(tmp_path) == []


def test_a_failed_save_removes_its_temporary_folder(one_rank_pm, tmp_path, monkeypatch):
    from autopart.runtime import checkpoint

    def dies_half_way(state, storage_writer, planner, process_group=None):
        Path(storage_writer.path).mkdir(parents=True)
        (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"half")
        raise RuntimeError("disk full")
    monkeypatch.setattr(checkpoint.dcp, "save", dies_half_way)
    with pytest.raises(RuntimeError, match="disk full"):
        one_rank_pm.save(tmp_path / "ck", extra={"step": 3})
    assert _leftovers(tmp_path) == []


# -- train_step: runtime/step.py check_step_inputs, against what was compiled ---------------------

TRAIN_STEP_CASES = {
    # name: (idx, target, words the message must hold); compiled with a (2, 64) batch
    "a token id past the vocabulary": (
        lambda: torch.full((2, 64), 300), lambda: ids(2, 64),
        ["input 'idx' holds ids from 300 to 300", "embedding table transformer.wte.weight, "
         "which has 256 rows", "use ids in [0, 256)", "at least 301 rows"]),
    "a negative token id": (
        lambda: torch.full((2, 64), -1), lambda: ids(2, 64), ["holds ids from -1 to -1"]),
    "a longer sequence than compiled": (
        lambda: ids(2, 128), lambda: ids(2, 128),
        ["input 'idx' has shape (2, 128): 128 at dim 1 (the sequence), longer than the 64",
         "cut the sequences to at most 64"]),
    "float token ids": (
        lambda: torch.rand(2, 64), lambda: ids(2, 64),
        ["input 'idx' is torch.float32", "integer 'idx'", "torch.long"]),
    "an extra dimension": (
        lambda: ids(2, 64, 1), lambda: ids(2, 64), ["has shape (2, 64, 1), 3 dims", "(2, 64)"]),
    "a target of another length": (
        lambda: ids(2, 64), lambda: ids(2, 128), ["input 'target' has shape (2, 128)"]),
}


def test_train_step_refuses_inputs_unlike_the_compiled_ones(one_rank_pm):
    pm = one_rank_pm
    assert torch.isfinite(pm.train_step(ids(2, 64), target=ids(2, 64)))
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    for name, (idx, target, words) in TRAIN_STEP_CASES.items():
        with pytest.raises(AutopartError) as e:
            pm.train_step(idx(), target=target())
        for w in words:
            assert w in str(e.value), f"{name}: {w!r} not in:\n{e.value}"
    # refused before anything moved: the accumulated gradients and the step count are kept
    assert pm.steps == 1
    assert all(torch.equal(p.grad, grads[n]) for n, p in pm.named_parameters())


# -- the same global batch on every rank: runtime/groups.py check_same_batch ---------------------

def _different_batches_rank(rank, world):
    """Rank 1 passes other tokens (as each DDP rank loads its own shard); a second step with
    the same batch everywhere then trains: the refusal moved nothing."""
    import autopart
    from examples.gpt import GPT, config, lm_loss
    torch.manual_seed(0)
    model = GPT(config("tiny,n_layer=2"))
    good = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    pm = autopart.parallelize(model, autopart.Mesh(dp=2), (good,), loss_fn=lm_loss,
                              target=good, timeout=timedelta(seconds=120))
    mine = good if rank == 0 else good.flip(0)
    try:
        pm.train_step(mine, target=mine)
        refused = ""
    except AutopartError as e:
        refused = str(e)
    loss = pm.train_step(good, target=good)
    return refused, float(loss), pm.steps


def test_train_step_refuses_different_global_batches_on_different_ranks():
    from autopart.runtime.launch import spawn
    for refused, loss, steps in spawn(_different_batches_rank, 2, timeout=300, pg_timeout=120):
        assert "different global batches on different ranks" in refused, refused
        assert "ranks [0] passed batch" in refused and "ranks [1] passed batch" in refused
        assert "same whole global batch on every rank" in refused
        assert torch.isfinite(torch.tensor(loss)) and steps == 1


@pytest.mark.full     # a spawn that waits out a 10 s timeout
def test_save_called_on_one_rank_fails_within_the_timeout_naming_the_others(tmp_path):
    """Was: rank 0 still blocked after 60 s with parallelize(timeout=10 s). Now a monitored
    barrier on the model's group (runtime/groups.enter_together) fails within the timeout and
    names rank 1; nothing is written."""
    from autopart.runtime.launch import spawn
    from tests.workers.failure import save_on_one_rank
    out = spawn(save_on_one_rank, 2, 25.0, str(tmp_path / "ck"), timeout=300, pg_timeout=120)
    assert out[1] == "did not save"
    assert out[0].startswith("AutopartError after "), out[0]
    seconds = float(out[0].split("after ")[1].split(" s")[0])
    assert seconds < 30, out[0]
    assert "save: rank(s) [1] did not enter it within 10 s" in out[0], out[0]
    assert "call pm.save(...) on every rank" in out[0]
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


# -- a ZeRO optimizer built before a load that was not handed it: runtime/parallel_model.py ----

def test_zero1_optimizer_built_before_load_steps_the_loaded_weights(single_process_group,
                                                                     tmp_path):
    """Was: the optimizer kept its fp32 slices of the weights from before the load, and its next
    step silently undid the load. Now it steps the loaded weights, as a plain SGD would."""
    from datetime import timedelta
    x = ids(2, 64)
    pm = autopart.parallelize(GPT(config("tiny,n_layer=2")), autopart.Mesh(), (x,),
                              loss_fn=lm_loss, target=x, zero=1, timeout=timedelta(seconds=60))
    opt = pm.optimizer(torch.optim.SGD, lr=0.5)
    pm.save(tmp_path / "ck")
    saved = {n: p.detach().clone() for n, p in pm.named_parameters()}
    pm.train_step(x, target=x)
    opt.step()
    opt.zero_grad()
    assert any(not torch.equal(p, saved[n]) for n, p in pm.named_parameters())
    pm.load(tmp_path / "ck")                       # the optimizer not handed to it
    assert all(torch.equal(p, saved[n]) for n, p in pm.named_parameters())
    pm.train_step(x, target=x)
    expected = {n: p.detach() - 0.5 * p.grad for n, p in pm.named_parameters()}
    opt.step()
    for n, p in pm.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=1e-6, atol=1e-7)


# -- local batches: runtime/batches.py (train_step given a share; pm.local_batch) --------------

def test_train_step_refuses_none_for_an_input_the_rank_reads(one_rank_pm):
    """A rank may pass None only for what its chunks do not read (pm.batch_shard.reads); the
    one rank of Mesh() reads both."""
    pm = one_rank_pm
    with pytest.raises(AutopartError) as e:
        pm.train_step(None, target=ids(2, 64))
    assert "input 'idx' is None, but this rank's chunks read it" in str(e.value)
    assert "pm.batch_shard.reads = ['idx', 'target']" in str(e.value)
    assert "remedy: pass its share, pm.local_batch(...)" in str(e.value)
    with pytest.raises(AutopartError, match=r"local_batch: 'idx' is not the global batch \(2 "
                                            r"rows\): \(3, 64\).\n  remedy: pass the global"):
        pm.local_batch(ids(3, 64), target=ids(3, 64))
    assert pm.steps == 0
