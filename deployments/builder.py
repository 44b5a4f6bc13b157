"""``build_app``: the import_path of serve_config.yaml."""

from __future__ import annotations

from app.config import INGRESS, AppConfig, denoiser_name


def pin_model(cfg: AppConfig) -> AppConfig:
    """A hub id in ``engine.model`` resolved once, here, before any replica starts (downloaded into the hub
    cache when missing): the deployments receive its snapshot directory, whose path names the repo and the
    commit (a node without it resolves that same commit: ``engine.loading.resolve_model``), and serve it under
    the hub id unless ``http.served_model_name`` says otherwise. Any other model is returned as it is."""
    from engine.models.hub import is_hub_id

    e = cfg.engine
    if not is_hub_id(e.model):
        return cfg
    from engine.loading import resolve_model

    path = resolve_model(e.model, e.revision)
    return cfg.model_copy(update={"engine": e.model_copy(update={"model": str(path)}),
                                  "http": cfg.http.model_copy(update={"served_model_name": cfg.name})})


def build_app(args: dict | AppConfig | None):
    """One Denoiser deployment per TP degree and the Ingress in front of them. ``args``: serve_config.yaml's
    ``args`` (validated here, once: every deployment receives the ``AppConfig`` itself) or an ``AppConfig``."""
    from deployments.denoiser import Denoiser
    from deployments.ingress import Ingress

    cfg = pin_model(args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {}))
    res = cfg.resources
    handles = {}
    initial = None
    grace = res.drain_s + 10.0  # Serve kills a stopping replica after this: drain first (resources.drain_s)
    if cfg.planner is not None:
        from app.autoscaling import initial_counts

        initial = initial_counts(cfg)
    # a rank's GPUs (a fraction of one when replicas share GPUs: a new replica loads beside the one it replaces)
    gpus = {"GPU": res.gpus_per_rank} if res.gpus_per_rank else {}
    for d in res.tp_degrees:
        bundles = [{"CPU": res.cpus_per_replica, **gpus}] + [{"CPU": 0.01, **gpus}] * (d - 1)
        if initial is None:
            scaling = {"num_replicas": res.replicas.get(d, 1)}
        else:  # the planner sets the count (app.autoscaling); the deployment's own policy holds it
            # make-before-break: while new replicas load beside old ones, a GPU holds up to two
            most = max(cfg.planner.gpus // d, 1) * (2 if cfg.planner.make_before_break else 1)
            scaling = {"autoscaling_config": {
                "min_replicas": 0, "max_replicas": most, "initial_replicas": initial[d],
                "metrics_interval_s": 1.0, "look_back_period_s": 2.0, "upscale_delay_s": 0.0,
                "downscale_delay_s": 0.0, "policy": {"policy_function": "app.autoscaling:hold_policy"}}}
        dep = Denoiser.options(name=denoiser_name(d), placement_group_bundles=bundles,
                               placement_group_strategy="PACK", graceful_shutdown_timeout_s=grace, **scaling,
                               ray_actor_options={"num_cpus": res.cpus_per_replica,
                                                  **({"num_gpus": res.gpus_per_rank} if res.gpus_per_rank else {})})
        handles[d] = dep.bind(cfg, d)
    ingress = Ingress.options(name=INGRESS, graceful_shutdown_timeout_s=grace,  # open streams end before it stops
                              max_ongoing_requests=cfg.http.max_ongoing,
                              max_queued_requests=cfg.http.max_queued,
                              backpressure_config={"status_code": 429, "retry_after_s": 1})
    if initial is not None:  # one replica, autoscaled only so that its metrics reach the policy
        ingress = ingress.options(autoscaling_config={
            "min_replicas": 1, "max_replicas": 1, "metrics_interval_s": 1.0, "look_back_period_s": 2.0,
            "policy": {"policy_function": "app.autoscaling:hold_policy"}})
    return ingress.bind(handles, cfg)
