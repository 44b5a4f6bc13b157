"""The cluster router core (DiLaServe's Alg. 1-3): pure Python, no torch, no ray."""

from __future__ import annotations

from app.router.admission import AdmissionGovernor, foreseen_miss
from app.router.core import Router, RouterConfig
from app.router.estimator import FeatureStepEstimator, OnlineStepEstimator, StepEstimator, TableStepEstimator
from app.router.latency import StepShape, TpLatencyModel
from app.router.policies import ROUTER_POLICIES, RouterPolicy, make_router_policy
from app.router.state import InstanceState, RequestState

__all__ = ["Router", "RouterConfig", "StepEstimator", "TableStepEstimator", "FeatureStepEstimator",
           "OnlineStepEstimator", "AdmissionGovernor", "foreseen_miss", "TpLatencyModel", "StepShape",
           "ROUTER_POLICIES", "RouterPolicy", "make_router_policy", "InstanceState", "RequestState"]
