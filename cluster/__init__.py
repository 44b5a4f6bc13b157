"""The cluster control, pure Python (no torch, no ray): the cluster driver (``driver``: the one door the live
dispatcher and the simulator both go through), the router core (DiLaServe's Alg. 1-3: ``router``,
``policies``, ``state``, ``thresholds``), admission, step estimators, the TP latency model, capacity,
placement, the transition follower and the online learners' wiring (``learning``)."""

from __future__ import annotations

from cluster.admission import AdmissionGovernor
from cluster.estimator import (
    CanvasStepEstimator,
    FeatureStepEstimator,
    OnlineStepEstimator,
    StepEstimator,
    TableStepEstimator,
)
from cluster.latency import StepShape, TpLatencyModel
from cluster.policies import ROUTER_POLICIES, RouterPolicy, make_router_policy
from cluster.router import Router, RouterConfig
from cluster.state import InstanceState, RequestState

__all__ = ["Router", "RouterConfig", "StepEstimator", "TableStepEstimator", "FeatureStepEstimator",
           "OnlineStepEstimator", "CanvasStepEstimator", "AdmissionGovernor", "TpLatencyModel", "StepShape",
           "ROUTER_POLICIES", "RouterPolicy", "make_router_policy", "InstanceState", "RequestState"]
