"""The house's floors (docs/architecture.md), checked on the source tree: no package imports one on a
floor above it or beside it, no module imports itself back through others (type-only imports count: a
knot drawn for the type checker is a knot), the pure modules stay pure, and outside ``cluster/`` the
router is reached only through the cluster driver."""

from __future__ import annotations

import ast
import re
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


def imports(path: Path, text: str | None = None) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (function-level too, and those under ``if
    TYPE_CHECKING``: a type-only import ties the two modules all the same), relative ones resolved;
    ``from pkg import name`` counts ``pkg.name`` too. ``text``: the file's source (default: read it)."""
    tree = ast.parse(path.read_text() if text is None else text, filename=str(path))
    here = module_of(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    names = set()
    for node in ast.walk(tree):
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


# loops being untied as this is written, each with who unties it; remove an entry once its loop is gone
KNOWN_LOOPS: list[list[str]] = []


def test_type_only_imports_are_counted():
    """A module that imports another only under ``if TYPE_CHECKING`` still imports it here."""
    text = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .router import Router\n"
    assert {"cluster.router", "cluster.router.Router"} <= imports(ROOT / "cluster" / "probe.py", text)


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
    loops = [c for c in loops if c not in KNOWN_LOOPS]
    assert not loops, f"import loops: {loops}"


def router_members() -> set[str]:
    """The names a ``cluster.router.Router`` answers to: its methods and the attributes it sets on itself."""
    tree = ast.parse((ROOT / "cluster" / "router.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Router"]
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return names


# outside cluster/, files that still read the router past the driver, each with why; remove an entry once its
# file goes through the driver
ROUTER_REACH_KNOWN: dict[str, str] = {}


def test_only_the_cluster_driver_reaches_the_router():
    """The cluster driver is the one door into the cluster core: outside ``cluster/`` no code uses a router's
    member through an attribute (``self.router.by_id``, ``dispatcher.router.stats``, ``driver.router.…``:
    the live dispatcher and the cluster simulator ask the driver). A config's ``router`` section
    (``cfg.router.thresholds``) is no router: its fields are not the router's members."""
    members = router_members()
    assert {"by_id", "instances", "requests", "policy", "latency", "remaining_steps", "stats"} <= members
    reach = re.compile(r"\.router\.(\w+)|\bdriver\.router\b")
    bad = []
    for pkg in LAYERS:
        if pkg == "cluster":
            continue
        for path in py_files(f"{pkg}/**/*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ROUTER_REACH_KNOWN:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for m in reach.finditer(line):
                    if m.group(1) is None or m.group(1) in members:
                        bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "the router reached past the cluster driver:\n" + "\n".join(bad)


def test_app_holds_no_tools():
    """The serving library has no CLI, benchmark, fault harness or training in it (they live in tools/)."""
    names = {p.stem for p in py_files("app/*.py")}
    assert not names & {"cli", "faults", "bench", "bench_control", "training", "evaluate"}, names


def test_pure_modules_import_neither_torch_nor_ray():
    for path in py_files(*PURE):
        bad = {m for m in imports(path) if m.split(".")[0] in ("torch", "ray")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_deployments_import_ray_serve():
    skip = {"deployments", "tools", "scripts", ".venv", ".git", "tests"}  # not walked at all (.venv: seconds)
    tops = [p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in skip]
    for path in py_files("*.py", *(f"{top}/**/*.py" for top in tops)):
        rel = path.relative_to(ROOT)
        bad = {m for m in imports(path) if m.startswith("ray.serve") or m == "ray.serve"}
        assert not bad, f"{rel} imports {bad}"


def test_no_test_module_imports_another():
    """Fakes and builders shared by the tests live in support modules (tests/builders.py, fakes.py,
    serving.py, checkpoints.py): no test file imports a test module or conftest.py (pytest loads those)."""
    for path in py_files("tests/*.py"):
        bad = {m for m in imports(path) if m.split(".")[0] == "tests" and len(m.split(".")) > 1
               and (m.split(".")[1].startswith("test_") or m.split(".")[1] == "conftest")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: move what it needs to a support module"


def test_policies_use_only_their_view_of_the_router():
    """The router policies see the router as ``cluster.policies.RouterView``: every member of ``router`` they
    use is in the view, and the router has every member of the view (so the view is what ties the two, not
    an import)."""
    from cluster.policies import PolicySettings, RouterView
    from cluster.router import RouterConfig

    def members(proto) -> set[str]:
        return {n for n in vars(proto) if not n.startswith("_")}

    view, settings = members(RouterView), members(PolicySettings)
    assert view == {"latency", "instances", "cfg", "now", "move", "migration_cost_ms"}, view
    assert view <= router_members() and settings <= set(RouterConfig.__dataclass_fields__)
    used, cfg_used = set(), set()
    for path in (ROOT / "cluster" / "policies.py", ROOT / "sim" / "report" / "cluster_runs.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "router":
                used.add(node.attr)
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "cfg" and isinstance(node.value.value, ast.Name)
                    and node.value.value.id == "router"):
                cfg_used.add(node.attr)
    assert used <= view, f"policies use {sorted(used - view)} of the router beyond RouterView"
    assert cfg_used <= settings, f"policies read {sorted(cfg_used - settings)} of the settings beyond PolicySettings"
    assert {"move", "instances", "latency"} <= used  # the walk found the policies' uses
