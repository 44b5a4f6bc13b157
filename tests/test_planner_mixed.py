"""Stage 1 with mixed rounds (planner/stage1_mixed.py) and the trace's frozen load calibration."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.latency_profile import load_tp_profiles
from planner import Cluster, Planner, PlannerConfig, Stage1Config, WorkloadClass, WorkloadMonitor, plan_capacity
from planner.costs import StepModel
from planner.stage1_mixed import _queue, mixed_tables, rank

# the hand-derived H200 table these tests' workloads and SLOs are set against (not the measured default)
HAND_PROFILE = str(Path(__file__).parent / "profiles" / "h200-llada8b-hand.json")

PROFILES = load_tp_profiles(HAND_PROFILE)
SPT = {0.7: 0.323, 0.8: 0.372, 0.9: 0.41}  # the dilaserve-trace workload's measured steps per token
# a fifth of the requests unmask a block per step (8 steps for 256 tokens), the rest take more than the mean
SPREAD = ((0.2, 0.07), (0.8, 1.2325))
STEPS = StepModel(steps_per_token=SPT, block_tokens=32, spread=SPREAD)
# SLO 1.7x the request alone: at two requests a round on TP-1 (its recompute step and another's cached step)
# a short request's step is 1.72x its alone step under the hand table's round-time model
MIXED = Stage1Config(slo_scale=1.7, solver="highs", batches=(1, 2, 4, 8, 16, 32), rounds="mixed")


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
        alone = PROFILES[d].round_ms([("recompute", seq, 0)])  # its attention is in the curve, as the router counts
        assert tab.latency[short, top, k, 0] == pytest.approx(8 * alone, rel=1e-6)
        assert np.all(np.diff(tab.latency[:, :, k, :], axis=-1) > 0)  # more requests per round: slower
    # a recompute step shares its round with the others' cached forward: at 4 requests on TP-1 a short
    # request's step takes its own recompute plus at least the cached forward of the others
    others = PROFILES[1].round_ms([("cached", 32, seq)] * 3)
    assert tab.latency[short, top, 0, 2] / 8 >= PROFILES[1].round_ms([("recompute", seq, 0)]) + 0.9 * others
    # per step the instance's time falls with occupancy (rounds amortise), and TP-4 is faster than TP-1
    assert np.all(np.diff(tab.step_ms, axis=-1) < 0)
    assert np.all(tab.latency[:, :, -1, :] < tab.latency[:, :, 0, :])


def test_mixed_stage1_picks_tp4_where_only_it_meets_the_short_requests_budget():
    """At 40 req/s and SLO 1.7x, 16 TP-1 instances run about 4 requests per round: a short request's
    recompute step plus the others' cached forward passes its per-step budget (1.7 x its alone step),
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


def test_queue_occupancy_is_the_birth_death_chains_stationary_distribution():
    """With rounds whose time grows in proportion to their occupancy the departure rate is flat, and the
    chain is M/M/1: an arrival meets j others with probability (1 - r) r^j. The first level's load is
    averaged over (0, utilisation x its throughput]: with one sub-rate, half of it."""
    T, D, N = 1, 1, 8
    round_all = np.arange(1, N + 1, dtype=float).reshape(T, D, N) * 10.0  # ms: mu = 1000 / (steps x 10) per s
    steps = np.array([5.0])  # mu = 20 requests/s at every occupancy
    wait, occ = _queue(round_all, steps, (1, 4), utilisation=0.9, factor=8, sub=1)
    r = 0.45
    k = np.arange(1, 8 * N + 1)
    assert occ.shape == (T, D, 2, 8 * N) and np.allclose(occ.sum(axis=-1), 1.0)
    assert np.allclose(occ[0, 0, 0], (1 - r) * r ** (k - 1), atol=1e-12)
    # beyond the largest level an arrival waits for k - N departures at that level's rate
    assert wait[0, 0, N - 1] == 0.0 and wait[0, 0, N] == pytest.approx(1e3 / 20.0)
    # the second level carries the load between the first's and its own: a busier chain
    assert occ[0, 0, 1] @ k > occ[0, 0, 0] @ k


def test_queue_model_counts_a_share_of_each_group_within_slo():
    """The fluid model puts a whole group in or out of its SLO at the level; the queue model counts the share
    of its requests that meet an occupancy whose latency is within it. On 16 TP-1 instances at SLO 1.7x the
    short group is mostly out and the long one mostly in; the share falls as the load rises; 4 TP-4 instances
    keep more of both."""
    queue = replace(MIXED, occupancy="queue")
    shares = []
    for rate in (10.0, 25.0, 40.0):
        tp1 = plan_capacity(_classes(rate), 16, PROFILES, STEPS, queue, fixed_counts={1: 16, 2: 0, 4: 0})
        shares.append(tp1.slo_met)
    assert shares[0] > shares[1] > shares[2]
    tp1 = plan_capacity(_classes(40.0), 16, PROFILES, STEPS, queue, fixed_counts={1: 16, 2: 0, 4: 0})
    tp4 = plan_capacity(_classes(40.0), 16, PROFILES, STEPS, queue, fixed_counts={1: 0, 2: 0, 4: 4})
    short, long_ = (g["within_slo"] for g in tp1.groups)
    assert 0.0 < short < 0.5 < long_ < 1.0
    assert all(g4["within_slo"] > g1["within_slo"] for g1, g4 in zip(tp1.groups, tp4.groups))
    assert tp4.slo_met > tp1.slo_met
    tab = mixed_tables(_classes(40.0), PROFILES, STEPS, MIXED.levels)
    slo = 1.75 * tab.isolated
    assert np.array_equal(tab.within_slo(slo, "level"), (tab.latency <= slo[:, None, None, None] * (1 + 1e-9)))
    share = tab.within_slo(slo, "queue")
    assert share.shape == tab.latency.shape and np.all((share >= 0) & (share <= 1 + 1e-9))


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


def test_a_change_below_confirm_below_waits_for_the_next_period_to_agree():
    stage1 = replace(MIXED, mixed_search="single-degree")
    planner = Planner(Cluster((4, 4, 4, 4)), PROFILES, PlannerConfig(period_s=300.0, stage1=stage1, steps=STEPS,
                                                                     confirm_below=1.0), clock=lambda: 0.0)
    first = planner.decide(_classes(40.0))
    assert not first.act and "wait for the next period to agree" in first.reason and first.proposal.counts[4] == 4
    planner.last_decision = first  # what maybe_replan keeps
    second = planner.decide(_classes(40.0))
    assert second.act and second.proposal.counts == first.proposal.counts
    planner.last_decision = replace(first, proposal=replace(first.proposal, counts={1: 16, 2: 0, 4: 0}))
    assert not planner.decide(_classes(40.0)).act  # the last period proposed something else
    # confirm="change": any change that paid last period, from the same running configuration, agrees
    planner = Planner(Cluster((4, 4, 4, 4)), PROFILES, PlannerConfig(period_s=300.0, stage1=stage1, steps=STEPS,
                                                                     confirm_below=1.0, confirm="change"),
                      clock=lambda: 0.0)
    first = planner.decide(_classes(40.0))
    assert not first.act and first.wanted
    other = replace(first.proposal, counts={1: 0, 2: 8, 4: 0})
    planner.last_decision = replace(first, proposal=other)
    assert planner.decide(_classes(40.0)).act
    planner.last_decision = replace(first, proposal=other, wanted=False)  # last period kept the running one
    assert not planner.decide(_classes(40.0)).act
    running_then = replace(first.current, counts={1: 0, 2: 8, 4: 0})  # ... or ran something else then
    planner.last_decision = replace(first, current=running_then)
    assert not planner.decide(_classes(40.0)).act
    with pytest.raises(ValueError, match="confirm"):
        PlannerConfig(confirm="twice")


def test_forecast_weighs_the_window_mean_by_past_period_to_period_changes():
    """Once three changes of the window's mean rate are known, the next period's loads are the current mean
    times each of them, equally likely; a decision then weighs every configuration over those loads."""
    now = [0.0]
    monitor = WorkloadMonitor(window_s=10.0, buffer=0.0, slices=5)
    stage1 = replace(MIXED, mixed_search="single-degree")
    planner = Planner(Cluster((4, 4, 4, 4)), PROFILES,
                      PlannerConfig(period_s=10.0, stage1=stage1, steps=STEPS, forecast=True), monitor,
                      clock=lambda: now[0])
    got = []
    for period, rate in enumerate((10.0, 15.0, 20.0, 30.0)):
        for k in range(int(rate * 10)):
            planner.observe(55, 256, period * 10.0 + k / rate)
        now[0] = (period + 1) * 10.0
        got.append(planner.forecast(now[0]))
    assert got[:3] == [None, None, None]
    loads = got[3]
    assert [w for w, _ in loads] == pytest.approx([1 / 3] * 3)
    assert [sum(c.rate for c in cs) for _, cs in loads] == pytest.approx([30 * 1.5, 30 * 20 / 15, 30 * 1.5], rel=0.02)
    d = planner.decide(monitor.classes(now[0]), scenarios=loads)
    assert 0.0 <= d.current.slo_met <= 1.0 and d.proposal.slo_met >= d.current.slo_met


def test_group_placement_sends_a_class_short_requests_to_the_fast_instances():
    """With an SLO-fit router (``remask-fit``) a class's requests do not share one placement: at 40 req/s the
    block-per-step fifth fits only on TP-4, and 12 x TP-1 + 1 x TP-4 meets every SLO once that group goes to
    the TP-4 instance and the long requests to TP-1. Placed by class, a class's groups split alike, and the
    one TP-4 instance cannot carry the class's share that would hold all of its short requests."""
    counts = {1: 12, 2: 0, 4: 1}
    by_class = plan_capacity(_classes(40.0), 16, PROFILES, STEPS, MIXED, fixed_counts=counts)
    by_group = plan_capacity(_classes(40.0), 16, PROFILES, STEPS, replace(MIXED, placement="group"),
                             fixed_counts=counts)
    short = [g for g in by_class.groups if g["steps"] == 8]
    assert short and short[0]["within_slo"] < 0.5 and by_class.slo_met < 0.9
    assert by_group.slo_met == pytest.approx(1.0)
    assert all(g["within_slo"] == pytest.approx(1.0) for g in by_group.groups)
    # all TP-1 misses the short group whatever the placement: nothing to send it to
    tp1 = plan_capacity(_classes(40.0), 16, PROFILES, STEPS, replace(MIXED, placement="group"),
                        fixed_counts={1: 16, 2: 0, 4: 0})
    assert tp1.slo_met == pytest.approx(0.8, abs=1e-6)
    with pytest.raises(ValueError, match="placement"):
        Stage1Config(placement="anywhere")


def test_full_counts_lists_every_configuration_that_uses_all_gpus():
    from planner.stage1_mixed import full_counts

    menu = full_counts((1, 2, 4), 16)
    assert len(menu) == 25  # n4 = 0..4, then n2 = 0..(16 - 4 n4) / 2, the rest TP-1
    assert all(sum(d * k for d, k in c.items()) == 16 for c in menu)
    assert len({tuple(sorted(c.items())) for c in menu}) == 25
    assert {1: 12, 2: 0, 4: 1} in menu and {1: 0, 2: 8, 4: 0} in menu
    # slots cap a degree's instances (and a configuration that cannot use every GPU is not listed)
    capped = full_counts((1, 4), 16, slots={4: 2})
    assert sorted(capped, key=lambda c: c[4]) == [{1: 16, 4: 0}, {1: 12, 4: 1}, {1: 8, 4: 2}]
    plan = plan_capacity(_classes(40.0), 16, PROFILES, STEPS, replace(MIXED, placement="group", mixed_search="every"))
    assert plan.slo_met == pytest.approx(1.0) and sum(d * k for d, k in plan.counts.items()) == 16
