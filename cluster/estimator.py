"""Step estimators: predicted remaining denoising steps of a request under
each candidate threshold (pure Python).

The interface (``StepEstimator``) is one batched call::

    estimator.thresholds            # the candidate thresholds, as the router's config lists them
    estimator.predict(states)       # -> list of rows, one per state: remaining steps per threshold

``states`` are ``RequestState`` objects; the fields an estimator may read are
the step predictor's inputs: ``thresholds_used`` (the threshold history; the
last entry is the current one), ``output_tokens``, ``progress`` (fraction of
the output committed), ``block_progress``, ``blocks_left``, ``step_in_block``
and ``conf_stats`` (min, q25, median, mean, q75 of the last step's
confidences; empty before the first step). Rows must be non-negative and
should not increase as the threshold falls. The router calls ``predict``
after a request's steps at its update granularity, batching across requests
(DiLaServe batches across requests and thresholds the same way).

Implementations:

- ``TableStepEstimator`` (simulation): the request's true total steps at
  each threshold are known to the simulator (from real tiny-model decodes);
  it predicts ``(1 - progress) x total`` times a per-request log-normal error
  that shrinks as progress grows (online updates with progress and
  confidence features are what cut the paper's error).
- ``OnlineStepEstimator``: ``FeatureStepEstimator`` over a learner that trains
  on served traffic (``predictors.online.OnlineStepLearner``: a prior until
  its first model, then LightGBM refit every so many finished requests).
- ``FeatureStepEstimator``: wraps any function ``predict(rows) -> values``
  over rows of the 11 scalar step features (``predictors.features.StepFeatures``
  as rows, threshold first: ``feature_row``); one state row is asked about every
  threshold by overwriting the threshold column.
  The GBM plugs in as
  ``FeatureStepEstimator(StepPredictor.load(path).predict_rows, thresholds)``
  with ``RouterConfig(estimate_every=predictor.interval)``: between updates
  the router counts the estimates down itself.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from cluster.state import RequestState
from predictors.features import STEP_FEATURES, StepFeatures

__all__ = ["STEP_FEATURES", "StepEstimator", "TableStepEstimator", "FeatureStepEstimator", "OnlineStepEstimator",
           "AdmissionStepEstimator", "feature_row"]
_NO_CONF = (0.0,) * 5  # a request that has not stepped yet: no confidences


class StepEstimator(Protocol):
    thresholds: tuple[float, ...]

    def predict(self, states: Sequence[RequestState]) -> list[list[float]]: ...


class TableStepEstimator:
    """Oracle totals per threshold with a calibrated, shrinking error (simulation only).

    ``totals(state)`` returns the request's true total steps at each threshold
    (the simulator keeps them in ``state.extra``). The error factor is
    ``exp(sigma * (1 - progress) * z)`` with one ``z ~ N(0, 1)`` per request (from its id and ``seed``),
    kept until the router calls ``forget(req_id)`` (``Router.finish``); at most
    ``max_requests`` are kept in any case (the oldest go first).
    """

    def __init__(self, thresholds: Sequence[float], totals: Callable[[RequestState], Sequence[float]],
                 sigma: float = 0.3, seed: int = 0, max_requests: int = 100_000) -> None:
        self.thresholds = tuple(thresholds)
        self.totals, self.sigma = totals, sigma
        self.seed = seed
        self._z: dict[str, float] = {}
        self.max_requests = max_requests

    def predict(self, states):
        out = []
        for s in states:
            z = self._z.get(s.req_id)
            if z is None:
                if len(self._z) >= self.max_requests:  # a caller that never forgets: drop the oldest
                    del self._z[next(iter(self._z))]
                # drawn from the request's own stream: a request's error does not depend on what the router
                # asked before it, so two runs of the same requests (a static mix and a reconfigured cluster)
                # see the same errors (common random numbers: their difference is the configuration's)
                z = self._z[s.req_id] = random.Random(f"{self.seed}:{s.req_id}").gauss(0.0, 1.0)
            left = 1.0 - s.progress
            f = left * math.exp(self.sigma * left * z)
            out.append([t * f for t in self.totals(s)])
        return out

    @property
    def arrival_error(self) -> float:
        """The mean relative error of an arrival's estimate: E|exp(sigma z) - 1| for z ~ N(0, 1)."""
        s = self.sigma
        return math.exp(s * s / 2) * math.erf(s / math.sqrt(2))

    def forget(self, req_id: str) -> None:
        self._z.pop(req_id, None)


def feature_row(state: RequestState, threshold: float) -> list[float]:
    """The step model's row of ``state`` at ``threshold``: its ``StepFeatures`` as of its last step (the
    replica's, which the ingress keeps on the state), asked about ``threshold``."""
    return StepFeatures(float(threshold), float(state.output_tokens), state.progress, state.block_progress,
                        float(state.blocks_left), float(state.step_in_block),
                        *(state.conf_stats or _NO_CONF)).as_row()


class FeatureStepEstimator:
    """Adapter for a trained step-count model: ``predict_rows(rows)`` with rows of STEP_FEATURES."""

    def __init__(self, predict_rows: Callable[[list[list[float]]], Sequence[float]], thresholds: Sequence[float],
                 row: Callable[[RequestState, float], list[float]] = feature_row) -> None:
        self.predict_rows, self.thresholds, self.row = predict_rows, tuple(thresholds), row

    def predict(self, states):
        if not states:
            return []
        rows = [self.row(s, t) for s in states for t in self.thresholds]
        values = list(self.predict_rows(rows))
        m = len(self.thresholds)
        return [[max(float(v), 0.0) for v in values[i * m:(i + 1) * m]] for i in range(len(states))]


class OnlineStepEstimator(FeatureStepEstimator):
    """The step estimate of a learner that trains on served traffic (``predictors.online.OnlineStepLearner``,
    or anything with ``predict_rows(rows)`` over STEP_FEATURES rows): the learner's prior until its first
    model, then its latest model, read at each call (the learner swaps models atomically, so a refit on
    another thread never blocks ``predict``).

    ``admission`` (optional; ``predictors.online.OnlineAdmissionLearner`` or anything with ``source`` and
    ``predict_one(row) -> total steps``) answers for a request that has not stepped yet (``steps_done``
    0) and carries its prompt features in ``state.extra["admission"]``, as ``AdmissionStepEstimator``
    does, once it has a model (``source`` not "prior": before, the step learner's prior, a measured
    mean, says more than one step per block). ``describe()`` is the learners'."""

    def __init__(self, learner, thresholds: Sequence[float],
                 row: Callable[[RequestState, float], list[float]] = feature_row, admission=None) -> None:
        super().__init__(learner.predict_rows, thresholds, row)
        self.learner, self.admission = learner, admission

    def predict(self, states):
        adm = self.admission
        if adm is None or adm.source == "prior":
            return super().predict(states)
        out: list[list[float] | None] = [None] * len(states)
        rest = []
        for i, s in enumerate(states):
            feats = s.extra.get("admission") if s.steps_done == 0 else None
            if feats is None:
                rest.append(i)
            else:
                out[i] = [max(float(adm.predict_one([*feats, t])), 1.0) for t in self.thresholds]
        for i, row in zip(rest, super().predict([states[i] for i in rest])):
            out[i] = row
        return out

    measured_prior = 20  # finished requests after which the step prior's tokens per step are measured

    @property
    def arrival_error(self) -> float:
        """The relative error of an arrival's estimate, as measured: the admission learner's holdout MAPE
        when its model answers for arrivals (0 before: its prior, one round per block, is a lower bound)."""
        adm = self.admission
        if adm is None or adm.source == "prior":
            return 0.0
        err = getattr(adm, "holdout_mape", None)
        return 0.0 if err is None or err != err else float(err)

    @property
    def ready(self) -> bool:
        """Estimates an admission decision may trust: the step learner has a model (trained online or
        shipped), or its prior has measured the tokens a step commits on ``measured_prior`` finished
        requests. Before, the prior assumes 1 token a step, and shedding on that guess refuses the requests
        the learners would learn from; without shedding meanwhile, an overloaded start builds a backlog
        that misses its SLOs. (The admission prior, one round per block, is a lower bound: it admits.)"""
        return self.learner.source != "prior" or getattr(self.learner, "seen", 0) >= self.measured_prior

    def describe(self) -> dict:
        out = self.learner.describe()
        if self.admission is not None:
            out["admission"] = self.admission.describe()
        return out


class AdmissionStepEstimator:
    """Live estimator: the admission predictor until a request's first step, the step predictor after.

    Before its first step a request has no step features (no confidences, no progress), and the step
    model would be asked about states it never saw; the admission model (DWISE: prompt features and
    the threshold -> total steps) answers instead. The owner puts the prompt features in
    ``state.extra["admission"]`` (words, newlines, prompt tokens); the threshold is appended.
    """

    def __init__(self, admission: Callable[[list[float]], float], step: FeatureStepEstimator) -> None:
        self.admission, self.step = admission, step
        self.thresholds = step.thresholds

    def predict(self, states):
        fresh = [i for i, s in enumerate(states) if not s.conf_stats and "admission" in s.extra]
        if not fresh:
            return self.step.predict(states)
        out: list[list[float] | None] = [None] * len(states)
        for i in fresh:
            feats = list(states[i].extra["admission"])
            out[i] = [max(float(self.admission([*feats, t])), 1.0) for t in self.thresholds]
        rest = [i for i in range(len(states)) if out[i] is None]
        for i, row in zip(rest, self.step.predict([states[i] for i in rest])):
            out[i] = row
        return out
