"""``remask eval --decoding``'s arithmetic: a rule's accuracy/speed frontier, the forwards per token it needs
for an accuracy, the speedup over ``threshold`` at matched accuracy, the plot, and the CLI's checks."""

from __future__ import annotations

import argparse

import pytest

from tools.evaluate import KNOB_SWEEPS, forwards_at, frontier, knob_sweep, matched_speedup, plot_frontiers


def pt(fpt, acc, value=0.0):
    return {"forwards_per_token": fpt, "accuracy": acc, "value": value, "knob": "threshold"}


def test_frontier_keeps_the_points_nothing_beats():
    pts = [pt(0.5, 0.8), pt(0.3, 0.6), pt(0.4, 0.55), pt(0.6, 0.79), pt(0.2, 0.6), pt(0.7, 0.9)]
    assert [(p["forwards_per_token"], p["accuracy"]) for p in frontier(pts)] == [(0.2, 0.6), (0.5, 0.8), (0.7, 0.9)]


def test_forwards_at_interpolates_along_the_frontier():
    pts = [pt(0.2, 0.6), pt(0.5, 0.8), pt(0.7, 0.9)]
    assert forwards_at(pts, 0.6) == 0.2 and forwards_at(pts, 0.5) == 0.2
    assert forwards_at(pts, 0.7) == pytest.approx(0.35) and forwards_at(pts, 0.9) == 0.7
    assert forwards_at(pts, 0.95) is None


def test_matched_speedup_against_threshold():
    sweeps = {"threshold": [pt(0.4, 0.6), pt(0.8, 0.8)], "fast": [pt(0.2, 0.6), pt(0.4, 0.8)],
              "weak": [pt(0.1, 0.5), pt(0.3, 0.7)]}
    out = matched_speedup(sweeps)
    assert [r["speedup"] for r in out["fast"]] == [2.0, 2.0]
    assert out["weak"][0]["speedup"] == pytest.approx(0.4 / (0.1 + 0.2 * 0.5)) and out["weak"][1]["speedup"] is None


def test_plot_and_sweeps(tmp_path):
    sweeps = {"threshold": [pt(0.4, 0.6, 0.5), pt(0.8, 0.8, 0.9)], "credit": [pt(0.3, 0.6, 0.5)]}
    path = plot_frontiers(sweeps, "t", str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 1000 and path.endswith("f.png")
    assert knob_sweep("threshold") == KNOB_SWEEPS["threshold"]
    assert knob_sweep("dynamic")[0] == 0.95


def _args(**kw):
    base = dict(model="tiny-bd", decoding=None, decoding_config=None, knobs=None, plot=None, thresholds=[0.9],
                n=1, seed=0, json=True, cache="dual", slots=4, device="cpu", quiet=True)
    return argparse.Namespace(**{**base, **kw})


def test_eval_cli_rejects_bad_rules_before_loading_a_model():
    from tools.model_cli import cmd_eval

    with pytest.raises(ValueError, match="unknown unmasking rule 'nope'"):
        cmd_eval(_args(decoding="nope"))
    with pytest.raises(ValueError, match="gamma"):
        cmd_eval(_args(decoding="entropy_bound", decoding_config='{"gamma": -1}'))
    with pytest.raises(ValueError, match="JSON object"):
        cmd_eval(_args(decoding="credit", decoding_config="[1]"))
    with pytest.raises(ValueError, match="unknown field 'bogus'"):
        cmd_eval(_args(decoding="credit", decoding_config='{"bogus": 1}'))
    with pytest.raises(ValueError, match="go with --decoding"):
        cmd_eval(_args(knobs=[0.5]))
