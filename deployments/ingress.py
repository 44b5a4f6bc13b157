"""Ingress deployment: the OpenAI-compatible HTTP API (one replica).

It validates requests and hands them to the ``Dispatcher`` (``app.dispatch``),
which hosts the cluster router: placement and migration across every
Denoiser replica of every TP degree, per-step thresholds under load control,
and resuming the requests of a replica that dies. Each Denoiser replica
registers its control channel here (``register``); progress comes back as
one batch per round and each request's committed text streams to its client.
"""

# no `from __future__ import annotations`: FastAPI must see the real Request type

import asyncio
import logging
import math
import secrets
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from app import api, heap, playground
from app.auth import ApiKey, Keyring, RateLimits
from app.config import AppConfig
from app.control_timer import ControlTimer
from app.metrics import Metrics, failure_reason
from app.protocol import ProgressBatch, StepItem

log = logging.getLogger(__name__)
GIL_SWITCH_S = 0.001  # the ingress process's GIL switch interval (Python's default: 0.005)
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


REQUEST_ID_HEADER = "x-request-id"  # Serve's proxy sets it on every request and returns it as X-Request-ID


def request_id(scope) -> tuple[str, bool]:
    """The request's id: the one Serve's proxy gave it (its ``x-request-id`` header), else a new one (the
    app outside Serve: tests); ``True`` when it is new (the response must carry it then)."""
    for key, value in scope.get("headers", ()):
        if key == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if 0 < len(text) <= 128 and text.isprintable():
                return text, False
    return uuid.uuid4().hex, True


class _ServerErrors:
    """Any unexpected exception of a handler becomes an OpenAI-style JSON 500 naming the request id, logged
    with its traceback under that id (never Serve's or Starlette's plain-text 500). A response already under
    way cannot change its status: the exception is logged and the body is cut, as a crash would cut it (the
    streams turn their own failures into an error event first: ``Ingress._sse``)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            rid, new = request_id(scope)
            log.exception("unexpected error in %s %s (request id %s)", scope.get("method"), scope.get("path"), rid)
            if started:
                raise
            err = api.server_error(f"The server had an error while processing your request (request id {rid}).")
            headers = {REQUEST_ID_HEADER: rid} if new else None
            await JSONResponse(err.to_dict(), status_code=500, headers=headers)(scope, receive, send)


web.add_middleware(_ServerErrors)  # before @serve.ingress: Serve freezes a copy of the app there


def chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for (the longest vocabulary entry; a byte-level
    vocabulary spells one byte per character, at least one byte per character of text), so that a text
    of ``c`` characters is at least ``ceil(c / chars_per_token)`` tokens. ``None`` when the tokenizer shows
    no vocabulary."""
    vocab = getattr(tokenizer, "vocab", None)
    if not isinstance(vocab, dict) and hasattr(getattr(tokenizer, "tok", None), "get_vocab"):
        vocab = tokenizer.tok.get_vocab()
    return max((len(t) for t in vocab), default=None) if isinstance(vocab, dict) else None


def _client(request: Request) -> str | None:
    """The client's address (the per-address rate limits of an app without keys)."""
    return request.client.host if request.client is not None else None


class _Described:
    """A planner's ``describe()`` answer, read beforehand off the event loop (``playground.cluster_view``)."""

    def __init__(self, plan: dict) -> None:
        self._plan = plan

    def describe(self) -> dict:
        return self._plan


# Everything the Ingress's methods use is defined above the class: Serve copies the class by value when it is
# decorated, with the module's names as they are at that point.
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
    def __init__(self, denoisers: dict[int, DeploymentHandle], cfg: AppConfig) -> None:
        from app.dispatch import Dispatcher
        from cluster.factory import build_router
        from cluster.learning import build_learning
        from engine.loading import resolve_model
        from engine.models.loader import load_config
        from engine.tokenizer import load_tokenizer

        self.cfg = cfg
        http = cfg.http
        self.keys = Keyring.from_specs(  # reads key_env / key_file here, in the replica
            http.api_keys, defaults=RateLimits(http.requests_per_second, http.request_burst, http.tokens_per_minute),
            max_priority_without_key=http.max_priority_without_key)
        self.denoisers = {int(k): v for k, v in denoisers.items()}  # keeps the deployments in the app
        path = resolve_model(cfg.engine.model)
        self.model_cfg = load_config(path)
        self.tokenizer = load_tokenizer(path)
        self.chars_per_token = chars_per_token(self.tokenizer)  # the cheap length check before tokenizing
        self.metrics = Metrics(model_name=cfg.name)
        self.control = ControlTimer()
        self.outcomes = playground.RecentOutcomes()  # SLO met/missed over the last minutes (the playground)
        # the step and admission predictors, learnt from the traffic served (cluster.learning)
        rc, ec = cfg.router, cfg.engine
        self.learning = None if rc.predictors == "off" else build_learning(rc.predictors, ec.model, rc.thresholds)
        self.dispatcher = Dispatcher(
            build_router(cfg, self.model_cfg, self.learning), self.tokenizer.decode,
            block_tokens=self.model_cfg.block_size,
            full_sequence=self.model_cfg.attention != "block_causal",
            per_instance_limit=ec.slots * 8 + ec.max_waiting, default_slo_s=rc.default_slo_ms / 1e3,
            dead_after_s=rc.dead_after_s, park_s=rc.park_s, shed_over_capacity=rc.shed_over_capacity,
            on_batch=self._on_batch, on_migration=self.metrics.migration, learning=self.learning)
        self._lag_task: asyncio.Task | None = None  # the event-loop lag probe, started with the first request
        self.planner = None
        if cfg.planner is not None:  # the TP groups' sizes follow the planner (app.autoscaling)
            from app.autoscaling import build_service

            self.planner = build_service(cfg, self.model_cfg)
            # arrivals are queued without a lock; the calls that take the planner's lock (which a solve holds)
            # run in one thread of their own, in order, never on the event loop
            self._planner_calls = ThreadPoolExecutor(1, thread_name_prefix="remask-planner-calls")
            self.dispatcher.on_arrival = self.planner.observe
            self.dispatcher.on_instances = lambda counts: self._planner_calls.submit(self.planner.set_live,
                                                                                     dict(counts))
            self.planner.start()
        self.started = time.time()
        self._document()
        self.gc_pauses = heap.PauseTimer(self.metrics.collected)
        heap.settle("ingress")
        # the event loop shares the GIL with Serve's replica thread, the tokenizer's and the learners' threads:
        # one of them busy holds it up to the switch interval (Python's default 5 ms) before the loop's turn
        sys.setswitchinterval(GIL_SWITCH_S)

    def _document(self) -> None:
        """The OpenAPI document (``/openapi.json``) with this application's model, max_tokens limit and auth."""
        doc = web.openapi()
        for path, kind in (("/v1/completions", "completion"), ("/v1/chat/completions", "chat"),
                           ("/tokenize", "tokenize"), ("/detokenize", "detokenize")):
            doc["paths"][path]["post"].update(api.openapi_body(kind, self.cfg.name, self.cfg.http.max_tokens_limit,
                                                               vocab_size=self.model_cfg.vocab_size))
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
        """The request body, at most ``http.max_body_bytes`` (413 past it, before reading the rest), within
        ``http.body_timeout_s`` (408 past it: a slow upload does not hold a slot for long)."""
        limit, deadline = self.cfg.http.max_body_bytes, self.cfg.http.body_timeout_s
        api.check_content_length(request.headers.get("content-length"), limit)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(deadline):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise api.body_too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise api.request_timeout(deadline) from None
        return b"".join(chunks)

    def _admit(self, request: Request, key: ApiKey) -> None:
        """The caller's request rate (429 + Retry-After past it)."""
        try:
            self.keys.admit(key, _client(request))
        except api.APIError:
            self.metrics.rejected("rate_limited")
            raise

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

    # ---- endpoints ----------------------------------------------------------------------
    @web.get("/health")
    async def health(self):
        ready = sorted({i.tp for i in self.dispatcher.instances.values()})
        body = {"status": "ok" if ready else "starting", "model": self.cfg.name, "tp_degrees": sorted(self.denoisers),
                "instances": len(self.dispatcher.instances), "ready_tp_degrees": ready}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def record_autoscaling_stats(self) -> dict:
        """The planner's replica-count targets, read by the app-level autoscaling policy (in a thread: they
        wait for a solve under way)."""
        return await asyncio.to_thread(self.planner.metrics) if self.planner is not None else {}

    @web.get("/debug/planner")
    async def planner_state(self, request: Request) -> dict:
        """The planner's targets, the joined instances, the transition under way, the last decision, and
        where each of its inputs came from (default, configured, measured or scaled)."""
        self._authorize(request)
        if self.planner is None:
            return {"enabled": False}
        return await asyncio.to_thread(self.planner.describe)  # it waits for a solve under way

    @web.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return api.models_response([self.cfg.name])

    @web.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> dict:
        self._authorize(request)
        if model_id != self.cfg.name:
            raise api.APIError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                               type="not_found_error", param="model", code="model_not_found")
        return api.model_response(self.cfg.name)

    @web.get("/version")
    async def version(self) -> dict:
        return api.version_response()

    @web.post("/tokenize", openapi_extra=api.openapi_body("tokenize"))
    async def tokenize(self, request: Request) -> dict:
        """The token ids of a prompt or a chat, as a generation request would send them to the model."""
        self._admit(request, self._authorize(request))
        req = api.parse_tokenize(await self._body(request), known_models=[self.cfg.name])
        b = self.model_cfg.block_size
        if req.messages is not None:
            ids = await asyncio.to_thread(self.tokenizer.chat_ids, req.messages, b,
                                          add_generation_prompt=req.add_generation_prompt,
                                          add_special_tokens=req.add_special_tokens)
        elif req.add_special_tokens:
            ids = await asyncio.to_thread(self.tokenizer.completion_ids, req.prompt, b)
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt)
        return api.tokenize_response(ids, self.model_cfg.max_position_embeddings)

    @web.post("/detokenize", openapi_extra=api.openapi_body("detokenize"))
    async def detokenize(self, request: Request) -> dict:
        self._admit(request, self._authorize(request))
        _, ids = api.parse_detokenize(await self._body(request), known_models=[self.cfg.name],
                                      vocab_size=self.model_cfg.vocab_size)
        return api.detokenize_response(await asyncio.to_thread(self.tokenizer.decode, ids))

    @web.get("/playground", include_in_schema=False)
    async def playground_page(self) -> HTMLResponse:
        """A web page to try the model: the canvas unmasking live and the cluster at work."""
        return HTMLResponse(playground.page(), headers=playground.HEADERS)

    @web.get("/static/{name}", include_in_schema=False)
    async def playground_static(self, name: str) -> Response:
        try:
            body, media = playground.static_file(name)
        except KeyError:
            raise HTTPException(404, "Not Found") from None
        return Response(body, media_type=media, headers=playground.HEADERS)

    @web.get("/debug/cluster")
    async def cluster(self, request: Request) -> dict:
        """The playground's cluster panel: instances per TP degree, slots filled, thresholds in use, SLO
        attainment over the last minute, the planner's last decision."""
        self._authorize(request)
        planner = None
        if self.planner is not None:  # its state waits for a solve under way: read it in a thread
            plan = await asyncio.to_thread(self.planner.describe)
            planner = _Described(plan)
        return playground.cluster_view(self.dispatcher, planner, time.monotonic(), self.outcomes,
                                       slots=self.cfg.engine.slots)

    @web.get("/metrics")
    async def metrics(self) -> Response:
        self._cluster_gauges()  # as of now, between progress batches too
        # rendering every series takes milliseconds (2-20 ms measured): in a thread, not on the event loop
        body, ctype = await asyncio.to_thread(self.metrics.render)
        return Response(body, media_type=ctype)

    @web.get("/debug/predictors")
    async def predictors(self, request: Request) -> dict:
        """The step and admission predictors: source (prior | shipped | online), version, requests trained
        on, and their error on the most recent finished requests (``spearman_recent``, ``mape_recent``)."""
        self._authorize(request)
        if self.learning is None:
            return {"enabled": False}
        return await asyncio.to_thread(self.learning.describe)

    async def _probe_lag(self, period_s: float = 0.01) -> None:
        """How late the event loop wakes up: a refit, a tokenization, a solve or a collection that held it shows
        here (and the collections timed since the last wake-up go to their histogram)."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(period_s)
            self.metrics.loop_lag(max(loop.time() - t - period_s, 0.0))
            self.gc_pauses.drain()

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
        if self._lag_task is None:
            self._lag_task = asyncio.get_running_loop().create_task(self._probe_lag())
        key = self._authorize(request)
        self._admit(request, key)
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

    def _parse(self, kind: str, body: bytes, key: ApiKey) -> api.GenRequest:
        """The request, checked against everything the body and the key decide before tokenizing: the
        fields, ``priority`` (403 above the key's), and the prompts' lengths (:meth:`_check_lengths`)."""
        req = api.parse_request(kind, body, known_models=[self.cfg.name],
                                max_tokens_limit=key.max_tokens_limit(self.cfg.http.max_tokens_limit),
                                default_max_tokens=self.cfg.http.default_max_tokens
                                or int(self.model_cfg.extra.get("gen_length", 128)),
                                vocab_size=self.model_cfg.vocab_size)
        key.check_priority(req.priority)
        self._check_lengths(req, key)
        return req

    def _charge(self, req: api.GenRequest, prompts: list[list[int]], key: ApiKey, request: Request) -> None:
        """The request's prompt tokens + max_tokens (each choice's) against the caller's tokens per minute."""
        self.keys.charge(key, sum(map(len, prompts)) + req.max_tokens * len(prompts), _client(request))

    def _prompt_ids(self, req: api.GenRequest) -> list[list[int]]:
        """Each choice's prompt as token ids: a chat through the checkpoint's template, a completion as raw
        text (the embedded models keep their own format). Runs off the event loop."""
        b = self.model_cfg.block_size
        if req.kind == "chat":
            return [self.tokenizer.chat_ids(req.messages, b, add_generation_prompt=req.add_generation_prompt)]
        return [self.tokenizer.completion_ids(p, b) for p in req.prompts]

    def _context_room(self, req: api.GenRequest) -> int:
        """Prompt tokens the model's context leaves beside the request's canvas (whole blocks)."""
        b = self.model_cfg.block_size
        return self.model_cfg.max_position_embeddings - -(-req.max_tokens // b) * b

    def _check_lengths(self, req: api.GenRequest, key: ApiKey) -> None:
        """Refuse, before tokenizing, a prompt certainly too long: token ids by their count, text by the fewest
        tokens its characters can make (``chars_per_token``), against the context and the key's limit. A
        1 MiB prompt is refused here in microseconds; one that may fit is tokenized off the event loop."""
        cpt = self.chars_per_token
        if req.kind == "chat":
            texts = [sum(len(m["content"]) + len(m.get("name", "")) for m in req.messages)]
        else:
            texts = [len(p) for p in req.prompts]  # token ids or characters
        room = self._context_room(req)
        for prompt, size in zip(req.prompts or [None], texts):
            exact = isinstance(prompt, list)
            if not exact and cpt is None:
                continue
            least = size if exact else math.ceil(size / cpt)
            what = f"{least} tokens" if exact else f"at least {least} tokens ({size} characters)"
            if least > room:
                raise api.APIError(400, f"prompt ({what}) + max_tokens ({req.max_tokens}) exceeds the model's "
                                        f"context of {self.model_cfg.max_position_embeddings} tokens",
                                   param="prompt", code="context_length_exceeded")
            if key.max_prompt_tokens is not None and least > key.max_prompt_tokens:
                raise api.invalid(f"This API key allows prompts of at most {key.max_prompt_tokens} tokens; your "
                                  f"prompt has {what}.", param="prompt", code="prompt_too_long")

    def _check_prompt(self, ids: list[int], req: api.GenRequest, key: ApiKey) -> None:
        n = len(ids)
        if not n:
            raise api.invalid("The prompt is empty.", param="prompt", code="empty_prompt")
        key.check_prompt(n)
        limit = self.model_cfg.max_position_embeddings
        if n > self._context_room(req):  # the engine's canvas is whole blocks
            raise api.APIError(400, f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                                    f"model's context of {limit} tokens", param="prompt",
                               code="context_length_exceeded")

    def _sampling(self, req: api.GenRequest) -> dict:
        """The engine's sampling fields: the request's, else the checkpoint's defaults, else greedy. A request
        that samples gets a seed when it has none, so a resume elsewhere decodes as it would have."""
        defaults = getattr(self.tokenizer, "generation_defaults", {})
        out = {"temperature": req.temperature if req.temperature is not None else defaults.get("temperature", 0.0),
               "top_p": req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
               "top_k": req.top_k if req.top_k is not None else defaults.get("top_k", 0),
               "seed": req.seed, "stop_token_ids": list(req.stop_token_ids)}
        if out["temperature"] > 0 and out["seed"] is None:
            out["seed"] = secrets.randbits(63)
        return out

    @staticmethod
    def _prompt_text(req: api.GenRequest, i: int) -> str:
        if req.kind == "chat":
            return "\n".join(m["content"] for m in req.messages)
        return req.prompts[i] if isinstance(req.prompts[i], str) else ""

    async def _generate(self, kind: str, request: Request, key: ApiKey):
        from app.dispatch import DispatchError

        streams = []
        try:
            req = self._parse(kind, await self._body(request), key)
            prompts = await asyncio.to_thread(self._prompt_ids, req)
            for ids in prompts:
                self._check_prompt(ids, req, key)
            self._charge(req, prompts, key, request)
            sampling = self._sampling(req)
            for i, ids in enumerate(prompts):
                rid = req.request_id if len(prompts) == 1 else f"{req.request_id}-{i}"
                streams.append(self.dispatcher.submit(
                    rid, ids, req.max_tokens, prompt_text=self._prompt_text(req, i), threshold=req.threshold,
                    slo_ms=req.slo_ms, priority=req.priority, sampling=sampling, stop=req.stop,
                    canvas=req.include_canvas))
        except api.APIError as err:
            self._cancel(streams)
            self.metrics.rejected("rate_limited" if err.status == 429 else failure_reason(err.status))
            return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)
        except DispatchError as exc:
            self._cancel(streams)
            return self._refused(exc.status, str(exc))
        except BaseException as exc:
            self._cancel(streams)
            if isinstance(exc, Exception):  # a JSON 500 (_ServerErrors)
                self.metrics.rejected("error")
            raise
        for _ in streams:
            self.metrics.request_started()
        try:
            firsts = [await s.__anext__() for s in streams]
        except BaseException as exc:
            self._cancel(streams)
            for _ in streams:
                self.metrics.request_failed("error" if isinstance(exc, Exception) else "cancelled")
            raise
        failed = next((e for e in firsts if e["type"] == "error"), None)
        if failed is not None:
            self._cancel(streams)
            self.metrics.request_dropped(len(streams))  # _refused counts the refusal
            return self._refused(failed.get("status", 500), failed["message"])
        if req.stream:
            started: list[bool] = []  # _sse notes that it ran: it counts its streams' outcomes itself

            def closed() -> None:
                self._cancel(streams)
                if not started:  # the client went away before the first chunk
                    for _ in streams:
                        self.metrics.request_failed("cancelled")

            return _Stream(self._sse(req, streams, started), closed, media_type="text/event-stream")
        dones = []
        gap = self.metrics.gap_timer()
        try:
            for first, stream in zip(firsts, streams):
                done = first
                async for event in stream:
                    done = event
                    if event["type"] == "delta" and stream is streams[0]:  # later choices' deltas queue meanwhile
                        gap()
                dones.append(done)
        except BaseException as exc:
            for _ in streams:  # the handler was cancelled (or failed): its client got none of them
                self.metrics.request_failed("error" if isinstance(exc, Exception) else "cancelled")
            raise
        finally:
            self._cancel(streams)  # a no-op once they ended; frees them if this handler was cancelled
        for done in dones:
            if done["type"] == "done":
                self._finished(req, done)
            else:
                self.metrics.request_dropped()  # _refused counts the refusal
        bad = next((d for d in dones if d["type"] != "done"), None)
        if bad is not None:
            return self._refused(bad.get("status", 500), bad.get("message", "generation failed"))
        prompt_tokens = sum(d["prompt_tokens"] for d in dones)
        completion_tokens = sum(d["completion_tokens"] for d in dones)
        if kind == "completion":
            return api.completion_response(req, [(d["text"], d["finish_reason"]) for d in dones], prompt_tokens,
                                           completion_tokens)
        return api.chat_response(req, dones[0]["text"], dones[0]["finish_reason"], prompt_tokens, completion_tokens)

    @staticmethod
    def _cancel(streams) -> None:
        for s in streams:
            s.cancel()

    def _refused(self, status: int, message: str) -> JSONResponse:
        self.metrics.rejected(failure_reason(status))
        kind = {429: "rate_limit_error", 400: "invalid_request_error", 503: "service_unavailable"}.get(
            status, "server_error")
        err = api.APIError(status, message, type=kind, headers={"Retry-After": "1"} if status in (429, 503) else None)
        return JSONResponse(err.to_dict(), status_code=status, headers=err.headers)

    async def _sse(self, req: api.GenRequest, streams, started: list):
        """Every choice's events as server-sent events, interleaved as they come (each chunk names its
        choice's ``index``; with ``include_canvas``, a ``remask_canvas`` chunk per denoising step); the
        usage chunk and ``[DONE]`` once all choices ended."""
        started.append(True)
        chat = req.kind == "chat"
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for event in stream:
                    await events.put((index, event))
            except Exception:
                log.exception("unexpected error in choice %d of %s", index, req.request_id)
                await events.put((index, {"type": "error", "status": 500,
                                          "message": f"The server had an error while streaming {req.request_id}."}))
            finally:
                await events.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        open_, dones, failed = len(streams), [], False
        gap, errors = self.metrics.gap_timer(), 0
        try:
            if chat:
                yield api.sse(api.chat_chunk(req, role=True))
            while open_:
                index, event = await events.get()
                if event is None:
                    open_ -= 1
                elif event["type"] == "delta":
                    gap(index)
                    yield api.sse(api.chat_chunk(req, event["text"]) if chat
                                  else api.completion_chunk(req, event["text"], index=index))
                elif event["type"] == "canvas":
                    yield api.sse(api.canvas_chunk(req, event["canvas"], index=index))
                elif event["type"] == "done":
                    dones.append(event)
                    yield api.sse(api.chat_chunk(req, finish_reason=event["finish_reason"]) if chat
                                  else api.completion_chunk(req, "", event["finish_reason"], index=index))
                elif event["type"] == "error":
                    failed = True
                    errors += 1
                    self.metrics.request_failed(failure_reason(event.get("status")))
                    yield api.sse({"error": {"message": event.get("message", "generation failed"),
                                             "type": "server_error", "param": None, "code": event.get("status")}})
            if req.include_usage and not failed:
                yield api.sse(api.usage_chunk(req, sum(d["prompt_tokens"] for d in dones),
                                              sum(d["completion_tokens"] for d in dones)))
            yield api.sse("[DONE]")
        except Exception:  # the stream has started: its client gets an error event, then the end
            log.exception("unexpected error in the stream of %s", req.request_id)
            for _ in range(len(streams) - len(dones) - errors):
                self.metrics.request_failed("error")
            errors = len(streams) - len(dones)
            yield api.sse({"error": {"message": f"The server had an error while streaming {req.request_id}.",
                                     "type": "server_error", "param": None, "code": 500}})
        finally:
            for t in tasks:
                t.cancel()
            for done in dones:
                self._finished(req, done)
            if len(dones) < len(streams):  # the client disconnected or a choice failed: free them on their instances
                self._cancel(streams)
                for _ in range(len(streams) - len(dones) - errors):  # the client went away
                    self.metrics.request_failed("cancelled")

    def _on_batch(self, batch: ProgressBatch, now: float) -> None:
        if batch.items:
            self.metrics.control_event(self.control.batch(batch) / 1e3)
            stepped = sum(type(item) is StepItem for item in batch.items)
            if stepped:
                self.metrics.round_observed(stepped)
        self._cluster_gauges()

    def _cluster_gauges(self) -> None:
        """Running and waiting requests, KV usage (each instance's reported capacity) and the shed count."""
        self.metrics.set_cluster([i.stats for i in self.dispatcher.instances.values()],
                                 self.cfg.engine.kv_capacity_tokens or 0, self.dispatcher.stats["shed"])

    def _finished(self, req: api.GenRequest, done: dict) -> None:
        slo_met = None if req.slo_ms is None else done["e2e_s"] * 1000 <= req.slo_ms
        self.metrics.request_finished(
            finish_reason=done["finish_reason"], prompt_tokens=done.get("prompt_tokens", 0),
            completion_tokens=done.get("completion_tokens", 0), e2e_s=done["e2e_s"], ttft_s=done.get("ttft_s"),
            queue_s=done.get("queue_s"), rounds=done.get("rounds", 0), threshold=done.get("threshold"),
            slo_met=slo_met, resumes=done.get("resumes", 0))
        if slo_met is not None:
            self.outcomes.add(time.monotonic(), slo_met)
        if self.planner is not None and done.get("tp") is not None:  # the planner's inputs, measured
            self.planner.observe_finished(
                prompt_tokens=done["prompt_tokens"], output_tokens=done["max_tokens"], steps=done["denoise_steps"],
                threshold=done.get("threshold"), slo_s=None if req.slo_ms is None else done["slo_s"],
                e2e_s=done["e2e_s"], tp=done["tp"])

