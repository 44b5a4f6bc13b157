"""The door of every /v1/* and /debug/* request: the caller's API key (401), its request rate (429 +
Retry-After) and its body, read within the size and time limits of the ``http`` section (413, 408). Each
refusal is counted in the request metrics."""

from __future__ import annotations

import asyncio

from app import api
from app.auth import ApiKey, Keyring
from app.config import HttpArgs
from app.metrics import Metrics


def client_address(request) -> str | None:
    """The client's address (the per-address rate limits of an app without keys)."""
    return request.client.host if request.client is not None else None


class Gate:
    def __init__(self, keys: Keyring, metrics: Metrics, http: HttpArgs) -> None:
        self.keys, self.metrics, self.http = keys, metrics, http

    def authorize(self, request) -> ApiKey:
        """The caller of a /v1/* or /debug/* request (401 unless its Bearer key is configured, when any are)."""
        try:
            return self.keys.authenticate(request.headers.get("authorization"))
        except api.APIError:
            self.metrics.rejected("unauthorized")
            raise

    def admit(self, request, key: ApiKey) -> None:
        """The caller's request rate (429 + Retry-After past it)."""
        try:
            self.keys.admit(key, client_address(request))
        except api.APIError:
            self.metrics.rejected("rate_limited")
            raise

    async def body(self, request) -> bytes:
        """The request body, at most ``http.max_body_bytes`` (413 past it, before reading the rest), within
        ``http.body_timeout_s`` (408 past it: a slow upload does not hold a slot for long)."""
        limit, deadline = self.http.max_body_bytes, self.http.body_timeout_s
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
