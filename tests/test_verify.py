"""`autopart verify` and `autopart.verify`: a layout trained beside the plain model on local Gloo
ranks, compared per parameter group (autopart/verification.py, autopart/cli/verify.py).

Fast tier: the report, the comparison (NaN fails), --shrink on configs (no processes), bad flags,
one passing run and one run with a deliberately wrong plain copy, one passing run with
--local-batches (2 ranks each). Full tier: a Hugging Face GPT-2 with tp=2, the Switch MoE with
dp=2 x ep=2, a shrunk gpt3-175b with tp=2 x pp=2 under zb-v, --local-batches on pp=2 x dp=2
passing and failing with a rank fed another replica's rows, and the Python API with a builder
function (local_batches=True on dp=2 x cp=2 too).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import autopart
from autopart import rehearsal_config as RC
from autopart import verification as V
from autopart.cli import main
from autopart.mesh import Mesh

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py") + ":GPT"
SWITCH = str(ROOT / "examples" / "switch.py") + ":SwitchGPT"
TIMEOUT = ["--timeout", "400"]      # every spawned run is bounded (spawn kills what is left)

REPORT_KEYS = {"ok", "mesh", "world", "steps", "optimizer", "lr", "rtol", "atol", "losses",
               "groups", "first_differing", "unused", "problems", "notes", "seconds",
               "max_diff", "model", "config", "parameters", "shrunk", "batch", "schedule",
               "microbatches", "local_batches", "fed"}
GROUP_KEYS = {"group", "parameters", "elements", "max_diff", "ok", "verdict", "first_differing",
              "detail"}
LOSS_KEYS = {"step", "parallel", "plain", "diff", "ok"}

HF_GPT2 = '''
import torch.nn.functional as F
import transformers

transformers.logging.set_verbosity_error()
GPT2LMHeadModel = transformers.GPT2LMHeadModel


def config(spec=None):
    return transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256,
                                   n_positions=32, bos_token_id=0, eos_token_id=0)


def lm_loss(out, target):
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
'''


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(["verify", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- the report and the comparison (one process) --------------------------------------------------

def test_group_of_reads_like_the_model():
    assert V.group_of("transformer.h.0.attn.c_attn.weight") == "transformer.h.0"
    assert V.group_of("model.layers.11.mlp.gate_proj.weight") == "model.layers.11"
    assert V.group_of("transformer.wte.weight") == "transformer.wte"
    assert V.group_of("model.norm.weight") == "model.norm"
    assert V.group_of("lm_head.weight") == "lm_head"


def test_compare_fails_on_non_finite_values_and_differences():
    a = torch.ones(4)
    assert V.compare(a, a.clone(), 1e-5, 1e-6) == (0.0, None)
    nan = a.clone()
    nan[2] = float("nan")
    diff, detail = V.compare(nan, a, 1e-5, 1e-6)
    assert diff == math.inf and "non-finite" in detail and "parallel" in detail
    diff, detail = V.compare(a, nan, 1.0, 1.0)          # however loose the tolerance
    assert diff == math.inf and "plain" in detail
    diff, detail = V.compare(a + 1e-3, a, 1e-5, 1e-6)
    assert detail is not None and abs(diff - 1e-3) < 1e-6     # fp32 1 + 1e-3


def _rank_result(rank, params, losses=((2.0, 2.0),), had_grad=None):
    order = ["emb.weight", "layers.0.w", "layers.1.w", "head.weight", "unused.weight"]
    return {"rank": rank, "losses": list(losses), "params": params, "order": order,
            "numel": {n: 4 for n in order}, "had_grad": had_grad or order[:4], "dropout": []}


def test_merge_groups_ranks_and_names_the_first_differing_parameter():
    ok = {"emb.weight": (1e-8, None), "layers.0.w": (2e-8, None), "head.weight": (0.0, None)}
    bad = {"layers.1.w": (3e-3, "1 of 4 elements differ"), "head.weight": (0.0, None)}
    report = V.merge([_rank_result(0, ok), _rank_result(1, bad)], mesh=Mesh(pp=2), steps=1,
                     optimizer="sgd")
    assert not report.ok
    assert [g.group for g in report.groups] == ["emb", "layers.0", "layers.1", "head"]
    assert [g.verdict for g in report.groups] == ["PASS", "PASS", "FAIL", "PASS"]
    assert report.first_differing == "layers.1.w"
    assert report.groups[2].detail.startswith("rank 1: ")
    assert report.unused == ["unused.weight"]
    text = str(report)
    assert "FAIL" in text and "layers.1.w" in text and "first differing parameter" in text
    d = report.to_dict()
    json.dumps(d)                                          # inf/nan become strings
    assert {"ok", "groups", "losses", "first_differing", "max_diff"} <= set(d)


def test_merge_fails_on_a_nan_loss_and_on_a_parameter_no_rank_holds():
    params = {n: (0.0, None) for n in ("emb.weight", "layers.0.w", "layers.1.w")}
    report = V.merge([_rank_result(0, params, losses=((float("nan"), 2.0),))], mesh=Mesh(),
                     steps=1, optimizer="sgd")
    assert not report.ok and not report.losses[0].ok
    assert report.first_differing == "head.weight"        # it had a gradient, no rank holds it
    assert json.loads(json.dumps(report.to_dict()))["losses"][0]["parallel"] == "nan"


def test_tolerances_are_the_stated_ones():
    assert V.tolerance_for("sgd") == (1e-5, 1e-6)
    assert V.tolerance_for("adam") == (1e-5, 1e-5)
    assert V.tolerance_for("sgd", (1e-4, 1e-5)) == (1e-4, 1e-5)
    with pytest.raises(autopart.AutopartError):
        V.tolerance_for("lamb")


# -- --shrink on configs (no processes) -----------------------------------------------------------

def _shrunk(cfg, mesh, v=1):
    return RC.apply_changes(cfg, RC.config_changes(cfg, mesh, v))


@pytest.mark.parametrize("tp,pp,v", [(2, 2, 2), (8, 4, 2), (4, 1, 1)])
def test_shrink_keeps_heads_divisible_by_tp_and_layers_at_least_chunks(tp, pp, v):
    from examples.gpt import config
    cfg = _shrunk(config("gpt3-175b"), Mesh(tp=tp, pp=pp), v)
    assert cfg.n_head % tp == 0 and cfg.n_embd % cfg.n_head == 0
    assert cfg.n_layer >= pp * v
    assert cfg.vocab_size % tp == 0
    assert cfg.n_embd <= 16 * 8 and cfg.vocab_size <= 256 and cfg.block_size <= 32
    assert cfg.n_params() < 4e6


def test_shrink_hugging_face_llama_keeps_grouped_kv_heads():
    import transformers
    big = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                   num_hidden_layers=32, intermediate_size=11008, vocab_size=32000,
                                   max_position_embeddings=4096)
    cfg = _shrunk(big, Mesh(tp=4, pp=2))
    assert cfg.num_attention_heads % 4 == 0 and cfg.num_key_value_heads % 4 == 0
    assert cfg.num_attention_heads > cfg.num_key_value_heads          # still grouped-query
    assert cfg.hidden_size == cfg.num_attention_heads * cfg.head_dim
    assert cfg.num_hidden_layers >= 2 and cfg.intermediate_size % 4 == 0
    assert big.hidden_size == 4096                                    # the original is untouched
    model = transformers.LlamaForCausalLM(cfg)                        # it builds
    assert sum(p.numel() for p in model.parameters()) < 1e6


def test_shrink_mixtral_experts_divisible_by_ep():
    import transformers
    big = transformers.MixtralConfig(hidden_size=4096, num_attention_heads=32,
                                     num_key_value_heads=8, num_hidden_layers=32,
                                     intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000)
    cfg = _shrunk(big, Mesh(dp=4, ep=4))
    assert cfg.num_local_experts % 4 == 0 and cfg.num_local_experts >= 2


def test_shrink_refuses_what_the_full_layout_cannot_take():
    from examples.gpt import config
    with pytest.raises(autopart.AutopartError, match="n_head=96 is not divisible by tp=5"):
        RC.config_changes(config("gpt3-175b"), Mesh(tp=5))
    with pytest.raises(autopart.AutopartError, match="fewer than pp"):
        RC.config_changes(config("tiny"), Mesh(pp=4), 2)


def test_shrink_through_the_command_line_builds_a_small_switch_model():
    from autopart.cli import build_parser
    from autopart.cli.verify import _job, _prepare
    args = build_parser().parse_args(["verify", SWITCH, "--config", "switch-base",
                                      "--mesh", "dp=2,ep=2", "--shrink"])
    prepared = _prepare(_job(args))
    assert prepared["n_params"] < 2e6
    assert prepared["shrunk"]["num_experts"] % 2 == 0 and prepared["shrunk"]["n_layer"] >= 1
    assert "shrunk (--shrink): " in prepared["notes"][0]
    idx, targets = prepared["inputs"]
    assert idx.max() < prepared["shrunk"]["vocab_size"] and not torch.equal(idx, targets)


# -- bad input: one line, exit 2 ------------------------------------------------------------------

@pytest.mark.parametrize("argv,says", [
    (["--config", "tiny", "--mesh", "dp=16"], "at most 8"),
    (["--config", "tiny", "--steps", "0"], "--steps 0"),
    (["--config", "tiny", "--tolerance", "tight"], "--tolerance 'tight'"),
    (["--config", "tiny", "--tolerance", "1e-5,-1"], "two numbers >= 0"),
    (["--config", "tiny", "--precision", "bf16"], "bf16"),
    (["--config", "tiny", "--mesh", "pp=2", "--schedule", "zb-v"], "virtual_stages=2"),
    (["--config", "tiny", "--mesh", "tp=3"], "tp"),                         # compile error
    (["--config", "gpt3-175b", "--mesh", "tp=5", "--shrink"], "n_head=96 is not divisible"),
    (["--config", "gpt3-175b", "--mesh", "tp=2"], "add --shrink"),
    (["--config", "gpt2-124m,n_layer=48", "--mesh", "dp=8", "--optimizer", "adam"],
     "GiB in 8 rank processes"),                         # ~380M parameters: ~97 GiB
    (["--config", "tiny,n_head=5"], "n_head"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    code, out, err = _run([GPT, *argv], capsys)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("autopart verify: error: "), err
    assert says in err, err


def test_a_missing_file_is_exit_2(capsys):
    code, _, err = _run(["nowhere.py:GPT"], capsys)
    assert code == 2 and "no such file" in err and err.count("\n") == 1


# -- spawned runs (2 ranks in the fast tier) ------------------------------------------------------

def test_verify_passes_on_the_example_gpt_with_json(capsys):
    code, out, err = _run([GPT, "--config", "tiny,n_layer=2", "--mesh", "pp=2", "--microbatches",
                           "2", "--steps", "2", "--json", *TIMEOUT], capsys)
    report = json.loads(out)
    assert code == 0, (report, err)
    assert set(report) == REPORT_KEYS
    assert report["ok"] and report["world"] == 2 and report["steps"] == 2
    assert [s["step"] for s in report["losses"]] == [1, 2]
    assert all(set(s) == LOSS_KEYS and s["ok"] for s in report["losses"])
    assert [g["group"] for g in report["groups"]] == [
        "transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
        "transformer.ln_f"]
    assert all(set(g) == GROUP_KEYS and g["verdict"] == "PASS" for g in report["groups"])
    assert report["first_differing"] is None
    assert (report["rtol"], report["atol"]) == (1e-5, 1e-6)


PRINTING_MODEL = """
import os
import torch, torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        print("number of parameters: 0.00M")          # as nanoGPT's model does
        os.write(1, b"a write to file descriptor 1\\n")   # as C code would

    def forward(self, x, y):
        print("forward called")
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


def build(batch):
    return Net(), (torch.randn(batch, 8),), torch.randn(batch, 8)
"""


def test_json_alone_on_stdout_when_the_model_prints(tmp_path):
    """A model that prints when it is built and when it runs (here, in the rank processes and
    while it is captured): under --json stdout is the JSON report alone, the prints on stderr."""
    import subprocess
    import sys
    (tmp_path / "printing.py").write_text(PRINTING_MODEL)
    out = subprocess.run([sys.executable, "-m", "autopart", "verify",
                          f"{tmp_path / 'printing.py'}:build", "--mesh", "pp=2", "--batch", "4",
                          "--steps", "1", "--json", *TIMEOUT], capture_output=True, text=True,
                         timeout=450)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    report = json.loads(out.stdout)
    assert report["ok"] and report["world"] == 2
    for said in ("number of parameters", "a write to file descriptor 1", "forward called"):
        assert said in out.stderr, said


def test_verify_reports_a_layout_that_differs(capsys, monkeypatch):
    """The plain copy gets one parameter nudged by 1e-3 (AUTOPART_VERIFY_PERTURB, read only by
    the command line for this test): verify must say FAIL, exit 1, and name the group."""
    wrong = "transformer.h.1.mlp.c_fc.weight"
    monkeypatch.setenv("AUTOPART_VERIFY_PERTURB", wrong)
    code, out, err = _run([GPT, "--config", "tiny,n_layer=2", "--mesh", "pp=2", "--steps", "1",
                           *TIMEOUT], capsys)
    assert code == 1, (out, err)
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith("transformer.")}
    assert rows["transformer.h.1"][3:5] == ["1.00e-03", "FAIL"]     # max |diff|: the nudge
    # the first differing parameter in the plain model's order: the nudged one or one before it
    # (whose gradient the nudge changed)
    first = rows["transformer.h.1"][5].rstrip(":")
    order = [n for n, _ in build_tiny_gpt().named_parameters()]
    assert order.index(first) <= order.index(wrong)
    assert "FAIL: the layout" in out and "first differing parameter: transformer." in out


def _local(mesh: str) -> list[str]:
    return [GPT, "--config", "tiny,n_layer=2", "--mesh", mesh, "--microbatches", "2", "--steps",
            "2", "--local-batches", "--json", *TIMEOUT]


def test_verify_with_local_batches_on_dp(capsys):
    """--local-batches on dp=2: each rank's train_step is given only its replica's 2 of the 4
    rows; the plain model trains on all 4. PASS."""
    code, out, err = _run(_local("dp=2"), capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"], (report, err)
    assert report["local_batches"] and report["batch"] == 4
    assert report["fed"] == [[[2, 64], [2, 64]]] * 2, report["fed"]
    assert any("local batches" in n for n in report["notes"])


def test_a_wrong_share_without_local_batches_is_bad_input(capsys, monkeypatch):
    monkeypatch.setenv("AUTOPART_VERIFY_WRONG_SHARE", "1")
    code, _, err = _run([GPT, "--config", "tiny", "--mesh", "dp=2"], capsys)
    assert code == 2 and "add --local-batches" in err and err.count("\n") == 1


# -- full tier ------------------------------------------------------------------------------------

@pytest.mark.full
def test_verify_hugging_face_gpt2_tensor_parallel(capsys, tmp_path):
    file = tmp_path / "hf_gpt2.py"
    file.write_text(HF_GPT2)
    code, out, err = _run([f"{file}:GPT2LMHeadModel", "--mesh", "tp=2", "--json", *TIMEOUT],
                          capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"], (report, err)
    assert "transformer.h.3" in [g["group"] for g in report["groups"]]
    assert any("dropout set to 0" in n for n in report["notes"])    # GPT-2's default 0.1


@pytest.mark.full
def test_verify_switch_moe_expert_parallel(capsys):
    code, out, err = _run([SWITCH, "--config", "tiny", "--mesh", "dp=2,ep=2", "--optimizer",
                           "adam", *TIMEOUT], capsys)
    assert code == 0, (out, err)
    assert "transformer.h.1" in out and "(fp32, adam)" in out and "PASS: 3 steps of adam" in out


@pytest.mark.full
def test_verify_shrunk_gpt3_tp_pp_zero_bubble(capsys):
    code, out, err = _run([GPT, "--config", "gpt3-175b", "--mesh", "tp=2,pp=2", "--schedule",
                           "zb-v", "--virtual-stages", "2", "--shrink", "--json", *TIMEOUT],
                          capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"], (report, err)
    assert report["shrunk"]["n_head"] % 2 == 0 and report["shrunk"]["n_layer"] >= 4


@pytest.mark.full
def test_verify_with_local_batches_on_pp_x_dp(capsys):
    """--local-batches on pp=2 x dp=2: each rank is given only its replica's 2 of the 4 rows,
    the first stage the tokens alone, the last the targets alone. PASS."""
    code, out, err = _run(_local("pp=2,dp=2"), capsys)
    report = json.loads(out)
    assert code == 0 and report["ok"], (report, err)
    # rank = pp * 2 + dp: ranks 0, 1 the first stage, 2, 3 the last
    assert report["fed"] == [[[2, 64], None]] * 2 + [[None, [2, 64]]] * 2, report["fed"]


@pytest.mark.full
def test_verify_with_local_batches_fails_a_rank_fed_another_replicas_rows(capsys, monkeypatch):
    """The same run with rank 1 (first stage, replica 1) fed replica 0's rows
    (AUTOPART_VERIFY_WRONG_SHARE, a hook for this test only): its shapes are right, its data is
    not, and verify must say FAIL, exit 1."""
    monkeypatch.setenv("AUTOPART_VERIFY_WRONG_SHARE", "1")
    code, out, err = _run(_local("pp=2,dp=2"), capsys)
    report = json.loads(out)
    assert code == 1 and not report["ok"], (report, err)
    assert report["fed"][1] == [[2, 64], None]
    assert not all(s["ok"] for s in report["losses"]) and report["first_differing"]


NAN_LOSS = '''
import torch.nn.functional as F
from examples.gpt import GPT, config


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)) * float("inf")
'''


@pytest.mark.full
def test_non_finite_values_fail(capsys, tmp_path):
    """An infinite loss (NaN gradients) on both sides: not a match, however equal they are."""
    file = tmp_path / "nan_gpt.py"
    file.write_text(NAN_LOSS)
    code, out, err = _run([f"{file}:GPT", "--config", "tiny,n_layer=2", "--mesh", "dp=2",
                           "--steps", "1", "--json", *TIMEOUT], capsys)
    report = json.loads(out)
    assert code == 1 and not report["ok"], (report, err)
    assert report["losses"][0]["parallel"] == "inf" and not report["losses"][0]["ok"]
    assert "non-finite" in report["groups"][0]["detail"]


def build_tiny_gpt():
    """Module level, so the rank processes autopart.verify starts can import it."""
    from examples.gpt import GPT, config
    return GPT(config("tiny,n_layer=2"))


@pytest.mark.full
def test_python_api_with_a_builder():
    from examples.gpt import lm_loss
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (4, 16), generator=g) for _ in range(2))
    report = autopart.verify(build_tiny_gpt, "dp=2", (x,), loss_fn=lm_loss, target=y, steps=2,
                             timeout=400)
    assert isinstance(report, autopart.VerifyReport)
    assert report.ok, str(report)
    assert len(report.losses) == 2 and report.groups[0].group == "transformer.wte"


@pytest.mark.full
def test_python_api_with_local_batches_on_dp_x_cp():
    """dp=2 x cp=2, local_batches=True: each rank given its replica's 2 rows and its two of the
    four sequence chunks (8 of 16 positions), tokens and targets; the plain model all of it."""
    from examples.gpt import lm_loss
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (4, 16), generator=g) for _ in range(2))
    report = autopart.verify(build_tiny_gpt, "dp=2,cp=2", (x,), loss_fn=lm_loss, target=y,
                             steps=2, timeout=400, local_batches=True)
    assert report.ok, str(report)
    assert report.local_batches and report.fed == [[[2, 8], [2, 8]]] * 4, report.fed


def verify_in_group(rank: int, world: int) -> dict:
    """Rank function: autopart.verify called on every rank of a process group, with the model."""
    from examples.gpt import lm_loss
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    report = autopart.verify(build_tiny_gpt(), autopart.Mesh(pp=2), (x,), loss_fn=lm_loss,
                             target=y, steps=1, microbatches=2)
    return report.to_dict()


@pytest.mark.full
def test_python_api_inside_a_process_group():
    from autopart.runtime.launch import spawn
    reports = spawn(verify_in_group, 2, timeout=400, pg_timeout=120)
    assert all(r["ok"] for r in reports), reports
    assert reports[0]["groups"] == reports[1]["groups"]          # the same report on every rank


def test_python_api_refuses_a_module_without_a_process_group():
    with pytest.raises(autopart.AutopartError, match="zero-argument"):
        autopart.verify(build_tiny_gpt(), "pp=2", (torch.zeros(2, 8, dtype=torch.long),))
