"""Ingress deployment: the OpenAI-compatible HTTP API (one replica), a thin Ray Serve shell.

Each replica builds one ``app.frontend.Frontend`` from the application's config (keys, tokenizer, the
``Dispatcher`` hosting the cluster router, metrics, the planner service and the completion service) and serves
the routes of ``app.routes``, which only ask it for their answers. Each Denoiser replica registers its control
channel here (``register``, over Ray); the app-level autoscaling policy reads ``record_autoscaling_stats``.
"""

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import AppConfig
from app.frontend import Frontend
from app.routes import build_web


def _front() -> Frontend:
    """The Frontend of the Ingress replica serving this request."""
    return serve.get_replica_context().servable_object.front


web = build_web(_front)  # its middleware is in place before @serve.ingress freezes a copy of it


@serve.deployment(num_replicas=1, max_ongoing_requests=4096)
@serve.ingress(web)
class Ingress:
    def __init__(self, denoisers: dict[int, DeploymentHandle], cfg: AppConfig) -> None:
        self.front = Frontend(cfg, denoisers, tune_process=True)

    async def register(self, info: dict) -> int:
        """A Denoiser replica announces its control channel and the latency profile it measured."""
        return await self.front.register(info)

    async def record_autoscaling_stats(self) -> dict:
        """The planner's replica-count targets, read by the app-level autoscaling policy."""
        return await self.front.record_autoscaling_stats()
