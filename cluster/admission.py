"""Admission at the ingress, pure (no asyncio, no torch, no ray): the live dispatcher and the cluster
simulator run the same code.

An arrival is admitted when ``Router.admissible(state, now, util)`` holds: with the work ahead of it
it can finish within its SLO even at the lowest threshold, and it makes no longer request miss.
``AdmissionGovernor`` sets ``util``, the share of the modelled capacity arrivals are admitted
against, from the SLO attainment of the requests admitted under it. The cluster driver tells it of a
miss as soon as a request is past its deadline, not when it finishes.

The driver used to tell it of misses it foresaw: a request whose predicted remaining steps, at the
length of the round just run, ended past its deadline. Under load every one of them met its SLO (the
router lowers thresholds as deadlines near, and a round with prefills is no measure of the rounds after
it): on dilaserve-bench at rate 85 those false misses cut admission until shedding served 0.55 of the
arrivals in time, against 0.86 admitting everything.
"""

from __future__ import annotations


class AdmissionGovernor:
    """Feedback on admission: the share of the cluster's modelled capacity that arrivals are admitted
    against (``Router.admissible``'s ``util``), from the SLO attainment of the requests admitted under
    the current share (measured here, at the ingress).

    The router's capacity comes from latency profiles calibrated by measured rounds; it cannot see a
    bottleneck outside the instances (an HTTP path or an ingress saturated by a flood shares the CPU on
    a small machine). When requests admitted under the current share miss their SLOs (attainment over
    a window of at least ``min_requests`` below ``low``), the share is cut (x ``cut``) and a new epoch
    starts, so the backlog admitted before the cut does not cut it again; while arrivals are shed and
    attainment is at least ``high``, it grows back (x ``grow`` per window) up to 1. It starts at
    ``start`` (a slow start: the profile's scaling with the batch is least known before the first
    large batches, and a flood into an idle cluster would otherwise admit a backlog that misses).
    """

    def __init__(self, low: float = 0.9, high: float = 0.97, cut: float = 0.7, grow: float = 1.1,
                 window_s: float = 0.5, min_requests: int = 8, floor: float = 0.05, start: float = 0.5) -> None:
        self.low, self.high, self.cut, self.grow = low, high, cut, grow
        self.window_s, self.min_requests, self.floor = window_s, min_requests, floor
        self.util = start
        self.epoch = 0
        self._met = self._n = 0
        self._start: float | None = None
        self._shed_at_start = 0
        self.cuts = 0

    def finished(self, met: bool, now: float, shed: int) -> None:
        """A request admitted in the current epoch finished (``met``: within its SLO); ``shed``: the
        dispatcher's count of arrivals shed so far."""
        if self._start is None:
            self._start, self._shed_at_start = now, shed
        self._met += met
        self._n += 1
        if now - self._start < self.window_s or self._n < self.min_requests:
            return
        attainment = self._met / self._n
        if attainment < self.low:
            self.util = max(self.floor, self.util * self.cut)
            self.epoch += 1
            self.cuts += 1
        elif attainment >= self.high and shed > self._shed_at_start and self.util < 1.0:
            self.util = min(1.0, self.util * self.grow)
        self._met = self._n = 0
        self._start = None
