"""The routes of the Remask HTTP API: a FastAPI app whose handlers only ask the serving front
(``app.frontend.Frontend``) for their answer; the middleware of ``app.middleware`` around them."""

# no `from __future__ import annotations`: FastAPI must see the real Request type

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from app import api, middleware, playground


def build_web(front: Callable, allowed_origins: Callable | None = None) -> FastAPI:
    """The app; ``front()`` is the ``Frontend`` serving a request (the Ingress replica's, or a test's),
    ``allowed_origins()`` its CORS origins (default: the front's ``http.allowed_origins``)."""
    if allowed_origins is None:
        def allowed_origins() -> list[str]:
            return front().cfg.http.allowed_origins
    web = FastAPI(title="Remask", description="OpenAI-compatible serving of diffusion language models")
    middleware.install(web, allowed_origins)
    documented: list[bool] = []

    def openapi() -> dict:
        """The document of the app serving it (Serve serves a copy of ``web``), narrowed by its front once
        one is there (``Frontend.document``)."""
        schema = FastAPI.openapi(web)  # built once, then cached on the app
        if not documented:
            try:
                fe = front()
            except Exception:  # no front yet (a replica still starting): the generic document
                return schema
            fe.document(schema)
            documented.append(True)
        return schema

    web.openapi = openapi

    def guarded(request: Request):
        """The front of a /v1/* or /debug/* request, after its key is checked (401)."""
        fe = front()
        fe.gate.authorize(request)
        return fe

    @web.get("/health")
    async def health():
        body, status = front().health()
        return JSONResponse(body, status_code=status)

    @web.get("/debug/planner")
    async def planner_state(request: Request) -> dict:
        """The planner's targets, the joined instances, the transition under way, the last decision, and
        where each of its inputs came from (default, configured, measured or scaled)."""
        return await guarded(request).planner_state()

    @web.get("/v1/models")
    async def models(request: Request) -> dict:
        return guarded(request).models()

    @web.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        return guarded(request).model(model_id)

    @web.get("/version")
    async def version() -> dict:
        return api.version_response()

    @web.post("/tokenize", openapi_extra=api.openapi_body("tokenize"))
    async def tokenize(request: Request) -> dict:
        """The token ids of a prompt or a chat, as a generation request would send them to the model."""
        return await front().tokenize(request)

    @web.post("/detokenize", openapi_extra=api.openapi_body("detokenize"))
    async def detokenize(request: Request) -> dict:
        return await front().detokenize(request)

    @web.get("/playground", include_in_schema=False)
    async def playground_page() -> HTMLResponse:
        """A web page to try the model: the canvas unmasking live and the cluster at work."""
        return HTMLResponse(playground.page(), headers=playground.HEADERS)

    @web.get("/static/{name}", include_in_schema=False)
    async def playground_static(name: str) -> Response:
        try:
            body, media = playground.static_file(name)
        except KeyError:
            raise HTTPException(404, "Not Found") from None
        return Response(body, media_type=media, headers=playground.HEADERS)

    @web.get("/debug/cluster")
    async def cluster(request: Request) -> dict:
        """The playground's cluster panel: instances per TP degree, slots filled, thresholds in use, SLO
        attainment over the last minute, the planner's last decision."""
        return await guarded(request).cluster()

    @web.get("/metrics")
    async def metrics() -> Response:
        body, ctype = await front().render_metrics()
        return Response(body, media_type=ctype)

    @web.get("/debug/predictors")
    async def predictors(request: Request) -> dict:
        """The step and admission predictors: source (prior | shipped | online), version, requests trained
        on, and their error on the most recent finished requests (``spearman_recent``, ``mape_recent``)."""
        return await guarded(request).predictors()

    @web.get("/debug/control")
    async def control_stats(request: Request, since: int = 0) -> dict:
        """Control-path timing: progress-event delivery (round loop -> ingress) since event ``since``."""
        return guarded(request).control.summary(since)

    @web.get("/debug/instances")
    async def instances(request: Request) -> dict:
        """Every instance's state as its last progress batch or tick reported it, and the dispatcher's counts."""
        return guarded(request).instances()

    @web.post("/v1/completions", openapi_extra=api.openapi_body("completion"))
    async def completions(request: Request):
        return await front().generate("completion", request)

    @web.post("/v1/chat/completions", openapi_extra=api.openapi_body("chat"))
    async def chat_completions(request: Request):
        return await front().generate("chat", request)

    return web
