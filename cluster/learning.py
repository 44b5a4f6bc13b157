"""The ingress's online predictors: the step and admission predictors learnt from the traffic it serves.

``LiveLearning`` holds an ``OnlineStepLearner`` (DiLaServe's step predictor: a request's state after a
step -> remaining denoising steps) and an ``OnlineAdmissionLearner`` (DWISE's admission predictor:
prompt features -> denoising rounds), and a ``RefitWorker`` that refits them in a worker process (a
thread here only hands it the new requests and swaps the answer in: no fit holds the ingress's GIL).
The dispatcher hands it each finished request with its decoding rule (``finished``: O(1) appends, then a
wake-up of the worker); the router reads the learners through ``OnlineStepEstimator`` at every estimate,
its rows built by ``cluster.thresholds.request_row`` (the request's step features, its rule's code and
its knob at each candidate level, and whether a grammar holds its text), so live-learned steps are a
function of (rule, knob, constraint); a
refit swaps a better model in atomically. Shipped predictors, when the mode allows them, are the learners'
starting point; without any, the learners' priors serve (measured tokens per step; one round per
block) until the first model, so every adaptive mechanism runs on any checkpoint.

Modes (``AppConfig.router.predictors``): ``auto`` (shipped when present, else learnt), ``shipped`` (shipped
only: no refits; the finished requests still score them), ``online`` (learnt from a cold start, shipped
ones ignored), ``off`` (no step estimates: the router keeps fixed thresholds).
"""

from __future__ import annotations

import logging

from predictors.online import OnlineAdmissionLearner, OnlineStepLearner
from predictors.refit_worker import RefitWorker

log = logging.getLogger(__name__)

MODES = ("auto", "shipped", "online", "off")


class LiveLearning:
    def __init__(self, step: OnlineStepLearner, admission: OnlineAdmissionLearner, learn: bool = True,
                 interval: int = 1) -> None:
        self.step, self.admission = step, admission
        self.learn = learn
        self.interval = interval  # the router re-predicts every ``interval`` steps (counts down between)
        self.worker = RefitWorker(step, admission) if learn else None
        self.recorded = 0

    def finished(self, rows: list[list[float]], row_steps: list[int], total_steps: int, admission_row: list[float],
                 blocks: float, last_threshold: float | None, decoding: str | None = None,
                 constrained: float = 0.0) -> None:
        """A request finished after ``total_steps`` denoising steps: its step rows (after each denoising step
        but the last; ``row_steps[k]`` the steps done at row k: the replica's 11 step features), its
        admission row and output blocks. ``decoding``: its rule (``RequestState.decoding``; default
        ``threshold``) and ``constrained`` (``RequestState.constrained``: 1 when a grammar holds its text):
        the step learner keeps each row with the rule's code and knob at the row's level and the constraint's
        column, the columns the router asks with (``cluster.thresholds.request_row``)."""
        self.step.record(rows, row_steps, total_steps, last_threshold=last_threshold, decoding=decoding,
                         constrained=constrained)
        self.admission.record(admission_row, total_steps, blocks)
        self.recorded += 1
        if self.worker is not None:  # without learning the records only score the predictors in service
            self.worker.notify()

    def describe(self) -> dict:
        """``GET /debug/predictors``: per predictor, source (prior | shipped | online), version, requests
        trained on, and its error on the most recent finished requests."""
        out = {"step": self.step.describe(), "admission": self.admission.describe(), "learning": self.learn,
               "recorded": self.recorded}
        if self.worker is not None:
            w = self.worker
            out.update(refits=w.refits, refit_errors=w.errors, worker_alive=w.alive, worker_pid=w.pid,
                       worker_restarts=w.restarts)
            # when the last refits ran (wall clock), for the event-loop lag while refitting
            out["refit_windows"] = sorted([r["started"], r["ended"]] for learner in (self.step, self.admission)
                                          for r in learner.history[-100:] if "started" in r)
        return out

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()


def build_learning(mode: str, model: str, thresholds, default_blocks: float = 1.0) -> LiveLearning:
    """The learners for ``mode``; the step estimate's interval is the shipped step predictor's, else 1.
    ``shipped`` raises ``PredictorError`` when the model has none."""
    if mode not in MODES or mode == "off":
        raise ValueError(f"predictors mode {mode!r} has no learners; known: {', '.join(MODES)}")
    shipped = None
    if mode in ("auto", "shipped"):
        from predictors.bundle import PredictorError, load_predictors

        try:
            shipped = load_predictors(model)
        except PredictorError as exc:
            if mode == "shipped":
                raise
            log.info("no shipped predictors (%s): learning them from the traffic served", exc)
    step = OnlineStepLearner(thresholds, start=None if shipped is None else shipped.step)
    admission = OnlineAdmissionLearner(default_blocks=default_blocks, start=None if shipped is None
                                       else shipped.admission)
    interval = shipped.step.interval if shipped is not None else 1
    return LiveLearning(step, admission, learn=mode != "shipped", interval=interval)
