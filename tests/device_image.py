"""The lent device's Python: torch, numpy, safetensors, tokenizers, scipy and pytest, but none of the service's
stack. ``without_service_stack`` runs a test's code in a subprocess where importing any of ``ABSENT`` fails, as
it would there (tests/test_device_image.py, tests/test_h200_check.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# in the project's dependencies, absent from the device image (.library/device/KINDS.md's package list)
ABSENT = ("ray", "pydantic", "fastapi", "starlette", "uvicorn", "cvxpy", "highspy", "lightgbm", "locust",
          "gurobipy")

# the blocker, then the test's code; sys.argv[1] is ABSENT as JSON, the test's own arguments follow it
_PRELUDE = textwrap.dedent("""
    import importlib.abc, json, sys
    ABSENT = set(json.loads(sys.argv[1]))

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ABSENT:
                raise ModuleNotFoundError(f"No module named {name!r} (absent on the device image)", name=name)
            return None

    sys.meta_path.insert(0, Absent())

    def leaked():
        return sorted(m for m in sys.modules if m.split(".")[0] in ABSENT)
""")


def without_service_stack(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``code`` (after the blocker; it reads its ``args`` from ``sys.argv[2:]``) in a fresh Python where
    none of ``ABSENT`` can be imported; ``leaked()`` there names any that were."""
    return subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code), json.dumps(ABSENT), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
