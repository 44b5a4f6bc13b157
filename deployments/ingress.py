"""Ingress deployment: the OpenAI-compatible HTTP API (one replica).

It validates requests and hands them to the ``Dispatcher`` (``app.dispatch``),
which hosts the cluster router: placement and migration across every
Denoiser replica of every TP degree, per-step thresholds under load control,
and resuming the requests of a replica that dies. Each Denoiser replica
registers its control channel here (``register``); progress comes back as
one batch per round and each request's committed text streams to its client.
"""

# no `from __future__ import annotations`: FastAPI must see the real Request type

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from app import api
from app.auth import ApiKey, Keyring
from app.config import AppConfig
from app.control import ControlTimer
from app.metrics import Metrics

web = FastAPI(title="Remask", description="OpenAI-compatible serving of diffusion language models")


# every error, the framework's own included, gets an OpenAI-style body
@web.exception_handler(api.APIError)
async def _api_error(request: Request, err: api.APIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)


@web.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    err = (api.not_found_error(f"Unknown request URL: {request.method} {request.url.path}.")
           if exc.status_code == 404 else api.APIError(exc.status_code, str(exc.detail), headers=exc.headers))
    return await _api_error(request, err)


@web.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = (exc.errors() or [{}])[0]
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return await _api_error(request, api.invalid(f"Invalid value for '{param}': {first.get('msg', 'invalid')}.",
                                                 param=param, code="invalid_value"))


class _Stream(StreamingResponse):
    """A streamed response that calls ``on_close`` once sent, whether the stream ended, failed, was never
    started or its client went away (a generator's ``finally`` does not run if it never started)."""

    def __init__(self, content, on_close, **kw) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


@serve.deployment(num_replicas=1, max_ongoing_requests=4096)
@serve.ingress(web)
class Ingress:
    def __init__(self, denoisers: dict[int, DeploymentHandle], config: dict) -> None:
        from app.dispatch import Dispatcher, build_router
        from engine.loading import resolve_model
        from engine.models.loader import load_config
        from engine.tokenizer import load_tokenizer

        self.cfg = AppConfig(**config)
        self.keys = Keyring.from_specs(self.cfg.api_keys)  # reads key_env / key_file here, in the replica
        self.denoisers = {int(k): v for k, v in denoisers.items()}  # keeps the deployments in the app
        path = resolve_model(self.cfg.model)
        self.model_cfg = load_config(path)
        self.tokenizer = load_tokenizer(path)
        self.metrics = Metrics()
        self.control = ControlTimer()
        self.dispatcher = Dispatcher(
            build_router(self.cfg, self.model_cfg), self.tokenizer.decode, block_tokens=self.model_cfg.block_size,
            full_sequence=self.model_cfg.attention != "block_causal",
            per_instance_limit=self.cfg.slots * 8 + self.cfg.max_waiting, default_slo_s=self.cfg.default_slo_ms / 1e3,
            dead_after_s=self.cfg.dead_after_s, park_s=self.cfg.park_s, shed_over_capacity=self.cfg.shed_over_capacity,
            on_batch=self._on_batch, on_migration=self.metrics.migration)
        self.planner = None
        if self.cfg.planner is not None:  # the TP groups' sizes follow the planner (app.autoscaling)
            from app.autoscaling import build_service

            self.planner = build_service(self.cfg, self.model_cfg)
            self.dispatcher.on_arrival = self.planner.observe
            self.dispatcher.on_instances = self.planner.set_live
            self.planner.start()
        self.started = time.time()
        self._document()

    def _document(self) -> None:
        """The OpenAPI document (``/openapi.json``) with this application's model, max_tokens limit and auth."""
        doc = web.openapi()
        for path, kind in (("/v1/completions", "completion"), ("/v1/chat/completions", "chat")):
            doc["paths"][path]["post"].update(api.openapi_body(kind, self.cfg.name, self.cfg.max_tokens_limit))
        if self.keys.enabled:
            doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, ops in doc["paths"].items():
                if path.startswith(("/v1/", "/debug/")):
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]

    def _authorize(self, request: Request) -> ApiKey:
        """The caller of a /v1/* or /debug/* request (401 unless its Bearer key is configured, when any are)."""
        try:
            return self.keys.authenticate(request.headers.get("authorization"))
        except api.APIError:
            self.metrics.rejected("unauthorized")
            raise

    async def _body(self, request: Request) -> bytes:
        """The request body, at most ``max_body_bytes`` (413 past it, before reading the rest)."""
        limit = self.cfg.max_body_bytes
        api.check_content_length(request.headers.get("content-length"), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise api.body_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def register(self, info: dict) -> int:
        """A Denoiser replica announces its control channel (called over Ray, not HTTP)."""
        return await self.dispatcher.connect(info["replica"], int(info["tp"]), info["host"], int(info["port"]),
                                             info["secret"],
                                             meta={"actor": info.get("actor"), "workers": info.get("workers", [])})

    # ---- endpoints ----------------------------------------------------------------------
    @web.get("/health")
    async def health(self):
        ready = sorted({i.tp for i in self.dispatcher.instances.values()})
        body = {"status": "ok" if ready else "starting", "model": self.cfg.name, "tp_degrees": sorted(self.denoisers),
                "instances": len(self.dispatcher.instances), "ready_tp_degrees": ready}
        return JSONResponse(body, status_code=200 if ready else 503)

    def record_autoscaling_stats(self) -> dict:
        """The planner's replica-count targets, read by the app-level autoscaling policy."""
        return self.planner.metrics() if self.planner is not None else {}

    @web.get("/debug/planner")
    async def planner_state(self) -> dict:
        """The planner's targets, the joined instances, the transition under way and the last decision."""
        return self.planner.describe() if self.planner is not None else {"enabled": False}

    @web.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return api.models_response([self.cfg.name])

    @web.get("/metrics")
    async def metrics(self) -> Response:
        body, ctype = self.metrics.render()
        return Response(body, media_type=ctype)

    @web.get("/debug/control")
    async def control_stats(self, request: Request, since: int = 0) -> dict:
        """Control-path timing: progress-event delivery (round loop -> ingress) since event ``since``."""
        self._authorize(request)
        return self.control.summary(since)

    @web.get("/debug/instances")
    async def instances(self, request: Request) -> dict:
        """Every instance's state as its last progress batch or tick reported it, and the dispatcher's counts."""
        self._authorize(request)
        return {"instances": self.dispatcher.describe(), "dispatch": self.dispatcher.stats,
                "router": {**self.dispatcher.router.stats,
                           "latency_scale": round(self.dispatcher.router.latency.scale, 3),
                           "admission_util": round(self.dispatcher.governor.util, 3),
                           "admission_cuts": self.dispatcher.governor.cuts},
                "live": len(self.dispatcher.live),
                "parked": len(self.dispatcher.parked)}

    @web.post("/v1/completions", openapi_extra=api.openapi_body("completion"))
    async def completions(self, request: Request):
        return await self._serve("completion", request)

    @web.post("/v1/chat/completions", openapi_extra=api.openapi_body("chat"))
    async def chat_completions(self, request: Request):
        return await self._serve("chat", request)

    # ---- one request ---------------------------------------------------------------------
    async def _serve(self, kind: str, request: Request):
        """Authenticate, hold one of the key's concurrent slots until the response is sent, and serve."""
        key = self._authorize(request)
        try:
            lease = self.keys.acquire(key)
        except api.APIError:
            self.metrics.rejected("key_concurrency")
            raise
        try:
            response = await self._generate(kind, request, key)
        except BaseException:
            lease.release()
            raise
        if isinstance(response, _Stream):
            cancel = response.on_close
            response.on_close = lambda: (lease.release(), cancel())
        else:
            lease.release()
        return response

    def _parse(self, kind: str, body: bytes, key: ApiKey) -> tuple[api.GenRequest, int]:
        req = api.parse_request(kind, body, known_models=[self.cfg.name],
                                max_tokens_limit=key.max_tokens_limit(self.cfg.max_tokens_limit),
                                default_max_tokens=self.cfg.default_max_tokens
                                or int(self.model_cfg.extra.get("gen_length", 128)))
        n_prompt = len(self.tokenizer.prompt_ids(req.prompt, self.model_cfg.block_size))
        key.check_prompt(n_prompt)
        limit, b = self.model_cfg.max_position_embeddings, self.model_cfg.block_size
        if n_prompt + -(-req.max_tokens // b) * b > limit:  # the engine's canvas is whole blocks
            raise api.APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                                    f"model's context of {limit} tokens", param="prompt",
                               code="context_length_exceeded")
        return req, n_prompt

    async def _generate(self, kind: str, request: Request, key: ApiKey):
        from app.dispatch import DispatchError

        try:
            req, n_prompt = self._parse(kind, await self._body(request), key)
            stream = self.dispatcher.submit(req.request_id, req.prompt, n_prompt, req.max_tokens,
                                            threshold=req.threshold, slo_ms=req.slo_ms, priority=req.priority)
        except api.APIError as err:
            self.metrics.rejected("invalid")
            return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)
        except DispatchError as exc:
            return self._refused(exc.status, str(exc))
        self.metrics.request_started()
        try:
            first = await stream.__anext__()
        except BaseException:
            stream.cancel()
            raise
        if first["type"] == "error":
            self.metrics.request_finished(None, 0.0, None, 0, req.threshold, ok=False)
            return self._refused(first.get("status", 500), first["message"])
        if req.stream:
            return _Stream(self._sse(req, stream), stream.cancel, media_type="text/event-stream")
        done = first
        try:
            async for event in stream:
                done = event
        finally:
            stream.cancel()  # a no-op once it ended; frees the request if this handler was cancelled
        if done["type"] != "done":
            self.metrics.request_finished(None, 0.0, None, 0, req.threshold, ok=False)
            return self._refused(done.get("status", 500), done.get("message", "generation failed"))
        self._finished(req, done)
        build = api.completion_response if kind == "completion" else api.chat_response
        return build(req, done["text"], done["finish_reason"], done["prompt_tokens"], done["completion_tokens"])

    def _refused(self, status: int, message: str) -> JSONResponse:
        self.metrics.rejected({429: "overload", 400: "invalid"}.get(status, "error"))
        kind = {429: "rate_limit_error", 400: "invalid_request_error", 503: "service_unavailable"}.get(
            status, "server_error")
        err = api.APIError(status, message, type=kind, headers={"Retry-After": "1"} if status in (429, 503) else None)
        return JSONResponse(err.to_dict(), status_code=status, headers=err.headers)

    async def _sse(self, req: api.GenRequest, stream):
        chat = req.kind == "chat"
        done = None
        try:
            if chat:
                yield api.sse(api.chat_chunk(req, role=True))
            async for event in stream:
                if event["type"] == "delta":
                    chunk = api.chat_chunk(req, event["text"]) if chat else api.completion_chunk(req, event["text"])
                    yield api.sse(chunk)
                elif event["type"] == "done":
                    done = event
                    end = (api.chat_chunk(req, finish_reason=event["finish_reason"]) if chat
                           else api.completion_chunk(req, "", event["finish_reason"]))
                    yield api.sse(end)
                    if req.include_usage:
                        yield api.sse(api.usage_chunk(req, event["prompt_tokens"], event["completion_tokens"]))
                else:
                    yield api.sse({"error": {"message": event.get("message", "generation failed"),
                                             "type": "server_error", "param": None, "code": event.get("status")}})
            yield api.sse("[DONE]")
        finally:
            if done is not None:
                self._finished(req, done)
            else:  # the client disconnected or the request failed: free it on its instance
                stream.cancel()
                self.metrics.request_finished(None, 0.0, None, 0, req.threshold, ok=False)

    def _on_batch(self, batch: dict, now: float) -> None:
        if batch.get("items"):
            ms = self.control.batch(batch)
            if ms is not None:
                self.metrics.control.observe(ms / 1e3)
            stepped = sum("steps" in item for item in batch["items"])
            if stepped:
                self.metrics.round_observed(stepped)
        views = [i.stats for i in self.dispatcher.instances.values()]
        self.metrics.set_queue(sum(v.get("running", 0) for v in views), sum(v.get("waiting", 0) for v in views))

    def _finished(self, req: api.GenRequest, done: dict) -> None:
        slo_met = None if req.slo_ms is None else done["e2e_s"] * 1000 <= req.slo_ms
        self.metrics.request_finished(done["ttft_s"], done["e2e_s"], slo_met, done["rounds"], done.get("threshold"),
                                      ok=True)
