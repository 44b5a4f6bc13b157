"""The cluster driver (cluster/driver.py): admission, membership, moves and their attempts, thresholds."""

from __future__ import annotations

from cluster import RequestState, Router, RouterConfig, StepShape, TableStepEstimator, TpLatencyModel
from cluster.driver import ClusterDriver
from engine.latency_profile import load_tp_profiles

TS = (0.9, 0.8, 0.7)


def driver(tps=(1, 1), policy="remask", **kw) -> ClusterDriver:
    est = TableStepEstimator(TS, lambda s: (40.0, 30.0, 20.0), sigma=0.0)
    lat = TpLatencyModel(load_tp_profiles("h200-llada8b-measured", sorted(set(tps)) or [1]), 16, StepShape(32, 396))
    return ClusterDriver(Router(policy, lat, est, list(enumerate(tps)), RouterConfig(thresholds=TS)), log=True, **kw)


def req(rid: str, now: float = 0.0, slo: float = 10.0, **kw) -> RequestState:
    return RequestState(rid, now, now + slo, 140, 256, **kw)


def test_arrivals_are_placed_with_a_first_attempt_and_a_threshold():
    d = driver()
    m = d.arrive(req("a"), 0.0)
    assert m.why == "place" and m.src is None and m.attempt == 1 and m.state.instance == m.dst
    assert d.threshold_for(m.state, 0.0) in TS
    fixed = req("b", fixed_threshold=0.85)
    d.arrive(fixed, 0.0)
    assert d.threshold_for(fixed, 0.0) == 0.85  # the client's own: never the router's
    assert "b" not in d.plan(fixed.instance, 0.0).thresholds
    assert [e[1] for e in d.decisions][:2] == ["place", "threshold"]


def test_a_plan_carries_the_thresholds_with_the_estimates_at_them():
    d = driver(tps=(1,))
    a, b = req("a"), req("b", fixed_threshold=0.85)
    for s in (a, b):
        d.arrive(s, 0.0)
    plan = d.plan(0, 0.0)
    assert set(plan.thresholds) == set(plan.estimates) == {"a"}  # a fixed threshold is the client's
    k = TS.index(plan.thresholds["a"])
    assert plan.estimates["a"] == a.est[k] == d.estimate(a)  # the remaining rounds at the chosen threshold
    assert d.plan(5, 0.0).thresholds == {}  # an instance the router does not know


def test_the_views_answer_for_the_router():
    d = driver(tps=(1, 1), per_instance_limit=1)
    assert d.chooses_thresholds and not driver(policy="infaas").chooses_thresholds
    assert d.instance(0).tp == 1 and d.instance(9) is None and d.instance(None) is None
    assert not d.full()
    for i in range(2):
        d.arrive(req(f"r{i}"), 0.0)
    assert d.full() and d.instance(0).n == d.instance(1).n == 1
    d.drain(1, 1.0)
    assert d.serving() == [0] and d.instance(1) is not None  # draining: still in the router, out of placement
    assert d.counters()["policy"] == "remask" and d.counters()["migrations"] == 0
    assert d.migration_cost_ms(req("x")) > 0.0


def test_a_measured_profile_replaces_the_router_s_once():
    d = driver(tps=(1,))
    old = d.router.latency.profiles[1]
    prof = old.scaled(2.0)
    prof.meta["measured_at"] = "t1"
    prof.attn_ms_per_pair = 0.0
    assert d.use_profile(1, prof) and d.router.latency.profiles[1] is prof
    assert prof.attn_ms_per_pair == old.attn_ms_per_pair  # it measured one prompt length: the old term kept
    again = old.scaled(3.0)
    again.meta["measured_at"] = "t1"
    assert not d.use_profile(1, again) and d.router.latency.profiles[1] is prof  # the same measurement


def test_with_no_instance_arrivals_wait_and_the_next_instance_takes_them():
    d = driver(tps=())
    a = req("a")
    assert d.arrive(a, 0.0) is None and not a.shed and d.held == [a]
    moves = d.join(7, 1, 1.0)
    assert [(m.state.req_id, m.dst, m.why) for m in moves] == [("a", 7, "place")]
    assert d.held == [] and a.instance == 7


def test_drain_moves_requests_to_the_other_instance_with_a_new_attempt():
    d = driver()
    states = [req(f"r{i}") for i in range(4)]
    for s in states:
        d.arrive(s, 0.0)
    on0 = [s for s in states if s.instance == 0]
    assert on0, "placement spread the requests"
    d.drain(0, 1.0)
    assert d.serving() == [1]
    moves = d.evacuate(0, 1.0)
    assert sorted(m.state.req_id for m in moves) == sorted(s.req_id for s in on0)
    assert all(m.src == 0 and m.dst == 1 and m.why == "evacuate" and m.attempt == 2 for m in moves)
    assert 0 not in d.router.by_id and all(s.instance == 1 for s in states)
    assert all(s.next_heavy for s in on0)  # no KV travels: a recompute step first


def test_a_draining_instance_alone_keeps_its_requests_until_another_joins():
    d = driver(tps=(1,))
    a = req("a")
    d.arrive(a, 0.0)
    d.drain(0, 1.0)
    assert d.evacuate(0, 1.0) == [] and a.instance == 0 and d.stranded == {0}
    b = req("b")
    assert d.arrive(b, 1.5) is None and d.held == [b]  # nothing new goes to a draining instance
    moves = d.join(1, 1, 2.0)
    assert {(m.state.req_id, m.why) for m in moves} == {("a", "evacuate"), ("b", "place")}
    assert 0 not in d.router.by_id and a.instance == b.instance == 1


def test_a_stopping_instance_alone_hands_its_requests_to_the_next_one():
    d = driver(tps=(1,))
    a = req("a")
    d.arrive(a, 0.0)
    d.drain(0, 1.0)
    assert d.evacuate(0, 1.0, keep_if_alone=False) == [] and d.held == [a]
    (m,) = d.join(1, 1, 2.0)
    assert (m.state, m.dst, m.why, m.attempt) == (a, 1, "resume", 2)


def test_lost_instance_requests_resume_elsewhere_or_wait():
    d = driver()
    states = [req(f"r{i}") for i in range(4)]
    for s in states:
        d.arrive(s, 0.0)
    orphans = d.lost(0, 1.0)
    assert orphans and all(s.instance is None for s in orphans)
    moves = [d.resume(s, 1.0) for s in orphans]
    assert all(m is not None and m.dst == 1 for m in moves)
    orphans = d.lost(1, 2.0)
    assert all(d.resume(s, 2.0) is None for s in orphans) and d.held == orphans


def test_shedding_refuses_an_arrival_that_cannot_make_its_slo():
    d = driver(shed=True)
    hopeless = req("h", slo=0.001)
    assert d.arrive(hopeless, 0.0) is None and hopeless.shed and d.stats["shed"] == 1
    assert "h" not in d.router.requests and d.held == []
    ok = req("ok", slo=60.0)
    assert d.arrive(ok, 0.0) is not None and ok.epoch == d.governor.epoch


def test_the_governor_hears_of_a_miss_once_a_request_is_past_its_deadline():
    """A request still running past its deadline is a miss now (the governor's feedback comes an SLO
    sooner for long requests); one that could still make it is not, however long the round just run."""
    d = driver(shed=True)
    late, tight = req("late", slo=1.5), req("tight", slo=3.0)
    for s in (late, tight):
        assert d.arrive(s, 0.0) is not None
    d.on_round(late.instance, [(late, False, False)], 2.0, round_ms=100.0)
    d.on_round(tight.instance, [(tight, False, False)], 2.0, round_ms=5000.0)
    assert late.epoch == -1 and d.governor._n == 1  # counted as a miss now, not again when it finishes
    assert tight.epoch == d.governor.epoch  # it may still finish in time
    d.on_round(late.instance, [(late, False, False)], 2.5, round_ms=100.0)
    assert d.governor._n == 1  # once


def test_per_instance_limit_sends_to_the_least_full():
    d = driver(tps=(1, 1, 1), policy="fixed-threshold", per_instance_limit=1)
    dsts = [d.arrive(req(f"r{i}"), 0.0).dst for i in range(3)]
    assert sorted(dsts) == [0, 1, 2]


def test_finished_feeds_the_governor_only_for_counted_admissions():
    d = driver(shed=True)
    a, b = req("a", slo=60.0), req("b", slo=60.0, counted=False)
    d.arrive(a, 0.0)
    d.arrive(b, 0.0)
    assert a.epoch == 0 and b.epoch == -1
    d.finished(a, 1.0)
    d.finished(b, 1.0)
    assert d.governor._n == 1 and "a" not in d.router.requests and "b" not in d.router.requests


def test_transition_follower_starts_when_gpus_free_and_stops_after_earlier_starts_serve():
    from cluster.transition import TransitionFollower
    from planner.transition import Action, Instance

    running = [Instance("a", 0, 4), Instance("b", 1, 1)]
    f = TransitionFollower((4, 4), running)
    start1 = Action("start", 1, 2, "c")  # node 1 has 3 GPUs free: goes now
    stop_a = Action("stop", 0, 4, "a")  # waits for the start above to serve
    start0 = Action("start", 0, 1, "d")  # node 0 is full until a stops
    f.follow([start1, stop_a, start0])
    assert f.issue() == [start1] and f.targets([1, 2, 4]) == {1: 1, 2: 1, 4: 1}
    assert f.issue() == []  # the stop waits for c
    f.ready(start1)
    assert f.issue() == [stop_a] and f.targets([1, 2, 4]) == {1: 1, 2: 1, 4: 0}
    assert f.issue() == [] and f.busy  # d waits for a's GPUs
    f.stopped(stop_a)
    assert f.issue() == [start0] and f.targets([1, 2, 4]) == {1: 2, 2: 1, 4: 0}
    f.ready(start0)
    assert not f.busy and f.free == [3, 1]


def test_make_before_break_loads_the_new_instance_beside_the_old_one():
    from cluster.transition import TransitionFollower
    from planner.transition import Action, Instance

    running = [Instance("a", 0, 1), Instance("b", 0, 1)]
    stop_a, stop_b = Action("stop", 0, 1, "a"), Action("stop", 0, 1, "b")
    start = Action("start", 0, 2, "c")  # needs both GPUs of node 0
    bbm = TransitionFollower((2,), running)
    bbm.follow([stop_a, stop_b, start])
    assert bbm.issue() == [stop_a, stop_b]  # break before make: the GPUs go dark while c loads
    mbb = TransitionFollower((2,), running, make_before_break=True)
    mbb.follow([stop_a, stop_b, start])
    assert mbb.issue() == [start] and mbb.shared(0)  # c loads beside a and b, which keep serving
    assert mbb.targets([1, 2]) == {1: 2, 2: 1}
    assert mbb.issue() == []  # the stops wait for c
    mbb.ready(start)
    assert mbb.issue() == [stop_a, stop_b] and mbb.targets([1, 2]) == {1: 0, 2: 1}
    mbb.stopped(stop_a)
    mbb.stopped(stop_b)
    assert not mbb.busy and not mbb.shared(0) and mbb.free == [0]
    # a start that would not fit even after its node's stops still waits
    tight = TransitionFollower((2,), running, make_before_break=True)
    tight.follow([Action("start", 0, 4, "d")])
    assert tight.issue() == []
