"""The dev extra holds only what the tests and `make test` use, and installs every extra the tests need.

deptry (`make deps`) checks the other direction: every import is declared, and every regular dependency imported;
it does not look at the dev extra's packages, which are imported by tests or run as tools."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
NAME = PYPROJECT["project"]["name"]
# extras for a backend the code falls back from (planner/solver.py uses HiGHS without Gurobi): not in dev
OPTIONAL_BACKENDS = {"gurobi"}


def _requirement(spec: str) -> tuple[str, set[str]]:
    """(normalized name, extras) of a requirement such as ``ray[serve]==2.60.0``."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", spec)
    if m is None:
        raise ValueError(f"not a requirement: {spec!r}")
    extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), extras


def _module_of(package: str) -> str:
    """The import name of a package: [tool.deptry]'s package_module_name_map, else the name with underscores."""
    mapped = PYPROJECT["tool"]["deptry"]["package_module_name_map"]
    names = {_requirement(k)[0]: v for k, v in mapped.items()}
    return names.get(package, package.replace("-", "_"))


def _test_imports() -> set[str]:
    """Top-level modules the test files import, with ``pytest.importorskip("name")`` counted as an import."""
    found: set[str] = set()
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)):
                found.add(str(node.args[0].value).split(".")[0])
    return found


# pytest options a plugin provides, and the plugin's import name (`make test` runs two pytest-xdist workers)
PYTEST_PLUGIN_OPTIONS = {"--dist": "xdist"}


def _makefile_tools() -> set[str]:
    """Programs the Makefile runs from the virtualenv (``$(VENV)/bin/x``) or as modules (``-m x``), and the
    pytest plugins its pytest options need."""
    text = (ROOT / "Makefile").read_text()
    return (set(re.findall(r"\$\(VENV\)/bin/([A-Za-z0-9_-]+)", text)) | set(re.findall(r"-m ([A-Za-z0-9_]+)", text))
            | {plugin for option, plugin in PYTEST_PLUGIN_OPTIONS.items() if option in text})


def test_requirement_names_parse():
    assert _requirement("ray[serve]==2.60.0") == ("ray", {"serve"})
    assert _requirement("prometheus_client>=0.20") == ("prometheus-client", set())
    assert _requirement(f"{NAME}[load, x]") == (NAME, {"load", "x"})


def test_every_dev_package_is_imported_by_a_test_or_run_by_make():
    used = _test_imports() | _makefile_tools()
    unused = []
    for spec in EXTRAS["dev"]:
        package, _ = _requirement(spec)
        if package != NAME and _module_of(package) not in used and package not in used:
            unused.append(package)
    assert not unused, f"in the dev extra but neither imported by tests/ nor run by the Makefile: {unused}"


def test_the_dev_extra_installs_every_other_extra_the_tests_need():
    pulled: set[str] = set()
    for spec in EXTRAS["dev"]:
        package, extras = _requirement(spec)
        if package == NAME:
            pulled |= extras
    wanted = set(EXTRAS) - {"dev"} - OPTIONAL_BACKENDS
    missing = sorted(wanted - pulled)
    assert not missing, f"`pip install -e .[dev]` misses the extras {missing}: add them to dev as {NAME}[...]"
