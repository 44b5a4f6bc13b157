"""The web playground (app/playground.py, app/static/playground.*): its static files (and nothing else),
the cluster view of /debug/cluster, SLO outcomes over a window, and the page itself in headless Chromium
against a scripted server that streams canvas chunks in the API's format."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from app import api
from app.playground import HEADERS, STATIC_DIR, RecentOutcomes, cluster_view, page, static_file, static_files
from tests.browser import chromium_available, missing_reason, run_playground
from tests.fakes import RecordingLink

# ---- static files -----------------------------------------------------------------------------------


def test_the_page_and_its_files_are_served():
    html = page()
    for needle in ('id="answer"', 'id="status"', 'id="canvas"', 'id="prompt"', 'id="send"',
                   'src="static/playground.js"', 'href="static/playground.css"'):
        assert needle in html, needle
    assert set(static_files()) >= {"playground.html", "playground.js", "playground.css"}
    body, media = static_file("playground.js")
    assert media.startswith("text/javascript") and b"include_canvas" in body
    assert static_file("playground.css")[1].startswith("text/css")
    assert static_file("playground.html")[1].startswith("text/html")
    assert STATIC_DIR == Path(__file__).resolve().parent.parent / "app" / "static"
    assert "default-src 'self'" in HEADERS["Content-Security-Policy"]


@pytest.mark.parametrize("name", ["../playground.py", "../x", "..", ".", "", "/etc/passwd", "static/playground.js",
                                  "./playground.js", "playground.js/..", "%2e%2e/playground.py", "PLAYGROUND.JS",
                                  "playground.js\x00", "..\\playground.py", "nope.js", None])
def test_static_file_refuses_any_other_name(name):
    with pytest.raises(KeyError):
        static_file(name)


def test_the_page_fetches_nothing_from_elsewhere():
    """No CDN, no font service: every URL in the page's files is relative to this server."""
    for name in ("playground.html", "playground.js", "playground.css"):
        text = static_file(name)[0].decode()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name
        assert "@import" not in text and "url(" not in text.replace("url(data:", ""), name


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node (a syntax check of the page's script)")
def test_the_script_parses():
    """Where no browser is at hand, node at least checks the page's script for syntax errors."""
    proc = subprocess.run(["node", "--check", str(STATIC_DIR / "playground.js")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_every_input_has_a_label():
    html = page()
    ids = re.findall(r'<(?:input|select|textarea)[^>]*\bid="([^"]+)"', html)
    assert len(ids) >= 8
    for i in ids:
        assert f'<label for="{i}"' in html, i


# ---- SLO outcomes -------------------------------------------------------------------------------------


def test_recent_outcomes_over_a_window():
    o = RecentOutcomes()
    assert o.attainment(0.0) is None
    o.add(0.0, True)
    o.add(30.5, False)
    o.add(59.9, True)
    assert o.attainment(59.9) == pytest.approx(2 / 3)
    assert o.counts(60.0, 60) == (1, 2)  # t=0 fell out of (0, 60]
    assert o.attainment(100.0) == 1.0  # only t=59.9 is within the last minute
    assert o.attainment(100.0, window_s=10) is None
    assert o.attainment(200.0) is None


def test_recent_outcomes_memory_is_bounded():
    o = RecentOutcomes(horizon_s=60, bucket_s=1)
    for i in range(50_000):  # 500 s of 100 finishes a second
        o.add(i * 0.01, i % 4 != 0)
    assert len(o) <= o.max_buckets == 61
    assert o.attainment(499.99) == pytest.approx(0.75, abs=0.01)
    for _ in range(10_000):  # a burst at one instant: one bucket
        o.add(600.0, False)
    assert len(o) == 1 and o.counts(600.0) == (0, 10_000)
    o.add(550.0, True)  # a time that went back lands in the newest bucket: still bounded
    assert len(o) == 1 and o.counts(600.0) == (1, 10_001)
    with pytest.raises(ValueError):
        RecentOutcomes(horizon_s=1, bucket_s=2)


# ---- the cluster view -----------------------------------------------------------------------------------


def real_dispatcher():
    """The ingress's Dispatcher (tiny-bd's router) with two instances on fake channels and three requests."""
    from app.config import AppConfig
    from app.dispatch import Dispatcher
    from cluster.factory import build_router
    from engine.loading import resolve_model
    from engine.models.loader import load_config

    cfg = AppConfig(engine={"model": "tiny-bd", "slots": 8})
    mcfg = load_config(resolve_model("tiny-bd"))
    d = Dispatcher(build_router(cfg, mcfg), lambda ids: "", block_tokens=mcfg.block_size, full_sequence=False,
                   per_instance_limit=cfg.engine.slots * 8 + cfg.engine.max_waiting)
    for inst_id, tp in enumerate(d.driver.degrees()[:1] * 2):
        assert d.attach(f"r{inst_id}", tp, RecordingLink(), read=False) == inst_id
        d.instances[inst_id].stats = {"running": 2 + inst_id, "waiting": inst_id, "resident": 3, "rounds": 40,
                                      "filled_slots": 100, "kv_reserved_tokens": 1024}
    d.submit("a", [1, 2, 3, 4], 16, slo_ms=60_000)
    d.submit("b", [1, 2, 3], 16, slo_ms=60_000, threshold=0.7)
    d.submit("c", [5, 6], 32)
    return d


def test_cluster_view_of_a_real_dispatcher():
    d = real_dispatcher()
    d.live["a"].state.thresholds_used.extend([0.9, 0.8])
    outcomes = RecentOutcomes()
    for t, met in [(1.0, True), (2.0, True), (3.0, False), (50.0, True)]:
        outcomes.add(t, met)
    planner = SimpleNamespace(describe=lambda: {"targets": {1: 2, 2: 0}, "live": {1: 2, 2: 0}, "pending": [],
                                                "transitions": 1, "offered_rps": 0.5,
                                                "last_decision": {"act": False, "reason": "within 10%",
                                                                  "proposal": {1: 2}, "current": {1: 2}}})
    view = cluster_view(d, planner, 61.5, outcomes, slots=8)
    assert json.loads(json.dumps(view)) == view  # plain JSON
    assert [i["id"] for i in view["instances"]] == [0, 1]
    assert sum(i["requests"] for i in view["instances"]) == 3 == view["live"]
    i0 = view["instances"][0]
    assert (i0["running"], i0["waiting"], i0["slots"], i0["slots_per_round"]) == (2, 0, 8, 2.5)
    (tp,) = view["by_tp"].values()
    assert tp["instances"] == 2 and tp["requests"] == 3 and tp["running"] == 5 and tp["waiting"] == 1
    assert tp["slots"] == 16
    used = view["thresholds"]["in_use"]
    assert sum(used.values()) == 3 and used["0.80"] >= 1 and used["0.70"] >= 1  # a's last step, b's own
    assert view["thresholds"]["fixed_by_client"] == 1
    assert view["slo"] == {"window_s": 60.0, "attainment": pytest.approx(2 / 3), "met": 2, "finished": 3}
    assert view["router"]["policy"] == d.driver.counters()["policy"] == "remask-fit"
    assert view["router"]["admission_util"] == round(d.driver.governor.util, 3) and view["parked_total"] == 0
    assert view["planner"]["enabled"] and view["planner"]["targets"] == {"1": 2, "2": 0}
    assert view["planner"]["last_decision"]["reason"] == "within 10%"
    assert view["dispatch"] == d.stats

    empty = cluster_view(d, None, 0.0)
    assert empty["planner"] == {"enabled": False} and empty["slo"]["attainment"] is None


def fake_dispatcher():
    """What cluster_view reads of a Dispatcher, for the scripted server: two TP-1 instances and a TP-2 one."""
    keys = ("running", "waiting", "resident", "rounds", "filled_slots", "kv_reserved_tokens")
    stats = [dict(zip(keys, v)) for v in [(6, 1, 7, 820, 4510, 9000), (3, 0, 3, 640, 2300, 4000),
                                          (8, 4, 8, 900, 6800, 16000)]]
    instances = {i: SimpleNamespace(inst_id=i, replica=f"Denoiser_TP{tp}#{i}", tp=tp, stats=stats[i],
                                    draining=i == 1) for i, tp in enumerate([1, 1, 2])}
    lives = {}
    for k, t in enumerate([0.9, 0.9, 0.8, 0.7, 0.7, 0.7, 0.5]):
        lives[f"r{k}"] = SimpleNamespace(sent_threshold=t, state=SimpleNamespace(
            thresholds_used=[0.9, t], fixed_threshold=0.5 if t == 0.5 else None))
    by_id = {i: SimpleNamespace(n=s["running"] + s["waiting"]) for i, s in enumerate(stats)}
    driver = SimpleNamespace(instance=by_id.get, stats={"held": 3}, governor=SimpleNamespace(util=0.8),
                             counters=lambda: {"policy": "remask", "migrations": 4, "load_control_runs": 120},
                             candidate_thresholds=lambda: (0.9, 0.8, 0.7, 0.6, 0.5))
    return SimpleNamespace(instances=instances, driver=driver, live=lives, parked=[],
                           stats={"resumed": 0, "migrated": 4, "failed_over": 0, "instances_lost": 0, "shed": 2,
                                  "drained": 0})


FAKE_PLANNER = SimpleNamespace(describe=lambda: {
    "targets": {1: 2, 2: 1}, "live": {1: 2, 2: 1}, "pending": [], "transitions": 1, "offered_rps": 3.2,
    "last_decision": {"act": False, "reason": "the proposal gains under 10% (hysteresis)",
                      "proposal": {1: 2, 2: 1}, "current": {1: 2, 2: 1}}})

# ---- a scripted server and the page in a real browser -----------------------------------------------------

MODEL, KEY = "tiny-bd", "sk-playground-test"
BLOCK, LENGTH = 8, 32
# the answer's tokens: (token id, the canvas piece, its text); a multi-byte character spans two tokens whose
# pieces are partial ("\ufffd", "") while the text deltas carry it whole; the canvas ends in EOS padding
TOKENS = [(300 + i, p, p) for i, p in enumerate(["The", " canvas", " fills", " in", " parallel", ":", " several",
                                                  " positions", " per", " round", ",", " block", " by", " block",
                                                  " \u2014", " caf"])]
TOKENS += [(400, "\ufffd", ""), (401, "", "\u00e9"), (402, ".", ".")]
TOKENS += [(2, "", "")] * (LENGTH - len(TOKENS))
ANSWER = "".join(t for _, _, t in TOKENS)


def scripted_rounds(seed: int = 0, tokens: list = TOKENS, block: int = BLOCK, most: int = 4) -> list[dict]:
    """The canvas of each round: each block's positions committed in a shuffled order, 1 to ``most`` a round."""
    rng, rounds, length = random.Random(seed), [], len(tokens)
    for start in range(0, length, block):
        order = list(range(start, start + block))
        rng.shuffle(order)
        while order:
            k = rng.randint(1, most)
            now, order = order[:k], order[k:]
            thr = [0.9, 0.8, 0.7][len(rounds) % 3]
            rounds.append({"step": len(rounds) + 1, "instance": len(rounds) // 6 % 2, "tp": 1, "threshold": thr,
                           "block": [start, start + block],
                           "committed": [[p, tokens[p][0], tokens[p][1]] for p in sorted(now)],
                           "masked": sorted(order), "length": length})
    return rounds


def canvas_chunk(req, canvas: dict) -> dict:
    if hasattr(api, "canvas_chunk"):
        return api.canvas_chunk(req, canvas)
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"  # the same, before it exists
    view = {"index": 0, "round": canvas["step"], **{k: v for k, v in canvas.items() if k != "step"}}
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": [],
            "remask_canvas": view}


class ScriptedServer:
    """The playground's endpoints on 127.0.0.1: the page and its files, /v1/models, /debug/cluster (the real
    cluster_view of a fake dispatcher) and a streamed /v1/chat/completions that replays ``scripted_rounds``
    (canvas chunks, then the text the committed prefix adds) in the API's own chunk format."""

    def __init__(self, round_s: float = 0.01, rounds: list[dict] | None = None, tokens: list | None = None) -> None:
        self.round_s = round_s
        self.tokens = TOKENS if tokens is None else tokens
        self.bodies: list[dict] = []
        self.auth: list[tuple] = []  # (method, path, Authorization) of each API call
        self.rounds = scripted_rounds() if rounds is None else rounds
        self.outcomes = RecentOutcomes()
        for k in range(40):
            self.outcomes.add(time.monotonic() - k, k % 9 != 0)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _json(self, status: int, obj) -> None:
                self._send(status, json.dumps(obj).encode(), "application/json")

            def _authorized(self) -> bool:
                got = self.headers.get("Authorization")
                server.auth.append((self.command, self.path, got))
                if got != f"Bearer {KEY}":
                    self._json(401, {"error": {"message": "invalid API key", "type": "authentication_error"}})
                    return False
                return True

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/playground":
                    return self._send(200, page().encode(), "text/html; charset=utf-8", HEADERS)
                if path.startswith("/static/"):
                    try:
                        body, media = static_file(path[len("/static/"):])
                    except KeyError:
                        return self._json(404, {"detail": "Not Found"})
                    return self._send(200, body, media, HEADERS)
                if path == "/v1/models" and self._authorized():
                    return self._json(200, api.models_response([MODEL]))
                if path == "/debug/cluster" and self._authorized():
                    return self._json(200, cluster_view(fake_dispatcher(), FAKE_PLANNER, time.monotonic(),
                                                        server.outcomes, slots=8))
                if path not in ("/v1/models", "/debug/cluster"):
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                if self.path != "/v1/chat/completions" or not self._authorized():
                    return None if self.path == "/v1/chat/completions" else self._json(404, {"detail": "Not Found"})
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                data = json.loads(raw)
                server.bodies.append(data)
                checked = json.loads(raw)
                if "include_canvas" not in api.STREAM_OPTIONS:  # before the API accepts it
                    checked.get("stream_options", {}).pop("include_canvas", None)
                try:  # the page's request is a valid API request
                    req = api.parse_request("chat", json.dumps(checked), known_models=[MODEL], max_tokens_limit=256,
                                            default_max_tokens=64)
                except api.APIError as err:
                    return self._json(err.status, err.to_dict())
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                try:
                    self._stream(req)
                except (BrokenPipeError, ConnectionResetError):  # the page stopped reading (Stop, closed)
                    pass

            def _stream(self, req) -> None:
                def write(event: str) -> None:  # in two reads' worth, split mid-way (even inside a character)
                    data = event.encode()
                    half = len(data) // 2
                    out.write(data[:half])
                    out.flush()
                    out.write(data[half:])

                out = self.wfile
                write(api.sse(api.chat_chunk(req, role=True)))
                done: set[int] = set()
                emitted = 0
                for canvas in server.rounds:
                    time.sleep(server.round_s)
                    write(api.sse(canvas_chunk(req, canvas)))
                    done.update(p for p, _, _ in canvas["committed"])
                    text = ""
                    while emitted in done:
                        text += server.tokens[emitted][2]
                        emitted += 1
                    if text:
                        write(api.sse(api.chat_chunk(req, text)))
                    out.flush()
                write(api.sse(api.chat_chunk(req, finish_reason="stop")))
                write(api.SSE_DONE)
                out.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_script_adds_up():
    rounds = scripted_rounds()
    positions = [p for r in rounds for p, _, _ in r["committed"]]
    assert sorted(positions) == list(range(LENGTH))
    assert all(1 <= len(r["committed"]) <= 4 for r in rounds)
    assert "caf\u00e9." in ANSWER


@pytest.mark.slow
@pytest.mark.skipif(not chromium_available(), reason=missing_reason() or "chromium unavailable")
def test_page_in_a_real_browser_with_a_scripted_stream(tmp_path):
    shot = Path(os.environ.get("REMASK_PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
    with ScriptedServer() as server:
        params = {"api_key": KEY, "model": MODEL, "threshold": 0.8, "slo_ms": 5000, "temperature": 0,
                  "max_tokens": LENGTH, "seed": 7}
        got = run_playground(server.url, "Describe the canvas.", params, shot, timeout_s=60)
    assert got["status"] == "done"
    assert got["answer"] == ANSWER
    assert got["rounds"] == len(server.rounds)
    assert got["cells"] == LENGTH
    committed = sorted(p for r in server.rounds for p, _, _ in r["committed"])
    assert got["cells_committed"] == len(committed) and sorted(got["committed_positions"]) == committed
    assert got["cluster"].startswith("updated"), got["cluster"]
    # no script error, no blocked resource; the only failed loads are the calls made before the key was typed
    errors = [e for e in got["console_errors"] if "status of 401" not in e]
    assert not errors, errors
    (body,) = server.bodies
    assert body["stream"] is True and body["stream_options"] == {"include_canvas": True}
    assert body["messages"] == [{"role": "user", "content": "Describe the canvas."}]
    assert (body["model"], body["threshold"], body["slo_ms"], body["temperature"], body["max_tokens"],
            body["seed"]) == (MODEL, 0.8, 5000, 0, LENGTH, 7)
    assert ("POST", "/v1/chat/completions", f"Bearer {KEY}") in server.auth  # the request carried the key
    assert ("GET", "/debug/cluster", f"Bearer {KEY}") in server.auth  # the panel too, once the key was set
    assert shot.is_file() and shot.stat().st_size > 10_000
