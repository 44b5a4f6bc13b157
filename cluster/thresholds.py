"""Threshold control: SLO-aware choice (Alg. 1) and adaptive load control (Alg. 2).

Candidate thresholds are kept highest first; a request's allowed set is
always a suffix ``thresholds[cap:]`` (lower thresholds mean fewer steps and
less load, so whenever a threshold fits, every lower one fits too), and the
lowest threshold is always allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.state import RequestState


def choose_threshold(est: Sequence[float], cap: int, budget_ms: float, step_ms: float,
                     heavy_extra_ms: float = 0.0) -> int:
    """Alg. 1: index of the highest allowed threshold whose predicted remaining
    latency fits the remaining SLO budget; the lowest one if none fits.

    est: predicted remaining steps per candidate threshold (highest first);
    cap: first allowed index; step_ms: the instance's step (round) latency;
    heavy_extra_ms: the request's remaining recompute steps times the extra
    latency a recompute step adds over a cached one (the two kinds counted
    separately).
    """
    last = len(est) - 1
    for i in range(cap, last):
        if heavy_extra_ms + est[i] * step_ms <= budget_ms:
            return i
    return last


def request_load(req: RequestState, i: int, heavy_cost: float, light_cost: float) -> float:
    """Load of ``req`` at candidate ``i``: its remaining recompute and cached
    steps, each times its cost (instance-ms per step at full batch); the
    cost-weighted form of DiLaServe's tokens x remaining steps."""
    return req.heavy_left * heavy_cost + req.light_left(i) * light_cost


def load_control(ordered: Sequence[RequestState], capacity: float, heavy_cost: float, light_cost: float) -> float:
    """Alg. 2: set every request's ``cap``; returns the headroom left.

    ``ordered``: requests in priority order (higher priority first, then
    arrival). Walking them in order, each threshold from high to low is kept
    only if the worst-case aggregate load (the committed load of the requests
    before it at their highest allowed thresholds + this request at the
    threshold + every later request at the lowest threshold) fits
    ``capacity``. Earlier requests thus get the widest ranges; under overload
    the later ones are left with the lowest threshold only.
    """
    if not ordered:
        return capacity
    last = len(ordered[0].est) - 1
    heavy = [r.heavy_left for r in ordered]
    lows = [h * heavy_cost + r.light_left(last) * light_cost for r, h in zip(ordered, heavy)]
    headroom = capacity - sum(lows)  # capacity - committed - (this and the rest at the lowest)
    for r, h, low in zip(ordered, heavy, lows):
        cap = last
        if headroom > 0.0:
            base = h * heavy_cost - low
            for i in range(last):
                extra = base + r.light_left(i) * light_cost
                if extra <= headroom:
                    cap = i
                    headroom -= extra
                    break
        r.cap = cap
    return headroom
