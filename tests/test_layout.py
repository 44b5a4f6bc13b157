"""The house's floors (docs/architecture.md), checked on the source tree: no package imports one on a
floor above it or beside it, no module imports itself back through others, the pure modules stay pure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# each package and the packages it may import (directly or not): the order of the floors
LAYERS = {
    "tasksuite": set(),
    "engine": set(),
    "predictors": {"engine", "tasksuite"},
    "loadgen": {"engine", "tasksuite"},
    "planner": {"engine"},
    "cluster": {"engine", "predictors", "planner", "tasksuite"},
    "sim": {"engine", "predictors", "planner", "cluster", "loadgen", "tasksuite"},
    "app": {"engine", "predictors", "planner", "cluster", "tasksuite"},
    "deployments": {"engine", "predictors", "planner", "cluster", "app", "tasksuite"},
    "tools": {"engine", "predictors", "planner", "cluster", "app", "deployments", "sim", "loadgen", "tasksuite"},
}
# scheduling and routing code: never torch or ray (the simulator runs it at full speed)
PURE = ["tasksuite/*.py", "engine/scheduler/*.py", "engine/registry.py", "cluster/*.py",
        "sim/*.py", "planner/*.py"]


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports at run time, at any depth of the file (function-level too; not those
    under ``if TYPE_CHECKING``), relative ones resolved; ``from pkg import name`` counts ``pkg.name`` too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_of(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def tree_modules() -> dict[str, Path]:
    return {module_of(p): p for pkg in LAYERS for p in ROOT.glob(f"{pkg}/**/*.py")}


def py_files(*patterns: str) -> list[Path]:
    return sorted({p for pat in patterns for p in ROOT.glob(pat)})


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_packages_import_only_the_floors_below(package):
    for path in py_files(f"{package}/**/*.py"):
        bad = {m for m in imports(path) if m.split(".")[0] in LAYERS and m.split(".")[0] != package
               and m.split(".")[0] not in LAYERS[package]}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} (above or beside {package})"


def test_layers_are_closed_under_their_own_imports():
    """A floor may import a package only with everything that package may import (the order is total)."""
    for pkg, allowed in LAYERS.items():
        for dep in allowed:
            assert LAYERS[dep] <= allowed, f"{pkg} may import {dep}, which may import {LAYERS[dep] - allowed}"


def test_no_import_loops():
    mods = tree_modules()
    graph = {m: {i for i in imports(p) if i in mods and i != m} for m, p in mods.items()}
    # a package's __init__ importing its own modules is how a package exports: not a loop back through it
    for m in graph:
        if mods[m].name == "__init__.py":
            graph[m] = {i for i in graph[m] if not i.startswith(m + ".")}
    index, low, stack, on, loops, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not loops, f"import loops: {loops}"


def test_app_holds_no_tools():
    """The serving library has no CLI, benchmark, fault harness or training in it (they live in tools/)."""
    names = {p.stem for p in py_files("app/*.py")}
    assert not names & {"cli", "faults", "bench", "bench_control", "training", "evaluate"}, names


def test_pure_modules_import_neither_torch_nor_ray():
    for path in py_files(*PURE):
        bad = {m for m in imports(path) if m.split(".")[0] in ("torch", "ray")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_deployments_import_ray_serve():
    for path in py_files("**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("deployments", "tools", "scripts", ".venv", "tests"):
            continue
        bad = {m for m in imports(path) if m.startswith("ray.serve") or m == "ray.serve"}
        assert not bad, f"{rel} imports {bad}"
