"""``remask faults``: fault injection against a real Ray Serve app.

It starts the app (tiny-bd, several TP-1 Denoiser replicas) on a local Ray
cluster, streams ``requests`` completions into it at a steady rate, and kills
the Denoiser replica holding the most requests ``kills`` times while they run
(``ray.kill``: the process dies, its sockets close, Serve starts a
replacement). Every request must end as *completed* (finish_reason and
``[DONE]``) or *cleanly failed* (an HTTP error with an OpenAI-style body, or
an SSE error event); anything else (a broken stream, a hang past the
timeout) counts as *lost*. For each kill it reports the recovery time: from
the kill until every request the dead replica held has streamed text again
(or ended), and until the replacement replica has joined the router.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

PROMPTS_CATEGORIES = ("reverse", "choice", "arith", "prose")


async def _one(client, url: str, body: dict, timeout: float, log: list) -> dict:
    """Stream one completion; ``log`` gets (time, request index) per content chunk."""
    out = {"outcome": "lost", "text": "", "chunks": [], "status": None}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    err = json.loads(raw)["error"]
                    out["outcome"], out["error"] = "failed", err["message"]
                except (ValueError, KeyError, TypeError):
                    out["error"] = raw[:200].decode(errors="replace")
                return out
            finished = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["outcome"] = "completed" if finished else out["outcome"]
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out["outcome"], out["error"] = "failed", chunk["error"]["message"]
                    continue
                choice = chunk["choices"][0]
                if choice.get("text"):
                    out["text"] += choice["text"]
                    out["chunks"].append(time.monotonic())
                if choice.get("finish_reason"):
                    finished = True
    except Exception as exc:  # a broken connection or a timeout: lost
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


async def _inject(client, url: str, kill_at: list[float], reports: list) -> None:
    """Kill the busiest Denoiser replica at each time in ``kill_at`` (seconds from now), without waiting
    for the previous one's replacement; each kill's detection and replacement are watched apart."""
    import ray

    t0 = time.monotonic()
    watchers = []
    for at in kill_at:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        view = (await client.get(f"{url}/debug/instances", timeout=30)).json()
        if not view["instances"]:
            continue
        _, victim = max(view["instances"].items(), key=lambda kv: kv[1]["requests"])
        ray.kill(ray.get_actor(victim["actor"], namespace="serve"), no_restart=True)
        rep = {"replica": victim["replica"], "requests_held": victim["requests"], "t": time.monotonic()}
        reports.append(rep)
        known = {i["replica"] for i in view["instances"].values()}
        watchers.append(asyncio.create_task(_watch(client, url, rep, known)))
    await asyncio.gather(*watchers)


async def _watch(client, url: str, rep: dict, known: set) -> None:
    """Until the ingress dropped the dead replica and a new replica (not in ``known``) has joined."""
    while time.monotonic() - rep["t"] < 120:
        await asyncio.sleep(0.1)
        view = (await client.get(f"{url}/debug/instances", timeout=30)).json()
        now = time.monotonic() - rep["t"]
        if "detected_s" not in rep and all(i["replica"] != rep["replica"] for i in view["instances"].values()):
            rep["detected_s"] = round(now, 3)
        new = {i["replica"] for i in view["instances"].values()} - known
        if new:
            rep["replaced_s"] = round(now, 3)
            known |= new  # the other kill's watcher must see its own replacement
            return
    rep["replaced_s"] = None


async def _drive(url: str, n: int, rate: float, kills: int, timeout: float) -> tuple[list, list, dict, float]:
    import httpx

    from engine import tasks

    examples = [e for e in tasks.heldout_set(4 * n) if e.category in PROMPTS_CATEGORIES][:n]
    reports: list = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 8)) as client:
        t0 = time.monotonic()
        span = n / rate
        kill_at = [span * (k + 1) / (kills + 1) for k in range(kills)]  # spread over the arrivals
        injector = asyncio.create_task(_inject(client, url, kill_at, reports))
        jobs = []
        for i, ex in enumerate(examples):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            body = {"prompt": ex.prompt, "max_tokens": 96 if ex.category == "prose" else 24, "stream": True,
                    "threshold": 0.999, "slo_ms": 30_000}
            jobs.append(asyncio.create_task(_one(client, url, body, timeout, [])))
        results = await asyncio.gather(*jobs)
        await injector
        dispatch = (await client.get(f"{url}/debug/instances", timeout=30)).json()["dispatch"]
    for r, ex in zip(results, examples):
        r["correct"] = ex.check(r["text"]) if r["outcome"] == "completed" else None
    return results, reports, dispatch, time.monotonic() - t0


def _recovery(results: list, reports: list) -> None:
    """Per kill: the longest silence of a request across the kill (it was streaming before it)."""
    for rep in reports:
        t = rep["t"]
        gaps = []
        for r in results:
            before = [c for c in r["chunks"] if c <= t]
            after = [c for c in r["chunks"] if c > t]
            if before and after and after[0] - before[-1] > 0:
                gaps.append(after[0] - t)
        rep["resume_gap_s"] = {"max": round(max(gaps), 3), "median": round(statistics.median(gaps), 3)} if gaps \
            else None
        del rep["t"]


def run_faults(requests: int = 200, kills: int = 2, rate: float = 8.0, replicas: int = 3, port: int = 8790,
               timeout: float = 180.0) -> dict:
    import ray
    from ray import serve

    from app.builder import build_app

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": "tiny-bd", "replicas": {1: replicas}, "slots": 16, "max_tokens_limit": 256,
                             "dead_after_s": 5.0}), name="remask", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, replicas)
        results, reports, dispatch, wall = asyncio.run(_drive(url, requests, rate, kills, timeout))
    finally:
        serve.shutdown()
        ray.shutdown()
    _recovery(results, reports)
    outcomes = {k: sum(r["outcome"] == k for r in results) for k in ("completed", "failed", "lost")}
    done = [r for r in results if r["outcome"] == "completed"]
    return {"requests": requests, "kills": len(reports), **outcomes,
            "accuracy": round(sum(bool(r["correct"]) for r in done) / max(len(done), 1), 3),
            "wall_s": round(wall, 1), "kill_reports": reports, "dispatch": dispatch,
            "errors": sorted({r.get("error", "") for r in results if r["outcome"] != "completed"})[:10]}


def _wait_ready(url: str, replicas: int, limit_s: float = 300.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200 and \
                    len(httpx.get(f"{url}/debug/instances", timeout=5).json()["instances"]) >= replicas:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the app did not get {replicas} ready instances within {limit_s:.0f} s")
