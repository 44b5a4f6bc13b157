"""Locust users for a Remask (or any OpenAI-compatible) server.

    locust -f loadgen/locustfile.py --headless -u 5 -r 5 -t 20s --host http://127.0.0.1:8000

Each user streams completions of held-out task-suite prompts and reports, besides Locust's own
``POST`` row (time to response headers), custom events: ``TTFT`` (first text chunk) and ``E2E``
(end of stream) per endpoint in ms, ``ANSWER`` per category (a failure when the answer is wrong,
so the failure ratio is the error rate of answers), and in trace mode ``LAG`` (how late a request
went out after its arrival time).

Trace mode: ``REMASK_TRACE=trace.jsonl locust -f loadgen/locustfile.py --headless --host ...`` adds
``TracePacer``, a LoadTestShape: each request of the trace goes out at its arrival offset, sent by
whichever user is free; the user count follows Little's law (arrivals within the last
``REMASK_LOCUST_LATENCY_S`` seconds, default 10, plus the next second), never decreases (a stopped
user would drop its request) and is capped by ``REMASK_LOCUST_MAX_USERS`` (default 200). The test
ends once every request has been answered. When users run short, requests go out late (see ``LAG``);
``remask loadgen replay`` is the exact open-loop tool. Other settings: ``REMASK_THRESHOLD``,
``REMASK_MODEL``, ``REMASK_SEED``.

API key: ``--api-key KEY`` (a Locust option this file adds; also ``LOCUST_API_KEY=KEY``, or
``api-key = KEY`` in a Locust config file), else ``$OPENAI_API_KEY``: every request then carries
``Authorization: Bearer KEY``. Locust's web UI shows the option masked; the key is never printed.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import time

import gevent
from locust import HttpUser, LoadTestShape, between, events, task

import tasksuite as tasks
from loadgen.client import PATHS, auth_headers, chunk_text, resolve_api_key, unauthorized_hint
from loadgen.lengths import max_tokens_for
from loadgen.trace import TraceRequest, read_trace

TRACE = read_trace(os.environ["REMASK_TRACE"]) if os.environ.get("REMASK_TRACE") else None
THRESHOLD = float(os.environ["REMASK_THRESHOLD"]) if os.environ.get("REMASK_THRESHOLD") else None
MODEL = os.environ.get("REMASK_MODEL") or None


class _Pace:
    """The trace's shared cursor: which request goes next, and how many are still unanswered."""

    def __init__(self, trace: list[TraceRequest]) -> None:
        self.trace, self.next, self.open = trace, 0, len(trace)
        self.arrivals = [r.arrival_s for r in trace]

    def take(self) -> TraceRequest | None:
        if self.next >= len(self.trace):
            return None
        self.next += 1
        return self.trace[self.next - 1]


PACE = _Pace(TRACE) if TRACE is not None else None


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--api-key", default="", env_var="LOCUST_API_KEY", is_secret=True,
                        help="sent as 'Authorization: Bearer KEY' with every request (default: $OPENAI_API_KEY)")


def _fire(env, kind: str, name: str, ms: float, exc: Exception | None = None) -> None:
    env.events.request.fire(request_type=kind, name=name, response_time=ms, response_length=0, exception=exc,
                            context={})


class RemaskUser(HttpUser):
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random(int(os.environ.get("REMASK_SEED", "0")) * 100003 + id(self) % 100003)
        options = self.environment.parsed_options
        self.client.headers.update(auth_headers(resolve_api_key(getattr(options, "api_key", None))))

    def _own_request(self) -> TraceRequest:
        ex = tasks.sample(self.rng, None, split="heldout")
        return TraceRequest(request_id=f"locust-{id(self):x}-{self.rng.getrandbits(32):08x}", arrival_s=0.0,
                            endpoint="completion", max_tokens=max_tokens_for(ex, None, 256), category=ex.category,
                            answer=ex.answer, prompt=ex.prompt, threshold=THRESHOLD)

    @task
    def generate(self) -> None:
        if PACE is None:
            return self.stream(self._own_request())
        req = PACE.take()
        if req is None:
            gevent.sleep(0.5)
            return
        t0 = self.environment.shape_class.start_time
        gevent.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
        _fire(self.environment, "LAG", "send", (time.perf_counter() - t0 - req.arrival_s) * 1000.0)
        try:
            self.stream(req)
        finally:
            PACE.open -= 1

    def stream(self, req: TraceRequest) -> None:
        body = req.body(MODEL)
        if req.threshold is None and THRESHOLD is not None:
            body["threshold"] = THRESHOLD
        path = PATHS[req.endpoint]
        start = time.perf_counter()
        ttft = None
        text = ""
        with self.client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"},
                              stream=True, catch_response=True, name=f"{path} (headers)") as resp:
            if resp.status_code >= 400:
                hint = f" ({unauthorized_hint(self.client.headers.get('Authorization'))})" \
                    if resp.status_code == 401 else ""
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}{hint}")
                return
            try:
                for line in resp.iter_lines(decode_unicode=True):
                    if not line or not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise RuntimeError(f"stream error: {event['error'].get('message')}")
                    piece = chunk_text(event)
                    if piece and ttft is None:
                        ttft = (time.perf_counter() - start) * 1000.0
                    text += piece
            except Exception as exc:  # a broken stream fails this request, not the user
                resp.failure(str(exc))
                return
            resp.success()
        e2e = (time.perf_counter() - start) * 1000.0
        if ttft is not None:
            _fire(self.environment, "TTFT", req.endpoint, ttft)
        _fire(self.environment, "E2E", req.endpoint, e2e)
        ok = req.check(text)
        if ok is not None:  # prompts without a reference answer (a prompts file's) are not checked
            _fire(self.environment, "ANSWER", req.category, 0.0, None if ok else AssertionError("wrong answer"))


if PACE is not None:

    class TracePacer(LoadTestShape):
        latency_s = float(os.environ.get("REMASK_LOCUST_LATENCY_S", "10"))
        max_users = int(os.environ.get("REMASK_LOCUST_MAX_USERS", "200"))
        users = 1

        def tick(self):
            if PACE.open <= 0:
                return None
            t = self.get_run_time()
            arr = PACE.arrivals
            window = bisect.bisect_right(arr, t + 1.0) - bisect.bisect_left(arr, t - self.latency_s)
            self.users = min(self.max_users, max(self.users, window, 1))
            return self.users, 100.0


@events.quitting.add_listener
def _summary(environment, **_kw) -> None:
    if PACE is not None and PACE.open > 0:
        print(f"remask locust: {PACE.open} trace requests unanswered at exit")
