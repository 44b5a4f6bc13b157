"""The serve configs in the repository are valid application configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.config import AppConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(p.name for p in ROOT.glob("serve_config*.yaml")))
def test_serve_configs_validate(name):
    data = yaml.safe_load((ROOT / name).read_text())
    for app in data["applications"]:
        assert app["import_path"] == "deployments.builder:build_app"
        AppConfig(**app["args"])
