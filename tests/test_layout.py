"""The house's floors (docs/architecture.md), checked on the source tree: no package imports one on a
floor above it or beside it, no module imports itself back through others (type-only imports count: a
knot drawn for the type checker is a knot), the pure modules stay pure, outside ``cluster/`` (and its own
tests) the router is reached only through the cluster driver, and nothing imports a test module, by an
import statement or by its name: what tests and scripts share lives in support modules."""

from __future__ import annotations

import ast
import importlib
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


def imports(path: Path, text: str | None = None, tree: ast.AST | None = None) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (function-level too, and those under ``if
    TYPE_CHECKING``: a type-only import ties the two modules all the same), relative ones resolved;
    ``from pkg import name`` counts ``pkg.name`` too. ``text``: the file's source (default: read it); ``tree``:
    its parse, when the caller has it."""
    if tree is None:
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
# the tests of cluster/'s own modules (the router, the driver, the router's admission test): they may open it
CLUSTER_TESTS = {"tests/test_router.py", "tests/test_driver.py", "tests/test_admission.py"}
CONFIG_NAMES = {"cfg", "config", "gpu", "cpu", "app_config"}  # names an AppConfig goes by in the tests
REACH = re.compile(r"\.router\.(\w+)|\bdriver\.router\b|\b(?:dispatcher|sim|d)\.router\b")


def router_reaches(paths: list[Path], members: set[str], root: Path = ROOT) -> list[str]:
    """The lines of ``paths`` that use a router's member through an attribute, or the router of a driver, a
    dispatcher or a simulator."""
    bad = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in REACH.finditer(line):
                owner = re.search(r"(\w+)$", line[:m.start()])  # a config's router section is no router
                if owner is not None and (owner.group(1) in CONFIG_NAMES or owner.group(1).endswith("cfg")):
                    continue
                if m.group(1) is None or m.group(1) in members:
                    bad.append(f"{rel}:{n}: {line.strip()}")
    return bad


def test_only_the_cluster_driver_reaches_the_router():
    """The cluster driver is the one door into the cluster core: outside ``cluster/`` no code uses a router's
    member through an attribute (``self.router.by_id``, ``dispatcher.router.stats``, ``driver.router.…``:
    the live dispatcher and the cluster simulator ask the driver, and the debug views, the scripts and the
    tests read its views), but for the tests of cluster/'s own modules. A config's ``router`` section
    (``cfg.router.thresholds``) is no router: its fields are not the router's members."""
    members = router_members()
    assert {"by_id", "instances", "requests", "policy", "latency", "remaining_steps", "stats"} <= members
    paths = [p for pkg in LAYERS if pkg != "cluster" for p in py_files(f"{pkg}/**/*.py")]
    paths += [p for p in py_files("tests/*.py", "scripts/**/*.py")
              if p.relative_to(ROOT).as_posix() not in CLUSTER_TESTS | {"tests/test_layout.py"}]
    bad = [line for line in router_reaches(paths, members) if line.split(":", 1)[0] not in ROUTER_REACH_KNOWN]
    assert not bad, "the router reached past the cluster driver:\n" + "\n".join(bad)


def test_the_router_reach_check_sees_a_reach(tmp_path):
    probe = tmp_path / "probe.py"
    for line, caught in [("n = len(d.router.requests)", True), ("r = dispatcher.router", True),
                         ("x = sim.driver.router.by_id", True), ("t = cfg.router.thresholds", False),
                         ("p = self.cfg.router.policy", False), ("p = gpu.router.policy", False),
                         ("n = len(d.driver.active())", False)]:
        probe.write_text(line + "\n")
        assert bool(router_reaches([probe], router_members(), root=tmp_path)) == caught, line


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


def is_test_module(name: str) -> bool:
    """``tests.test_x`` (or a name in it) and ``tests.conftest``: what pytest alone loads."""
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == "tests" and (parts[1].startswith("test_") or parts[1] == "conftest")


def named_test_modules(text: str, tree: ast.AST | None = None) -> set[str]:
    """The test modules a source names as modules: dotted names in its strings (what ``__import__``,
    ``importlib.import_module``, ``runpy`` or ``python -m`` would load)."""
    names = set()
    if "tests." not in text:
        return names
    for node in ast.walk(ast.parse(text) if tree is None else tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for word in re.findall(r"\btests\.[A-Za-z_][\w.]*", node.value):
                if is_test_module(word):
                    names.add(word)
    return names


def importers() -> list[Path]:
    """Every Python file that could import a test module: the packages, the tests, the scripts, the root's."""
    return py_files("*.py", "tests/*.py", "scripts/**/*.py", *(f"{pkg}/**/*.py" for pkg in LAYERS))


def test_nothing_imports_a_test_module():
    """Fakes, builders and probes shared by the tests and the scripts live in support modules (tests/builders.py,
    fakes.py, serving.py, checkpoints.py, engine_probes.py...): no file imports a test module or conftest.py
    (pytest loads those), by an import statement or by its name (a string handed to the import machinery, a
    subprocess's ``-m``); a test that needs test files loaded has pytest collect them."""
    for path in importers():
        text = path.read_text()
        if "tests" not in text:
            continue
        tree = ast.parse(text)
        rel = path.relative_to(ROOT).as_posix()
        bad = {m for m in imports(path, tree=tree) if is_test_module(m)}
        assert not bad, f"{rel} imports {sorted(bad)}: move what it needs to a support module"
        if rel != "tests/test_layout.py":  # its own probes below
            named = named_test_modules(text, tree)
            assert not named, f"{rel} names the test modules {sorted(named)}: move what it needs to a support module"


def test_a_test_module_named_in_a_string_is_caught():
    loop = 'modules = ["tests.test_graphs", "tests.builders"]\nfor m in modules:\n    __import__(m)'
    probes = {'__import__("tests.test_runner")': {"tests.test_runner"}, loop: {"tests.test_graphs"},
              'importlib.import_module("tests.conftest")': {"tests.conftest"},
              'subprocess.run([sys.executable, "-m", "pytest", "tests/test_runner.py"])': set(),  # pytest loads a path
              "from tests.engine_probes import first_round": set()}
    for text, names in probes.items():
        assert named_test_modules(text) == names, text
    assert {"tests.test_runner", "tests.test_runner.MOE"} <= imports(ROOT / "scripts" / "probe.py",
                                                                    "from tests.test_runner import MOE\n")


def test_support_modules_are_importable():
    """The support modules load on their own (a script or a test imports them; none leans on conftest.py)."""
    import importlib

    support = [p.stem for p in py_files("tests/*.py") if not p.stem.startswith("test_") and p.stem != "conftest"]
    assert {"builders", "fakes", "engine_probes", "device_image"} <= set(support)
    for name in support:
        importlib.import_module(f"tests.{name}")


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


def top_level_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (imports, definitions, assignments)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If):  # e.g. an import under a guard
            names.update(top_level_names(ast.Module(body=node.body + node.orelse, type_ignores=[])))
    return names


def test_every_all_names_what_its_module_binds():
    """``from pkg import *`` works for every module of the tree that lists ``__all__``: each name it lists is
    bound there (``app.api`` listed ``VLLM_NOOPS`` without importing it)."""
    checked = 0
    for path in py_files(*(f"{pkg}/**/*.py" for pkg in LAYERS)):
        text = path.read_text()
        if "__all__" not in text:
            continue
        tree = ast.parse(text)
        listed = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                try:
                    listed += ast.literal_eval(node.value)
                except ValueError:  # built by code: the star import below is the check of such a one
                    pass
        missing = sorted(set(listed) - top_level_names(tree))
        if missing and "__getattr__" in top_level_names(tree):  # names a module __getattr__ serves (PEP 562)
            module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(
                ".__init__"))
            missing = [n for n in missing if not hasattr(module, n)]
        assert not missing, f"{path.relative_to(ROOT)}: __all__ lists {missing}, which it does not bind"
        checked += bool(listed)
    assert checked >= 3


def test_star_import_of_the_api():
    namespace: dict = {}
    exec("from app.api import *", namespace)
    import app.api

    assert set(app.api.__all__) <= set(namespace) and "VLLM_NOOPS" in namespace and "APIError" in namespace


def test_the_dispatcher_calls_the_driver_once_per_progress_batch():
    """A progress batch goes into the cluster as one call (``on_round``), whose answer is whole: neither
    ``Dispatcher.handle_batch`` nor what it calls to carry the answer out (finishing, moving, answering the
    instance) asks the driver anything else."""
    tree = ast.parse((ROOT / "app" / "dispatch.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Dispatcher"]
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}

    def driver_uses(name: str) -> list[str]:
        return [node.attr for node in ast.walk(methods[name]) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute) and node.value.attr == "driver"]

    assert driver_uses("handle_batch") == ["on_round"]
    for name in ("_item_step", "_finish", "_execute", "_send_add", "_planned", "_answer_round"):
        assert driver_uses(name) == [], name
