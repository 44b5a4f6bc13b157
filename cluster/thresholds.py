"""Threshold control: SLO-aware choice (Alg. 1) and adaptive load control (Alg. 2).

Candidate thresholds are kept highest first; a request's allowed set is
always a suffix ``thresholds[cap:]`` (lower thresholds mean fewer steps and
less load, so whenever a threshold fits, every lower one fits too), and the
lowest threshold is always allowed.

Every decoding rule is under this control, not only the threshold rule: a
candidate threshold is a *level* on one scale for all rules (higher: slower
and more careful), and a request's rule turns the level it is given into its
own knob, monotonically in its slower direction as the level rises
(``engine.decoding`` rules' ``knob_at``; ``knob_for`` here): the threshold
itself for ``threshold``, ``joint_threshold``, ``hierarchical`` and
``credit``; gamma = -ln(level) for ``entropy_bound``; k = round(8 (1 -
level)), at least 1, for ``low_confidence``. So Alg. 1 and Alg. 2 pick a
level exactly as they pick a threshold, a lower level under load moves every
rule's knob in its faster direction (a lower threshold, a higher gamma or
k), and the step estimates per candidate are the request's rule's at the
knob of each level (``RequestState.decoding``); the rows they are asked with
also say whether the request's text is held to a grammar (``request_row``:
``RequestState.constrained``), which changes its steps per token.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.estimator import feature_row
from cluster.state import RequestState
from predictors.features import decoding_columns, rule_knob


def knob_for(rule: str, level: float) -> float:
    """The knob of decoding rule ``rule`` (a registered name) at the router's candidate ``level``."""
    return rule_knob(rule, level)


def rule_knobs(rule: str, levels: Sequence[float]) -> tuple[float, ...]:
    """``knob_for`` of each candidate level (the router's thresholds, highest first)."""
    return tuple(knob_for(rule, t) for t in levels)


def decoding_row(state: RequestState, level: float) -> list[float]:
    """A decoding-aware step model's row of ``state`` at candidate ``level``: its step features
    (``cluster.estimator.feature_row``) and then its rule's code and knob at the level
    (``predictors.features.RULE_FEATURES``). ``FeatureStepEstimator(model, thresholds, row=decoding_row)``
    asks such a model about every candidate for the request's own rule."""
    return feature_row(state, level) + decoding_columns(state.decoding, level)


def request_row(state: RequestState, level: float) -> list[float]:
    """The row the router asks the step learner with, and the one it records, for ``state`` at candidate
    ``level``: ``decoding_row``'s and then whether its text is held to a grammar
    (``RequestState.constrained``: ``predictors.features.CONSTRAINT_FEATURES``), 14 columns. A model trained
    on fewer columns reads its own first ones (``predictors.step.StepPredictor``)."""
    return decoding_row(state, level) + [float(state.constrained)]


def request_knob(req: RequestState) -> float | None:
    """The knob the request's rule decodes with at its current threshold (None before the router chose one)."""
    return None if req.threshold is None else knob_for(req.decoding, req.threshold)


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
