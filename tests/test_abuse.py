"""Abuse of the ingress (issue 25 item 6, and item 5's ingress parts), without Ray: priorities only for keys
allowed them, per-key and per-address rate limits (429 + Retry-After), the body-read deadline (408), the
JSON 500 of an unexpected exception, the cheap prompt-length check before tokenizing, every /debug route
behind the keys, the planner's lock never waited for on the event loop, and the proxy's finite queue.

The front is built as the Ingress replica builds it (``app.frontend.Frontend``: keys, tokenizer, router,
dispatcher, completion service) around the embedded tiny-bd model, with the dispatcher's ``submit`` replaced by
a fake generation; the API's FastAPI app (``app.routes.build_web``) is served around it by uvicorn in a thread
on a free port, without Ray. Requests go over real HTTP, some through the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
import time

import pytest

from app.api import APIError
from app.auth import ApiKeySpec, Keyring, RateLimiter, RateLimits
from app.config import AppConfig

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny-bd"
LOW, HIGH = "sk-abuse-low-0123456789", "sk-abuse-high-9876543210"


# ---- the ingress, served without Ray ----------------------------------------------------------------------
class FakeStream:
    """A generation's events: accepted, one delta per piece, done; ``fail_after``: raise after that many."""

    def __init__(self, text: str, prompt_tokens: int, max_tokens: int, fail_after: int | None = None) -> None:
        pieces = [text[i:i + 2] for i in range(0, len(text), 2)]
        self.events = [{"type": "accepted", "add_ms": 0.1}] + [{"type": "delta", "text": p} for p in pieces] + [
            {"type": "done", "finish_reason": "stop", "text": text, "prompt_tokens": prompt_tokens,
             "completion_tokens": len(text), "max_tokens": max_tokens, "rounds": 2, "ttft_s": 0.01, "e2e_s": 0.02,
             "queue_s": 0.0, "threshold": 0.9, "resumes": 0}]
        self.fail_after, self.sent, self.cancelled = fail_after, 0, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        await asyncio.sleep(0)
        if self.fail_after is not None and self.sent >= self.fail_after:
            raise RuntimeError("injected fault in the stream")
        if self.cancelled or not self.events:
            raise StopAsyncIteration
        self.sent += 1
        return self.events.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class Current:
    """The ingress the routes serve (Serve's replica context, patched) and what its fake dispatcher got."""

    ingress = None
    submitted: list[dict] = []
    stream_fail_after: int | None = None


def make_ingress(**http) -> object:
    from app.frontend import Frontend

    cfg = AppConfig(engine={"model": MODEL, "slots": 4}, router={"predictors": "off"}, http=http)
    ing = Frontend(cfg)  # the replica's own start: keys, tokenizer, router, dispatcher (no instances)
    Current.submitted = []
    Current.stream_fail_after = None

    def submit(rid, ids, max_tokens, **kw):
        Current.submitted.append({"rid": rid, "ids": list(ids), "max_tokens": max_tokens, **kw})
        return FakeStream("hello world", len(ids), max_tokens, Current.stream_fail_after)

    ing.dispatcher.submit = submit
    Current.ingress = ing
    return ing


class LiveApp:
    """The ingress's FastAPI app under uvicorn, in a thread, on a free port."""

    def __init__(self) -> None:
        from app.routes import build_web

        web = build_web(lambda: Current.ingress)
        self.server = uvicorn.Server(uvicorn.Config(web, host="127.0.0.1", port=0, log_level="warning",
                                                   lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def live():
    app = LiveApp()
    yield app
    app.close()


def keyed(**extra) -> dict:
    """An http section with two keys: ``low`` (no max_priority) and ``high`` (max_priority 5), plus ``extra``."""
    low = {"name": "low", "key": LOW, **extra.pop("low", {})}
    high = {"name": "high", "key": HIGH, "max_priority": 5, **extra.pop("high", {})}
    return {"api_keys": [low, high], **extra}


def post(live, body: dict, key: str | None = LOW, path: str = "/v1/completions",
         headers: dict | None = None) -> httpx.Response:
    headers = {**({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return httpx.post(live.url + path, json={"model": MODEL, "max_tokens": 8, **body}, headers=headers, timeout=30)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def openai_client(live, key: str | None = LOW, **kw):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key or "unused", **kw)


# ---- 1. priority -------------------------------------------------------------------------------------------
def test_priority_above_0_needs_a_key_that_allows_it(live):
    openai = pytest.importorskip("openai")
    make_ingress(**keyed())
    err = error_of(post(live, {"prompt": "hi", "priority": 1}), 403)
    assert err["param"] == "priority" and err["code"] == "priority_not_allowed" and err["type"] == "permission_error"
    assert "above 0" in err["message"] and not Current.submitted  # refused before anything reached a replica
    with pytest.raises(openai.PermissionDeniedError) as info:  # the official client reads it as a 403
        openai_client(live, max_retries=0).completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                                              extra_body={"priority": 1})
    assert info.value.body["param"] == "priority"
    assert post(live, {"prompt": "hi", "priority": 0}).status_code == 200
    assert post(live, {"prompt": "hi", "priority": -3}).status_code == 200  # lower than default: anyone's
    done = openai_client(live, HIGH).completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                                       extra_body={"priority": 5})
    assert done.choices[0].text == "hello world"
    assert [s["priority"] for s in Current.submitted] == [0, -3, 5]
    assert error_of(post(live, {"prompt": "hi", "priority": 6}, key=HIGH), 403)["param"] == "priority"
    # a chat is checked the same way
    chat = post(live, {"messages": [{"role": "user", "content": "hi"}], "priority": 2}, path="/v1/chat/completions")
    assert error_of(chat, 403)["param"] == "priority"


def test_priority_without_keys_follows_the_http_section(live):
    make_ingress()  # the open demo: priority 0 at most
    err = error_of(post(live, {"prompt": "hi", "priority": 1}, key=None), 403)
    assert "without an API key" in err["message"] and err["param"] == "priority"
    make_ingress(max_priority_without_key=2)
    assert post(live, {"prompt": "hi", "priority": 2}, key=None).status_code == 200
    assert error_of(post(live, {"prompt": "hi", "priority": 3}, key=None), 403)["code"] == "priority_not_allowed"


# ---- 2. rate limits ----------------------------------------------------------------------------------------
def test_requests_per_second_429_with_retry_after_then_served_again(live):
    ing = make_ingress(**keyed(low={"requests_per_second": 2}))
    clock = [1000.0]
    ing.keys.limiter.clock = lambda: clock[0]
    assert [post(live, {"prompt": "hi"}).status_code for _ in range(2)] == [200, 200]  # the burst: 2
    r = post(live, {"prompt": "hi"})
    err = error_of(r, 429)
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert "requests per second" in err["message"] and LOW not in r.text
    assert r.headers["retry-after"] == "1"  # half a second to the next request, in whole seconds
    assert post(live, {"prompt": "hi"}, key=HIGH).status_code == 200  # another key has its own budget
    clock[0] += 0.4
    assert post(live, {"prompt": "hi"}).status_code == 429
    clock[0] += 0.1
    assert post(live, {"prompt": "hi"}).status_code == 200  # served again after the wait
    body, _ = ing.metrics.render()
    assert 'reason="rate_limited"} 2.0' in body.decode()
    # in real time, through the official client, which honours Retry-After: its retry is served
    ing = make_ingress(**keyed(low={"requests_per_second": 1}))
    assert post(live, {"prompt": "hi"}).status_code == 200  # the bucket's one request
    t0 = time.monotonic()
    done = openai_client(live, max_retries=2).completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert done.choices[0].text == "hello world" and time.monotonic() - t0 >= 0.9  # Retry-After: 1
    body, _ = ing.metrics.render()
    assert 'reason="rate_limited"} 1.0' in body.decode()  # the client's first try


def test_tokens_per_minute_counts_prompt_and_max_tokens_at_admission(live):
    ing = make_ingress(**keyed(low={"tokens_per_minute": 100}))
    clock = [1000.0]
    ing.keys.limiter.clock = lambda: clock[0]
    ids = list(range(10, 20))  # a prompt of 10 token ids (sent as they are)
    assert [post(live, {"prompt": ids, "max_tokens": 30}).status_code for _ in range(2)] == [200, 200]  # 2 x 40
    r = post(live, {"prompt": ids, "max_tokens": 30})  # 40 more: 20 left, 100 a minute refill 20 in 12 s
    err = error_of(r, 429)
    assert "tokens per minute" in err["message"] and r.headers["retry-after"] == "12"
    clock[0] += 11.0
    assert post(live, {"prompt": ids, "max_tokens": 30}).status_code == 429
    clock[0] += 1.0
    assert post(live, {"prompt": ids, "max_tokens": 30}).status_code == 200
    # a request the key's minute can never hold is a 400, not a 429 to retry forever
    err = error_of(post(live, {"prompt": ids, "max_tokens": 91}), 400)
    assert err["code"] == "tokens_per_minute_exceeded" and err["param"] == "max_tokens"
    assert [s["max_tokens"] for s in Current.submitted] == [30, 30, 30]


def test_per_address_limits_without_keys(live):
    make_ingress(requests_per_second=1)
    assert post(live, {"prompt": "hi"}, key=None).status_code == 200
    err = error_of(post(live, {"prompt": "hi"}, key=None), 429)
    assert "127.0.0.1" in err["message"]
    # /tokenize costs tokenization: it draws on the same bucket
    r = httpx.post(live.url + "/tokenize", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"


def test_rate_limiter_buckets():
    clock = [0.0]
    lim = RateLimiter(clock=lambda: clock[0], max_callers=3)
    limits = RateLimits(requests_per_second=0.5, request_burst=2, tokens_per_minute=600)
    for _ in range(2):
        lim.admit("a", limits, "a")
    with pytest.raises(APIError) as info:
        lim.admit("a", limits, "a")
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "2"  # one request per 2 s
    clock[0] = 2.0
    lim.admit("a", limits, "a")
    lim.charge("a", limits, 600, "a")  # the whole minute
    with pytest.raises(APIError) as info:
        lim.charge("a", limits, 1, "a")
    assert info.value.headers["Retry-After"] == "1"  # 10 tokens a second
    with pytest.raises(APIError) as info:
        lim.charge("a", limits, 601, "a")
    assert info.value.status == 400
    for who in "bcd":  # past max_callers the least recently used caller is forgotten
        lim.admit(who, limits, who)
    assert len(lim) == 3
    lim.admit("a", limits, "a")  # "a" was evicted: it starts afresh with a full bucket
    clock[0] = 1000.0
    assert lim.prune() == 3 and len(lim) == 0  # idle callers' full buckets are forgotten
    # a key's own limits replace the http section's, the burst going with its rate
    defaults = RateLimits(requests_per_second=10, request_burst=50, tokens_per_minute=1000)
    assert defaults.over(RateLimits(requests_per_second=1)) == RateLimits(1, None, 1000)
    assert defaults.over(RateLimits(tokens_per_minute=5)) == RateLimits(10, 50, 5)
    assert RateLimits(requests_per_second=0.2).burst == 1 and RateLimits(requests_per_second=7.5).burst == 8
    ring = Keyring.from_specs([ApiKeySpec(name="k", key="sk-k-123", requests_per_second=3)], defaults=defaults)
    assert ring.authenticate("Bearer sk-k-123").limits == RateLimits(3, None, 1000)
    with pytest.raises(ValueError, match="request_burst"):
        AppConfig(http={"request_burst": 4})


# ---- 3. body deadline, proxy queue -------------------------------------------------------------------------
def _slow_upload(port: int, key: str, declared: int = 200) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n")
    sock.sendall(head.encode() + b'{"prompt": "a slow')
    return sock


def _read_response(sock: socket.socket) -> tuple[int, str]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 20:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def test_a_slow_upload_gets_408_and_frees_its_slot(live):
    make_ingress(body_timeout_s=0.5, **keyed(low={"max_concurrent": 1}))
    t0 = time.monotonic()
    sock = _slow_upload(live.port, LOW)
    try:
        r = httpx.get(live.url + "/v1/models", headers={"authorization": f"Bearer {HIGH}"}, timeout=5)
        assert r.status_code == 200  # the app answers others meanwhile
        status, body = _read_response(sock)
    finally:
        sock.close()
    waited = time.monotonic() - t0
    assert status == 408 and 0.4 <= waited < 10, (status, waited)
    err = json.loads(body[body.index("{"):body.rindex("}") + 1])["error"]
    assert err["code"] == "request_timeout" and "0.5 seconds" in err["message"]
    assert post(live, {"prompt": "hi"}).status_code == 200  # the key's one slot was released


def test_the_proxy_queue_is_finite_by_default():
    from app.config import INGRESS
    from deployments.builder import build_app

    ingress = build_app({"engine": {"model": MODEL}})._bound_deployment
    conf = ingress._deployment_config
    assert ingress.name == INGRESS and conf.max_queued_requests == AppConfig().http.max_queued == 1024
    assert conf.backpressure_config.status_code == 429 and conf.backpressure_config.retry_after_s == 1
    assert AppConfig().http.body_timeout_s == 30 and AppConfig().http.requests_per_second is None


# ---- 4. unexpected exceptions ------------------------------------------------------------------------------
def test_an_unexpected_exception_is_a_json_500_with_a_request_id(live, caplog):
    openai = pytest.importorskip("openai")
    ing = make_ingress(**keyed())

    def boom(req):
        raise RuntimeError("injected fault in a handler")

    ing.completions.sampling = boom
    with caplog.at_level(logging.ERROR, logger="app.middleware"):
        r = post(live, {"prompt": "hi"})
    err = error_of(r, 500)
    rid = r.headers["x-request-id"]
    assert err["type"] == "server_error" and rid in err["message"] and "injected" not in r.text
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and "injected fault in a handler" in logged[0].exc_text
    # Serve's proxy gives every request an id (x-request-id): the error names that one
    r = post(live, {"prompt": "hi"}, headers={"x-request-id": "serve-req-42"})
    assert "serve-req-42" in error_of(r, 500)["message"] and "x-request-id" not in r.headers
    with pytest.raises(openai.InternalServerError):
        openai_client(live, max_retries=0).completions.create(model=MODEL, prompt="hi", max_tokens=4)
    body, _ = ing.metrics.render()
    assert 'reason="error"} 3.0' in body.decode()
    # a debug handler too
    ing.dispatcher.describe = lambda: 1 / 0
    r = httpx.get(live.url + "/debug/instances", headers={"authorization": f"Bearer {LOW}"}, timeout=30)
    assert error_of(r, 500)["type"] == "server_error"


def test_a_stream_that_fails_midway_ends_with_an_error_event(live, caplog):
    openai = pytest.importorskip("openai")
    make_ingress(**keyed())
    Current.stream_fail_after = 3  # accepted and two deltas, then the fault
    with caplog.at_level(logging.ERROR, logger="app.completions"):
        r = post(live, {"prompt": "hi", "stream": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events[:2]] == ["he", "ll"]
    assert events[2]["error"]["type"] == "server_error" and len(events) == 3  # no finish, no usage
    assert r.text.endswith("data: [DONE]\n\n")  # the response ends as when a choice's instance fails
    assert any("injected fault in the stream" in (rec.exc_text or "") for rec in caplog.records)
    with pytest.raises(openai.APIError):  # the client raises on the error event
        for _ in openai_client(live).completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True):
            pass
    # a fault in the stream's own loop: an error event ends the response
    ing = make_ingress(**keyed())

    def gap_timer():
        def gap(index=0):
            raise RuntimeError("injected fault in the stream's loop")
        return gap

    ing.metrics.gap_timer = gap_timer
    r = post(live, {"prompt": "hi", "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and events[-1]["error"]["type"] == "server_error" and "[DONE]" not in r.text
    body, _ = ing.metrics.render()
    assert 'reason="error"} 1.0' in body.decode() and 'reason="cancelled"} 0.0' in body.decode()


# ---- 5. a huge prompt ---------------------------------------------------------------------------------------
def test_a_huge_prompt_is_refused_before_tokenizing(live):
    openai = pytest.importorskip("openai")
    ing = make_ingress(**keyed(low={"max_prompt_tokens": 48}))
    calls = []
    encode = ing.tokenizer.completion_ids

    def spy(prompt, block):
        calls.append(threading.current_thread())
        return encode(prompt, block)

    ing.tokenizer.completion_ids = spy
    huge = "a" * ((1 << 20) - 200)  # fits the 1 MiB body
    t0 = time.monotonic()
    err = error_of(post(live, {"prompt": huge}, key=HIGH), 400)
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert time.monotonic() - t0 < 5 and not calls  # never tokenized
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(live, HIGH).completions.create(model=MODEL, prompt=huge, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    ing.tokenizer.chat_ids = lambda *a, **kw: calls.append("chat")
    messages = [{"role": "system", "content": "s" * 3000}, {"role": "user", "content": huge[5000:]}]
    chat = post(live, {"messages": messages}, key=HIGH, path="/v1/chat/completions")
    assert error_of(chat, 400)["code"] == "context_length_exceeded" and not calls
    # the key's own prompt limit is checked the same way, before tokenizing
    assert error_of(post(live, {"prompt": "b" * 1000}), 400)["code"] == "prompt_too_long" and not calls
    ids = [10 + i % 50 for i in range(ing.model_cfg.max_position_embeddings)]  # token ids: counted exactly
    assert "context" in error_of(post(live, {"prompt": ids}, key=HIGH), 400)["message"] and not calls
    # a prompt that may fit is tokenized, in a worker thread (the event loop runs uvicorn's thread)
    assert post(live, {"prompt": "hello there"}).status_code == 200
    assert calls and all(t is not live.thread for t in calls)
    assert ing.completions.chars_per_token == max(len(t) for t in ing.tokenizer.vocab)
    n = len(encode("x" * 40, ing.model_cfg.block_size))
    assert n >= math.ceil(40 / ing.completions.chars_per_token)  # the bound the check relies on


# ---- /debug behind the keys, the planner off the event loop -------------------------------------------------
def test_every_debug_route_needs_a_key(live):
    from app.routes import build_web

    web = build_web(lambda: Current.ingress)
    make_ingress(**keyed())
    debug = sorted(p for p in web.openapi()["paths"] if p.startswith("/debug"))
    assert len(debug) >= 5, debug
    for path in debug:
        r = httpx.get(live.url + path, timeout=30)
        assert error_of(r, 401)["code"] == "invalid_api_key", path
        assert httpx.get(live.url + path, headers={"authorization": f"Bearer {LOW}"}, timeout=30).status_code == 200


def test_planner_state_is_read_off_the_event_loop(live):
    ing = make_ingress(**keyed())
    gate = threading.Event()

    class SolvingPlanner:  # every call waits for the solve under way (the service's lock)
        def metrics(self):
            gate.wait(10)
            return {"target_tp1": 1.0}

        def describe(self):
            gate.wait(10)
            return {"targets": {1: 1}}

    ing.planner = SolvingPlanner()
    done: list = []
    t = threading.Thread(target=lambda: done.append(httpx.get(
        live.url + "/debug/cluster", headers={"authorization": f"Bearer {LOW}"}, timeout=30)))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert httpx.get(live.url + "/health", timeout=5).status_code == 503  # answered during the solve
    assert time.monotonic() - t0 < 2 and not done
    gate.set()
    t.join(10)
    assert done[0].status_code == 200 and done[0].json()["planner"]["targets"] == {"1": 1}

    async def stats():
        gate.clear()
        task = asyncio.ensure_future(ing.record_autoscaling_stats())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(0.05)
        lag = loop.time() - t0
        gate.set()
        return lag, await task

    lag, result = asyncio.run(stats())
    assert lag < 1 and result == {"target_tp1": 1.0}
