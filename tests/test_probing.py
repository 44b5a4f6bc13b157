"""engine/probing.py by itself: the failed-round bisection's decisions, without an engine (the round loop's
use of them is tests/test_failed_rounds.py)."""

from __future__ import annotations

import pytest

from engine.instance import RoundFailed
from engine.probing import PROBE_ROUNDS_MAX, Probing


def fail(p: Probing, batch: list[str], live: set[str], probing: bool = False, slots: int = 8) -> None:
    failed = RoundFailed("boom", batch, [])
    p.round_failed(failed, probing)
    p.bisect(failed, [r for r in batch if r in live], slots)


def test_a_failed_round_is_split_in_halves_first_half_first():
    p = Probing(2, 3)
    live = {"a", "b", "c", "d", "e"}
    fail(p, ["a", "b", "c", "d", "e"], live)
    assert not p.healthy and p.strikes == dict.fromkeys("abcde", 1)
    assert p.next_probe(live) == ["a", "b"]
    fail(p, ["a", "b"], live, probing=True)  # the failing half is split again, ahead of the other half
    assert [list(g) for g in p.probes] == [["a"], ["b"], ["c", "d", "e"]]
    p.probe_ran(caught_up=True)  # "a" ran alone and succeeded
    assert p.clear("a", short=False) and "a" not in p.strikes
    assert p.next_probe(live) == ["b"]


def test_a_request_failing_alone_max_times_is_convicted_and_fails_on_a_working_instance():
    p = Probing(2, 3)
    live = {"x", "y"}
    fail(p, ["x", "y"], live)
    assert p.next_probe(live) == ["x"]
    fail(p, ["x"], live, probing=True)  # alone, its second failure in a row: convicted
    assert set(p.convicted) == {"x"} and "2 rounds in a row, the last by itself" in p.convicted["x"]
    assert p.next_probe(live) == ["y"]  # the verdict waits for the other probes
    p.round_succeeded()  # y's probe round succeeded: the instance works
    p.probe_ran(caught_up=True)
    assert p.next_probe(live) is None  # no probe left: the verdict is due
    [(req, why, at_fault)] = p.verdict(live)
    assert req == "x" and at_fault and not p.convicted  # 500: the request is at fault


def test_without_a_successful_round_the_instance_gives_up_and_breaks_after_enough():
    p = Probing(1, 2)
    live = {"x", "y"}
    for r in ("x", "y"):
        fail(p, [r], live)
        [(req, _, at_fault)] = p.verdict(live)
        assert req == r and not at_fault  # 503: resumed elsewhere
        p.gave_up(r)
        p.forget(r)
    assert p.broken() and "2 requests given up" in p.broken_reason()
    p.round_succeeded()
    assert not p.broken()


def test_the_verdict_skips_requests_no_longer_held():
    p = Probing(1, 3)
    fail(p, ["x"], {"x"})
    assert p.verdict(set()) == [] and not p.convicted


def test_a_request_given_up_on_once_is_at_fault_the_next_time():
    p = Probing(1, 5)
    fail(p, ["x"], {"x"})
    assert [v[2] for v in p.verdict({"x"})] == [False]
    p.gave_up("x")
    fail(p, ["x"], {"x"})
    assert [v[2] for v in p.verdict({"x"})] == [True]


def test_a_short_request_keeps_its_strikes_and_a_probe_ends_after_its_limit():
    p = Probing(2, 3)
    live = {"a", "b"}
    fail(p, ["a", "b"], live)
    assert not p.clear("a", short=True) and p.strikes["a"] == 1  # started over, not yet past where it was
    assert p.clear("a", short=False)
    first = list(p.probes[0])
    for _ in range(PROBE_ROUNDS_MAX - 1):
        p.probe_ran(caught_up=False)
    assert list(p.probes[0]) == first
    p.probe_ran(caught_up=False)
    assert list(p.probes[0]) != first


def test_one_that_keeps_failing_unisolated_is_convicted_after_a_bisection_s_worth():
    p = Probing(2, 9)
    live = {"a", "b"}
    for _ in range(2 + (4).bit_length()):  # max_round_failures + bits of 4 slots
        fail(p, ["a", "b"], live, slots=4)
    assert set(p.convicted) == {"a", "b"}


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        Probing(0, 3)
    with pytest.raises(ValueError, match="at least 1"):
        Probing(2, 0)
