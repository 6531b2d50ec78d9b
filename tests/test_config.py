"""autopart.Config (autopart/config.py): one validated value holds every option, its allowed values
are written once, and compile, parallelize, the pass list, the command lines and explain() read it.
"""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import autopart
from autopart import config as C
from autopart.errors import AutopartError
from examples.gpt import GPT, config, lm_loss

ROOT = Path(__file__).resolve().parent.parent


def _ids(b=4, s=64):
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))


def test_a_bad_value_fails_where_the_config_is_built():
    with pytest.raises(AutopartError, match=r"schedule='1flb' is not one of .*\n  remedy:"):
        autopart.Config(schedule="1flb")
    with pytest.raises(AutopartError, match="zero=True is not one of 0, 1, 2, 3"):
        autopart.Config(zero=True)
    with pytest.raises(AutopartError, match="virtual_stages=0 must be >= 1"):
        autopart.Config(virtual_stages=0)
    with pytest.raises(AutopartError, match="zero_bucket_size=4096 sizes the buckets"):
        autopart.Config(zero_bucket_size=4096)
    with pytest.raises(AutopartError, match="no option shedule"):
        autopart.Config().replace(shedule="gpipe")
    with pytest.raises(dataclasses.FrozenInstanceError):
        autopart.Config().zero = 1


def test_sizes_are_parsed_once_and_str_names_what_differs_from_the_defaults():
    c = autopart.Config(microbatches=4, memory_budget="2GiB")
    assert c.memory_budget == 2 * 2**30
    assert str(c) == "Config(microbatches=4, memory_budget=2147483648)"
    assert c.replace(microbatches=1).changed() == {"memory_budget": 2 * 2**30}


def test_keywords_override_the_config_and_give_the_same_program():
    model, x = GPT(config("tiny,n_layer=2")), _ids()
    by_kw = autopart.compile(model, autopart.Mesh(pp=2), (x,), loss_fn=lm_loss, target=x,
                             microbatches=2, schedule="gpipe")
    by_cfg = autopart.compile(model, autopart.Mesh(pp=2), (x,), loss_fn=lm_loss, target=x,
                              config=autopart.Config(microbatches=2, schedule="1f1b"),
                              schedule="gpipe")
    assert by_cfg.config == by_kw.config == autopart.Config(microbatches=2, schedule="gpipe")
    assert by_cfg.plan == by_kw.plan and by_cfg.digest() == by_kw.digest()
    assert "options: Config(microbatches=2, schedule='gpipe')" in by_cfg.explain()
    assert by_cfg.to_json()["options"] == dataclasses.asdict(by_cfg.config)


def test_allowed_values_are_the_configs_everywhere_they_are_read():
    from autopart.compiler import CP_ATTENTIONS, PRECISIONS
    from autopart.memory import OPTIMIZER_STATES, ZERO_LEVELS
    from autopart.passes.recompute_activations import MODES as RECOMPUTE
    from autopart.passes.split_context_parallel.rewrite import KERNELS
    from autopart.runtime.nonfinite import MODES as NONFINITE
    from autopart.schedule import SCHEDULES
    assert C.choices("schedule") == SCHEDULES
    assert C.choices("recompute") == RECOMPUTE and C.choices("nonfinite") == NONFINITE
    assert C.choices("precision") == PRECISIONS and C.choices("zero") == ZERO_LEVELS
    assert set(C.choices("cp_attention")) == set(CP_ATTENTIONS) == set(KERNELS)
    assert set(C.choices("optimizer")) == set(OPTIMIZER_STATES)


def _literal_tuples(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and \
                all(isinstance(e, ast.Constant) for e in node.elts):
            yield node.lineno, {e.value for e in node.elts}


def test_no_module_spells_an_options_values_again():
    """The allowed values of each choice option are written in autopart/config.py only: a tuple
    of the same strings elsewhere (the command lines once repeated seven of them) is a second
    copy that can drift."""
    sets = {n: set(C.choices(n)) for n in C.names()
            if n in ("schedule", "recompute", "optimizer", "precision", "nonfinite",
                     "cp_attention")}
    found = []
    for folder in ("autopart", "passes", "runtime"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.startswith("test_") or path == ROOT / "autopart" / "config.py":
                continue
            for line, values in _literal_tuples(path):
                found += [f"{path.relative_to(ROOT)}:{line} spells {n}'s values"
                          for n, s in sets.items() if values == s]
    assert not found, "\n".join(found)


def test_the_command_line_offers_the_configs_values_and_defaults():
    import argparse
    from autopart.cli.compile import add_compile_command
    parser = argparse.ArgumentParser()
    p = add_compile_command(parser.add_subparsers())
    actions = {a.dest: a for a in p._actions}
    default = autopart.Config()
    for name in ("recompute", "optimizer", "precision", "zero", "cp_attention"):
        assert tuple(actions[name].choices) == C.choices(name), name
        assert actions[name].default == getattr(default, name), name


def test_the_command_line_compiles_what_the_api_compiles(capsys):
    from autopart.cli import main
    code = main(["compile", str(ROOT / "examples" / "gpt.py") + ":GPT", "--config",
                 "tiny,n_layer=2", "--mesh", "pp=2", "--microbatches", "2", "--recompute",
                 "full", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["recompute"] == "full" and out["options"]["microbatches"] == 2
    assert out["options"]["schedule"] == "1f1b" and out["config"] == "tiny,n_layer=2"
