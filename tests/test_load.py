"""Load as a multiple of capacity: ``planner.slo_capacity.slo_capacity``, the scenarios' capacity and the
``--load`` option of ``remask simulate``."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest

from cluster import RouterConfig
from engine.latency_profile import load_tp_profiles
from planner.costs import StepModel
from planner.slo_capacity import slo_capacity
from planner.workload import WorkloadClass
from sim.cluster import ClusterConfig, ClusterSimulator, summarize
from sim.cluster_scenarios import (
    CLUSTER_SCENARIOS,
    make_specs,
    mean_request,
    offered_rate,
    scenario_capacity,
)
from sim.threshold_table import ThresholdTable
from tools.cli import main

PROFILE = "h200-llada8b-measured"
TS = (0.9, 0.8, 0.7)


def _table() -> ThresholdTable:
    """A synthetic threshold table: long prose that a lower threshold shortens, short lookups that it does not."""
    prompts, cats, rounds, correct = [], [], [], []
    for k in range(12):
        prompts.append("write a story about a fox " + "and a hen " * (k % 4))
        cats.append("prose")
        rounds.append((14 + k, 11 + k, 9 + k))
        correct.append((True, True, k % 3 != 0))
    for k in range(6):
        prompts.append(f"capital of {k}")
        cats.append("lookup")
        rounds.append((1, 1, 1))
        correct.append((True, True, True))
    return ThresholdTable("synthetic", TS, tuple(prompts), tuple(cats), tuple(rounds), tuple(correct))


def _mean(prompt: float = 120.0, steps_per_token: float = 0.4):
    return WorkloadClass("mean", 1.0, prompt, 256.0), StepModel(steps_per_token={0.9: steps_per_token, 0.7: 0.3})


def test_slo_capacity_scales_with_instances_speed_and_slo():
    profiles = load_tp_profiles(PROFILE, [1, 2])
    mean, model = _mean()
    one = slo_capacity(mean, profiles, model, {1: 4}, 32, 5.0)
    assert one.threshold == 0.9 and one.mean_steps == 103  # ceil(256 x 0.4) steps at the top threshold
    assert slo_capacity(mean, profiles, model, {1: 16}, 32, 5.0).rps == pytest.approx(4 * one.rps)
    # a profile twice as fast completes twice as much at the same occupancy (the SLO scales with it)
    fast = {d: p.scaled(0.5) for d, p in profiles.items()}
    assert slo_capacity(mean, fast, model, {1: 4}, 32, 5.0).rps == pytest.approx(2 * one.rps, rel=1e-6)
    # an SLO of the isolated latency itself admits one request per round; a loose one fills every slot
    assert slo_capacity(mean, profiles, model, {1: 4}, 32, 1.0).levels == {1: 1}
    loose = slo_capacity(mean, profiles, model, {1: 4}, 32, 1000.0)
    assert loose.levels == {1: 32} and loose.rps > one.rps > slo_capacity(mean, profiles, model, {1: 4}, 32, 1.0).rps
    assert 1 < one.levels[1] < 32
    # a lower threshold needs fewer steps: more requests per second
    assert slo_capacity(mean, profiles, model, {1: 4}, 32, 5.0, threshold=0.7).rps > one.rps
    mixed = slo_capacity(mean, profiles, model, {1: 2, 2: 1}, 32, 5.0)
    assert mixed.rps == pytest.approx(2 * one.per_instance_rps[1] + mixed.per_instance_rps[2])
    assert mixed.per_instance_rps[2] > one.per_instance_rps[1]


def test_slo_capacity_rejects_bad_input():
    profiles = load_tp_profiles(PROFILE, [1])
    mean, model = _mean()
    with pytest.raises(ValueError, match="TP degree"):
        slo_capacity(mean, profiles, model, {1: 2, 4: 1}, 32, 5.0)
    with pytest.raises(ValueError, match="at least one instance"):
        slo_capacity(mean, profiles, model, {1: 0}, 32, 5.0)
    with pytest.raises(ValueError, match="slots"):
        slo_capacity(mean, profiles, model, {1: 1}, 0, 5.0)
    with pytest.raises(ValueError, match="threshold 0.5"):
        slo_capacity(mean, profiles, model, {1: 1}, 32, 5.0, threshold=0.5)


def test_mean_request_is_the_mix_expectation_of_make_specs():
    sc = replace(CLUSTER_SCENARIOS["dilaserve-bench"], tp_degrees=(1, 1, 1, 1))
    table = _table()
    profiles = load_tp_profiles(PROFILE, [1])
    prompt, steps = mean_request(sc, table, TS)
    specs = make_specs(sc, table, 6000, 1.0, 3, profiles, TS)
    assert statistics.fmean(s.prompt_tokens for s in specs) == pytest.approx(prompt, rel=0.03)
    assert statistics.fmean(s.steps[0] for s in specs) == pytest.approx(steps, rel=0.03)
    # the long mix has 70% prose: more steps than the uniform one's
    assert steps > mean_request(replace(sc, mix="uniform"), table, TS)[1]


def test_offered_rate():
    assert offered_rate(None, 1.5, 20.0, 7.0) == pytest.approx(30.0)
    assert offered_rate(12.0, None, 20.0, 7.0) == 12.0
    assert offered_rate(None, None, 20.0, 7.0) == 7.0
    with pytest.raises(ValueError, match="not both"):
        offered_rate(10.0, 1.0, 20.0, 7.0)
    with pytest.raises(ValueError, match="--load must be positive"):
        offered_rate(None, 0.0, 20.0, 7.0)
    with pytest.raises(ValueError, match="--rate must be positive"):
        offered_rate(-1.0, None, 20.0, 7.0)


def _attainment(load: float) -> float:
    sc = replace(CLUSTER_SCENARIOS["dilaserve-bench"], tp_degrees=(1, 1))
    table = _table()
    profiles = load_tp_profiles(PROFILE, [1])
    cap = scenario_capacity(sc, table, profiles, TS)
    specs = make_specs(sc, table, 160, load * cap.rps, 0, profiles, TS)
    cfg = ClusterConfig(sc.tp_degrees, sc.slots, sc.block_tokens, 300, router=RouterConfig(thresholds=TS))
    res = ClusterSimulator(cfg, profiles, "infaas", 0).run(specs)
    return summarize(res, specs, [])["slo_attainment"]


@pytest.mark.slow
def test_capacity_is_where_the_fixed_threshold_baseline_starts_to_miss():
    """Below the capacity INFaaS (threshold 0.9, every request admitted) meets nearly every SLO; at twice it,
    queues grow and most requests miss."""
    assert _attainment(0.6) >= 0.9
    assert _attainment(2.0) < 0.5


@pytest.fixture
def synthetic_scenario(monkeypatch):
    import sim.cluster_run as cr
    import sim.cluster_scenarios as cs

    sc = replace(cs.CLUSTER_SCENARIOS["dilaserve-bench"], tp_degrees=(1, 1, 1, 1))
    monkeypatch.setitem(cs.CLUSTER_SCENARIOS, "dilaserve-bench", sc)
    monkeypatch.setattr(cr, "load_table", lambda *a, **k: _table())
    return sc


def test_simulate_load_prints_capacity_and_rate(synthetic_scenario, capsys):
    assert main(["simulate", "--scenario", "dilaserve-bench", "--policies", "infaas", "--load", "0.5",
                 "--requests", "40", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["load"] == 0.5 and out["capacity_rps"] > 0
    assert out["arrival_rate_rps"] == pytest.approx(0.5 * out["capacity_rps"], rel=1e-3)
    assert out["capacity"]["slo_occupancy"]["tp1"] >= 1 and out["profile"] == PROFILE
    # --rate: the load is reported against the same capacity
    assert main(["simulate", "--scenario", "dilaserve-bench", "--policies", "infaas", "--rate", "3",
                 "--requests", "20", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "3.00 req/s = load" in text and f"capacity {out['capacity_rps']:.2f} req/s" in text


def test_simulate_rejects_rate_and_load_together(synthetic_scenario, capsys):
    assert main(["simulate", "--scenario", "dilaserve-bench", "--rate", "3", "--load", "1", "--requests", "5",
                 "--quiet"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["simulate", "--scenario", "dilaserve-bench", "--load", "-1", "--requests", "5", "--quiet"]) == 2
    assert "--load must be positive" in capsys.readouterr().err


def test_simulate_profile_option_moves_the_capacity(synthetic_scenario, capsys, tmp_path):
    from engine.latency_profile import load_profile

    slow = load_profile(PROFILE).scaled(2.0, name="slow")
    path = tmp_path / "slow.json"
    slow.save(path)
    caps = []
    for prof in (PROFILE, str(path)):
        assert main(["simulate", "--scenario", "dilaserve-bench", "--policies", "infaas", "--load", "1",
                     "--requests", "10", "--json", "--quiet", "--profile", prof]) == 0
        caps.append(json.loads(capsys.readouterr().out)["capacity_rps"])
    assert caps[1] == pytest.approx(caps[0] / 2, rel=1e-3)


def test_load_control_prices_steps_in_the_mixed_rounds_instances_run():
    """A recompute step costs its own forward in a round of mostly cached steps (fixed costs unshared), and the
    two kinds' costs add up to the round: not a round of ``batch`` recompute steps' share, which was a fraction
    of it on the measured profile."""
    from cluster import StepShape, TpLatencyModel
    from cluster.capacity import cluster_capacity, step_costs
    from cluster.state import InstanceState

    lat = TpLatencyModel(load_tp_profiles(PROFILE, [1]), 32, StepShape(32, 320, True))
    heavy, light = step_costs(lat, 1, 14, 0.076)  # one recompute step among 13 cached
    assert heavy == pytest.approx(lat.round_ms(1, 1, 13) - lat.round_ms(1, 0, 13))
    assert heavy + 13 * light == pytest.approx(lat.round_ms(1, 1, 13))
    assert heavy > 1.5 * lat.step_ms(1, 14, "recompute") / 14  # a round of 14 recompute steps shares its costs
    h3, l3 = step_costs(lat, 1, 32, 0.1)  # three recompute steps share their forward
    assert 3 * h3 + 29 * l3 == pytest.approx(lat.round_ms(1, 3, 29)) and h3 < heavy
    cap = cluster_capacity(lat, [InstanceState(f"i{k}", 1) for k in range(4)], 5.0, 0.076)
    assert (cap.heavy_cost, cap.light_cost) == step_costs(lat, 1, cap.batch, 0.076) and cap.speed == pytest.approx(4)


def test_capacity_table_shows_what_a_lower_threshold_removes(synthetic_scenario, capsys):
    assert main(["simulate", "--scenario", "dilaserve-bench", "--capacity", "--json", "--quiet"]) == 0
    rep = json.loads(capsys.readouterr().out)
    rows = rep["thresholds"]
    assert [r["threshold"] for r in rows] == list(TS) and rows[0]["steps_removed"] == 0.0
    for hi, lo in zip(rows, rows[1:]):
        assert lo["mean_steps"] < hi["mean_steps"] and lo["capacity_rps"] > hi["capacity_rps"]
    for r in rows[1:]:  # one recompute step per block stays whatever the threshold: less work goes than steps
        assert 0 < r["work_removed"] < r["steps_removed"]
        assert r["recompute_share_of_work"] > rows[0]["recompute_share_of_work"] * 0.99
    assert rows[2]["accuracy_mix"] < rows[0]["accuracy_mix"]  # the synthetic prose loses answers at 0.7
    assert main(["simulate", "--scenario", "dilaserve-bench", "--capacity", "--quiet"]) == 0
    assert "work removed" in capsys.readouterr().out
