"""The router an app serves with: latency profiles per TP degree and its step estimates."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cluster.router import Router

if TYPE_CHECKING:
    from cluster.learning import LiveLearning

log = logging.getLogger(__name__)


def build_router(cfg, model_cfg, learning: LiveLearning | None = None, canvas_steps: int | None = None) -> Router:
    """The router of an app (``AppConfig``) serving a model (``ModelConfig``): latency profiles per
    configured TP degree, and step estimates from ``learning`` (the online learners, which start from
    the shipped predictors when there are any); without it, from the shipped predictors alone, and
    without those (or with ``router.predictors: off``) the thresholds stay fixed: a dynamic policy needs
    step estimates. ``canvas_steps``: the replicas decode canvases (DiffusionGemma's ``renoise`` rule) with
    this step cap (its ``max_denoising_steps``): the estimates are ``CanvasStepEstimator``'s, steps per canvas
    per level learnt from the canvases served (the cap their prior), and ``learning`` is not used."""
    from cluster import OnlineStepEstimator, RouterConfig, StepShape, TpLatencyModel
    from cluster.estimator import CanvasStepEstimator
    from cluster.learning import build_learning
    from cluster.thresholds import request_row
    from engine.latency_profile import load_tp_profiles
    from predictors.bundle import PredictorError

    rc, degrees = cfg.router, cfg.resources.tp_degrees
    thresholds = tuple(sorted(rc.thresholds, reverse=True))
    shape = StepShape(block_tokens=model_cfg.block_size,
                      sequence_tokens=int(model_cfg.extra.get("gen_length", 128)) + 64,
                      full_sequence=model_cfg.attention != "block_causal")
    latency = TpLatencyModel(load_tp_profiles(cfg.profile_name(), degrees), cfg.engine.slots, shape)
    policy = rc.policy
    if canvas_steps is not None and rc.predictors != "off":
        rcfg = RouterConfig(thresholds=thresholds, fixed_threshold=thresholds[0])
        return Router(policy, latency, CanvasStepEstimator(thresholds, canvas_steps), [], rcfg)
    if learning is None and rc.predictors != "off":
        try:
            learning = build_learning("shipped", cfg.engine.model, thresholds, 1.0)
        except PredictorError as exc:
            log.warning("no step predictor (%s)", exc)
    if learning is not None:
        # rows with the request's rule, its knob at each level and its constraint: the columns the step learner
        # records
        estimator = OnlineStepEstimator(learning.step, thresholds, row=request_row, admission=learning.admission)
    else:
        estimator = BlocksLeft(thresholds)
        if policy not in ("fixed-threshold", "infaas", "llumnix"):
            log.warning("no step estimates: router policy %r falls back to fixed-threshold", policy)
            policy = "fixed-threshold"
    every = learning.interval if learning is not None else 1
    rcfg = RouterConfig(thresholds=thresholds, fixed_threshold=thresholds[0], estimate_every=every)
    return Router(policy, latency, estimator, [], rcfg)


class BlocksLeft:
    """Step estimate without a trained predictor: one step per block left (a lower bound)."""

    def __init__(self, thresholds) -> None:
        self.thresholds = tuple(thresholds)

    def predict(self, states):
        return [[float(s.blocks_left)] * len(self.thresholds) for s in states]
