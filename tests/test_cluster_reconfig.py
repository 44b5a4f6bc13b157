"""Reconfiguring the simulated cluster: instances come and go, requests move, none is lost."""

from __future__ import annotations

from collections import Counter

import pytest

from cluster import RouterConfig
from engine.latency_profile import load_tp_profiles
from planner import Cluster, Instance, Planner, PlannerConfig, Stage1Config, WorkloadClass
from sim.cluster import ClusterConfig, ClusterSimulator
from sim.reconfig import PlannerController
from tests.builders import TS, synthetic

PROFILES = load_tp_profiles("h200-llada8b-measured", (1, 2, 4))


def sim_of(tps, slots=16) -> ClusterSimulator:
    return ClusterSimulator(ClusterConfig(tuple(tps), slots=slots, router=RouterConfig(thresholds=TS)), PROFILES,
                            "remask", seed=1)


def _ids(res):
    return sorted(s.req_id for s, _, _ in res.finished)


@pytest.mark.slow
def test_draining_instances_mid_run_moves_their_requests_and_loses_none():
    specs = synthetic(600, rate=30.0, seed=3)
    sim = sim_of((1, 1, 1, 1))
    rounds_at_drain = {}

    def drain(now):
        for i in (0, 1):
            rounds_at_drain[i] = sim.insts[i].rounds
            sim.drain_instance(i)
        sim.add_instance(2)

    sim.call_at(5.0, drain)
    res = sim.run(specs)
    assert _ids(res) == sorted(s.req_id for s in specs) and res.lost == 0 and res.arrived == 600
    assert res.evacuated > 0  # they held requests when drained
    assert [i.state for i in sim.insts] == ["stopped", "stopped", "serving", "serving", "serving"]
    for i in (0, 1):  # at most the round in flight when the drain came
        assert sim.insts[i].rounds <= rounds_at_drain[i] + 1
    assert sim.insts[4].rounds > 0 and sim.insts[4].tp == 2
    assert sim.driver.serving() == [2, 3, 4]


def test_with_no_instance_serving_requests_wait_and_resume():
    specs = synthetic(200, rate=20.0, seed=4)
    sim = sim_of((1, 1))
    sim.call_at(2.0, lambda now: [sim.drain_instance(0), sim.drain_instance(1)])
    sim.call_at(4.0, lambda now: sim.add_instance(4))
    res = sim.run(specs)
    assert res.lost == 0 and _ids(res) == sorted(s.req_id for s in specs)
    assert res.held > 0 and res.evacuated > 0
    late = [lat for s, lat, _ in res.finished if 2.0 < s.arrival < 4.0]
    assert late and min(late) > 0.0
    assert all(s.arrival + lat >= 4.0 for s, lat, _ in res.finished if 2.0 < s.arrival < 4.0)


def test_request_travelling_to_an_instance_that_starts_draining_is_redirected():
    specs = synthetic(300, rate=40.0, seed=5)
    sim = sim_of((1, 1, 1))
    drained = []

    def watch(now):  # once instance 0 evacuates, drain the first target a request is travelling to
        if drained:
            return
        targets = [data[1] for _, _, kind, data in sim._events if kind == "migrate"]
        if sim.insts[0].state == "stopped" and targets:
            sim.add_instance(1)
            drained.append(targets[0])
            sim.drain_instance(targets[0])
        else:
            sim.call_at(now + 0.0005, watch)

    sim.call_at(3.0, lambda now: (sim.drain_instance(0), watch(now)))
    res = sim.run(specs)
    assert drained and res.redirected >= 1
    assert res.lost == 0 and _ids(res) == sorted(s.req_id for s in specs)


@pytest.mark.slow
def test_planner_controller_follows_the_plan_and_keeps_every_request():
    specs = synthetic(900, rate=20.0, seed=6, slo_factor=2.0)
    sim = sim_of((), slots=32)
    cluster = Cluster((4, 4))
    cfg = PlannerConfig(period_s=5.0, stage1=Stage1Config(slo_scale=2.0, batches=(1, 2, 4, 8, 16, 32)))
    planner = Planner(cluster, PROFILES, cfg, clock=sim.clock.now,
                      current=[Instance(f"i{k}", k // 4, 1) for k in range(8)])
    # rates from outside: light at first, then heavy (the monitor is bypassed)
    light = [WorkloadClass("x", 3.0, 140, 256)]
    heavy = [WorkloadClass("x", 40.0, 140, 256)]
    planner.observe_rates(light)
    ctl = PlannerController(sim, planner, start_delay_s=1.0, tick_s=0.5)
    ctl.begin(0.0)
    sim.call_at(20.0, lambda now: planner.observe_rates(heavy))
    res = sim.run(specs)
    assert res.lost == 0 and _ids(res) == sorted(s.req_id for s in specs)
    mixes = [c for _, c in ctl.log.timeline]
    assert mixes[0] == {1: 8, 2: 0, 4: 0}
    low = [c for t, c in ctl.log.timeline if t < 20.0][-1]  # the mix serving when the load rises
    assert low[4] >= 1 and low[1] < 8  # light load: fewer, larger instances
    assert mixes[-1][1] > low[1] and mixes[-1][4] < low[4]  # heavy load: back towards TP-1
    assert ctl.log.plans >= 2 and ctl.log.starts > 0 and ctl.log.stops > 0
    assert res.evacuated > 0
    for _, c in ctl.log.timeline:  # never more GPUs serving than the nodes hold
        assert sum(d * n for d, n in c.items()) <= 8
    used = Counter()
    for i in sim.insts:
        if i.state == "serving":
            used[i.tp] += 1
    assert dict(used) == {d: n for d, n in mixes[-1].items() if n}


def synthetic_table(n: int = 60, seed: int = 0):
    """A threshold table without the model: prose needs many rounds (fewer at lower thresholds), the rest one."""
    import random

    from sim.threshold_table import ThresholdTable

    rng = random.Random(seed)
    cats = [rng.choice(["prose", "prose", "prose", "lookup", "arith"]) for _ in range(n)]
    rounds = [tuple(max(1, round(r * f)) for f in (1.0, 0.9, 0.8, 0.7, 0.6)) if c == "prose" else (1,) * 5
              for c, r in zip(cats, (rng.randint(8, 40) for _ in range(n)))]
    prompts = tuple("q" * rng.randint(10, 70) for _ in range(n))
    return ThresholdTable("synthetic", (0.9, 0.8, 0.7, 0.6, 0.5), prompts, tuple(cats), tuple(rounds),
                          tuple((True,) * 5 for _ in range(n)))


@pytest.mark.slow
def test_dilaserve_trace_short_run_reconfigures_with_the_load_and_loses_nothing(tmp_path):
    from sim.cluster_trace import TraceScenario, plot_trace, run_trace

    # the controller's mechanics under the fast separate-rounds planner (the mixed-rounds one, the trace's
    # default, takes ~30 s of solving here; tests/test_planner_mixed.py tests its choices)
    r = run_trace(TraceScenario(stage1_rounds="separate"), n=800, seed=0, statics=(), table=synthetic_table())
    rec = r["policies"]["reconfig"]
    assert rec["requests"] == rec["arrived"] == 800 and rec["lost"] == 0
    p = r["planner"]
    assert p["plans"] >= 2 and p["starts"] > 0 and p["stops"] > 0
    low, peak = r["instances_by_load"]["low_load"], r["instances_by_load"]["peak_load"]
    assert low["4"] > peak["4"] and peak["1"] > low["1"]  # TP-4 at low load, TP-1 at the peak
    assert low["instances"] < peak["instances"]
    assert r["peak_window_rps"] > 2 * r["low_window_rps"]
    assert all(v is None or 0.0 <= v <= 1.0 for v in r["windows"]["slo_attainment"]["reconfig"])
    out = tmp_path / "trace.png"
    plot_trace(r, str(out))
    assert out.stat().st_size > 10_000


def test_dilaserve_trace_with_shedding_counts_refused_requests_as_misses_in_their_windows():
    """With admission on (``shed``), a refused request is a miss in the window it arrived in: the windows'
    attainments, weighted by their arrivals, add up to the run's."""
    from dataclasses import replace

    from sim.cluster_trace import TraceScenario, run_trace

    sc = TraceScenario(stage1_rounds="separate", shed=True)
    sc = replace(sc, requests=replace(sc.requests, slo_factor=1.3))
    r = run_trace(sc, n=400, seed=0, statics=((16, 0, 0), (0, 0, 4)), table=synthetic_table())
    w = r["windows"]
    width = (w["minutes"][1] - w["minutes"][0]) * 60 / r["time_compression"]
    arrivals = [round(x * width) for x in w["offered_rps"]]
    for name, s in r["policies"].items():
        assert s["requests"] == 400 and s["lost"] == 0
        met = sum((a or 0.0) * n for a, n in zip(w["slo_attainment"][name], arrivals))
        assert met / 400 == pytest.approx(s["slo_attainment"], abs=2e-3), name
    assert r["shedding"] and sum(s["shed"] for s in r["policies"].values()) > 0
    # the hindsight bound: the best static mix of every window, weighted by its arrivals
    statics = ("static-16xTP1", "static-4xTP4")
    best = sum(max(w["slo_attainment"][k][i] or 0.0 for k in statics) * n for i, n in enumerate(arrivals))
    assert r["hindsight_static"] == pytest.approx(best / 400, abs=2e-3)
    assert r["hindsight_static"] >= max(r["policies"][k]["slo_attainment"] for k in statics)
