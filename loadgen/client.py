"""One streamed OpenAI-style request over httpx, timed on the client.

Timing follows vLLM's benchmark: TTFT is the time from sending the request to the first chunk that
carries text (a chat stream's opening role-only chunk does not count); ITL are the gaps between
successive chunks with text; E2EL is the time to the end of the stream.

API keys: every client of this package (replay, Locust, ``remask chat``, ``remask bench control``) takes
``--api-key`` (default: the ``OPENAI_API_KEY`` environment variable) and sends it as
``Authorization: Bearer <key>`` with every request. The key is never printed, logged or written to a
results file; a 401 is reported with :func:`unauthorized_hint`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from loadgen.trace import TraceRequest

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
API_KEY_ENV = "OPENAI_API_KEY"


def resolve_api_key(given: str | None) -> str | None:
    """The key to send: ``given`` (``--api-key``), else ``$OPENAI_API_KEY``, else none."""
    return given or os.environ.get(API_KEY_ENV) or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def unauthorized_hint(api_key: str | None) -> str:
    """What to do about a 401 (never the key itself)."""
    if api_key:
        return "the server refused the API key sent (from --api-key or $OPENAI_API_KEY)"
    return "the server wants an API key: pass --api-key KEY or set $OPENAI_API_KEY"


class Unauthorized(ValueError):
    """HTTP 401 from the server (a ValueError so ``remask`` prints it as an error line, without a traceback)."""


@dataclass
class RequestResult:
    request_id: str
    category: str
    endpoint: str
    arrival_s: float  # scheduled offset from the start of the replay
    send_s: float = 0.0  # actual offset at which the request was sent
    queued_ms: float = 0.0  # waited this long for a slot under --max-concurrency (not in TTFT/E2EL, as in vLLM)
    status: int | None = None  # HTTP status; None when no response came
    ok: bool = False
    error: str | None = None
    cancelled: bool = False
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    chunk_offsets_ms: list[float] = field(default_factory=list)  # arrival of each text chunk, from send
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    prompt_chars: int = 0
    max_tokens: int | None = None
    threshold: float | None = None
    slo_ms: float | None = None
    slo_met: bool | None = None
    correct: bool | None = None

    @property
    def send_lag_ms(self) -> float:
        """How late the request went out after its arrival, besides any wait for a concurrency slot."""
        return (self.send_s - self.arrival_s) * 1000.0 - self.queued_ms

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["send_lag_ms"] = self.send_lag_ms
        return out


def chunk_text(event: dict) -> str:
    """The text a completion or chat chunk carries ('' for role-only, usage and finish chunks)."""
    parts = []
    for choice in event.get("choices") or ():
        if "text" in choice:
            parts.append(choice.get("text") or "")
        else:
            parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _finish(choices: list[dict]) -> str | None:
    return next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)


def error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body (else its first 200 bytes)."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


async def send(transport, req: TraceRequest, model: str | None, res: RequestResult, t0: float,
               path: str | None = None) -> RequestResult:
    """Send ``req`` now over ``transport`` (see loadgen.http), filling ``res`` as the stream arrives.

    ``t0`` is the replay's start (``time.perf_counter``). Timings start when the request is written.
    ``path`` replaces the endpoint's usual path (``PATHS``), e.g. a benchmark's ``--endpoint``.
    """
    res.max_tokens, res.threshold, res.slo_ms = req.max_tokens, req.threshold, req.slo_ms
    res.prompt_chars = len(req.text)
    payload = json.dumps(req.body(model)).encode()
    res.send_s = time.perf_counter() - t0
    last = start = None
    done = False
    try:
        async with transport.stream(path or PATHS[req.endpoint], payload, {"X-Request-Id": req.request_id}) as resp:
            start = resp.sent_at
            res.send_s = start - t0
            res.status = resp.status
            if resp.status >= 400:
                res.error = f"HTTP {resp.status}: {error_message(await resp.read())}"
                return res
            async for line in resp.lines():
                if done or not line.startswith("data:"):
                    continue  # read to the end, so the connection can be reused
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {(event['error'] or {}).get('message')}"
                    return res
                text = chunk_text(event)
                if text:
                    if res.ttft_ms is None:
                        res.ttft_ms = (now - start) * 1000.0
                    else:
                        res.itl_ms.append((now - last) * 1000.0)
                    last = now
                    res.chunk_offsets_ms.append((now - start) * 1000.0)
                    res.text += text
                res.finish_reason = _finish(event.get("choices") or []) or res.finish_reason
                usage = event.get("usage")
                if usage:
                    res.prompt_tokens, res.output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        res.e2el_ms = (time.perf_counter() - start) * 1000.0
        if res.finish_reason is None:
            res.error = "stream ended without a finish_reason"
            return res
        res.ok = True
        res.correct = req.check(res.text)
        res.slo_met = None if req.slo_ms is None else res.e2el_ms <= req.slo_ms
    except Exception as exc:  # any failure is this request's error, never the replay's
        res.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return res
