"""The live app under abuse: API keys and their limits, hand-written bad input, and a schema fuzz run.

One Ray Serve app for the module (on the session's shared Ray cluster, tests/serving.py) with three API
keys: ``main`` (from an environment variable of the replica, no limits of its own), ``tight`` (from a
file; 1 request at a time, 48 prompt tokens, max_tokens 4) and ``metered`` (one request per 2 s, priority
up to 3); bodies must arrive within 6 s. The app's max_tokens limit is 8 to keep generation short. Every
answer must be < 500, arrive within the client timeout, and carry an OpenAI-style error body when it is
a 4xx; normal requests keep working throughout.

The fuzz test generates ``REMASK_FUZZ_EXAMPLES`` (default 125) schema-valid and as many schema-violating
cases for each POST route (25 each for the GET routes) from the app's own ``/openapi.json`` with
schemathesis (in a thread started when the app is up, while the tests before it run: ``FuzzCases``); a
larger run is ``REMASK_FUZZ_EXAMPLES=1500 pytest -q tests/test_serve_guard.py -k fuzz``
(``REMASK_FUZZ_SEED`` picks other cases).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving import BASE, PORT, REPLICA_ENV, delete_apps, deploy, quick_stops, wait_until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

KEY = REPLICA_ENV["REMASK_GUARD_KEY"]  # set before the shared Ray cluster starts (tests/serving.py)
TIGHT = "sk-remask-guard-tight-77b20e"
WRONG = "sk-remask-guard-wrong-d41d8c"
METERED = "sk-remask-guard-metered-5e0a44"
BODY_TIMEOUT_S = 6
BODY_LIMIT = 256 * 1024
TIMEOUT = 60  # a hang fails the test
FUZZ: dict[str, FuzzCases] = {}  # the fuzz cases of the app at a URL, generating since it came up


@pytest.fixture(scope="module")
def app_url(ray_serve, tmp_path_factory, request):
    key_file = tmp_path_factory.mktemp("keys") / "tight.key"
    key_file.write_text(TIGHT + "\n")
    # no start-time profile (engine.profile_seconds 0): nothing here reads the router's prices, and the replica
    # starts ~3 s sooner; its stopping replicas look every 0.2 s whether they are drained (quick_stops)
    args = {"engine": {"model": "tiny-bd", "slots": 16, "max_waiting": 64, "profile_seconds": 0},
            "http": {"max_tokens_limit": 8, "max_body_bytes": BODY_LIMIT, "body_timeout_s": BODY_TIMEOUT_S,
                     "api_keys": [{"name": "main", "key_env": "REMASK_GUARD_KEY"},
                                  {"name": "tight", "key_file": str(key_file), "max_concurrent": 1,
                                   "max_prompt_tokens": 48, "max_tokens": 4},
                                  {"name": "metered", "key": METERED, "requests_per_second": 0.5,
                                   "max_priority": 3}]}}
    try:  # deleted however the module ends, set-up included
        # the replica inherits the key from the environment that starts Ray (Ray's runtime_env would log it)
        deploy({"name": "remask-guard", "route_prefix": "/", "args": args, "deployments": quick_stops()})
        wait_until(lambda: httpx.get(f"{BASE}/health", timeout=2).status_code == 200)
        if any(item.name == "test_fuzz_from_openapi_schema" for item in request.session.items) \
                and importlib.util.find_spec("schemathesis") is not None:
            FUZZ[BASE] = FuzzCases(BASE)  # generated beside the tests before the fuzz test
        yield BASE
    finally:
        delete_apps("remask-guard")


def auth(key: str | None = KEY) -> dict:
    return {"authorization": f"Bearer {key}"} if key else {}


def post(path: str, body, key: str | None = KEY, headers: dict | None = None, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    hdrs = {"content-type": "application/json", **auth(key), **(headers or {})}
    return httpx.post(BASE + path, content=content, headers=hdrs, timeout=TIMEOUT, **kw)


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    return err


def completion_ok(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 0
    return choice["text"]


# ---------------------------------------------------------------------------------------------------------------
# Access
# ---------------------------------------------------------------------------------------------------------------


def test_keys_guard_api_and_debug_but_not_health_metrics_or_schema(app_url):
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(app_url + path, timeout=TIMEOUT).status_code == 200, path
    for path in ("/v1/models", "/debug/instances", "/debug/control", "/debug/planner", "/debug/cluster",
                 "/debug/predictors"):
        r = httpx.get(app_url + path, timeout=TIMEOUT)
        assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(app_url + path, headers=auth(), timeout=TIMEOUT).status_code == 200, path
    assert httpx.get(app_url + "/v1/models", headers=auth(TIGHT), timeout=TIMEOUT).json()["data"][0]["id"] == "tiny-bd"
    doc = httpx.get(app_url + "/openapi.json", timeout=TIMEOUT).json()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


@pytest.mark.parametrize("headers", [{}, auth(WRONG), {"authorization": f"Basic {KEY}"}, auth(KEY[:-1]),
                                     auth(KEY + " extra"), {"authorization": "Bearer"}])
def test_missing_or_wrong_key_is_401_and_never_echoed(app_url, headers):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(app_url + path, json={"prompt": "rev: ab", "messages": [{"role": "user", "content": "x"}]},
                       headers=headers, timeout=TIMEOUT)
        err = assert_openai_error(r, 401)
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
        for secret in (KEY, TIGHT, WRONG, KEY[:-1]):
            assert secret not in r.text and secret not in str(r.headers)


def test_logs_never_contain_keys(app_url):
    post("/v1/completions", {"prompt": "rev: ab"}, key=WRONG)
    completion_ok(post("/v1/completions", {"prompt": "rev: ab", "max_tokens": 8}))
    logs_dir = ray._private.worker._global_node.get_logs_dir_path()
    time.sleep(1.0)  # the log files are flushed by the workers
    seen = 0
    for root, _, files in os.walk(logs_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            seen += 1
            for secret in (KEY, TIGHT, WRONG):
                assert secret.encode() not in data, (name, secret)
    assert seen > 0


def test_per_key_token_limits(app_url):
    err = assert_openai_error(post("/v1/completions", {"prompt": "rev: ab", "max_tokens": 5}, key=TIGHT), 400)
    assert err["param"] == "max_tokens" and err["code"] == "integer_above_max_value"
    err = assert_openai_error(post("/v1/completions", {"prompt": "rev: " + "a" * 60, "max_tokens": 4}, key=TIGHT),
                              400)
    assert err["param"] == "prompt" and err["code"] == "prompt_too_long"
    r = post("/v1/completions", {"prompt": "rev: abc"}, key=TIGHT)  # the default max_tokens is capped to 4
    assert completion_ok(r) == "cba" and r.json()["usage"]["completion_tokens"] <= 4
    # the same requests are fine for the key without limits of its own
    completion_ok(post("/v1/completions", {"prompt": "rev: " + "a" * 60, "max_tokens": 8}))


class SlowUpload:
    """A request whose body stops half-way until ``finish()`` (or ``abort()``): the server holds its slot."""

    def __init__(self, key: str) -> None:
        self.go, self.fail, self.response, self.error = threading.Event(), False, None, None
        self.thread = threading.Thread(target=self._run, args=(key,))
        self.thread.start()

    def _body(self):
        yield b'{"prompt": "rev: abc", '
        self.go.wait(TIMEOUT)
        if self.fail:
            raise RuntimeError("client gave up mid-upload")
        yield b'"max_tokens": 4}'

    def _run(self, key: str) -> None:
        try:
            self.response = httpx.post(BASE + "/v1/completions", content=self._body(), timeout=TIMEOUT,
                                       headers={"content-type": "application/json", **auth(key)})
        except Exception as exc:  # the abort path
            self.error = exc

    def finish(self, fail: bool = False) -> None:
        self.fail = fail
        self.go.set()
        self.thread.join(TIMEOUT)


def eventually_ok(key: str, seconds: float = 10.0) -> httpx.Response:
    """A normal request of ``key``, retried while it gets 429 (a slot is being released)."""
    end = time.monotonic() + seconds
    while True:
        r = post("/v1/completions", {"prompt": "rev: abc", "max_tokens": 4}, key=key)
        if r.status_code != 429 or time.monotonic() > end:
            return r
        time.sleep(0.2)


def test_concurrency_limit_429_with_retry_after_and_release(app_url):
    r = None
    for attempt in range(1, 6):  # the slow request must reach the ingress first, or it is the one refused
        slow = SlowUpload(TIGHT)
        time.sleep(0.5 * attempt)
        r = post("/v1/completions", {"prompt": "rev: ab", "max_tokens": 4}, key=TIGHT)
        if r.status_code == 429:
            break
        slow.finish()
    try:
        err = assert_openai_error(r, 429)
        assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
        completion_ok(post("/v1/completions", {"prompt": "rev: ab", "max_tokens": 4}))  # other keys: unaffected
    finally:
        slow.finish()
    assert completion_ok(slow.response) == "cba"
    assert completion_ok(eventually_ok(TIGHT)) == "cba"


def test_slot_is_released_after_errors_and_disconnects(app_url):
    for body in (b"{oops", {"prompt": "x", "max_tokens": -1}, {"prompt": 5}, b"[" * 1000):
        assert_openai_error(post("/v1/completions", body, key=TIGHT))
    assert_openai_error(post("/v1/completions", b"x" * (BODY_LIMIT + 1), key=TIGHT), 413)
    assert completion_ok(post("/v1/completions", {"prompt": "rev: abc", "max_tokens": 4}, key=TIGHT)) == "cba"
    # a client that goes away mid-upload
    slow = SlowUpload(TIGHT)
    time.sleep(1.0)
    slow.finish(fail=True)
    assert slow.error is not None
    assert completion_ok(eventually_ok(TIGHT)) == "cba"
    # a client that goes away mid-stream
    for _ in range(3):
        with httpx.stream("POST", app_url + "/v1/chat/completions", headers=auth(TIGHT), timeout=TIMEOUT, json={
                "messages": [{"role": "user", "content": "story: owl 8"}], "max_tokens": 4, "threshold": 1.0,
                "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        assert completion_ok(eventually_ok(TIGHT)) == "cba"


def test_priority_and_rate_limits_through_the_proxy(app_url):
    err = assert_openai_error(post("/v1/completions", {"prompt": "rev: ab", "priority": 1}), 403)
    assert err["param"] == "priority" and err["code"] == "priority_not_allowed"
    completion_ok(post("/v1/completions", {"prompt": "rev: ab", "priority": 3}, key=METERED))
    r = post("/v1/completions", {"prompt": "rev: ab", "priority": 3}, key=METERED)
    err = assert_openai_error(r, 429)
    assert err["code"] == "rate_limit_exceeded" and r.headers["retry-after"] == "2" and r.headers["x-request-id"]
    time.sleep(2)
    assert completion_ok(post("/v1/completions", {"prompt": "rev: abc"}, key=METERED)) == "cba"


def test_a_slow_upload_gets_408_through_the_proxy(app_url):
    import socket

    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", PORT), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TIGHT}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ".encode())
        data = b""
        while b"}}" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    waited = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408" and BODY_TIMEOUT_S - 1 <= waited < TIMEOUT, (head, waited)
    assert b'"request_timeout"' in body
    assert completion_ok(eventually_ok(TIGHT)) == "cba"  # its slot (max_concurrent 1) was released


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------


def test_body_limit_is_413(app_url):
    big = json.dumps({"prompt": "a" * (BODY_LIMIT + 10)})
    t0 = time.monotonic()
    assert assert_openai_error(post("/v1/completions", big), 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(64):
            yield b" " * 16384

    r = httpx.post(app_url + "/v1/chat/completions", content=chunks(), timeout=TIMEOUT,
                   headers={"content-type": "application/json", **auth()})
    assert_openai_error(r, 413)
    # a 64 MiB declared body is refused without reading it
    r = post("/v1/completions", b"{" + b" " * (64 << 20) + b"}")
    assert_openai_error(r, 413)
    assert time.monotonic() - t0 < 30
    completion_ok(post("/v1/completions", {"prompt": "rev: ab", "max_tokens": 8}))


DEEP = 100_000
BAD_BODIES = {
    "empty": b"",
    "null": b"null",
    "array": b"[]",
    "string": b'"prompt"',
    "number_overflow": b"1e999",
    "not_json": b"{not json",
    "trailing_garbage": b'{"prompt": "x"} tail',
    "deep_array": b"[" * DEEP + b"]" * DEEP,
    "deep_object": b'{"a":' * (DEEP // 6) + b"1" + b"}" * (DEEP // 6),
    "deep_in_field": b'{"prompt": "x", "extra": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "moderately_deep_prompt": json.dumps({"prompt": json.loads("[" * 500 + "]" * 500)}).encode(),
    "invalid_utf8": b'{"prompt": "\xff\xfe\xfd"}',
    "invalid_utf8_key": b'{"\xc3\x28": 1, "prompt": "x"}',
    "overlong_utf8": b'{"prompt": "\xc0\xaf"}',
    "utf16_bom": '{"prompt": "rev: ab", "max_tokens": 4}'.encode("utf-16"),
    "nul_bytes": b'{"prompt": "x\x00"}',
    "escaped_nul": b'{"prompt": "rev: a\\u0000b", "max_tokens": 4}',
    "lone_surrogate_model": b'{"prompt": "x", "model": "\\ud800"}',
    "lone_surrogate_role": b'{"messages": [{"role": "\\udfff", "content": "x"}]}',
    "duplicate_keys": b'{"prompt": 1, "prompt": "rev: ab", "max_tokens": 4}',
    "nan_threshold": b'{"prompt": "x", "threshold": NaN}',
    "inf_threshold": b'{"prompt": "x", "threshold": Infinity}',
    "neg_inf_slo": b'{"prompt": "x", "slo_ms": -Infinity}',
    "overflow_slo": b'{"prompt": "x", "slo_ms": 1e400}',
    "nan_temperature": b'{"prompt": "x", "temperature": NaN}',
    "nan_max_tokens": b'{"prompt": "x", "max_tokens": NaN}',
    "huge_int_priority": b'{"prompt": "rev: ab", "max_tokens": 4, "priority": ' + b"9" * 4000 + b"}",
    "huge_slo": b'{"prompt": "rev: ab", "max_tokens": 4, "slo_ms": 1e300}',
    "tiny_threshold": b'{"prompt": "rev: ab", "max_tokens": 4, "threshold": 5e-324}',
}
MAX_TOKENS = [-1, 0, -(2**63), 2**63, 10**30, 10**4000, 1e308, 1.5, 16.0, "8", True, None, [8], {"n": 8}]


def _case(name: str, kind: str, body) -> tuple[str, httpx.Response]:
    return name, post("/v1/completions" if kind == "completion" else "/v1/chat/completions", body)


def test_bad_input_never_5xx_never_hangs_never_disturbs_others(app_url):
    stop, canary = threading.Event(), []

    def keep_serving():  # a normal client, throughout the barrage
        while not stop.is_set():
            r = post("/v1/completions", {"prompt": "rev: abcde", "max_tokens": 8, "threshold": 0.9})
            canary.append((r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))

    cases = [(f"{k}/{kind}", kind, v) for k, v in BAD_BODIES.items() for kind in ("completion", "chat")]
    for v in MAX_TOKENS:
        cases.append((f"max_tokens={v!r:.20}", "completion", {"prompt": "rev: ab", "max_tokens": v}))
        cases.append((f"max_completion_tokens={v!r:.20}", "chat",
                      {"messages": [{"role": "user", "content": "rev: ab"}], "max_completion_tokens": v}))
    many = [{"role": "user", "content": "a"}] * 5000
    cases += [("5000_messages", "chat", {"messages": many}),
              ("5000_empty_messages", "chat", {"messages": [{"role": "user", "content": ""}] * 5000}),
              ("20000_messages_over_limit", "chat", {"messages": many * 4}),
              ("5000_part_content", "chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                                                           * 5000}]}),
              ("5000_prompts", "completion", {"prompt": ["a"] * 5000}),
              ("long_prompt", "completion", {"prompt": "a" * 200_000, "max_tokens": 4})]
    guard = threading.Thread(target=keep_serving)
    guard.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda c: _case(*c), cases))
    finally:
        stop.set()
        guard.join(TIMEOUT)
    for name, r in results:
        assert r.status_code < 500, (name, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert_openai_error(r)
    statuses = dict(results)
    for name in ("not_json/completion", "deep_array/chat", "deep_in_field/completion", "invalid_utf8/chat",
                 "nan_threshold/completion", "inf_threshold/completion", "neg_inf_slo/completion",
                 "overflow_slo/completion", "nan_max_tokens/completion", f"max_tokens={10**30!r:.20}",
                 "5000_messages", "long_prompt"):
        assert statuses[name].status_code == 400, (name, statuses[name].text[:200])
    assert statuses["20000_messages_over_limit"].status_code == 413
    assert statuses["lone_surrogate_model/completion"].status_code == 404
    for name in ("utf16_bom/completion", "escaped_nul/completion", "huge_slo/completion",
                 "tiny_threshold/completion", "duplicate_keys/completion"):
        completion_ok(statuses[name])
    err = assert_openai_error(statuses["huge_int_priority/completion"], 403)  # the key's max_priority is 0
    assert err["code"] == "priority_not_allowed" and "asked for more" in err["message"]
    assert canary and all(c == (200, "edcba") for c in canary), canary[:5]


UNICODE_PROMPTS = [
    "rev: héllo", "rev: straße", "rev: İstanbul", "中文提示：翻转", "rev: 😀🙂👍🏽", "rev: e\u0301\u0301\u0301",
    "\u202erev: abc", "rev: a\u200bb\u200dc", "\ufeffrev: abc", "rev: \U0010ffff", "ﷺ" * 40, "\t\r\n\x0b\x0c",
    "Ǆǅǆ ΣΑΣ ὒ ﬃ", "\ud800", "x\udfffy", "",
]


@pytest.mark.parametrize("stream", [False, True])
def test_unicode_prompts_get_sensible_completions(app_url, stream):
    # the tiny model's character tokenizer maps what it cannot encode to <unk>: a completion, not an error
    # (json.dumps escapes lone surrogates, which UTF-8 cannot carry)
    def one(prompt):
        if stream:
            body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": True})
            with httpx.stream("POST", app_url + "/v1/chat/completions", headers=auth(), timeout=TIMEOUT,
                              content=body) as r:
                lines = [x for x in r.iter_lines() if x.startswith("data: ")]
            assert r.status_code == 200 and lines[-1] == "data: [DONE]", prompt
            return "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or "" for x in lines[:-1])
        r = post("/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 8}))
        if prompt == "":  # an empty completion prompt is refused (an empty chat message is not)
            assert assert_openai_error(r, 400)["param"] == "prompt"
            return ""
        return completion_ok(r)

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, UNICODE_PROMPTS))
    assert all(isinstance(t, str) for t in texts)
    r = post("/v1/completions", {"prompt": "rev: " + "é" * 600, "max_tokens": 4})
    assert assert_openai_error(r, 400)["code"] == "context_length_exceeded"


WRONG_VALUES = [None, True, -1, 1.5, "s", [1, "a"], {"a": [1]}, 2**64]
FIELDS = {
    "completion": ["model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p", "n", "stop",
                   "user", "slo_ms", "priority", "threshold"],
    "chat": ["model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "temperature",
             "top_p", "n", "stop", "user", "slo_ms", "priority", "threshold"],
}


def kind_of(name: str) -> str:
    return "completion" if name.startswith(("completion.", "include_usage")) else "chat"


def test_wrong_types_for_every_field(app_url):
    base = {"completion": {"prompt": "rev: ab", "max_tokens": 4},
            "chat": {"messages": [{"role": "user", "content": "rev: ab"}], "max_tokens": 4}}
    cases = []
    for kind, fields in FIELDS.items():
        for field in fields:
            for value in WRONG_VALUES:
                cases.append((f"{kind}.{field}={value!r:.20}", kind, {**base[kind], field: value}))
    for value in WRONG_VALUES:  # inside a chat message and the stream options
        msg = {"role": "user", "content": "rev: ab"}
        for field in ("role", "content"):
            cases.append((f"message.{field}={value!r:.20}", "chat", {**base["chat"], "messages": [{**msg,
                                                                                                 field: value}]}))
        cases.append((f"message={value!r:.20}", "chat", {**base["chat"], "messages": [value]}))
        cases.append((f"content_part={value!r:.20}", "chat",
                      {**base["chat"], "messages": [{"role": "user", "content": [value]}]}))
        cases.append((f"include_usage={value!r:.20}", "completion",
                      {**base["completion"], "stream_options": {"include_usage": value}}))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: _case(*c), cases))
    assert len(results) > 250
    codes = {}
    for name, r in results:
        assert r.status_code < 500, (name, r.status_code, r.text[:300])
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
        if r.status_code >= 400:
            assert_openai_error(r)
        elif kind_of(name) == "completion" and not r.headers["content-type"].startswith("text/event-stream"):
            completion_ok(r)
    assert codes.get(400, 0) > 80 and codes.get(200, 0) > 20, codes


@pytest.mark.parametrize("ctype,body,ok", [
    ("text/plain", json.dumps({"prompt": "rev: ab", "max_tokens": 4}), True),
    (None, json.dumps({"prompt": "rev: ab", "max_tokens": 4}), True),
    ("application/x-www-form-urlencoded", "prompt=rev%3A+ab&max_tokens=4", False),
    ("multipart/form-data; boundary=xyz", '--xyz\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n--xyz--',
     False),
    ("application/json; charset=latin-1", '{"prompt": "rev: \xe9"}'.encode("latin-1"), False),
    ("application/octet-stream", bytes(range(256)), False),
    ("application/xml", "<prompt>x</prompt>", False),
])
def test_non_json_content_types(app_url, ctype, body, ok):
    hdrs = {**auth(), **({"content-type": ctype} if ctype else {})}
    r = httpx.post(app_url + "/v1/completions", content=body, headers=hdrs, timeout=TIMEOUT)
    if ok:  # the body is JSON whatever the header says, as OpenAI's API reads it
        completion_ok(r)
    else:
        assert assert_openai_error(r, 400)["code"] in ("invalid_json", "invalid_type")


def test_unknown_routes_and_methods_get_openai_errors(app_url):
    assert assert_openai_error(httpx.get(app_url + "/v1/nope", headers=auth(), timeout=TIMEOUT), 404)["type"] \
        == "not_found_error"
    assert_openai_error(httpx.get(app_url + "/v1/completions", headers=auth(), timeout=TIMEOUT), 405)
    assert_openai_error(httpx.get(app_url + "/debug/control?since=abc", headers=auth(), timeout=TIMEOUT), 400)


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing from the OpenAPI document
# ---------------------------------------------------------------------------------------------------------------


# Ray Serve's HTTP proxy (uvicorn) answers a malformed request (e.g. a control character in a header) itself,
# before the app sees it, with this plain-text 400
PROXY_400 = "Invalid HTTP request received."


class Tally:
    def __init__(self) -> None:
        self.sent, self.statuses, self.server_errors, self.bad_bodies, self.proxy_rejected = 0, {}, [], [], 0

    def add(self, label: str, case, r) -> None:
        self.sent += 1
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        what = (label, r.status_code, case.headers, repr(case.query), repr(case.body)[:300], r.text[:200])
        if r.status_code >= 500:
            self.server_errors.append(what)
        elif r.status_code == 400 and r.text == PROXY_400:
            self.proxy_rejected += 1
        elif r.status_code >= 400:
            try:
                ok = set(r.json()["error"]) == {"message", "type", "param", "code"}
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                self.bad_bodies.append(what)


class FuzzCases:
    """The fuzz test's cases, generated by schemathesis from the app's own ``/openapi.json`` in a thread of their own,
    started as soon as the app answers (``app_url``): hypothesis's generation is ~12 s of CPU, done while the
    module's other tests mostly wait on the app (a slow upload, rate limits, paced replays), not ahead of the
    fuzz test's requests. ``REMASK_FUZZ_EXAMPLES`` (default 125) schema-valid and as many schema-violating cases a
    POST operation, 25 a GET; ``REMASK_FUZZ_SEED`` picks them. The cases are the same whenever they are sent."""

    def __init__(self, url: str) -> None:
        self.per_mode = int(os.environ.get("REMASK_FUZZ_EXAMPLES", "125"))
        self.seed = int(os.environ.get("REMASK_FUZZ_SEED", "20251130"))
        self.cases: list[tuple[str, object]] = []  # (label, case), in generation order
        self.unsatisfiable: list[tuple[str, object]] = []  # (operation, mode) without any case
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._generate, args=(url,), name="fuzz-cases", daemon=True)
        self._thread.start()

    def _generate(self, url: str) -> None:
        try:
            import schemathesis
            from hypothesis.errors import Unsatisfiable

            schema = schemathesis.openapi.from_url(url + "/openapi.json")
            for result in schema.get_all_operations():
                op = result.ok()
                for mode in schemathesis.GenerationMode:
                    examples = self.per_mode if op.method.upper() == "POST" else 25
                    try:
                        self._operation(op, mode, examples)
                    except Unsatisfiable:  # a GET without parameters has no schema-violating request
                        if op.method.upper() == "POST":
                            raise
                        self.unsatisfiable.append((op.label, mode))
        except BaseException as exc:  # the fuzz test raises it
            self.error = exc

    def _operation(self, op, mode, examples: int) -> None:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import seed as with_seed

        @with_seed(self.seed)
        @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            self.cases.append((f"{op.label} ({mode.value})", case))

        run()

    def result(self, timeout_s: float) -> list[tuple[str, object]]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the fuzz cases were not generated within {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.cases


def test_fuzz_from_openapi_schema(app_url):
    """Schema-valid (positive) and schema-violating (negative) cases for every operation of the app's own
    OpenAPI document, from schemathesis (``FuzzCases``): no answer may be a 5xx, every 4xx is an OpenAI error body."""
    schemathesis = pytest.importorskip("schemathesis")

    fuzz = FUZZ.get(app_url) or FuzzCases(app_url)
    cases = fuzz.result(300)
    assert all(mode == schemathesis.GenerationMode.NEGATIVE for _, mode in fuzz.unsatisfiable), fuzz.unsatisfiable
    tally, t0 = Tally(), time.monotonic()
    with ThreadPoolExecutor(4) as pool:  # four requests in flight
        sent = [(label, case, pool.submit(case.call, base_url=app_url, headers=auth(), timeout=TIMEOUT))
                for label, case in cases]
        for label, case, answer in sent:
            try:
                r = answer.result()
            except Exception as exc:  # no answer within the client timeout, or the connection failed
                raise AssertionError(f"{label}: {exc!r} for {case.headers} {case.query!r} {repr(case.body)[:300]}") \
                    from exc
            tally.add(label, case, r)
    print(f"fuzz: {tally.sent} requests in {time.monotonic() - t0:.0f} s, statuses "
          f"{dict(sorted(tally.statuses.items()))}, {len(tally.server_errors)} server errors, "
          f"{len(tally.bad_bodies)} 4xx without an OpenAI error body ({tally.proxy_rejected} malformed HTTP "
          "requests answered by the proxy)")
    assert not tally.server_errors, tally.server_errors[:5]
    assert not tally.bad_bodies, tally.bad_bodies[:5]
    assert tally.sent >= 1000 or fuzz.per_mode < 125, tally.sent
    assert tally.statuses.get(200, 0) > 100 and tally.statuses.get(400, 0) > 100, tally.statuses


def test_normal_requests_unaffected_afterwards(app_url):
    r = post("/v1/completions", {"prompt": "rev: abcde", "max_tokens": 8})
    assert completion_ok(r) == "edcba"
    with httpx.stream("POST", app_url + "/v1/chat/completions", headers=auth(), timeout=TIMEOUT, json={
            "messages": [{"role": "user", "content": "max: a3 b9 c1 d2"}], "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or "" for x in lines[:-1]) == "b"
    state = {}
    for _ in range(100):  # nothing left behind on the instance
        (state,) = httpx.get(app_url + "/debug/instances", headers=auth(), timeout=TIMEOUT).json()["instances"].values()
        if state["running"] == 0 and state["resident"] == 0 and state["requests"] == 0:
            break
        time.sleep(0.1)
    assert state["running"] == 0 and state["resident"] == 0 and state["requests"] == 0, state


def test_loadgen_replay_with_an_api_key(app_url, tmp_path):
    """`remask loadgen replay --api-key K` against the keyed app: every request completes; without the key
    every request gets 401 and the tool says so."""
    from loadgen.arrivals import ArrivalParams
    from loadgen.trace import SynthConfig, synth, write_trace
    from tools.cli import main

    trace = tmp_path / "trace.jsonl"
    # max_tokens <= 8; 6 requests a second (the replay keeps the trace's arrival times: at the default 1 a second
    # each replay took about 5 s)
    write_trace(synth(SynthConfig(n=6, seed=0, mix={"choice": 1.0, "reverse": 1.0},
                                  arrival_params=ArrivalParams(rate=6.0))), trace)
    out = tmp_path / "out.json"
    assert main(["loadgen", "replay", "--url", app_url, "--trace", str(trace), "--out", str(out), "--api-key", KEY,
                 "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 6 and KEY not in out.read_text()
    main(["loadgen", "replay", "--url", app_url, "--trace", str(trace), "--out", str(out), "--api-key", "",
          "--quiet"])
    assert json.loads(out.read_text())["summary"]["completed"] == 0


def test_vllm_bench_bodies_through_the_proxy(app_url):
    """The body vLLM's benchmark client sends with --ignore-eos decodes to max_tokens through the real instances;
    the response id is the request id Serve's proxy returns; a chat with logprobs gets one per token."""
    body = {"model": "tiny-bd", "prompt": "rev: abc", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    r = post("/v1/completions", body)
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert chunks[-1]["usage"]["completion_tokens"] == 8  # past the model's end of text, to max_tokens
    assert {c["id"] for c in chunks} == {r.headers["x-request-id"]}
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "max: a3 b9 c1 d2"}],
                                      "logprobs": True, "max_completion_tokens": 8})
    body = r.json()
    assert r.status_code == 200 and body["id"] == r.headers["x-request-id"]
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]
    assert content and all(c["logprob"] <= 0 for c in content)
