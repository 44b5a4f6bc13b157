"""The import direction of DESIGN.md, checked on the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOWER = ("engine", "predictors", "planner")
UPPER = {"app", "deployments", "sim", "loadgen"}
# scheduling and routing code: never torch or ray (the simulator runs it at full speed)
PURE = ["engine/tasks.py", "engine/scheduler*.py", "engine/policies*.py", "engine/registry.py", "app/router*.py",
        "app/router/*.py", "sim/*.py", "planner/*.py"]


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def py_files(*patterns: str) -> list[Path]:
    return sorted({p for pat in patterns for p in ROOT.glob(pat)})


@pytest.mark.parametrize("package", LOWER)
def test_lower_layers_do_not_import_upper(package):
    for path in py_files(f"{package}/**/*.py"):
        bad = {m for m in imports(path) if m.split(".")[0] in UPPER}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_pure_modules_import_neither_torch_nor_ray():
    for path in py_files(*PURE):
        bad = {m for m in imports(path) if m.split(".")[0] in ("torch", "ray")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_deployments_import_ray_serve():
    for path in py_files("**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("deployments", ".venv", "tests"):
            continue
        bad = {m for m in imports(path) if m.startswith("ray.serve") or m == "ray.serve"}
        assert not bad, f"{rel} imports {bad}"
