"""Decoding rules under DiLaServe's control: the router's candidate thresholds are levels that every rule
turns into its own knob (monotone, in its slower direction as the level rises), so SLO-aware selection
(Alg. 1) and load control (Alg. 2) move an ``entropy_bound`` request's gamma and a ``joint_threshold``
request's threshold in their faster directions under load, as they move a threshold request's threshold;
and a step model learns steps as a function of (rule, knob)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cluster import RequestState, Router, RouterConfig, StepShape, TableStepEstimator, TpLatencyModel
from cluster.thresholds import decoding_row, knob_for, request_knob, rule_knobs
from engine.decoding import RULES, make_rule
from engine.latency_profile import load_tp_profiles
from predictors.features import RULE_CODES, RULE_FEATURES, STEP_FEATURES, rule_code, with_decoding

HAND_PROFILE = str(Path(__file__).parent / "profiles" / "h200-llada8b-hand.json")
TS = (0.9, 0.8, 0.7, 0.6, 0.5)
# remaining steps per candidate level of a 256-token request, per rule (what its table would hold)
STEPS = {"threshold": (100.0, 80.0, 60.0, 50.0, 40.0), "entropy_bound": (90.0, 70.0, 55.0, 45.0, 35.0),
         "joint_threshold": (110.0, 90.0, 70.0, 60.0, 50.0)}


def router(capacity_util: float) -> Router:
    lat = TpLatencyModel(load_tp_profiles(HAND_PROFILE, [1]), 16, StepShape(32, 396))
    est = TableStepEstimator(TS, lambda s: STEPS[s.decoding], sigma=0.0)
    return Router("remask", lat, est, [(0, 1)], RouterConfig(load_control_interval_s=0.0,
                                                              capacity_util=capacity_util))


def plan(capacity_util: float) -> dict[str, tuple[float, float]]:
    """(level, knob) of one request of each rule, all on one instance with a generous SLO."""
    r = router(capacity_util)
    reqs = []
    for i, rule in enumerate(STEPS):
        req = RequestState(rule, 0.001 * i, 100.0, 140, 256, decoding=rule)
        r.add_request(req, 0.001 * i)
        reqs.append(req)
    r._control(1.0)
    levels = r.plan_thresholds(0, reqs, 1.0)
    return {q.decoding: (lv, request_knob(q)) for q, lv in zip(reqs, levels)}


def test_load_control_moves_every_rules_knob_in_its_faster_direction():
    calm, loaded = plan(1.0), plan(1e-4)
    assert all(level == 0.9 for level, _ in calm.values())  # no load, a loose SLO: the slowest, most careful
    assert all(level == 0.5 for level, _ in loaded.values())  # overloaded: the lowest level for everyone
    # threshold-knobbed rules: their threshold falls (faster)
    for rule in ("threshold", "joint_threshold"):
        assert calm[rule][1] == 0.9 and loaded[rule][1] == 0.5
    # entropy_bound: gamma rises (faster), from -ln 0.9 to -ln 0.5
    assert calm["entropy_bound"][1] == pytest.approx(-math.log(0.9))
    assert loaded["entropy_bound"][1] == pytest.approx(math.log(2.0))
    for rule, (_, knob) in loaded.items():
        assert make_rule(rule).speed_sign * (knob - calm[rule][1]) > 0  # faster, in the rule's own terms


def test_every_rule_maps_the_candidate_levels_monotonically():
    for name in RULES:
        rule = make_rule(name)
        knobs = rule_knobs(name, TS)
        assert len(set(knobs)) >= 2, name  # the levels move the knob
        assert all(rule.speed_sign * (b - a) >= 0 for a, b in zip(knobs, knobs[1:])), (name, knobs)
        assert all(rule.knob_range[0] <= k <= rule.knob_range[1] for k in knobs)
    assert knob_for("threshold", 0.73) == 0.73  # the threshold rule: the level is the threshold, as today
    with pytest.raises(ValueError, match="unknown unmasking rule"):
        knob_for("nope", 0.9)


def test_decoding_rows_carry_the_rule_and_its_knob():
    assert RULE_FEATURES == ("rule", "knob") and RULE_CODES[0] == "threshold"
    assert rule_code("renoise") >= 100 and rule_code("renoise") == rule_code("renoise")
    s = RequestState("a", 0.0, 10.0, 140, 256, decoding="entropy_bound")
    s.progress, s.conf_stats = 0.25, (0.1, 0.2, 0.3, 0.4, 0.5)
    row = decoding_row(s, 0.7)
    assert len(row) == len(STEP_FEATURES) + 2 and row[0] == 0.7
    assert row[-2:] == [float(RULE_CODES.index("entropy_bound")), pytest.approx(-math.log(0.7))]
    rows = with_decoding(np.array([row[:11], row[:11]]), "low_confidence")
    assert rows.shape == (2, 13) and rows[0, 11] == 2.0 and rows[0, 12] == 2.0  # k at 0.7


@pytest.mark.slow  # two LightGBM fits, about a second each
def test_step_model_learns_steps_per_rule_and_knob():
    """A step model trained on rows with the rule columns tells the rules apart at the same level, where the
    eleven features alone cannot; a model of the eleven still answers wider rows (it reads its own)."""
    from predictors.step import StepPredictor

    rng = np.random.default_rng(0)
    rows, labels = [], []
    for _ in range(600):
        rule = ("threshold", "entropy_bound")[int(rng.integers(2))]
        level = float(rng.choice(TS))
        progress = float(rng.uniform(0, 0.9))
        base = [level, 256.0, progress, 0.5, 4.0, 2.0, 0.1, 0.3, 0.5, 0.5, 0.7]
        knob = knob_for(rule, level)
        # threshold: fewer steps as the threshold falls; entropy_bound: fewer as gamma rises, and half as many
        total = 40.0 + 100.0 * level if rule == "threshold" else 20.0 + 15.0 / (0.05 + knob)
        rows.append(with_decoding(np.array([base]), rule)[0])
        labels.append(max(total * (1.0 - progress), 1.0))
    aware = StepPredictor.fit(np.array(rows), np.array(labels))
    blind = StepPredictor.fit(np.array(rows)[:, :11], np.array(labels))
    assert aware.width == 13 and blind.width == 11
    probe = np.array([[0.9, 256.0, 0.0, 0.5, 4.0, 2.0, 0.1, 0.3, 0.5, 0.5, 0.7]])
    thr = aware.predict(probe, TS, rule="threshold")[0]
    eb = aware.predict(probe, TS, rule="entropy_bound")[0]
    assert thr[0] == pytest.approx(140.0, rel=0.1) and eb[0] == pytest.approx(20 + 15 / (0.05 - math.log(0.9)),
                                                                              rel=0.15)
    assert all(a > b for a, b in zip(thr, thr[1:])) and all(a > b for a, b in zip(eb, eb[1:]))
    # the blind model answers the 13-column rows (the same for both rules: it cannot tell them apart)
    assert np.allclose(blind.predict(probe, TS, rule="threshold"), blind.predict(probe, TS, rule="entropy_bound"))


@pytest.mark.slow  # loads the embedded model and decodes a few prompts (about 5 s on a busy core)
def test_threshold_tables_are_per_rule(tmp_path, monkeypatch):
    """A rule's table holds its rounds at the knob of each level; the threshold rule's key is today's."""
    from sim import threshold_table as tt

    monkeypatch.setenv("REMASK_CACHE_DIR", str(tmp_path))
    ts = (0.9, 0.5)
    assert tt._key("tiny-bd", 4, 1, ts) == tt._key("tiny-bd", 4, 1, ts, "threshold", None)
    assert tt._key("tiny-bd", 4, 1, ts, "low_confidence") != tt._key("tiny-bd", 4, 1, ts)
    table = tt.load_table("tiny-bd", n=4, seed=1, thresholds=ts, rule="low_confidence")
    assert table.decoding == "low_confidence" and table.knobs() == (1, 4)
    # k = 1 commits one token per round, k = 4 up to four: fewer rounds at the lower level
    assert all(r[0] > r[1] for r in table.rounds)
    again = tt.ThresholdTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert again == table and tt.load_table("tiny-bd", n=4, seed=1, thresholds=ts, rule="low_confidence") == table
    with pytest.raises(ValueError, match="unknown unmasking rule"):
        tt.load_table("tiny-bd", n=4, seed=1, thresholds=ts, rule="nope")
