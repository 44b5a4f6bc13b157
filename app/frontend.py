"""The HTTP front of one application, outside Ray Serve: :class:`Frontend` holds what the Ingress replica
serves with (keys, tokenizer, the dispatcher and its cluster driver, metrics, the planner service, the
completion service); ``app.routes.build_web`` is the FastAPI app whose routes call it. The Ingress deployment
(``deployments/ingress.py``) builds one ``Frontend`` per replica and serves ``build_web``'s app; a test serves
the same app around a ``Frontend`` of its own, without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from app import api, gc_pauses, playground
from app.auth import Keyring, RateLimits
from app.completions import CompletionService
from app.config import AppConfig
from app.control_timer import ControlTimer
from app.gate import Gate
from app.metrics import Metrics
from app.protocol import ProgressBatch, StepItem

log = logging.getLogger(__name__)
GIL_SWITCH_S = 0.001  # the ingress process's GIL switch interval (Python's default: 0.005)


class Described:
    """A planner's ``describe()`` answer, read beforehand off the event loop (``playground.cluster_view``)."""

    def __init__(self, plan: dict) -> None:
        self._plan = plan

    def describe(self) -> dict:
        return self._plan


class Frontend:
    """One application's front: built from its config as the Ingress replica starts (``denoisers``: the
    deployments' handles by TP degree, kept so the app holds them)."""

    def __init__(self, cfg: AppConfig, denoisers: dict | None = None, *, tune_process: bool = False) -> None:
        from app.dispatch import Dispatcher
        from cluster.factory import build_router
        from cluster.learning import build_learning
        from engine.loading import engine_rule, is_canvas_model, resolve_model
        from engine.models.loader import load_config
        from engine.tokenizer import load_tokenizer

        self.cfg = cfg
        http = cfg.http
        self.keys = Keyring.from_specs(  # reads key_env / key_file here, in the replica
            http.api_keys, defaults=RateLimits(http.requests_per_second, http.request_burst, http.tokens_per_minute),
            max_priority_without_key=http.max_priority_without_key)
        self.denoisers = {int(k): v for k, v in (denoisers or {}).items()}
        path = resolve_model(cfg.engine.model)
        self.model_cfg = load_config(path)
        self.tokenizer = load_tokenizer(path)
        self.metrics = Metrics(model_name=cfg.name)
        self.gate = Gate(self.keys, self.metrics, http)
        self.control = ControlTimer()
        self.outcomes = playground.RecentOutcomes()  # SLO met/missed over the last minutes (the playground)
        # the step and admission predictors, learnt from the traffic served (cluster.learning); for canvas
        # replicas (DiffusionGemma) the router learns steps per canvas per level itself, its prior the step cap of
        # the replicas' rule (cluster.estimator.CanvasStepEstimator)
        rc, ec = cfg.router, cfg.engine
        canvas_steps = (engine_rule(path, ec.decoding, ec.decoding_config).max_denoising_steps
                        if is_canvas_model(path) else None)
        self.learning = (None if rc.predictors == "off" or canvas_steps is not None
                         else build_learning(rc.predictors, ec.model, rc.thresholds))
        self.dispatcher = Dispatcher(
            build_router(cfg, self.model_cfg, self.learning, canvas_steps), self.tokenizer.decode,
            block_tokens=self.model_cfg.block_size,
            full_sequence=self.model_cfg.attention != "block_causal",
            per_instance_limit=ec.slots * 8 + ec.max_waiting, default_slo_s=rc.default_slo_ms / 1e3,
            dead_after_s=rc.dead_after_s, park_s=rc.park_s, shed_over_capacity=rc.shed_over_capacity,
            on_batch=self.on_batch, on_migration=self.metrics.migration, learning=self.learning)
        self._lag_task: asyncio.Task | None = None  # the event-loop lag probe, started with the first request
        self._planner = None
        if cfg.planner is not None:  # the TP groups' sizes follow the planner (app.planner_service)
            from app.planner_service import build_service

            planner = build_service(cfg, self.model_cfg)
            # arrivals are queued without a lock; the calls that take the planner's lock (which a solve holds)
            # run in one thread of their own, in order, never on the event loop
            self._planner_calls = ThreadPoolExecutor(1, thread_name_prefix="remask-planner-calls")
            self.dispatcher.on_arrival = planner.observe
            self.dispatcher.on_instances = lambda counts: self._planner_calls.submit(planner.set_live, dict(counts))
            planner.start()
            self._planner = planner
        self.completions = CompletionService(cfg, self.model_cfg, self.tokenizer, self.dispatcher, self.gate,
                                             self.metrics, self.outcomes, self._planner)
        # the replicas' decoding rule (the server's over the checkpoint's): the router moves its knob
        self.dispatcher.default_decoding = self.completions.decoding_base.name
        self.started = time.time()
        self.gc_pauses = gc_pauses.PauseTimer(self.metrics.collected)
        if tune_process:
            gc_pauses.settle("ingress")
            # the event loop shares the GIL with Serve's replica thread, the tokenizer's and the learners' threads:
            # one of them busy holds it up to the switch interval (Python's default 5 ms) before the loop's turn
            sys.setswitchinterval(GIL_SWITCH_S)

    @property
    def planner(self):
        return self._planner

    @planner.setter
    def planner(self, value) -> None:  # the completion service feeds the same one
        self._planner = value
        self.completions.planner = value

    def document(self, doc: dict) -> None:
        """The OpenAPI document (``/openapi.json``) narrowed to this application's model, max_tokens limit and
        auth (in place)."""
        for path, kind in (("/v1/completions", "completion"), ("/v1/chat/completions", "chat"),
                           ("/tokenize", "tokenize"), ("/detokenize", "detokenize")):
            doc["paths"][path]["post"].update(api.openapi_body(kind, self.cfg.name, self.cfg.http.max_tokens_limit,
                                                               vocab_size=self.model_cfg.vocab_size,
                                                               max_n=self.cfg.http.max_n))
        if self.keys.enabled:
            doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, ops in doc["paths"].items():
                if path.startswith(("/v1/", "/debug/")):
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]

    async def register(self, info: dict) -> int:
        """A Denoiser replica announces its control channel (called over Ray, not HTTP), and the latency
        profile it measured at its start: the router's and the planner's for its TP degree, unless the
        config names a profile (``router.profile``, ``planner.profile``)."""
        if info.get("profile") and self.cfg.router.profile is None:  # a profile named in the config stays in use
            try:
                prof = self.dispatcher.measured_profile(int(info["tp"]), info["profile"])
                if prof is not None and self.planner is not None and self.cfg.planner.profile is None:
                    self._planner_calls.submit(self.planner.set_profile, int(info["tp"]), prof)  # takes its lock
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("replica %s sent an unreadable latency profile: %s", info.get("replica"), exc)
        return await self.dispatcher.connect(info["replica"], int(info["tp"]), info["host"], int(info["port"]),
                                             info["secret"],
                                             meta={"actor": info.get("actor"), "workers": info.get("workers", [])})

    async def record_autoscaling_stats(self) -> dict:
        """The planner's replica-count targets, read by the app-level autoscaling policy (in a thread: they
        wait for a solve under way)."""
        return await asyncio.to_thread(self.planner.metrics) if self.planner is not None else {}

    # ---- what the routes answer --------------------------------------------------------
    def health(self) -> tuple[dict, int]:
        ready = sorted({i.tp for i in self.dispatcher.instances.values()})
        body = {"status": "ok" if ready else "starting", "model": self.cfg.name, "tp_degrees": sorted(self.denoisers),
                "instances": len(self.dispatcher.instances), "ready_tp_degrees": ready}
        return body, 200 if ready else 503

    async def planner_state(self) -> dict:
        if self.planner is None:
            return {"enabled": False}
        return await asyncio.to_thread(self.planner.describe)  # it waits for a solve under way

    def models(self) -> dict:
        return api.models_response([self.cfg.name], max_model_len=self.completions.max_model_len)

    def model(self, model_id: str) -> dict:
        if model_id != self.cfg.name:
            raise api.APIError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                               type="not_found_error", param="model", code="model_not_found")
        return api.model_response(self.cfg.name, max_model_len=self.completions.max_model_len)

    async def tokenize(self, request) -> dict:
        """The token ids of a prompt or a chat, as a generation request would send them to the model."""
        self.gate.admit(request, self.gate.authorize(request))
        req = api.parse_tokenize(await self.gate.body(request), known_models=[self.cfg.name])
        b = self.model_cfg.block_size
        if req.messages is not None:
            kw = {"chat_template": self.cfg.http.chat_template} if self.cfg.http.chat_template else {}
            ids = await asyncio.to_thread(self.tokenizer.chat_ids, req.messages, b,
                                          add_generation_prompt=req.add_generation_prompt,
                                          add_special_tokens=req.add_special_tokens, **kw)
        elif req.add_special_tokens:
            ids = await asyncio.to_thread(self.tokenizer.completion_ids, req.prompt, b)
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt)
        return api.tokenize_response(ids, self.completions.max_model_len)

    async def detokenize(self, request) -> dict:
        self.gate.admit(request, self.gate.authorize(request))
        _, ids = api.parse_detokenize(await self.gate.body(request), known_models=[self.cfg.name],
                                      vocab_size=self.model_cfg.vocab_size)
        return api.detokenize_response(await asyncio.to_thread(self.tokenizer.decode, ids))

    async def cluster(self) -> dict:
        """The playground's cluster panel: instances per TP degree, slots filled, thresholds in use, SLO
        attainment over the last minute, the planner's last decision."""
        planner = None
        if self.planner is not None:  # its state waits for a solve under way: read it in a thread
            planner = Described(await asyncio.to_thread(self.planner.describe))
        return playground.cluster_view(self.dispatcher, planner, time.monotonic(), self.outcomes,
                                       slots=self.cfg.engine.slots)

    async def render_metrics(self) -> tuple[bytes, str]:
        self.cluster_gauges()  # as of now, between progress batches too
        # rendering every series takes milliseconds (2-20 ms measured): in a thread, not on the event loop
        return await asyncio.to_thread(self.metrics.render)

    async def predictors(self) -> dict:
        if self.learning is None:  # a router estimator that learns by itself (canvas replicas) says what it learnt
            steps = self.dispatcher.driver.estimator_state()
            return {"enabled": False} if steps is None else {"enabled": True, "step": steps}
        return await asyncio.to_thread(self.learning.describe)

    def instances(self) -> dict:
        d = self.dispatcher
        governor = d.driver.governor
        return {"instances": d.describe(), "dispatch": d.stats,
                "router": {**d.driver.counters(),
                           "admission_util": round(governor.util, 3), "admission_cuts": governor.cuts},
                "live": len(d.live), "parked": len(d.parked)}

    async def generate(self, kind: str, request):
        """``/v1/completions`` (``kind="completion"``) and ``/v1/chat/completions`` (``"chat"``)."""
        if self._lag_task is None:
            self._lag_task = asyncio.get_running_loop().create_task(self._probe_lag())
        return await self.completions.serve(kind, request)

    # ---- the cluster's gauges --------------------------------------------------------------
    async def _probe_lag(self, period_s: float = 0.01) -> None:
        """How late the event loop wakes up: a refit, a tokenization, a solve or a collection that held it shows
        here (and the collections timed since the last wake-up go to their histogram)."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(period_s)
            self.metrics.loop_lag(max(loop.time() - t - period_s, 0.0))
            self.gc_pauses.drain()

    def on_batch(self, batch: ProgressBatch, now: float) -> None:
        if batch.items:
            self.metrics.control_event(self.control.batch(batch) / 1e3)
            stepped = sum(type(item) is StepItem for item in batch.items)
            if stepped:
                self.metrics.round_observed(stepped)
        self.cluster_gauges()

    def cluster_gauges(self) -> None:
        """Running and waiting requests, KV usage (each instance's reported capacity) and the shed count."""
        self.metrics.set_cluster([i.stats for i in self.dispatcher.instances.values()],
                                 self.cfg.engine.kv_capacity_tokens or 0, self.dispatcher.stats["shed"])

