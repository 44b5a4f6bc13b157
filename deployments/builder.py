"""``build_app``: the import_path of serve_config.yaml."""

from __future__ import annotations

from app.config import AppConfig


def build_app(args: dict):
    """One Denoiser deployment per TP degree and the Ingress in front of them."""
    from deployments.denoiser import Denoiser
    from deployments.ingress import Ingress

    cfg = AppConfig(**(args or {}))
    config = cfg.model_dump()
    handles = {}
    initial = None
    grace = cfg.drain_s + 10.0  # Serve kills a stopping replica after this: drain first (AppConfig.drain_s)
    if cfg.planner is not None:
        from app.autoscaling import initial_counts

        initial = initial_counts(cfg)
    for d in cfg.tp_degrees:
        bundles = [{"CPU": cfg.cpus_per_replica, **({"GPU": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})}]
        bundles += [{"CPU": 0.01, **({"GPU": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})}] * (d - 1)
        if initial is None:
            scaling = {"num_replicas": cfg.replicas.get(d, 1)}
        else:  # the planner sets the count (app.autoscaling); the deployment's own policy holds it
            scaling = {"autoscaling_config": {
                "min_replicas": 0, "max_replicas": max(cfg.planner.gpus // d, 1), "initial_replicas": initial[d],
                "metrics_interval_s": 1.0, "look_back_period_s": 2.0, "upscale_delay_s": 0.0,
                "downscale_delay_s": 0.0, "policy": {"policy_function": "app.autoscaling:hold_policy"}}}
        dep = Denoiser.options(name=f"Denoiser_TP{d}", placement_group_bundles=bundles,
                               placement_group_strategy="PACK", graceful_shutdown_timeout_s=grace, **scaling,
                               ray_actor_options={"num_cpus": cfg.cpus_per_replica,
                                                  **({"num_gpus": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})})
        handles[d] = dep.bind(config, d)
    ingress = Ingress.options(graceful_shutdown_timeout_s=grace,  # open streams end before it stops
                              max_ongoing_requests=cfg.ingress_max_ongoing,
                              max_queued_requests=cfg.ingress_max_queued,
                              backpressure_config={"status_code": 429, "retry_after_s": 1})
    if initial is not None:  # one replica, autoscaled only so that its metrics reach the policy
        ingress = ingress.options(autoscaling_config={
            "min_replicas": 1, "max_replicas": 1, "metrics_interval_s": 1.0, "look_back_period_s": 2.0,
            "policy": {"policy_function": "app.autoscaling:hold_policy"}})
    return ingress.bind(handles, config)
