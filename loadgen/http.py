"""Two HTTP transports for streamed POSTs, with the same small interface.

- ``raw`` (default for the replay): HTTP/1.1 on asyncio streams, keep-alive pool, chunked or sized
  bodies, http and https. About 0.3 ms of client CPU per request on two cores, so the TTFT it
  measures carries well under a millisecond of its own (``remask loadgen overhead``).
- ``httpx``: the same through httpx (HTTP/1.1 via httpcore, proxies from the environment). It costs
  2-4 ms of client CPU per request on the same machine; its send time is stamped by httpcore's
  ``trace`` hook when the request headers start going out, so request building is not in its TTFT.

``transport.stream(path, payload, headers)`` is an async context manager yielding a :class:`Stream`:
``status``, ``sent_at`` (``time.perf_counter`` when the request was written), ``lines()`` and ``read()``.
``headers`` given to the transport itself (e.g. ``Authorization``) go with every request.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import httpx

TRANSPORTS = ("raw", "httpx")


class Stream:
    status: int
    sent_at: float

    def lines(self) -> AsyncIterator[str]:
        raise NotImplementedError

    async def read(self) -> bytes:
        raise NotImplementedError


class _RawStream(Stream):
    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str], sent_at: float):
        self.reader, self.status, self.headers, self.sent_at = reader, status, headers, sent_at
        self.complete = False

    async def _pieces(self) -> AsyncIterator[bytes]:
        r = self.reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await r.readline()).split(b";")[0], 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                yield (await r.readexactly(size + 2))[:-2]
        elif "content-length" in self.headers:
            yield await r.readexactly(int(self.headers["content-length"]))
        else:
            yield await r.read()
        self.complete = True

    async def lines(self) -> AsyncIterator[str]:
        buf = b""
        async for piece in self._pieces():
            buf += piece
            *done, buf = buf.split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode()
        if buf:
            yield buf.decode()

    async def read(self) -> bytes:
        return b"".join([p async for p in self._pieces()])


class RawTransport:
    """A keep-alive pool of HTTP/1.1 connections to one origin."""

    def __init__(self, url: str, timeout_s: float = 600.0, headers: dict[str, str] | None = None) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"the URL must be http:// or https://, got {url!r}")
        self.host, self.tls = u.hostname or "127.0.0.1", u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.timeout_s = timeout_s
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.hostport = self.host if u.port is None else f"{self.host}:{self.port}"
        self.headers = dict(headers or {})

    async def _connect(self):
        ctx = ssl.create_default_context() if self.tls else None
        return await asyncio.open_connection(self.host, self.port, ssl=ctx, limit=1 << 20)

    async def _exchange(self, conn, request: bytes) -> tuple[int, dict[str, str], float]:
        reader, writer = conn
        sent_at = time.perf_counter()
        writer.write(request)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionResetError("the server closed the connection")
        version, status = status_line.split(b" ", 2)[:2]
        headers = {}
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if version == b"HTTP/1.0":
            headers.setdefault("connection", "close")
        return int(status), headers, sent_at

    @asynccontextmanager
    async def stream(self, path: str, payload: bytes, headers: dict[str, str]) -> AsyncIterator[Stream]:
        head = "".join(f"{k}: {v}\r\n" for k, v in {**self.headers, **headers}.items())
        request = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.hostport}\r\nContent-Type: application/json\r\n"
                   f"Accept: text/event-stream\r\n{head}Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        conn, reused = (self.idle.pop(), True) if self.idle else (await self._connect(), False)
        stream = None
        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    status, hdrs, sent_at = await self._exchange(conn, request)
                except (ConnectionError, asyncio.IncompleteReadError):
                    if not reused:
                        raise
                    conn[1].close()  # a kept-alive connection the server had closed: once more on a fresh one
                    conn = await self._connect()
                    status, hdrs, sent_at = await self._exchange(conn, request)
                stream = _RawStream(conn[0], status, hdrs, sent_at)
                yield stream
        finally:
            if (stream is not None and stream.complete and hdrs.get("connection", "").lower() != "close"
                    and not conn[0].at_eof()):
                self.idle.append(conn)
            else:
                conn[1].close()

    async def aclose(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


class _HttpxStream(Stream):
    def __init__(self, resp: httpx.Response, sent_at: float):
        self.resp, self.status, self.sent_at = resp, resp.status_code, sent_at

    def lines(self) -> AsyncIterator[str]:
        return self.resp.aiter_lines()

    async def read(self) -> bytes:
        return await self.resp.aread()


class HttpxTransport:
    def __init__(self, url: str, timeout_s: float = 600.0, headers: dict[str, str] | None = None) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits, timeout=timeout_s,
                                        headers=headers)

    @asynccontextmanager
    async def stream(self, path: str, payload: bytes, headers: dict[str, str]) -> AsyncIterator[Stream]:
        stamp: list[float] = []

        async def trace(name: str, info: dict) -> None:
            if name.endswith("send_request_headers.started") and not stamp:
                stamp.append(time.perf_counter())

        called = time.perf_counter()
        async with self.client.stream("POST", path, content=payload, extensions={"trace": trace},
                                      headers={"Content-Type": "application/json", **headers}) as resp:
            yield _HttpxStream(resp, stamp[0] if stamp else called)

    async def aclose(self) -> None:
        await self.client.aclose()


def make_transport(kind: str, url: str, timeout_s: float = 600.0,
                   headers: dict[str, str] | None = None) -> RawTransport | HttpxTransport:
    """A transport of ``kind`` to ``url``; ``headers`` are sent with every request."""
    if kind == "raw":
        return RawTransport(url, timeout_s, headers)
    if kind == "httpx":
        return HttpxTransport(url, timeout_s, headers)
    raise ValueError(f"unknown transport {kind!r}; known: {', '.join(TRANSPORTS)}")
