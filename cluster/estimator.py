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
- ``CanvasStepEstimator``: canvas (DiffusionGemma) requests, whose steps are
  not a masked block's: steps per canvas per level, learnt online from the
  canvases served requests finish (``observe``), times the canvases a
  request has left.

Two optional hooks: ``forget(req_id)`` (``Router.finish``: the request left)
and ``observe(stepped)`` (``Router.on_step``, before anything else of the
round: the (request, next step heavy, finished) triples of an instance's
round, progress fields written, ``next_heavy`` still the kind of the step
just taken), for an estimator that learns from the steps it sees.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from cluster.state import RequestState
from predictors.features import STEP_FEATURES, StepFeatures

__all__ = ["STEP_FEATURES", "StepEstimator", "TableStepEstimator", "FeatureStepEstimator", "OnlineStepEstimator",
           "AdmissionStepEstimator", "CanvasStepEstimator", "feature_row", "request_step_cap"]
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


DEFAULT_CANVAS_STEPS = 48  # transformers' DiffusionGemma max_denoising_steps: the prior when no rule's cap is given


def request_step_cap(decoding_config: dict | None) -> int | None:
    """A canvas request's own step cap: its ``decoding_config``'s ``max_denoising_steps`` (the renoise rule's
    field, engine/decoding/renoise.py), None when it sets none; a ValueError naming the field for a value that is
    not an integer of at least 1 (the replica would refuse it too)."""
    if not decoding_config or decoding_config.get("max_denoising_steps") is None:
        return None
    cap = decoding_config["max_denoising_steps"]
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"decoding_config.max_denoising_steps must be an integer of at least 1, got {cap!r}")
    return cap


class _CanvasTrack:
    """What ``CanvasStepEstimator`` keeps of a live request: its placement (``attempt``), the canvases its
    budget had left before its last step (``blocks``), and its current canvas's denoising steps so far, in all
    and per level."""

    __slots__ = ("attempt", "blocks", "steps", "levels", "moved")

    def __init__(self, attempt: int, blocks: int) -> None:
        self.attempt, self.blocks, self.steps = attempt, blocks, 0
        self.levels: dict[float, int] = {}
        self.moved = False  # placed again since its last step: its next step encodes (a prefill)


class CanvasStepEstimator:
    """Remaining denoising steps of canvas requests (DiffusionGemma: uniform-state canvases, the ``renoise``
    rule), learnt online from the canvases served requests finish.

    A canvas stops when its argmax is stable and confident, or at the rule's step cap (``step_cap``): how many
    steps it takes depends on the entropy bound, which the router's level sets (``knob_at``: each 0.1 below
    0.9 doubles it), and on the request. The estimator learns, per level, the steps of the recent canvases
    (the last ``window``) and, over all levels, the chance that a canvas with budget left after it is followed
    by another (the request did not end in it: EOS, a stop); a request's row at level ``l`` is

        max(spc(l) - steps into its current canvas, 1) + E[later canvases] x spc(l)

    where ``spc(l)`` is the mean steps per canvas measured at ``l``; between two measured levels it is
    interpolated linearly in the level (so an unmeasured middle level is worth choosing, and gets measured),
    below the lowest measured level it is that level's (a lower level is no slower), above the highest it is
    ``step_cap`` (the prior: an upper bound); it is kept non-increasing as the level falls. E[later canvases]:
    the budget's canvases after the current one (``blocks_left - 1``, from ``max_tokens`` over the canvas length
    and what the request committed), each reached with the measured chance (geometrically), or all of them
    until ``min_outcomes`` canvases have said whether another followed.

    A request with its own step cap (``RequestState.step_cap``: its ``decoding_config``'s ``max_denoising_steps``,
    ``request_step_cap``) is estimated with it: its prior is its cap, not ``step_cap``, and no level's steps per
    canvas exceed it (a canvas stops at its cap). Its canvases are not recorded in the per-level means (cut at
    a cap that is not the others', they would say nothing of an uncapped canvas); whether another followed is.

    It learns from the router's step events (``observe``, called by ``Router.on_step``): a step that denoised
    (a prefill only encodes the prompt: a block-causal request's first step on each instance it is placed on)
    counts toward the request's current canvas at the level the router
    gave it (``RequestState.threshold``: the level its instance turns into the entropy bound); a canvas ends
    when the request's canvases left fall (its tokens were published) or the request finishes, and is recorded
    at the level most of its steps took. A request that moved (``attempt`` changed) replays its current canvas
    from its first step, so the count starts again. ``forget`` drops a request (``Router.finish``); at most
    ``max_requests`` are tracked (the oldest go first). ``ready`` (admission may shed on its estimates) once
    ``measured_prior`` canvases were measured; ``describe()`` for the debug views.
    """

    def __init__(self, thresholds: Sequence[float], step_cap: int = DEFAULT_CANVAS_STEPS, *, window: int = 500,
                 min_outcomes: int = 8, measured_prior: int = 20, max_requests: int = 100_000) -> None:
        if int(step_cap) < 1:
            raise ValueError(f"step_cap must be at least 1 (the rule's max_denoising_steps), got {step_cap}")
        if int(window) < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.thresholds = tuple(float(t) for t in thresholds)
        self.step_cap, self.window = int(step_cap), int(window)
        self.min_outcomes, self.measured_prior, self.max_requests = min_outcomes, measured_prior, max_requests
        self._steps: dict[float, deque[int]] = {}  # level -> steps of its recent canvases
        self._sums: dict[float, int] = {}  # level -> the sum of those
        self._next: deque[bool] = deque(maxlen=self.window)  # canvases with budget after them: another followed?
        self._followed = 0  # True entries in _next
        self._tracks: dict[str, _CanvasTrack] = {}
        self.canvases = 0  # canvases measured
        self.own_cap_canvases = 0  # canvases of requests with their own step cap (not in the means)

    # ---- learning ------------------------------------------------------------------------------
    def _track(self, req: RequestState, blocks: int) -> _CanvasTrack:
        t = self._tracks.get(req.req_id)
        if t is None:
            if len(self._tracks) >= self.max_requests:  # a caller that never forgets: drop the oldest
                del self._tracks[next(iter(self._tracks))]
            t = self._tracks[req.req_id] = _CanvasTrack(req.attempt, blocks)
        elif t.attempt != req.attempt:  # moved: its current canvas replays from its first step where it went
            t.attempt, t.steps, t.levels, t.moved = req.attempt, 0, {}, True
        return t

    def observe(self, stepped: Sequence[tuple[RequestState, bool, bool]]) -> None:
        """An instance's round: (request, its next step is heavy, finished) per request that stepped, progress
        fields written, ``next_heavy`` still the kind of the step just taken (``Router.on_step`` calls it first)."""
        for req, _, finished in stepped:
            t = self._track(req, max(1, -(-req.output_tokens // max(req.block_tokens, 1))))
            # it denoised, unless it was a prefill (encodes only): a block-causal request's first step wherever it
            # was placed (the router keeps no step kind across a move for one)
            prefill = not req.full_sequence and (req.next_heavy or t.moved)
            t.moved = False
            if not prefill:
                level = round(float(req.threshold if req.threshold is not None else self.thresholds[0]), 4)
                t.steps += 1
                t.levels[level] = t.levels.get(level, 0) + 1
            left = req.blocks_left
            if finished or left < t.blocks:
                if t.steps:
                    # another canvas followed unless it finished; a finish in the budget's last canvas says nothing
                    own = req.step_cap is not None and req.step_cap != self.step_cap
                    self.record(max(t.levels.items(), key=lambda kv: kv[1])[0], t.steps,
                                None if finished and t.blocks <= 1 else not finished, steps_count=not own)
                t.blocks, t.steps, t.levels = left, 0, {}

    def record(self, level: float, steps: int, followed: bool | None = None, steps_count: bool = True) -> None:
        """A canvas took ``steps`` denoising steps at ``level``; ``followed``: whether another canvas of its
        request came after it (None: unknown, e.g. it was the budget's last); ``steps_count``: False for a canvas
        cut at a request's own cap (only ``followed`` is kept: ``own_cap_canvases`` counts them)."""
        if followed is not None:
            if len(self._next) == self._next.maxlen:
                self._followed -= self._next[0]
            self._next.append(bool(followed))
            self._followed += bool(followed)
        if not steps_count:
            self.own_cap_canvases += 1
            return
        key = round(float(level), 4)
        q = self._steps.get(key)
        if q is None:
            q = self._steps[key] = deque(maxlen=self.window)
            self._sums[key] = 0
        if len(q) == q.maxlen:
            self._sums[key] -= q[0]
        q.append(int(steps))
        self._sums[key] += int(steps)
        self.canvases += 1

    def forget(self, req_id: str) -> None:
        self._tracks.pop(req_id, None)

    # ---- estimates ------------------------------------------------------------------------------
    def per_canvas(self, cap: int | None = None) -> list[float]:
        """Expected steps of a canvas at each candidate level (highest first): the mean measured at the level;
        between two measured levels, interpolated linearly in the level; below the lowest measured level, its
        mean (a lower level is no slower); above the highest, the step cap (the prior). Non-increasing as the
        level falls. ``cap``: a request's own step cap (the prior, and a bound on every level's)."""
        cap = self.step_cap if cap is None else int(cap)
        measured = sorted((lv, self._sums[lv] / len(q)) for lv, q in self._steps.items() if q)
        out = []
        for lv in self.thresholds:
            above = next(((mlv, m) for mlv, m in measured if mlv >= lv - 1e-9), None)
            below = next(((mlv, m) for mlv, m in reversed(measured) if mlv < lv - 1e-9), None)
            if above is None:
                v = float(cap)
            elif below is None or above[0] <= lv + 1e-9:
                v = above[1]
            else:
                w = (lv - below[0]) / (above[0] - below[0])
                v = below[1] + w * (above[1] - below[1])
            v = min(v, float(cap))
            out.append(min(v, out[-1]) if out else v)
        return out

    def p_next(self) -> float:
        """The chance that a canvas with budget left after it is followed by another: measured, or 1 (the whole
        budget: an upper bound) before ``min_outcomes`` canvases have said."""
        n = len(self._next)
        return self._followed / n if n >= max(self.min_outcomes, 1) else 1.0

    @staticmethod
    def later_canvases(p: float, n: int) -> float:
        """Expected canvases after the current one when each of up to ``n`` more follows with chance ``p``."""
        if n <= 0:
            return 0.0
        return float(n) if p >= 1.0 else p * (1.0 - p ** n) / (1.0 - p)

    def predict(self, states):
        p = self.p_next()
        by_cap: dict[int | None, list[float]] = {}  # the per-level steps per canvas, per request cap met
        out = []
        for s in states:
            spc = by_cap.get(s.step_cap)
            if spc is None:
                spc = by_cap[s.step_cap] = self.per_canvas(s.step_cap)
            t = self._track(s, max(s.blocks_left, 1))
            later = self.later_canvases(p, max(s.blocks_left, 1) - 1)
            out.append([max(v - t.steps, 1.0) + later * v for v in spc])
        return out

    @property
    def ready(self) -> bool:
        """Admission may shed on these estimates: ``measured_prior`` canvases measured (before, the step cap is
        an upper bound that would refuse requests that fit)."""
        return self.canvases >= self.measured_prior

    arrival_error = 0.0  # the admission test's allowance for an arrival's estimate (a measured mean: none)

    def describe(self) -> dict:
        """Per measured level its canvases and mean steps; the estimate per candidate level; the chance of a
        next canvas and how many canvases measured it."""
        n = len(self._next)
        return {"estimator": "canvas", "step_cap": self.step_cap, "canvases": self.canvases, "ready": self.ready,
                "own_cap_canvases": self.own_cap_canvases,
                "steps_per_canvas": {f"{lv:g}": {"canvases": len(q), "mean": round(self._sums[lv] / len(q), 3)}
                                     for lv, q in sorted(self._steps.items(), reverse=True) if q},
                "estimate": {f"{t:g}": round(v, 3) for t, v in zip(self.thresholds, self.per_canvas())},
                "next_canvas": {"p": round(self.p_next(), 3), "canvases": n,
                                "source": "measured" if n >= max(self.min_outcomes, 1) else "prior"}}
