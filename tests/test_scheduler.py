from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.clock import VirtualClock
from engine.latency_profile import load_profile
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.policies import POLICIES, make_policy
from engine.scheduler.types import Residency, RoundResult, SchedRequest, StepKind, StepOutcome
from sim.runner import SimulatedRunner
from sim.simulator import simulate
from sim.workload import SimRequestSpec

PROFILE = load_profile("gh200-llada2-mini")


def spec(i: int, prompt_tokens: int, block_rounds: list[int], arrival: float = 0.0, est: float | None = None):
    total = sum(block_rounds)
    return SimRequestSpec(f"r{i}", "x", arrival, prompt_tokens, block_rounds, est or total, est or total,
                          32.0 * len(block_rounds), 32 * len(block_rounds))


class CheckingRunner(SimulatedRunner):
    """Checks the scheduler's invariants on every round it executes."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(PROFILE)
        self.sched = sched
        self.max_reserved = 0
        self.seen_kinds: dict[str, list[StepKind]] = {}

    def execute(self, plan):
        s = self.sched
        ids = [slot.req_id for slot in plan.slots]
        assert len(ids) == len(set(ids)), "a request occupies two slots in one round"
        assert len(ids) <= s.cfg.slots
        assert all(i in s.resident for i in ids), "a non-resident request runs"
        assert s.kv_reserved <= s.cfg.kv_budget, "KV reservation exceeded"
        assert s.kv_reserved == sum(r.kv_tokens for r in s.resident.values())
        assert len(s.resident) <= s.cfg.resident_factor * s.cfg.slots
        self.max_reserved = max(self.max_reserved, s.kv_reserved)
        for slot in plan.slots:
            kinds = self.seen_kinds.setdefault(slot.req_id, [])
            if slot.kind is StepKind.PREFILL:
                assert StepKind.DENOISE not in kinds, "prefill after denoising"
            kinds.append(slot.kind)
        return super().execute(plan)


def run(specs, policy, slots=4, k=2, kv_tokens=10_000):
    clock = VirtualClock()
    sched = Scheduler(make_policy(policy), SchedulerConfig(slots=slots, resident_factor=k,
                                                           kv_capacity_tokens=kv_tokens), clock)
    runner = CheckingRunner(sched)
    stats = simulate(specs, sched, runner, clock)
    return sched, runner, stats


request_lists = st.lists(
    st.tuples(st.integers(0, 200), st.lists(st.integers(1, 6), min_size=1, max_size=4),
              st.floats(0, 2), st.floats(0.5, 30)),
    min_size=1, max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=request_lists, policy=st.sampled_from(sorted(POLICIES)), slots=st.integers(1, 5),
       k=st.integers(1, 3), kv_blocks=st.integers(16, 40))  # the largest request needs 416 < 0.9 x 16 x 32
def test_invariants_hold_for_every_policy(reqs, policy, slots, k, kv_blocks):
    specs = [spec(i, p, br, arr, est) for i, (p, br, arr, est) in enumerate(reqs)]
    sched, runner, stats = run(specs, policy, slots, k, kv_blocks * 32)
    # nothing lost or duplicated; every resident request could finish
    assert sorted(r.req_id for r in sched.finished) == sorted(s.req_id for s in specs)
    assert not sched.requests and not sched.resident and sched.kv_reserved == 0
    for r in sched.finished:
        s = next(x for x in specs if x.req_id == r.req_id)
        assert r.prefill_done == -(-s.prompt_tokens // 32)
        assert r.rounds_done == s.true_rounds
        assert r.history[: r.prefill_done] == [StepKind.PREFILL] * r.prefill_done
    assert runner.max_reserved <= int(kv_blocks * 32 * 0.9)


def test_dwise_mixes_prefill_and_denoise_in_one_round():
    specs = [spec(0, 32 * 6, [5]), spec(1, 32, [5]), spec(2, 64, [3])]
    clock = VirtualClock()
    sched = Scheduler("dwise", SchedulerConfig(slots=3), clock)
    runner = SimulatedRunner(PROFILE)
    mixed = False
    for s in specs:
        sched.add_request(runner.register(s))
    while sched.has_work():
        plan = sched.schedule()
        kinds = {slot.kind for slot in plan.slots}
        mixed |= kinds == {StepKind.PREFILL, StepKind.DENOISE}
        sched.update(plan, runner.execute(plan))
    assert mixed


def test_prefill_first_rounds_carry_prefill_only():
    specs = [spec(i, 32 * 3, [4], arrival=0.0) for i in range(6)]
    sched, runner, stats = run(specs, "fcfs-prefill-first", slots=4, k=2)
    assert stats.prefill_only_rounds >= 6 * 3  # every prompt block in a round of its own
    # one request's prompt block per prefill round (SGLang's dLLM path)
    kinds = [kinds for kinds in runner.seen_kinds.values()]
    assert all(k[:3] == [StepKind.PREFILL] * 3 for k in kinds)


def test_only_top_b_waiting_requests_are_admitted():
    sched = Scheduler("dwise", SchedulerConfig(slots=2, resident_factor=4))
    for i, est in enumerate([50, 1, 2, 3, 40]):
        sched.add_request(SchedRequest(f"r{i}", 0, 1, float(est)))
    plan = sched.schedule()
    assert [s.req_id for s in plan.slots] == ["r1", "r2"]
    assert set(plan.admitted) == {"r1", "r2"} and set(sched.resident) == {"r1", "r2"}


def test_resident_cap_and_kv_budget_limit_admission():
    cfg = SchedulerConfig(slots=4, resident_factor=1, kv_capacity_tokens=32 * 10, kv_limit=1.0, slack_blocks=0)
    sched = Scheduler("dwise", cfg)
    for i in range(6):
        sched.add_request(SchedRequest(f"r{i}", 2, 2, 1.0 + i))  # 4 blocks of KV each
    sched.schedule()
    assert len(sched.resident) == 2  # 10 blocks fit two reservations of 4
    with pytest.raises(ValueError, match="reservation budget"):
        sched.add_request(SchedRequest("big", 20, 2, 1.0))


def test_preempted_request_is_paused_and_resumes():
    sched = Scheduler("dwise", SchedulerConfig(slots=1, resident_factor=4))
    sched.add_request(SchedRequest("long", 0, 1, 10.0))
    plan = sched.schedule()
    assert [s.req_id for s in plan.slots] == ["long"]
    sched.update(plan, RoundResult([StepOutcome("long", StepKind.DENOISE, next_kind=StepKind.DENOISE)]))
    sched.add_request(SchedRequest("short", 0, 1, 1.0))
    plan = sched.schedule()
    assert [s.req_id for s in plan.slots] == ["short"] and plan.paused == ["long"]
    assert sched.resident["long"].residency is Residency.PAUSED
    sched.update(plan, RoundResult([StepOutcome("short", StepKind.DENOISE, 32, True, True)]))
    plan = sched.schedule()
    assert [s.req_id for s in plan.slots] == ["long"] and sched.resident["long"].rounds_done == 1


def test_estimates_decrement_clamp_and_refine_once():
    sched = Scheduler("dwise", SchedulerConfig(slots=1))
    sched.add_request(SchedRequest("a", 1, 2, 2.0))
    steps = [StepOutcome("a", StepKind.PREFILL, next_kind=StepKind.DENOISE),
             StepOutcome("a", StepKind.DENOISE, refined_rounds=5.0),
             StepOutcome("a", StepKind.DENOISE, refined_rounds=50.0)]
    seen = []
    for out in steps:
        plan = sched.schedule()
        sched.update(plan, RoundResult([out]))
        seen.append(sched.requests["a"].est_rounds)
    assert seen == [2.0, 4.0, 3.0]  # prefill leaves r; refined to 5 - 1 done; later refinements ignored
    for _ in range(5):
        plan = sched.schedule()
        sched.update(plan, RoundResult([StepOutcome("a", StepKind.DENOISE)]))
    assert sched.requests["a"].est_rounds == 0.0


def _finish(sched: Scheduler, plan, *done: str) -> None:
    sched.update(plan, RoundResult([StepOutcome(s.req_id, s.kind, finished=s.req_id in done,
                                                next_kind=StepKind.DENOISE) for s in plan.slots]))


def test_an_external_estimate_replaces_r_i_and_reranks_residents_and_waiting_requests():
    sched = Scheduler("dwise", SchedulerConfig(slots=1, resident_factor=2))
    for rid, est in (("a", 10.0), ("b", 5.0), ("c", 20.0), ("d", 30.0)):
        sched.add_request(SchedRequest(rid, 0, 1, est))
    assert sched.fill_resident(2) == 2
    plan = sched.schedule()
    assert [s.req_id for s in plan.slots] == ["b"] and set(sched.resident) == {"a", "b"}
    _finish(sched, plan)
    assert sched.set_estimate("a", 1.0) and sched.requests["a"].est_rounds == 1.0
    plan = sched.schedule()
    assert [s.req_id for s in plan.slots] == ["a"] and plan.paused == ["b"]  # a resident overtakes
    _finish(sched, plan, "a")
    # a waiting request's new estimate moves it up the queue; its old heap entry is dropped, not run twice
    assert sched.set_estimate("d", 0.5) and not sched.set_estimate("gone", 1.0)
    plan = sched.schedule()
    assert [s.req_id for s in plan.slots] == ["d"] and plan.admitted == ["d"]
    ran = []
    while sched.has_work():
        plan = sched.schedule()
        ran += [s.req_id for s in plan.slots]
        _finish(sched, plan, *(s.req_id for s in plan.slots))
    assert sorted(ran) == ["b", "c", "d"] and sched.num_waiting == 0  # each once more: none ran twice
    assert sched.set_estimate("b", -3.0) is False  # finished
    # a waiting request whose estimate grew no longer ranks by its old one
    sched = Scheduler("dwise", SchedulerConfig(slots=1, resident_factor=1))
    sched.add_request(SchedRequest("x", 0, 1, 1.0))
    sched.add_request(SchedRequest("y", 0, 1, 2.0))
    sched.set_estimate("x", 50.0)
    assert sched.schedule().admitted == ["y"]


def test_reservations_take_whole_pool_slots_and_a_request_that_does_not_fit_waits():
    """With the KV pool's slot size, a request reserves the slots its cache takes (its positions rounded up
    to whole slots) against exactly the pool's slots; one that does not fit waits until another finishes;
    one that could never fit is refused."""
    cfg = SchedulerConfig(slots=4, resident_factor=4, kv_capacity_tokens=3 * 100, kv_limit=1.0, kv_slot_tokens=100)
    sched = Scheduler("dwise", cfg)
    sched.add_request(SchedRequest("one", 0, 1, 1.0, kv_positions=60))
    sched.add_request(SchedRequest("two", 0, 1, 2.0, kv_positions=150))  # longer than a slot: two of them
    sched.add_request(SchedRequest("late", 0, 1, 3.0, kv_positions=100))
    assert [sched.requests[r].kv_tokens for r in ("one", "two", "late")] == [100, 200, 100]
    plan = sched.schedule()
    assert set(sched.resident) == {"one", "two"} and sched.kv_reserved == 300 and sched.num_waiting == 1
    _finish(sched, plan)
    assert set(sched.resident) == {"one", "two"}  # still waiting: nothing finished
    plan = sched.schedule()
    _finish(sched, plan, "one")
    plan = sched.schedule()
    assert "late" in plan.admitted and sched.kv_reserved == 300
    with pytest.raises(ValueError, match="reservation budget"):
        sched.add_request(SchedRequest("huge", 0, 1, 1.0, kv_positions=301))
    # without positions, the footprint is estimated from the blocks (plus slack) and rounded up to slots
    est = SchedRequest("est", 2, 1, 1.0)
    assert sched.worst_case_kv(est) == 200  # (2 + 1 + 2 slack) blocks x 32 = 160 -> two slots


def test_abort_releases_reservation():
    sched = Scheduler("dwise", SchedulerConfig(slots=2))
    sched.add_request(SchedRequest("a", 1, 1, 1.0))
    sched.add_request(SchedRequest("b", 1, 1, 2.0))
    sched.schedule()
    assert sched.kv_reserved > 0
    assert sched.num_running == 2
    sched.abort("a")
    sched.abort("b")
    assert sched.kv_reserved == 0 and not sched.has_work() and sched.num_running == 0
    assert sched.schedule().slots == []


def test_unknown_policy():
    with pytest.raises(ValueError, match="known: .*dwise"):
        make_policy("nope")


def test_dwise_beats_fcfs_prefill_first_in_simulation():
    rng = random.Random(0)
    specs = [spec(i, rng.choice([64, 64, 2000]), [rng.randint(1, 12) for _ in range(rng.randint(1, 3))])
             for i in range(60)]
    _, _, fcfs = run(specs, "fcfs-prefill-first", slots=16, k=4, kv_tokens=200_000)
    _, _, dwise = run(specs, "dwise", slots=16, k=4, kv_tokens=200_000)
    assert sum(dwise.latencies) < 0.5 * sum(fcfs.latencies)
    assert dwise.rounds < fcfs.rounds
