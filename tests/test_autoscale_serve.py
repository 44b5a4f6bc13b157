"""The planner resizing TP groups of a live app on logical GPUs (Ray, no real GPU): at low load one
TP-2 replica replaces two TP-1 replicas, at high load two TP-1 replicas come back, and every request
sent during the transitions completes."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

PORT = 8767
URL = f"http://127.0.0.1:{PORT}"
PROMPTS = ["rev: abcde", "rev: xyz", "max: a3 b9 c1 d2", "rev: hello"]


@pytest.fixture(scope="module")
def app():
    import os

    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    args = {"engine": {"model": "tiny-bd", "slots": 8}, "http": {"max_tokens_limit": 256},
            "resources": {"tp_degrees": [1, 2], "gpus_per_rank": 1},
            "planner": {"nodes": 1, "gpus_per_node": 2, "period_s": 4, "window_s": 4, "profile": "cpu-tiny-bd",
                        "min_gain": 0.05, "check_s": 0.5, "step_timeout_s": 120}}
    # the app-level policy is part of the app's config, as `serve run` of a config file sets it
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [{
        "name": "auto", "route_prefix": "/", "import_path": "deployments.builder:build_app", "args": args,
        "autoscaling_policy": {"policy_function": "app.autoscaling:planner_policy"}}]}))
    wait_for(lambda: planner().get("live") == {"1": 2, "2": 0}, 240)
    yield URL
    serve.shutdown()
    ray.shutdown()


def planner() -> dict:
    try:
        return httpx.get(f"{URL}/debug/planner", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def wait_for(cond, limit_s: float) -> None:
    from tests.conftest import wait_until

    if wait_until(cond, limit_s):
        return
    apps = {name: (a.status, a.message) for name, a in serve.status().applications.items()}
    raise AssertionError(f"timed out after {limit_s} s; planner state {planner()}; apps {apps}")


def complete(i: int) -> tuple[int, str | None]:
    # a large budget the answers never use: the planner sizes for 256 output tokens, the CPU decodes a few
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 256, "stream": True}
    finish = None
    with httpx.stream("POST", f"{URL}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return r.status_code, finish


def offer(pool, rate: float, until, limit_s: float) -> list:
    """Send ``rate`` requests per second until ``until()`` holds (or ``limit_s``); their futures."""
    futures, t0 = [], time.monotonic()
    while not until() and time.monotonic() - t0 < limit_s:
        futures.append(pool.submit(complete, len(futures)))
        time.sleep(1.0 / rate)
    return futures


def test_planner_moves_replicas_between_tp_groups_and_loses_nothing(app):
    with concurrent.futures.ThreadPoolExecutor(256) as pool:
        low = offer(pool, 0.3, lambda: planner().get("live") == {"1": 0, "2": 1}, 240)
        state = planner()
        assert state["live"] == {"1": 0, "2": 1}, state
        assert state["transitions"] >= 1 and state["last_decision"]["proposal"] == {"1": 0, "2": 1}
        high = offer(pool, 3.0, lambda: planner().get("live") == {"1": 2, "2": 0}, 240)
        state = planner()
        assert state["live"] == {"1": 2, "2": 0}, json.dumps(state)
        results = [f.result(timeout=300) for f in low + high]
    assert len(results) > 10
    assert all(code == 200 and finish in ("stop", "length") for code, finish in results), results
