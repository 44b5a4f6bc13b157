"""Ray Serve deployments, thin shells over app/ and engine/: ``builder`` (build_app: validates the
``AppConfig`` once and binds the rest), ``ingress`` (the HTTP API and the dispatcher), ``denoiser`` (one
model instance per replica, rank 0 of its TP group), ``tp_worker`` (ranks 1..d-1) and ``startup`` (every
rank's engine from the config)."""
