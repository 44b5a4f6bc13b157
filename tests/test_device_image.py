"""The device run (scripts/h200_check.sh) uses the lent machine's own Python, which has torch, numpy,
safetensors, scipy and pytest but none of the service's stack (ray, pydantic, fastapi, cvxpy, HiGHS,
LightGBM, Locust). Its commands must run without them: here they run in a subprocess where importing
any of those fails, as it would there."""

from __future__ import annotations

import json

import pytest

from tests.device_image import without_service_stack

SHAPE = "llada-8b-shape:layers=1,vocab=128,hidden=64,heads=2,kv_heads=2,intermediate=128"

_RUNNER = """
    for module in json.loads(sys.argv[2]):  # what the gpu-tests step collects
        __import__(module)
    from tools.cli import main
    for argv in json.loads(sys.argv[3]):
        rc = main(argv)
        if rc:
            sys.exit(f"{argv[:2]} exited {rc}")
    sys.exit(f"imported {leaked()}" if leaked() else 0)
"""


def _without_service_stack(modules: list[str], commands: list[list[str]], timeout: float):
    """Import ``modules``, then run each ``remask`` command, in a Python where ABSENT cannot be imported."""
    return without_service_stack(_RUNNER, json.dumps(modules), json.dumps(commands), timeout=timeout)


@pytest.mark.slow
def test_device_run_commands_need_only_the_device_image(tmp_path):
    modules = ["tests.test_runner", "tests.test_bench_engine", "tests.test_graphs"]
    profile = tmp_path / "p.json"
    commands = [
        ["bench", "round", "--model", SHAPE, "--slots", "2", "--tokens", "8", "--context", "16", "--repeats", "1",
         "--json", "--out", str(tmp_path / "round.json")],
        ["bench", "round", "--recompute", "64", "--canvas", "64", "--model", SHAPE, "--repeats", "1", "--json",
         "--out", str(tmp_path / "recompute.json")],
        ["bench", "engine", "--model", SHAPE, "--requests", "2", "--prompt-len", "16", "--gen-length", "8",
         "--quiet", "--json"],
        ["profile", "--model", SHAPE, "--batch-sizes", "1,2", "--prompt-lens", "16", "--max-tokens", "8",
         "--rounds", "1", "--out", str(profile)],
        ["profile", "--model", SHAPE, "--check", str(profile), "--requests", "3", "--slots", "2", "--json"],
    ]
    done = _without_service_stack(modules, commands, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "round.json").read_text())["variants"]
    assert json.loads((tmp_path / "recompute.json").read_text())["rows"][0]["recompute"]["in_place"]
    assert json.loads(profile.read_text())["curves"]


def test_the_blocker_blocks():
    """The check above can fail: a command that imports the service stack is caught."""
    done = _without_service_stack(["planner.milp"], [], timeout=120)
    assert done.returncode != 0 and "absent on the device image" in done.stderr
