"""What the command line shows a newcomer: the pictures' titles and units (`autopart trace`,
`autopart plan --png`) and the plan's TFLOP/s column, against numbers worked out here. One
process, no ranks; the GPT-3 profile is captured once (one layer) and cached."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from autopart.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def figures(monkeypatch):
    """Every matplotlib figure saved while the test runs (drawn as usual, and kept to read)."""
    from matplotlib.figure import Figure
    saved, original = [], Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def _event(step: int, rank: int, ts_ms: float, dur_ms: float, kind: str = "F") -> dict:
    return {"name": f"0{kind}0", "ph": "X", "pid": rank, "tid": 0, "ts": ts_ms * 1e3,
            "dur": dur_ms * 1e3, "args": {"chunk": rank, "microbatch": 0, "kind": kind, "step": step}}


def test_trace_of_three_steps_says_three_steps_and_the_time_of_one(tmp_path, figures, capsys):
    """Three steps over 321 ms: the title once read "step 321 ms"; it is 107 ms a step."""
    events = [_event(step, rank, 107 * step + 50 * rank, 50) for step in range(3) for rank in (0, 1)]
    events.append(_event(2, 1, 300, 21, "B"))                       # the last one ends at 321 ms
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    assert main(["trace", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png")]) == 0
    title = figures[-1].axes[0].get_title()
    assert "3 steps in 321 ms (107 ms a step)" in title, title
    assert "over 3 steps, 321 ms" in capsys.readouterr().out


@pytest.fixture(scope="module")
def gpt3():
    """GPT-3 175B's cost model for a batch of 64 on Selene, and the paper's model-FLOPs count
    (Megatron-LM's num_floating_point_operations, 72 B s l h^2 (1 + s/6h + V/12lh): no
    recomputation), written out here."""
    from autopart.planner import CostModel
    from autopart.planner.cluster import cluster
    from autopart.planner.profile import load_profile
    p = load_profile(f"{ROOT}/examples/gpt.py:GPT", "gpt3-175b")
    B, s, l, h, V = 64, p.seq, p.blocks or p.layers, p.hidden, p.vocab
    flops = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))   # Megatron-LM's count
    return CostModel(p, cluster("a100-80gb-selene"), B, precision="bf16"), flops


def _estimates(model) -> dict:
    from autopart.planner.cost import Layout
    return {r: model.estimate(Layout(8, 8, 1, 1, 1, "1f1b", r)) for r in ("none", "full")}


def test_plan_counts_model_flops_not_recomputed_ones(gpt3, figures, tmp_path):
    """Full recomputation reruns each layer's forward: more FLOPs done, the same model trained.
    Its TFLOP/s (table and -layouts.png) must be the model's FLOPs over its longer step, so it
    is credited less than the same layout without recomputation, never more."""
    from autopart.cli.plan import draw, report
    model, flops = gpt3
    est = _estimates(model)
    assert est["full"].step_time > est["none"].step_time
    expected = {r: flops / (e.step_time * 64) / 1e12 for r, e in est.items()}
    ranked = sorted(est.values(), key=lambda e: e.step_time)
    table = report(model, ranked, ranked[0], 12, 0.0).splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("mesh"))
    assert "model TFLOP/s/dev" in table[head]
    at = table[head].index("model TFLOP/s")          # the columns are padded to line up
    cells = {row.split()[5]: float(row[at:].split()[0]) for row in table[head + 1:head + 3]}
    for r in ("none", "full"):
        assert cells[r] == pytest.approx(expected[r], abs=0.06), (r, table)
    assert cells["full"] < cells["none"]
    draw(model, ranked[0], ranked, str(tmp_path / "plan.png"))
    bars = figures[-1].axes[0]
    widths = [patch.get_width() for patch in bars.patches]
    shown = [label.get_text().split()[-1] for label in bars.get_yticklabels()]   # "... full"
    assert sorted(shown) == ["full", "none"]
    assert widths == pytest.approx([expected[r] for r in shown], rel=1e-9)
    assert "model TFLOP/s" in bars.get_xlabel() and "recomputation not counted" in bars.get_xlabel()


def test_plan_picture_says_one_unit(gpt3, figures, tmp_path):
    """The predicted timeline's costs are seconds: its axis said "cost units" under a title
    saying "seconds"; both now say seconds, and the title's makespan is the axis's end."""
    from autopart.cli.plan import draw
    model, _ = gpt3
    best = _estimates(model)["none"]
    draw(model, best, [best], str(tmp_path / "plan.png"))
    timeline = figures[0].axes[0]
    assert timeline.get_xlabel() == "time (s)"
    title = timeline.get_title()
    assert "cost units" not in title and "seconds" not in title, title
    makespan = float(re.search(r"([0-9.e+-]+) s$", title).group(1))
    assert makespan == pytest.approx(timeline.get_xlim()[1], rel=1e-2), title


def test_readme_shows_every_command_with_flags_it_takes():
    """README's "The command line" has one example per command (a newcomer found `compile`'s
    alone): each `autopart ...` line there parses with the real parser, names files that exist,
    and every command has one. (Each was run by hand; running them all here would take minutes.)"""
    import shlex

    from autopart.cli import build_parser
    section = (ROOT / "README.md").read_text().split("## The command line")[1].split("\n## ")[0]
    block = section.split("```bash\n")[1].split("```")[0]
    lines = [ln.split("#")[0].strip() for ln in block.splitlines()]
    commands = [shlex.split(ln) for ln in lines if ln.startswith("autopart ")]
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv[1:])             # exits (SystemExit) on a flag it lacks
        target = getattr(args, "target", None)
        assert target is None or (ROOT / target.split(":")[0]).is_file(), argv
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert {argv[1] for argv in commands} == set(choices), sorted(choices)
