"""Stage 1 with mixed rounds (planner/stage1_mixed.py) and the trace's frozen load calibration."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.latency_profile import load_tp_profiles
from planner import Cluster, Planner, PlannerConfig, Stage1Config, WorkloadClass, plan_capacity
from planner.costs import StepModel
from planner.stage1_mixed import mixed_tables, rank

PROFILES = load_tp_profiles("h200-llada8b")
SPT = {0.7: 0.323, 0.8: 0.372, 0.9: 0.41}  # the dilaserve-trace workload's measured steps per token
# a fifth of the requests unmask a block per step (8 steps for 256 tokens), the rest take more than the mean
SPREAD = ((0.2, 0.07), (0.8, 1.2325))
STEPS = StepModel(steps_per_token=SPT, block_tokens=32, spread=SPREAD)
MIXED = Stage1Config(slo_scale=1.75, solver="highs", batches=(1, 2, 4, 8, 16, 32), rounds="mixed")


def _classes(rate: float) -> list[WorkloadClass]:
    return [WorkloadClass("c", rate, 55.0, 256.0)]


def test_step_model_spread_is_checked_and_scales_steps():
    with pytest.raises(ValueError, match="spread"):
        StepModel(spread=((0.5, 1.0),))
    with pytest.raises(ValueError, match="spread"):
        StepModel(spread=((1.0, 0.0),))
    assert STEPS.steps(256, 0.9, 0.07) == (8, 0)  # floored at one step per block: all recompute
    assert STEPS.steps(256, 0.9) == (8, 97)
    assert sum(STEPS.steps(256, 0.9, 1.2325)) == int(np.ceil(256 * 0.41 * 1.2325))
    with pytest.raises(ValueError, match="rounds"):
        Stage1Config(rounds="both")


def test_mixed_round_latency_alone_is_the_profiles_round_and_grows_with_occupancy():
    tab = mixed_tables(_classes(10.0), PROFILES, STEPS, (1, 2, 4, 8))
    seq = 55.0 + 256.0
    short, top = 0, len(tab.thresholds) - 1  # the block-per-step group, threshold 0.9
    for k, d in enumerate(tab.degrees):
        alone = PROFILES[d].round_ms([("recompute", seq, seq)])
        assert tab.latency[short, top, k, 0] == pytest.approx(8 * alone, rel=1e-6)
        assert np.all(np.diff(tab.latency[:, :, k, :], axis=-1) > 0)  # more requests per round: slower
    # a recompute step shares its round with the others' cached forward: at 4 requests on TP-1 a short
    # request's step takes its own recompute plus at least the cached forward of the others
    others = PROFILES[1].round_ms([("cached", 32, seq)] * 3)
    assert tab.latency[short, top, 0, 2] / 8 >= PROFILES[1].round_ms([("recompute", seq, seq)]) + 0.9 * others
    # per step the instance's time falls with occupancy (rounds amortise), and TP-4 is faster than TP-1
    assert np.all(np.diff(tab.step_ms, axis=-1) < 0)
    assert np.all(tab.latency[:, :, -1, :] < tab.latency[:, :, 0, :])


def test_mixed_stage1_picks_tp4_where_only_it_meets_the_short_requests_budget():
    """At 40 req/s and SLO 1.75x, 16 TP-1 instances run about 4 requests per round: a short request's
    recompute step plus the others' cached forward passes its per-step budget (1.75 x its alone step),
    so the block-per-step fifth misses; 4 TP-4 instances meet every group's SLO."""
    classes = _classes(40.0)
    tp1 = plan_capacity(classes, 16, PROFILES, STEPS, MIXED, fixed_counts={1: 16, 2: 0, 4: 0})
    tp4 = plan_capacity(classes, 16, PROFILES, STEPS, MIXED, fixed_counts={1: 0, 2: 0, 4: 4})
    assert tp1.feasible and tp4.feasible
    short = [g for g in tp1.groups if g["steps"] == 8]
    assert short and all(g["within_slo"] == 0 for g in short) and tp1.slo_met == pytest.approx(0.8, abs=1e-6)
    assert tp4.slo_met == pytest.approx(1.0)
    for search in ("milp", "single-degree"):
        plan = plan_capacity(classes, 16, PROFILES, STEPS, replace(MIXED, mixed_search=search))
        assert plan.slo_met == pytest.approx(1.0) and plan.counts[4] >= 3, (search, plan.counts)
        assert rank(plan) >= rank(tp4)
    # the separate-rounds model sees the class's mean request only, and every step of it within budget on TP-1
    sep = plan_capacity(classes, 16, PROFILES, STEPS, replace(MIXED, rounds="separate"),
                        fixed_counts={1: 16, 2: 0, 4: 0})
    assert sep.feasible and sep.slo_met is None


def test_mixed_stage1_low_load_meets_everything_and_overload_falls_back():
    low = plan_capacity(_classes(5.0), 16, PROFILES, STEPS, MIXED)
    assert low.feasible and low.slo_met == pytest.approx(1.0) and set(low.thresholds.values()) == {0.9}
    assert low.gpus_used <= 16
    # overloaded: admission control refuses what would miss, and what is left is served within SLO
    over = plan_capacity(_classes(500.0), 16, PROFILES, STEPS, MIXED)
    assert over.feasible and over.slo_met < 0.4
    assert sum(g["refused"] * g["share"] for g in over.groups) / len(over.thresholds) > 0.6
    # without refusals an unstable load is infeasible: all TP-1 at the lowest thresholds
    stuck = plan_capacity(_classes(500.0), 16, PROFILES, STEPS, replace(MIXED, shed=False))
    assert not stuck.feasible and stuck.counts == {1: 16, 2: 0, 4: 0} and stuck.slo_met == 0.0


def test_planner_acts_on_the_share_within_slo():
    cfg = PlannerConfig(period_s=1.0, stage1=replace(MIXED, mixed_search="single-degree"), steps=STEPS)
    planner = Planner(Cluster((4, 4, 4, 4)), PROFILES, cfg, clock=lambda: 0.0)  # starts on 16 x TP-1
    d = planner.decide(_classes(40.0))
    assert d.act and d.proposal.counts[4] == 4 and d.current.slo_met < d.proposal.slo_met
    assert "within SLO" in d.reason


def test_trace_load_calibration_does_not_follow_the_planners_stage1():
    from sim.cluster import ClusterRequestSpec
    from sim.cluster_trace import TraceScenario, capacity_rps, step_model

    rng = np.random.default_rng(0)
    specs = []
    for i in range(200):
        steps = 8.0 if i % 5 == 0 else float(rng.integers(40, 200))
        specs.append(ClusterRequestSpec(f"r{i}", i, "c", 0.0, int(rng.integers(32, 120)), 256,
                                        (steps, max(steps * 0.9, 8.0)), (True, True), 1.0))
    thresholds = (0.9, 0.8)
    profiles = {d: PROFILES[d] for d in (1, 2, 4)}
    base = TraceScenario(stage1_rounds="separate", step_groups=1)
    caps = set()
    for sc in (base, replace(base, stage1_rounds="mixed", step_groups=5),
               replace(base, stage1_rounds="mixed", step_groups=3, single_batch=True)):
        model = step_model(specs, thresholds, 32, sc.step_groups)
        assert len(model.spread) == sc.step_groups
        caps.add(capacity_rps(sc, specs, profiles, model))
    assert len(caps) == 1 and caps.pop() > 0


def test_planner_prices_a_change_by_what_the_overlap_costs():
    """The same gain pays when the new instances serve early in the period, and does not when loading them
    takes most of it with the running instances slowed meanwhile."""
    stage1 = replace(MIXED, mixed_search="single-degree")
    quick = Planner(Cluster((4, 4, 4, 4)), PROFILES, PlannerConfig(period_s=300.0, stage1=stage1, steps=STEPS,
                                                                   change_s=30.0, overlap_slowdown=1.1))
    d = quick.decide(_classes(40.0))
    assert d.act and "during the change" in d.reason
    slow = Planner(Cluster((4, 4, 4, 4)), PROFILES, PlannerConfig(period_s=300.0, stage1=stage1, steps=STEPS,
                                                                  change_s=280.0, overlap_slowdown=2.0))
    d2 = slow.decide(_classes(40.0))
    assert not d2.act and d2.proposal.counts == d.proposal.counts
    assert d2.proposal.slo_met - d2.current.slo_met >= 0.02  # a gain the flat rule would have taken
