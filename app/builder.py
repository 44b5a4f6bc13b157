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
    for d in cfg.tp_degrees:
        bundles = [{"CPU": cfg.cpus_per_replica, **({"GPU": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})}]
        bundles += [{"CPU": 0.01, **({"GPU": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})}] * (d - 1)
        dep = Denoiser.options(name=f"Denoiser_TP{d}", num_replicas=cfg.replicas.get(d, 1),
                               placement_group_bundles=bundles, placement_group_strategy="PACK",
                               ray_actor_options={"num_cpus": cfg.cpus_per_replica,
                                                  **({"num_gpus": cfg.gpus_per_rank} if cfg.gpus_per_rank else {})})
        handles[d] = dep.bind(config, d)
    return Ingress.bind(handles, config)
