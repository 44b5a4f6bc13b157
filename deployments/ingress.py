"""Ingress deployment: the OpenAI-compatible HTTP API (one replica).

It validates requests, picks an instance, and streams each request's
committed text back as blocks commit. Routing is deliberately simple until
the cluster router lands: the Denoiser deployment of the lowest TP degree,
replica chosen by Ray Serve's handle.
"""

# no `from __future__ import annotations`: FastAPI must see the real Request type

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from app import api
from app.config import AppConfig
from app.control import ControlTimer
from app.metrics import Metrics

web = FastAPI(title="Remask", description="OpenAI-compatible serving of diffusion language models")


@serve.deployment(num_replicas=1, max_ongoing_requests=4096)
@serve.ingress(web)
class Ingress:
    def __init__(self, denoisers: dict[int, DeploymentHandle], config: dict) -> None:
        from engine.loading import resolve_model
        from engine.models.loader import load_config
        from engine.tokenizer import load_tokenizer

        self.cfg = AppConfig(**config)
        self.denoisers = {int(k): v for k, v in denoisers.items()}
        path = resolve_model(self.cfg.model)
        self.model_cfg = load_config(path)
        self.tokenizer = load_tokenizer(path)
        self.metrics = Metrics()
        self.control = ControlTimer()
        self.started = time.time()

    # ---- endpoints ----------------------------------------------------------------------
    @web.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "model": self.cfg.name, "tp_degrees": sorted(self.denoisers)}

    @web.get("/v1/models")
    async def models(self) -> dict:
        return api.models_response([self.cfg.name])

    @web.get("/metrics")
    async def metrics(self) -> Response:
        body, ctype = self.metrics.render()
        return Response(body, media_type=ctype)

    @web.get("/debug/control")
    async def control_stats(self, since: int = 0) -> dict:
        """Control-path timing: progress-event delivery (round loop -> ingress) since event ``since``."""
        return self.control.summary(since)

    @web.get("/debug/instances")
    async def instances(self) -> dict:
        """Each TP degree's replica state as one of its replicas reports it."""
        return {str(d): await h.stats.remote() for d, h in sorted(self.denoisers.items())}

    @web.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve("completion", request)

    @web.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve("chat", request)

    # ---- one request ---------------------------------------------------------------------
    def _parse(self, kind: str, body: bytes) -> api.GenRequest:
        req = api.parse_request(kind, body, known_models=[self.cfg.name], max_tokens_limit=self.cfg.max_tokens_limit,
                                default_max_tokens=self.cfg.default_max_tokens
                                or int(self.model_cfg.extra.get("gen_length", 128)))
        n_prompt = len(self.tokenizer.prompt_ids(req.prompt, self.model_cfg.block_size))
        limit = self.model_cfg.max_position_embeddings
        if n_prompt + req.max_tokens > limit:
            raise api.APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                                    f"model's context of {limit} tokens", param="prompt",
                               code="context_length_exceeded")
        return req

    async def _serve(self, kind: str, request: Request):
        try:
            req = self._parse(kind, await request.body())
        except api.APIError as err:
            self.metrics.rejected("invalid")
            return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)
        handle = self.denoisers[min(self.denoisers)]
        stream = handle.options(stream=True).generate.remote({
            "request_id": req.request_id, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "threshold": req.threshold, "slo_ms": req.slo_ms, "priority": req.priority, "sent_at": time.time(),
        })
        self.metrics.request_started()
        first = await stream.__anext__()
        if first["type"] == "error":
            self.metrics.request_finished(None, 0.0, None, 0, req.threshold, ok=False)
            status = first.get("status", 500)
            self.metrics.rejected("overload" if status == 429 else "error")
            err = api.APIError(status, first["message"], type="rate_limit_error" if status == 429 else
                               ("invalid_request_error" if status == 400 else "server_error"),
                               headers={"Retry-After": "1"} if status == 429 else None)
            return JSONResponse(err.to_dict(), status_code=status, headers=err.headers)
        if req.stream:
            return StreamingResponse(self._sse(req, first, stream), media_type="text/event-stream")
        text, done = "", first
        async for event in self._chain(first, stream):
            if event["type"] == "delta":
                text += event["text"]
            done = event
        if done["type"] != "done":
            return JSONResponse(api.APIError(500, done.get("message", "generation failed"),
                                             type="server_error").to_dict(), status_code=500)
        self._finished(req, done)
        build = api.completion_response if kind == "completion" else api.chat_response
        return build(req, done["text"], done["finish_reason"], done["prompt_tokens"], done["completion_tokens"])

    async def _sse(self, req: api.GenRequest, first: dict, stream):
        chat = req.kind == "chat"
        done = None
        try:
            if chat:
                yield api.sse(api.chat_chunk(req, role=True))
            async for event in self._chain(first, stream):
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
                                             "type": "server_error", "param": None, "code": None}})
            yield api.sse("[DONE]")
        finally:
            if done is not None:
                self._finished(req, done)
            else:  # the client disconnected or the stream broke: the replica aborts the request
                stream.cancel()
                self.metrics.request_finished(None, 0.0, None, 0, req.threshold, ok=False)

    async def _chain(self, first: dict, stream):
        self._timed(first)
        yield first
        async for event in stream:
            self._timed(event)
            yield event

    def _timed(self, event: dict) -> None:
        ms = self.control.event(event)
        if ms is not None:
            self.metrics.control.observe(ms / 1e3)

    def _finished(self, req: api.GenRequest, done: dict) -> None:
        slo_met = None if req.slo_ms is None else done["e2e_s"] * 1000 <= req.slo_ms
        self.metrics.request_finished(done["ttft_s"], done["e2e_s"], slo_met, done["rounds"], req.threshold, ok=True)
