"""The cluster driver (cluster/driver.py): admission, membership, moves and their attempts, thresholds."""

from __future__ import annotations

from cluster import Router, RouterConfig, StepShape, TableStepEstimator, TpLatencyModel
from cluster.driver import Arrival, ClusterDriver
from engine.latency_profile import load_tp_profiles

TS = (0.9, 0.8, 0.7)


def driver(tps=(1, 1), policy="remask", **kw) -> ClusterDriver:
    est = TableStepEstimator(TS, lambda s: (40.0, 30.0, 20.0), sigma=0.0)
    lat = TpLatencyModel(load_tp_profiles("h200-llada8b-measured", sorted(set(tps)) or [1]), 16, StepShape(32, 396))
    return ClusterDriver(Router(policy, lat, est, list(enumerate(tps)), RouterConfig(thresholds=TS)), log=True, **kw)


def req(rid: str, slo: float = 10.0, **kw) -> Arrival:
    return Arrival(rid, 140, 256, slo, **kw)


def arrive(d: ClusterDriver, rid: str, now: float = 0.0, **kw):
    """A new request's state and its move (None: shed or held)."""
    adm = d.arrive(req(rid, **kw), now)
    return adm.state, adm.move


def test_the_driver_builds_the_request_s_state_from_its_arrival():
    d = driver(block_tokens=8, full_sequence=False)
    adm = d.arrive(Arrival("a", 140, 256, 3.0, priority=2, fixed_threshold=0.85, counted=False,
                           admission=(4.0, 1.0, 140.0)), 5.0)
    st = adm.state
    assert (st.req_id, st.arrival, st.deadline, st.prompt_tokens, st.output_tokens) == ("a", 5.0, 8.0, 140, 256)
    assert (st.block_tokens, st.full_sequence, st.priority, st.counted) == (8, False, 2, False)
    assert st.fixed_threshold == st.threshold == 0.85 and st.extra["admission"] == (4.0, 1.0, 140.0)
    assert d.request("a") is st and not adm.shed and not adm.held
    assert "admission" not in d.arrive(req("b"), 5.0).state.extra  # no features handed: none made up


def test_arrivals_are_placed_with_a_first_attempt_and_a_threshold():
    d = driver()
    a, m = arrive(d, "a")
    assert m.why == "place" and m.src is None and m.attempt == 1 and a.instance == m.dst and m.state is a
    assert m.threshold in TS and m.threshold == a.threshold
    assert m.est_rounds == a.est[TS.index(m.threshold)] == d.estimate(a)  # the remaining rounds at it
    fixed, m = arrive(d, "b", fixed_threshold=0.85)
    assert m.threshold == 0.85  # the client's own: never the router's
    assert [e[1] for e in d.decisions][:2] == ["place", "threshold"]


def test_a_round_is_answered_whole():
    """One call per round: the finished request out of the router (the governor told), the plan of the ones
    left, with the estimates at the chosen thresholds; a fixed threshold is the client's (not in the plan)."""
    d = driver(tps=(1,), shed=True)
    (a, _), (b, _), (c, _) = (arrive(d, r, **kw) for r, kw in (("a", {}), ("b", {"fixed_threshold": 0.85}),
                                                               ("c", {"slo": 60.0})))
    out = d.on_round(0, [(a, False, False), (b, False, False), (c, False, True)], 0.5)
    assert out.finished == [c] and d.request("c") is None and d.governor._n == 1  # c met its SLO
    assert out.moves == [] and set(out.plan.thresholds) == set(out.plan.estimates) == {"a"}
    k = TS.index(out.plan.thresholds["a"])
    assert out.plan.estimates["a"] == a.est[k] == d.estimate(a)
    assert d.on_round(0, [], 0.6).plan.thresholds.keys() == {"a"}


def test_a_round_s_migrations_carry_their_thresholds():
    """Requests all on one instance when a second joins: the policy moves some at the first instance's rounds,
    each move with its first step's threshold there and the estimate of its remaining rounds at it."""
    d = driver(tps=(1,), policy="llumnix")
    states = [arrive(d, f"r{i}", slo=3.0)[0] for i in range(16)]
    d.join(1, 1, 0.0)
    moved = []
    for k in range(5):
        on0 = [s for s in states if s.instance == 0]
        moved += d.on_round(0, [(s, False, False) for s in on0], 0.05 * (k + 1)).moves
    assert moved and all(m.state.instance == 1 for m in moved)
    for m in moved:
        assert (m.why, m.src, m.dst, m.attempt) == ("migrate", 0, 1, 2)
        assert m.threshold == m.state.threshold in TS and m.est_rounds == d.estimate(m.state)
    assert d.counters()["migrations"] == len(moved) == d.stats["migrated"]


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
    assert d.migration_cost_ms(d.request("r0")) > 0.0 and d.request("x") is None
    assert d.degrees() == [1] and d.candidate_thresholds() == TS


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
    adm = d.arrive(req("a"), 0.0)
    a = adm.state
    assert adm.move is None and adm.held and not adm.shed and d.held == [a]
    moves = d.join(7, 1, 1.0)
    assert [(m.state.req_id, m.dst, m.why) for m in moves] == [("a", 7, "place")]
    assert moves[0].threshold == a.threshold in TS  # chosen as it is placed
    assert d.held == [] and a.instance == 7


def test_drain_moves_requests_to_the_other_instance_with_a_new_attempt():
    d = driver()
    states = [arrive(d, f"r{i}")[0] for i in range(4)]
    on0 = [s for s in states if s.instance == 0]
    assert on0, "placement spread the requests"
    d.drain(0, 1.0)
    assert d.serving() == [1]
    moves = d.evacuate(0, 1.0)
    assert sorted(m.state.req_id for m in moves) == sorted(s.req_id for s in on0)
    assert all(m.src == 0 and m.dst == 1 and m.why == "evacuate" and m.attempt == 2 and m.threshold in TS
               for m in moves)
    assert 0 not in d.router.by_id and all(s.instance == 1 for s in states)
    assert all(s.next_heavy for s in on0)  # no KV travels: a recompute step first


def test_a_draining_instance_alone_keeps_its_requests_until_another_joins():
    d = driver(tps=(1,))
    a, _ = arrive(d, "a")
    d.drain(0, 1.0)
    assert d.evacuate(0, 1.0) == [] and a.instance == 0 and d.stranded == {0}
    b, move = arrive(d, "b", 1.5)
    assert move is None and d.held == [b]  # nothing new goes to a draining instance
    moves = d.join(1, 1, 2.0)
    assert {(m.state.req_id, m.why) for m in moves} == {("a", "evacuate"), ("b", "place")}
    assert 0 not in d.router.by_id and a.instance == b.instance == 1


def test_a_stopping_instance_alone_hands_its_requests_to_the_next_one():
    d = driver(tps=(1,))
    a, _ = arrive(d, "a")
    d.drain(0, 1.0)
    assert d.evacuate(0, 1.0, keep_if_alone=False) == [] and d.held == [a]
    (m,) = d.join(1, 1, 2.0)
    assert (m.state, m.dst, m.why, m.attempt) == (a, 1, "resume", 2)


def test_lost_instance_requests_resume_elsewhere_or_wait():
    d = driver()
    for i in range(4):
        arrive(d, f"r{i}")
    orphans = d.lost(0, 1.0)
    assert orphans and all(s.instance is None for s in orphans)
    moves = [d.resume(s, 1.0) for s in orphans]
    assert all(m is not None and m.dst == 1 and m.why == "resume" and m.threshold in TS for m in moves)
    orphans = d.lost(1, 2.0)
    assert all(d.resume(s, 2.0) is None for s in orphans) and d.held == orphans


def test_shedding_refuses_an_arrival_that_cannot_make_its_slo():
    d = driver(shed=True)
    adm = d.arrive(req("h", slo=0.001), 0.0)
    assert adm.move is None and adm.shed and adm.state.shed and not adm.held and d.stats["shed"] == 1
    assert d.request("h") is None and d.held == []
    ok, move = arrive(d, "ok", slo=60.0)
    assert move is not None and ok.epoch == d.governor.epoch


def test_the_governor_hears_of_a_miss_once_a_request_is_past_its_deadline():
    """A request still running past its deadline is a miss now (the governor's feedback comes an SLO
    sooner for long requests); one that could still make it is not, however long the round just run."""
    d = driver(shed=True)
    (late, m1), (tight, m2) = arrive(d, "late", slo=1.5), arrive(d, "tight", slo=3.0)
    assert m1 is not None and m2 is not None
    d.on_round(late.instance, [(late, False, False)], 2.0, round_ms=100.0)
    d.on_round(tight.instance, [(tight, False, False)], 2.0, round_ms=5000.0)
    assert late.epoch == -1 and d.governor._n == 1  # counted as a miss now, not again when it finishes
    assert tight.epoch == d.governor.epoch  # it may still finish in time
    d.on_round(late.instance, [(late, False, False)], 2.5, round_ms=100.0)
    assert d.governor._n == 1  # once


def test_per_instance_limit_sends_to_the_least_full():
    d = driver(tps=(1, 1, 1), policy="fixed-threshold", per_instance_limit=1)
    dsts = [d.arrive(req(f"r{i}"), 0.0).move.dst for i in range(3)]
    assert sorted(dsts) == [0, 1, 2]


def test_finished_feeds_the_governor_only_for_counted_admissions():
    d = driver(shed=True)
    (a, _), (b, _) = arrive(d, "a", slo=60.0), arrive(d, "b", slo=60.0, counted=False)
    assert a.epoch == 0 and b.epoch == -1
    d.finished(a, 1.0)
    d.finished(b, 1.0)
    assert d.governor._n == 1 and d.request("a") is None and d.request("b") is None


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
