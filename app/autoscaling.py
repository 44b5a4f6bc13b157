"""Serve's side of planner-driven autoscaling: the autoscaling policies, and the replicas at start.

The targets come from the planner beside the ingress (``app.planner_service.PlannerService``), which the
Ingress reports as custom autoscaling metrics (``record_autoscaling_stats``: ``target_tp<d>``).

``planner_policy`` is the application-level ``autoscaling_policy`` (set it in
the serve config: ``autoscaling_policy: {policy_function:
app.autoscaling:planner_policy}``). It runs in Serve's controller, reads the
Ingress replica's latest ``target_tp<d>`` values, and returns them as the
replica counts of the ``Denoiser_TP<d>`` deployments. The planner itself never
runs on the controller's control loop; the policy only reads a cached
decision.

``hold_policy`` is the Denoisers' deployment-level policy: it keeps their count, so that only
``planner_policy`` changes it. ``initial_counts``: the replicas per TP degree an app starts with.
"""

from __future__ import annotations

from app.config import INGRESS, AppConfig, denoiser_tp


def initial_counts(cfg: AppConfig) -> dict[int, int]:
    """Replicas per TP degree at start: ``resources.replicas`` where given, else every GPU in the smallest
    degree."""
    degrees, replicas = cfg.resources.tp_degrees, cfg.resources.replicas
    if replicas:
        counts = {d: replicas.get(d, 0) for d in degrees}
    else:
        counts = {d: 0 for d in degrees}
        counts[degrees[0]] = cfg.planner.gpus // degrees[0]
    used = sum(d * n for d, n in counts.items())
    if used > cfg.planner.gpus:
        raise ValueError(f"initial replicas {counts} need {used} GPUs; the planner's cluster has {cfg.planner.gpus}")
    return counts


# ---- Serve's side (runs in the controller) ---------------------------------------------------------
def _latest(ctx, name: str) -> float | None:
    """The newest value of a custom metric over the context's replicas (raw series first)."""
    try:
        raw = ctx.raw_metrics or {}
    except Exception:  # lazily evaluated; a failure here means no data yet
        raw = {}
    series = raw.get(name)
    if series:
        points = [p for values in series.values() for p in values]
        if points:
            return float(max(points, key=lambda p: p.timestamp).value)
    agg = (ctx.aggregated_metrics or {}).get(name)
    if agg:
        return float(max(agg.values()))
    return None


def planner_policy(contexts: dict) -> tuple[dict, dict]:
    """Application-level autoscaling policy: Denoiser_TP<d> replicas = the Ingress's ``target_tp<d>``."""
    ingress = next((c for c in contexts.values() if c.deployment_name == INGRESS), None)
    decisions, state = {}, {}
    for dep_id, ctx in contexts.items():
        state[dep_id] = {}
        decisions[dep_id] = ctx.target_num_replicas
        tp = denoiser_tp(ctx.deployment_name)
        if tp is not None and ingress is not None:
            target = _latest(ingress, f"target_tp{tp}")
            if target is not None:
                decisions[dep_id] = int(round(target))
    return decisions, state


def hold_policy(ctx) -> tuple[int, dict]:
    """Deployment-level fallback for the Denoisers: keep the current count (only the application-level
    ``planner_policy`` changes it). Without it Serve's default policy would scale replicas that receive
    no Serve requests down to their minimum."""
    return ctx.target_num_replicas, {}
