"""The CLI on the shipped default models."""

from __future__ import annotations

import json

import pytest

from engine.loading import DEFAULTS_DIR
from tools.cli import main

pytestmark = pytest.mark.skipif(not (DEFAULTS_DIR / "tiny-bd" / "config.json").exists(),
                                reason="embedded models not present")


@pytest.mark.parametrize("model", ["tiny-bd", "tiny-mdm"])
def test_eval_prints_the_json_of_the_issue(capsys, model):
    assert main(["eval", "--model", model, "--thresholds", "0.5,0.9", "--n", "60", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == model
    lo, hi = out["results"]
    assert {"threshold", "accuracy", "mean_rounds", "requests", "by_category"} <= set(hi)
    assert hi["requests"] == 60 and set(hi["by_category"]) == {"arith", "choice", "lookup", "prose", "reverse"}
    assert lo["mean_rounds"] < hi["mean_rounds"]  # a lower threshold commits more per round
    assert hi["accuracy"] >= 0.6  # the shipped weights really solve the task suite


def test_generate_shows_the_canvas(capsys):
    assert main(["generate", "--model", "tiny-bd", "--prompt", "rev: abcde", "--show-steps"]) == 0
    out = capsys.readouterr().out
    assert "edcba" in out and "denoise" in out and "prefill" in out


def test_bad_arguments_get_a_clear_error_before_any_work(capsys):
    assert main(["simulate", "--scenario", "dilaserve-bench", "--plot", "x.png"]) == 2
    assert "dilaserve-trace" in capsys.readouterr().err
    assert main(["faults", "--replicas", "1"]) == 2
    assert "--replicas >= 2" in capsys.readouterr().err
