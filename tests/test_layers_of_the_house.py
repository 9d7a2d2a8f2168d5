"""mk is a house in layers: a package imports only from the packages below it, and no two modules
import each other, directly or around a circle.

Every module under mk/ is parsed with `ast`: its imports at the top and inside functions, and the
modules it names to `importlib.import_module`, all count. Bottom to top:

    mk.errors < mk.model < mk.io < mk.kernel < mk.perf < mk.notebooks < mk.cli
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mk"

# Bottom to top. `mk` (the package's __init__: the config names it re-exports) sits with the model;
# `mk.__main__` (the command line's entry point) with the cli.
LAYERS = ("mk.errors", "mk.model", "mk.io", "mk.kernel", "mk.perf", "mk.notebooks", "mk.cli")
PLACED = {"mk": "mk.model", "mk.__main__": "mk.cli"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = ("mk",) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def layer(module: str) -> int:
    """Index of `module`'s layer in LAYERS; KeyError for a module outside every layer."""
    home = PLACED.get(module, module)
    for i, pkg in enumerate(LAYERS):
        if home == pkg or home.startswith(pkg + "."):
            return i
    raise KeyError(f"{module} belongs to no layer of {LAYERS}")


def imports(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The mk modules that module `name` (source text `source`) imports, wherever it does."""
    package = name if is_package else name.rpartition(".")[0]
    out = set()

    def add(target: str, names=()):
        for n in names:                      # `from mk.kernel import plan`: the module mk.kernel.plan
            if f"{target}.{n}" in known:
                out.add(f"{target}.{n}")
            elif target in known:
                out.add(target)
        if not names and target in known:
            out.add(target)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            add(target, [a.name for a in node.names])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value)
    out.discard(name)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods)
    return {m: imports(p.read_text(), m, p.name == "__init__.py", known) for m, p in mods.items()}


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a layer above the importer's, as 'importer -> imported'."""
    return sorted(f"{a} ({LAYERS[layer(a)]}) -> {b} ({LAYERS[layer(b)]})"
                  for a, targets in graph.items() for b in targets if layer(b) > layer(a))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# ---- the house ------------------------------------------------------------------------------
def test_every_module_lives_on_a_floor():
    for m in modules():
        layer(m)                             # raises for a module outside every layer
    flat = sorted(m for m in modules() if m.count(".") == 1 and m not in PLACED and m not in LAYERS)
    assert not flat, f"modules left flat under mk/: {flat}"


def test_no_package_imports_from_a_layer_above_it():
    assert upward(import_graph()) == []


def test_no_circles_between_modules():
    assert circles(import_graph()) == []


def test_the_plan_is_data():
    """The plan imports neither the loader nor its own readers (the walkers, packing, the kernel)."""
    graph = import_graph()
    assert not {t for t in graph["mk.kernel.plan"] if t.startswith(("mk.io", "mk.kernel"))}
    assert not {t for t in graph["mk.model.sharding"] if t.startswith("mk.kernel")}


# ---- the checker can fail ---------------------------------------------------------------------
def test_the_checker_sees_an_upward_import_and_a_circle(tmp_path):
    root = tmp_path / "mk"
    for rel, text in {
        "__init__.py": "",
        "errors.py": "",
        "model/__init__.py": "",
        "model/config.py": "def f():\n    from mk.perf.sim import simulate\n",     # upward, inside a function
        "kernel/__init__.py": "",
        "kernel/plan.py": "from mk.kernel import schedule\n",                      # a circle inside a layer
        "kernel/schedule.py": "from . import plan\n",
        "perf/__init__.py": "",
        "perf/sim.py": "import importlib\nimportlib.import_module('mk.cli.main')\n",  # upward, by name
        "cli/__init__.py": "",
        "cli/main.py": "from mk.perf import sim\nfrom mk.model.config import f\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    graph = import_graph(root)
    assert graph["mk.kernel.schedule"] == {"mk.kernel.plan"}
    assert graph["mk.cli.main"] == {"mk.perf.sim", "mk.model.config"}
    assert upward(graph) == ["mk.model.config (mk.model) -> mk.perf.sim (mk.perf)",
                             "mk.perf.sim (mk.perf) -> mk.cli.main (mk.cli)"]
    assert circles(graph) == [["mk.cli.main", "mk.model.config", "mk.perf.sim"], ["mk.kernel.plan", "mk.kernel.schedule"]]
    with pytest.raises(KeyError, match="no layer"):
        layer("mk.somewhere_else")
