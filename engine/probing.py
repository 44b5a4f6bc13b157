"""Failed rounds: which request is at fault, found by bisection (the round loop's, engine/loop.py).

A round whose engine step raises (a CUDA out-of-memory error, a request that breaks the forward) fails no
request by itself: the loop finds the request at fault by bisection. The requests of the failed round that
it left as they were (``RoundFailed.touched``: engine/instance.py) run again in *probe* rounds of their
own, half of them at a time (``Instance.step(only=)``); a probe that fails is split again, one that
succeeds clears its requests. A request that failed ``max_round_failures`` rounds in a row, the last one
alone, is *convicted*; once every probe of the failure has run, a convicted request gets an ``ErrorItem``
with status 500 if a round succeeded on the instance since the failures began (the instance works: the
request is at fault), and otherwise status 503 (the instance gives up on it: its sender resumes it
elsewhere from its committed tokens), unless this instance had already given up on it once (then 500).

A request the failed round had half-updated starts over from the tokens already published
(``Instance.reset``: its KV slots and reservation are released and taken again when it is readmitted); a
step it takes then clears nothing until it has published past that point, and a probe holding it runs
again (``PROBE_ROUNDS_MAX`` rounds at most) until it has, or fails: a fault that strikes at a later step of
a request is found as well, and cannot make it start over for ever. Probe rounds run only the probe's
requests; the others wait. ``broken_after`` give-ups (503) with no successful round in between mean the
instance itself is broken.

``Probing`` holds this state and makes these decisions; the loop owns the requests, resets them, sends the
items and counts: nothing here touches the instance.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container

from engine.instance import RoundFailed

PROBE_ROUNDS_MAX = 64  # rounds a probe runs at most while its restarted requests get back to where they failed


class Probing:
    """The failed-round state of one round loop (module docstring)."""

    def __init__(self, max_round_failures: int, broken_after: int) -> None:
        if max_round_failures < 1 or broken_after < 1:
            raise ValueError("max_round_failures and broken_after must be at least 1")
        self.max_round_failures, self.broken_after = max_round_failures, broken_after
        self.strikes: dict[str, int] = {}  # request -> failed rounds in a row it was in
        self.probes: deque[list[str]] = deque()  # requests to run by themselves, next first
        self.probe_runs = 0  # rounds the first probe has run
        self.convicted: dict[str, str] = {}  # request -> its last failure, awaiting the verdict
        self.healthy = True  # a round succeeded since the current failures began
        self.given_up: dict[str, None] = {}  # requests handed back (503) lately, oldest first (bounded)
        self.give_ups = 0  # requests handed back since the last successful round

    def next_probe(self, live: Container[str]) -> list[str] | None:
        """The ``live`` requests the next round runs by themselves (None: an ordinary round, and the verdict is
        due if ``convicted`` holds any)."""
        while self.probes:
            group = [r for r in self.probes[0] if r in live and r not in self.convicted]
            if group:
                return group
            self.probes.popleft()
        return None

    def probe_passed(self) -> None:
        self.probes.popleft()
        self.probe_runs = 0

    def probe_ran(self, caught_up: bool) -> None:
        """A probe round succeeded; ``caught_up``: none of its requests is still short of where it started
        over. The probe is over then, or after ``PROBE_ROUNDS_MAX`` rounds."""
        self.probe_runs += 1
        if self.probe_runs >= PROBE_ROUNDS_MAX or caught_up:
            self.probe_passed()

    def round_succeeded(self) -> None:
        self.healthy, self.give_ups = True, 0

    def round_failed(self, failed: RoundFailed, probing: bool) -> None:
        """Count a strike against each request of a failed round (``probing``: it was a probe round)."""
        if probing:
            self.probe_passed()  # it failed: replaced by its halves (``bisect``)
        else:  # an ordinary round: new failures begin (no probe and no verdict is pending)
            self.healthy = False
        for req_id in failed.batch:
            self.strikes[req_id] = self.strikes.get(req_id, 0) + 1

    def bisect(self, failed: RoundFailed, suspects: list[str], slots: int) -> None:
        """After ``round_failed``: convict or split ``suspects`` (the failed round's requests still held)."""
        if len(failed.batch) == 1 and suspects and (n := self.strikes[suspects[0]]) >= self.max_round_failures:
            self.convicted[suspects[0]] = f"{failed} (the request failed {n} rounds in a row, the last by itself)"
            return
        # one that keeps failing without being isolated (a restarted request may miss its probes, not being
        # admitted in time): convicted once it failed more rounds than a bisection of ``slots`` takes
        cap = self.max_round_failures + slots.bit_length()
        suspects = list(suspects)
        for r in [r for r in suspects if self.strikes[r] >= cap]:
            self.convicted[r] = f"{failed} (the request failed {self.strikes[r]} rounds in a row)"
            suspects.remove(r)
        if len(suspects) > 1:
            half = len(suspects) // 2
            self.probes.extendleft([suspects[half:], suspects[:half]])  # the first half runs first
        elif suspects:
            self.probes.appendleft(suspects)  # again, by itself

    def clear(self, req_id: str, short: bool) -> bool:
        """``req_id`` took a step in a round that succeeded: its failures in a row are over (True), unless it
        is ``short`` (it started over and has not yet got past where it was: its step then proves nothing,
        it may fail again where it failed, and a fault that comes back before it publishes a token would go
        on for ever)."""
        if req_id not in self.strikes or short:
            return False
        del self.strikes[req_id]
        return True

    def verdict(self, live: Container[str]) -> list[tuple[str, str, bool]]:
        """Every probe has run: ``(request, why, at_fault)`` for each ``live`` convicted request. At fault
        (500) when the instance has run a round since the failures began or gave up on it once before;
        otherwise the instance gives up on it (503: ``gave_up``)."""
        out = [(r, why, self.healthy or r in self.given_up) for r, why in self.convicted.items() if r in live]
        self.convicted.clear()
        return out

    def gave_up(self, req_id: str) -> None:
        """The loop handed ``req_id`` back (503)."""
        self.give_ups += 1
        self.given_up[req_id] = None
        if len(self.given_up) > 1024:
            del self.given_up[next(iter(self.given_up))]

    def drop_all(self) -> None:
        """Every request was handed back: no probe and no verdict is pending."""
        self.probes.clear()
        self.convicted.clear()

    def forget(self, req_id: str) -> None:
        """``req_id`` left the instance."""
        self.strikes.pop(req_id, None)

    def broken(self) -> bool:
        """As many give-ups as ``broken_after`` with no round succeeding in between: the instance is broken."""
        return self.give_ups >= self.broken_after

    def broken_reason(self) -> str:
        return f"{self.give_ups} requests given up on with no round succeeding in between"
