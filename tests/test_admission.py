"""Router.admissible against what the cluster simulator then serves: shedding refuses only requests that
cannot make their SLO (issue 24: its serial time used to charge each step a round of recompute steps)."""

from __future__ import annotations

from cluster import RouterConfig
from cluster.capacity import step_rounds_ms
from cluster.latency import StepShape, TpLatencyModel
from engine.latency_profile import load_tp_profiles
from sim.cluster import ClusterConfig, ClusterSimulator, summarize
from tests.test_cluster_sim import TS, synthetic

TPS = (1, 1, 1, 1)


def simulate(specs, shed: bool, ask: dict | None = None):
    """remask on four TP-1 instances of 16 slots. ``ask``: filled with Router.admissible's answer for every
    placed arrival (asked as the driver asks it, right after placement, and not acted on)."""
    cfg = ClusterConfig(TPS, slots=16, router=RouterConfig(thresholds=TS), shed=shed)
    sim = ClusterSimulator(cfg, load_tp_profiles("h200-llada8b", [1]), "remask", seed=1)
    if ask is not None:
        arrive = sim.driver.arrive

        def asking(state, now):
            move = arrive(state, now)
            if move is not None:
                ask[state.req_id] = sim.router.admissible(state, now)
            return move

        sim.driver.arrive = asking
    return sim


def test_a_recompute_step_costs_the_round_it_is_in():
    lat = TpLatencyModel(load_tp_profiles("h200-llada8b", [1]), 16, StepShape(32, 396))
    heavy, light = step_rounds_ms(lat, 1, 16, 0.0)
    assert heavy == lat.round_ms(1, 1, 15) and light == lat.round_ms(1, 0, 16)
    assert heavy < 0.5 * lat.round_ms(1, 16, 0)  # one recompute step among cached ones, not a round of them
    heavy, light = step_rounds_ms(lat, 1, 16, 0.2)  # 3 of the 15 others recompute
    assert heavy == lat.round_ms(1, 4, 12) and light == lat.round_ms(1, 3, 13)
    assert step_rounds_ms(lat, 1, 16, 1.0) == (lat.round_ms(1, 16, 0), lat.round_ms(1, 15, 1))
    assert step_rounds_ms(lat, 1, 1, 0.7) == (lat.round_ms(1, 1, 0), lat.round_ms(1, 0, 1))  # alone


def test_admission_refuses_almost_nothing_the_cluster_serves_in_time():
    """At 20 req/s the four instances serve every request within its SLO; admission, asked at each
    arrival, agrees for all but a few (it refused 174 of 400 when its serial time charged each recompute
    step a whole round of recompute steps)."""
    specs = synthetic(400, rate=20.0, seed=3)
    ask: dict[str, bool] = {}
    res = simulate(specs, shed=False, ask=ask).run(specs)
    assert len(res.finished) == 400 and all(lat <= s.slo_s + 1e-9 for s, lat, _ in res.finished)
    assert len(ask) == 400 and sum(not ok for ok in ask.values()) <= 4


def test_shedding_at_full_trust_serves_more_within_slo_than_admitting_everything():
    """Overloaded (27 req/s), with the governor's feedback held off (full trust in the profile, no cuts):
    refusing what admission refuses raises the attainment over every arrival, the refused counted as
    misses (the former serial time shed 182 of 400 and fell from 0.84 to 0.55)."""
    specs = synthetic(400, rate=27.0, seed=3)
    out = {}
    for shed in (False, True):
        sim = simulate(specs, shed)
        sim.governor.util, sim.governor.low = 1.0, -1.0  # admission alone: full trust, never cut
        res = sim.run(specs)
        out[shed] = summarize(res, specs, [True] * len(res.finished))
    off, on = out[False], out[True]
    assert off["slo_attainment"] < 0.9  # overloaded without shedding
    assert on["slo_attainment"] >= off["slo_attainment"] + 0.03, (on, off)
    assert 0 < on["shed"] < 0.1 * len(specs) and on["served_slo_attainment"] >= 0.9, on
