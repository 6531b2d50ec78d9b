"""The pass runner checks the pass list before running it: requirements, order, what a pass
declares it provides. And the layout rules of the code base: passes import the IR and the ops,
never each other; the runtime never imports a pass."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from autopart.passes.analyze_costs import analyze_costs
from autopart.capture import capture
from autopart.compiler import pass_list
from autopart.errors import AutopartError
from autopart.mesh import Mesh
from autopart.pass_runner import Pass, check_order, run_passes
from examples.gpt import GPT, config, lm_loss

ROOT = Path(__file__).resolve().parent.parent


def _names(passes):
    return [p.name for p in passes]


def test_the_pass_list_is_in_order_for_every_axis():
    for mesh in (Mesh(pp=2), Mesh(tp=2, pp=2), Mesh(dp=2, ep=2)):
        passes = pass_list(mesh, microbatch_size=1, chunk_ranks=(0, 1))
        check_order(passes)       # raises if out of order
        assert ("shard_experts" in _names(passes)) == (mesh.ep > 1)


def test_a_pass_before_what_it_requires_is_a_clear_error():
    passes = pass_list(Mesh(pp=2), microbatch_size=1, chunk_ranks=(0, 1))
    by_name = {p.name: p for p in passes}
    wrong = [by_name["cut_pipeline_stages"], by_name["split_tensor_parallel"],
             by_name["analyze_costs"], by_name["emit_rank_programs"]]
    with pytest.raises(AutopartError) as e:
        check_order(wrong)
    msg = str(e.value)
    assert "cut_pipeline_stages (pass 1) requires ['costs']" in msg
    assert "'costs' is provided by analyze_costs" in msg and "remedy" in msg


def test_a_pass_listed_before_one_it_must_follow_is_an_error():
    passes = pass_list(Mesh(dp=2, ep=2), microbatch_size=1, chunk_ranks=(0,))
    i = _names(passes).index("shard_experts")
    swapped = [*passes[:i], passes[i + 1], passes[i], *passes[i + 2:]]
    assert _names(swapped)[i:i + 2] == ["split_tensor_parallel", "shard_experts"]
    with pytest.raises(AutopartError, match=rf"split_tensor_parallel \(pass {i + 1}\) must run after "
                                            r"\['shard_experts'"):
        check_order(swapped)


def test_a_requirement_no_pass_provides_is_named():
    with pytest.raises(AutopartError, match="no pass in the list"):
        check_order([Pass("analyze_costs", analyze_costs, requires=("tp",), provides=("costs",))])


def test_a_pass_that_does_not_provide_what_it_declares_is_an_error():
    x = torch.randint(0, 256, (2, 64))
    program = capture(GPT(config("tiny,n_layer=1")), (x,), loss_fn=lm_loss, target=x)
    liar = Pass("liar", lambda p: (p, {}), requires=(), provides=("stages",))
    with pytest.raises(AutopartError, match=r"pass liar did not set \['stages'\]"):
        run_passes(program, [liar])


# -- the layout: who may import whom --------------------------------------------------------------

def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _sources(folder: str):
    return [p for p in (ROOT / folder).rglob("*.py") if not p.name.startswith("test_")]


def _pass_of(path: Path) -> str:
    """The pass a file under passes/ belongs to: its package (passes/X/...) or itself."""
    return path.relative_to(ROOT / "passes").parts[0].removesuffix(".py")


def _relative_passes(path: Path, text: str | None = None) -> set[str]:
    """The passes `path`'s relative imports reach ('from ..shard_experts.find import x' in
    passes/split_tensor_parallel/a.py -> {'shard_experts'}; '.' of a top-level pass file is
    passes/ itself, so 'from .b import x' there reaches the pass b)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = path.parents[node.level - 1]
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                target = base.joinpath(*name.split("."))
                if target == ROOT / "passes" or ROOT / "passes" not in target.parents:
                    out.add(str(target.relative_to(ROOT)))      # passes/ or above: not a pass
                else:
                    out.add(_pass_of(target))
    return out


def test_passes_never_import_each_other_or_the_runtime():
    for path in _sources("passes"):
        bad = {m for m in _imports(path) if m.startswith(("autopart.passes", "autopart.runtime",
                                                          "autopart.compiler"))}
        bad |= _relative_passes(path) - {_pass_of(path)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: passes import the IR " \
                        "and the ops (and their own modules, relatively), never another pass " \
                        "(what two passes share is an analysis below them: autopart/moe_layers.py)"


def test_relative_imports_across_passes_are_seen():
    """The rule above reads relative imports too: 'from ..shard_experts.find import x' in
    split_tensor_parallel once reached into another pass, invisible to the absolute check."""
    tp = ROOT / "passes" / "split_tensor_parallel" / "expert_linears.py"
    assert _relative_passes(tp, "from ..shard_experts.find import find_moe_layers\n"
                                "from .linears import x\nfrom . import rewrite\n") == \
        {"shard_experts", "split_tensor_parallel"}
    top = ROOT / "passes" / "cut_pipeline_stages.py"
    assert _relative_passes(top, "from .analyze_costs import analyze_costs\n") == \
        {"analyze_costs"}


def test_the_runtime_never_imports_a_pass():
    for path in _sources("runtime"):
        bad = {m for m in _imports(path) if m.startswith("autopart.passes")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_ir_and_the_ops_import_no_pass_and_no_runtime():
    for path in [ROOT / "autopart" / "ir.py", *(ROOT / "autopart" / "ops").glob("*.py")]:
        bad = {m for m in _imports(path)
               if m.startswith(("autopart.passes", "autopart.runtime", "autopart.compiler",
                                "autopart.capture", "autopart.analysis"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


CLI_MODULES = ("autopart.cli", "autopart.__main__")     # autopart/cli/ is the command line


def test_the_library_imports_no_command_line_module():
    """The command line (autopart/cli/) sits on top of the library: a module outside it (but the
    smoke, itself a command, and __main__) never imports it, at the top or inside a function."""
    for folder in ("autopart", "runtime", "passes"):
        for path in _sources(folder):
            if ROOT / "autopart" / "cli" in path.parents or path.stem in ("smoke", "__main__"):
                continue
            bad = {m for m in _imports(path) if m.startswith(CLI_MODULES)}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: library code belongs " \
                            "in a library module the command imports (e.g. autopart/model_files.py)"


def test_the_runtime_imports_no_compiler_planner_or_front_door():
    """runtime/ executes a compiled plan: the compiler, capture, the planner, the passes and the
    front door (autopart/api.py, which calls both) sit above it; type-only imports excepted."""
    above = ("autopart.compiler", "autopart.capture", "autopart.planner", "autopart.passes",
             "autopart.api", *CLI_MODULES)
    for path in _sources("runtime"):
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If)
                       and getattr(t.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(t)}
        bad = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
               and id(n) not in typing_only and n.module.startswith(above)}
        bad -= {"autopart.api"} if path.name == "__init__.py" else set()   # the lazy re-export
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: the runtime runs what " \
                        "the compiler made; autopart/api.py joins them"


# The allow-list: per folder, the autopart modules it may import besides its own (a layer imports
# only those below it). runtime/ may also import the compiler for type hints (TYPE_CHECKING) and
# re-export the front door lazily (runtime/__init__.py).
BELOW_COMPILER = {"_version", "_C", "errors", "mesh", "config", "ir", "ops", "schedule",
                  "localize", "placement", "analysis", "aliasing", "memory", "moe_layers",
                  "linear_forms"}
ALLOWED = {
    # mesh: a leaf (it imports errors alone); ops and passes read its sequence_chunks rule
    "autopart/ops": {"errors", "mesh"},
    "autopart/memory": {"errors", "config", "ir", "ops", "localize", "analysis"},
    "passes": BELOW_COMPILER - {"_version", "_C"},
    "runtime": {"_version", "_C", "errors", "mesh", "config", "ir", "ops", "schedule",
                "schedule_lowering", "localize", "materialize"},
    "autopart/planner": BELOW_COMPILER | {"capture", "passes", "runtime", "gc_paused",
                                          "model_files"},
}


def _autopart_imports(path: Path) -> set[str]:
    """The autopart modules `path` imports at run time, by their name under autopart
    ('autopart.memory.units' -> 'memory'; 'from autopart import _C' -> '_C')."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If)
                   and getattr(t.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(t)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "autopart":
                out.update(parts[1:2] or [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            out.update((a.name.split(".") + ["autopart"])[1] for a in node.names
                       if a.name.split(".")[0] == "autopart")
    return out


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_folder_imports_only_what_its_allow_list_names(folder):
    own = Path(folder).name
    for path in _sources(folder):
        got = _autopart_imports(path) - {own}
        if folder == "runtime" and path.name == "__init__.py":
            got -= {"api"}                       # the lazy re-export of the front door
        bad = got - ALLOWED[folder]
        assert not bad, f"{path.relative_to(ROOT)} imports autopart.{sorted(bad)}, which " \
                        f"{folder}/ may not: it may import {sorted(ALLOWED[folder])}"


def test_passes_folder_holds_only_passes_and_their_tests():
    top = {p.stem for p in (ROOT / "passes").iterdir()
           if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    top -= {"__init__"}
    passes = {t for t in top if not t.startswith("test_")}
    tests = {t[len("test_"):] for t in top if t.startswith("test_")}
    assert passes <= tests, f"every pass has a test file beside it: missing {passes - tests}"
    assert tests <= passes, f"test files without a pass: {tests - passes}"


def _aten_literals(path: Path):
    """(line, {'view.default', ...}) for each set, tuple or list literal of two or more
    `aten.<op>.<overload>` attributes in `path`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            names = {f"{e.value.attr}.{e.attr}" for e in node.elts
                     if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Attribute)
                     and isinstance(e.value.value, ast.Name) and e.value.value.id in ("aten", "_aten")}
            if len(names) >= 2:
                yield node.lineno, names


def test_op_groups_are_written_once_in_the_op_table():
    """The ATen op groups (views, casts, softmaxes, matmuls...) live in autopart/ops/aten_groups.py;
    a literal elsewhere that spells a whole group again (view ops were once defined five times)
    is a second copy that drifts."""
    from autopart.ops import aten_groups as G
    groups = {name: {f"{op.overloadpacket.__name__}.{op._overloadname}" for op in ops
                     if hasattr(op, "overloadpacket")}
              for name, ops in vars(G).items() if isinstance(ops, frozenset)}
    groups = {n: g for n, g in groups.items() if len(g) >= 2}
    table = ROOT / "autopart" / "ops" / "aten_groups.py"
    found = []
    for folder in ("autopart", "passes", "runtime"):
        for path in _sources(folder):
            if path == table:
                continue
            for line, names in _aten_literals(path):
                found += [f"{path.relative_to(ROOT)}:{line} spells {n}" for n, g in groups.items()
                          if g <= names]
    assert not found, "\n".join(found)


def test_no_source_file_is_over_600_lines():
    """A file that does several jobs grows past what a reader takes in (checkpoint.py reached 903
    lines before it became a package): library, tests, benchmarks and examples stay under 600."""
    long = [f"{p.relative_to(ROOT)}: {n} lines"
            for folder in ("autopart", "passes", "runtime", "tests", "bench", "examples")
            for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, "\n".join(long)


# -- import cycles: none, at module level or through imports inside functions ------------------

PACKAGES = {"autopart": "autopart", "passes": "autopart.passes", "runtime": "autopart.runtime"}


def _module_files() -> dict[str, Path]:
    """autopart's modules by dotted name (passes/ and runtime/ are autopart.passes and
    autopart.runtime: pyproject's wheel.packages), tests beside the code left out."""
    files = {}
    for top, dotted in PACKAGES.items():
        for p in _sources(top):
            rel = p.relative_to(ROOT / top).with_suffix("").parts
            files[".".join((dotted, *rel[:-1], *([] if rel[-1] == "__init__" else rel[-1:])))] = p
    return files


def _import_targets(module: str, path: Path, node, known: set[str]) -> list[str]:
    """The modules `node` (an import statement of `module`) imports, as dotted names: `from
    pkg import name` is pkg.name where that is a module, else pkg itself."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(max(node.level - 1, 0)):
        base = base.rpartition(".")[0]
    pkg = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
    return [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in known else pkg for a in node.names]


def _import_graph(lazy: bool):
    import networkx as nx
    files = _module_files()
    known = set(files) | {"autopart._C"}
    g = nx.DiGraph()
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        for node in (ast.walk(tree) if lazy else tree.body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _import_targets(module, path, node, known):
                    while target and target not in known:
                        target = target.rpartition(".")[0]
                    if target and target != module:
                        g.add_edge(module, target)
    return g


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "with-lazy-imports"])
def test_no_import_cycles(lazy):
    """No two modules import each other, directly or around a loop: a loop makes import order
    matter (half-initialized modules) and hides layering. With `lazy`, the imports written
    inside functions count too (issue 54 found an 11-module loop through autopart/__init__)."""
    import networkx as nx
    g = _import_graph(lazy)
    loops = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert loops == [], loops
    assert g.number_of_nodes() > 50          # the graph really holds the package
