"""The HTTP middleware of the Remask API: OpenAI-style bodies for every error (the framework's own included), a
JSON 500 naming the request id for any unexpected exception, and CORS (off unless ``http.allowed_origins``).

:func:`install` puts them on a FastAPI app before Ray Serve's ``@serve.ingress`` freezes a copy of it; what
depends on the application's config (the allowed origins) is read per request through a callable, since the
config reaches the replica only when it starts.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from app import api

log = logging.getLogger(__name__)
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


def error_response(err: api.APIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)


async def _api_error(request: Request, err: api.APIError) -> JSONResponse:
    return error_response(err)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    err = (api.not_found_error(f"Unknown request URL: {request.method} {request.url.path}.")
           if exc.status_code == 404 else api.APIError(exc.status_code, str(exc.detail), headers=exc.headers))
    return error_response(err)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = (exc.errors() or [{}])[0]
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return error_response(api.invalid(f"Invalid value for '{param}': {first.get('msg', 'invalid')}.",
                                      param=param, code="invalid_value"))


class ServerErrors:
    """Any unexpected exception of a handler becomes an OpenAI-style JSON 500 naming the request id, logged
    with its traceback under that id (never Serve's or Starlette's plain-text 500). A response already under
    way cannot change its status: the exception is logged and the body is cut, as a crash would cut it (the
    streams turn their own failures into an error event first: ``CompletionService.sse``)."""

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


class ConfiguredCORS:
    """Starlette's ``CORSMiddleware`` with the origins ``origins()`` returns when a request comes (the config of
    the replica serving it); none (the default): no CORS headers, and a preflight is routed as any request."""

    def __init__(self, app, origins: Callable[[], Sequence[str]]) -> None:
        self.app = app
        self.origins = origins
        self._cors: tuple[tuple[str, ...], CORSMiddleware] | None = None

    def _middleware(self) -> CORSMiddleware | None:
        try:
            origins = tuple(self.origins() or ())
        except Exception:  # no replica yet (or no config): no CORS
            log.debug("no allowed origins available", exc_info=True)
            origins = ()
        if not origins:
            return None
        if self._cors is None or self._cors[0] != origins:
            self._cors = origins, CORSMiddleware(self.app, allow_origins=list(origins), allow_methods=["*"],
                                                 allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER],
                                                 allow_credentials="*" not in origins)
        return self._cors[1]

    async def __call__(self, scope, receive, send) -> None:
        cors = self._middleware() if scope["type"] == "http" else None
        await (cors or self.app)(scope, receive, send)


def install(web: FastAPI, allowed_origins: Callable[[], Sequence[str]]) -> None:
    """The error handlers, the JSON 500 and CORS on ``web`` (CORS outermost, so error answers carry it too)."""
    web.add_exception_handler(api.APIError, _api_error)
    web.add_exception_handler(HTTPException, _http_error)
    web.add_exception_handler(RequestValidationError, _validation_error)
    web.add_middleware(ServerErrors)
    web.add_middleware(ConfiguredCORS, origins=allowed_origins)
