"""A no-op OpenAI-style streaming server on raw asyncio, to measure the load generator itself.

It answers ``POST /v1/completions`` and ``/v1/chat/completions`` at once with a fixed reply split into
chunks (SSE over chunked HTTP/1.1, keep-alive), plus ``/health`` and ``/v1/models``. Every
``--fail-every``-th request gets ``--fail-status`` instead. It logs, per ``X-Request-Id``, when it read
the request line and when it wrote the first text chunk (``time.perf_counter``); ``GET /noop/log``
returns that log, so a client can subtract the server's own share from the TTFT it measured.

For the clients' tests: ``--api-key KEY`` makes every route but ``/health`` and ``/noop/*`` answer 401
unless ``Authorization: Bearer KEY`` comes with it; ``GET /noop/stats`` returns the generation requests
answered (``count``), the most streams in flight at once (``max_inflight``) and the ``Authorization``
headers seen with their counts (``authorization``: a test server's own key, nothing else); a request with
``stream_options.include_canvas`` gets a ``remask_canvas`` chunk before each text chunk (one round per
chunk, one position per character); ``GET /debug/control`` answers like the app's, with no samples;
``--refuse FIELD`` answers a body with that field 400 ``unknown_parameter``, as a server without it would.

``python -m loadgen.noop_server --port 0`` prints ``listening on <port>`` once ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class NoopConfig:
    reply: str = "ok"
    chunks: int = 4
    first_delay_s: float = 0.0
    gap_s: float = 0.0
    fail_every: int = 0
    fail_status: int = 500
    model: str = "noop"
    api_key: str | None = None
    refuse: tuple[str, ...] = ()  # body fields answered with a 400 unknown_parameter, as a server without them


class NoopServer:
    def __init__(self, cfg: NoopConfig) -> None:
        self.cfg = cfg
        self.count = 0
        self.log: dict[str, list[float]] = {}
        self.inflight = self.max_inflight = 0
        self.authorization: dict[str, int] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                t_recv = time.perf_counter()
                method, path = line.decode("latin-1").split(" ")[:2]
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                await self.route(method, path, headers, body, writer, t_recv)
                if headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def route(self, method, path, headers, body, writer, t_recv) -> None:
        path = path.split("?")[0]
        if method == "GET" and path == "/health":
            return self.send_json(writer, 200, {"status": "ok"})
        if method == "GET" and path == "/noop/log":
            return self.send_json(writer, 200, self.log)
        if method == "GET" and path == "/noop/stats":
            return self.send_json(writer, 200, {"count": self.count, "max_inflight": self.max_inflight,
                                                "authorization": self.authorization})
        auth = headers.get("authorization", "")
        self.authorization[auth] = self.authorization.get(auth, 0) + 1
        if self.cfg.api_key is not None and auth != f"Bearer {self.cfg.api_key}":
            return self.send_json(writer, 401, {"error": {"message": "Incorrect API key provided.",
                                                          "type": "invalid_request_error", "code": "invalid_api_key"}})
        if method == "GET" and path == "/v1/models":
            return self.send_json(writer, 200, {"object": "list", "data": [{"id": self.cfg.model, "object": "model"}]})
        if method == "GET" and path == "/debug/control":
            return self.send_json(writer, 200, {"events": 0, "samples": 0, "median_ms": 0.0, "p99_ms": 0.0,
                                                "add_median_ms": 0.0})
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            return self.send_json(writer, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})
        self.count += 1
        if self.cfg.fail_every and self.count % self.cfg.fail_every == 0:
            return self.send_json(writer, self.cfg.fail_status, {"error": {"message": "injected failure",
                                                                      "type": "server_error"}})
        req = json.loads(body or b"{}")
        if refused := [k for k in self.cfg.refuse if k in req]:
            return self.send_json(writer, 400, {"error": {
                "message": f"Unrecognized request argument supplied: {refused[0]}", "type": "invalid_request_error",
                "param": refused[0], "code": "unknown_parameter"}})
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await self.stream(writer, path.endswith("chat/completions"), req, headers.get("x-request-id"), t_recv)
        finally:
            self.inflight -= 1

    def send_json(self, writer, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (status, len(data), data))

    async def stream(self, writer, chat: bool, req: dict, rid: str | None, t_recv: float) -> None:
        cfg, obj = self.cfg, "chat.completion.chunk" if chat else "text_completion"
        n = max(1, min(cfg.chunks, len(cfg.reply)))
        size = -(-len(cfg.reply) // n)
        pieces = [cfg.reply[i:i + size] for i in range(0, len(cfg.reply), size)] or [""]

        canvas = bool((req.get("stream_options") or {}).get("include_canvas"))

        def event(choice: dict | None, usage: dict | None = None, view: dict | None = None) -> bytes:
            out = {"id": "noop", "object": obj, "created": 0, "model": cfg.model, "choices": [choice] if choice else []}
            if usage:
                out["usage"] = usage
            if view:
                out["remask_canvas"] = view
            payload = b"data: " + json.dumps(out).encode() + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(payload), payload)

        def choice(text: str, finish: str | None = None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        if chat:
            head += event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        if cfg.first_delay_s:
            writer.write(head)
            head = b""
            await asyncio.sleep(cfg.first_delay_s)
        for i, piece in enumerate(pieces):
            if i and cfg.gap_s:
                await asyncio.sleep(cfg.gap_s)
            if canvas:
                lo = i * size
                view = {"index": 0, "round": i + 1, "instance": 0, "tp": 1, "threshold": 0.9,
                        "block": [lo, lo + len(piece)], "committed": [[lo + j, ord(c), c] for j, c in enumerate(piece)],
                        "masked": [], "length": len(cfg.reply)}
                head += event(None, view=view)
            writer.write(head + event(choice(piece)))
            head = b""
            if i == 0 and rid is not None:
                self.log[rid] = [t_recv, time.perf_counter()]
            await writer.drain()
        usage = {"prompt_tokens": len(str(req.get("prompt") or req.get("messages") or "")),
                 "completion_tokens": len(cfg.reply), "total_tokens": 0}
        writer.write(event(choice("", "stop")) + event(None, usage) + b"%x\r\n%s\r\n0\r\n\r\n"
                     % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n"))
        await writer.drain()


async def serve(cfg: NoopConfig, host: str, port: int) -> None:
    app = NoopServer(cfg)
    server = await asyncio.start_server(app.handle, host, port, backlog=4096)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def spawn(*args: str) -> tuple[subprocess.Popen, str]:
    """Start the server in a subprocess on a free port; (process, base URL). The caller terminates it."""
    proc = subprocess.Popen([sys.executable, "-m", "loadgen.noop_server", "--port", "0", *args],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"no-op server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{int(line.split()[-1])}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--reply", default="ok")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--first-delay-ms", type=float, default=0.0)
    p.add_argument("--gap-ms", type=float, default=0.0)
    p.add_argument("--fail-every", type=int, default=0, help="every k-th generation request fails (0: none)")
    p.add_argument("--fail-status", type=int, default=500)
    p.add_argument("--api-key", help="answer 401 unless 'Authorization: Bearer KEY' comes with a request")
    p.add_argument("--refuse", action="append", default=[], metavar="FIELD",
                   help="answer 400 unknown_parameter to a request body with FIELD (repeatable)")
    a = p.parse_args(argv)
    cfg = NoopConfig(a.reply, a.chunks, a.first_delay_ms / 1000, a.gap_ms / 1000, a.fail_every, a.fail_status,
                     api_key=a.api_key, refuse=tuple(a.refuse))
    try:
        asyncio.run(serve(cfg, a.host, a.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
