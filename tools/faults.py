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
import contextlib
import json
import os
import re
import statistics
import time

from app.config import INGRESS

PROMPTS_CATEGORIES = ("reverse", "choice", "arith", "prose")


async def _one(transport, body: dict, timeout: float) -> dict:
    """Stream one completion: its outcome, status, text, the times of its content chunks, and e2e time.

    ``transport``: ``loadgen.http.RawTransport`` (about 0.3 ms of client CPU per request against httpx's
    2-4 ms: at 10x overload on two cores the client must not take the CPU the service is measured on)."""
    out = {"outcome": "lost", "text": "", "chunks": [], "status": None, "retry_after": None}
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout), transport.stream("/v1/completions", json.dumps(body).encode(), {}) as r:
            out["status"], out["retry_after"] = r.status, r.headers.get("retry-after")
            if r.status != 200:  # failed cleanly: an OpenAI-style error body, or Serve's proxy's own 429 +
                raw = await r.read()  # Retry-After (plain text); any other error (a plain 500) counts as lost
                try:
                    out["outcome"], out["error"] = "failed", json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    out["error"] = raw[:200].decode(errors="replace")
                    if r.status == 429 and out["retry_after"] is not None:
                        out["outcome"] = "failed"
            else:
                finished = False
                async for line in r.lines():
                    if line == "data: [DONE]":
                        out["outcome"] = "completed" if finished else out["outcome"]
                        break
                    if line.startswith("data: "):
                        chunk = json.loads(line[6:])
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
    out["e2e_s"] = time.monotonic() - t0
    return out


async def _inject(client, url: str, kill_at: list[float], reports: list, target: str = "replica") -> None:
    """Kill the busiest Denoiser replica (``target="replica"``) or its tensor-parallel rank 1
    (``"tp-worker"``: the replica's round breaks and it fails over) at each time in ``kill_at`` (seconds
    from now), without waiting for the previous one's replacement; each kill is watched apart."""
    import ray

    t0 = time.monotonic()
    watchers = []
    for at in kill_at:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        view = (await client.get(f"{url}/debug/instances", timeout=30)).json()
        if not view["instances"]:
            continue
        _, victim = max(view["instances"].items(), key=lambda kv: kv[1]["requests"])
        actor = victim["actor"] if target == "replica" else victim["workers"][0]
        ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
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


async def _drive(url: str, n: int, rate: float, kills: int, timeout: float,
                 target: str = "replica") -> tuple[list, list, dict, float]:
    import httpx

    import tasksuite as tasks
    from loadgen.http import RawTransport

    examples = [e for e in tasks.heldout_set(4 * n) if e.category in PROMPTS_CATEGORIES][:n]
    reports: list = []
    transport = RawTransport(url, timeout_s=timeout)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
        t0 = time.monotonic()
        span = n / rate
        kill_at = [span * (k + 1) / (kills + 1) for k in range(kills)]  # spread over the arrivals
        injector = asyncio.create_task(_inject(client, url, kill_at, reports, target))
        jobs = []
        for i, ex in enumerate(examples):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            body = {"prompt": ex.prompt, "max_tokens": 96 if ex.category == "prose" else 24, "stream": True,
                    "threshold": 0.999, "slo_ms": 30_000}
            jobs.append(asyncio.create_task(_one(transport, body, timeout)))
        results = await asyncio.gather(*jobs)
        await transport.aclose()
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


def app_args(replicas: dict[int, int], slots: int, **sections: dict) -> dict:
    """The harness's app config (``AppConfig``'s sections): tiny-bd, ``replicas`` Denoiser replicas per TP
    degree, ``slots`` per round, max_tokens up to 256; ``sections``: more keys, by section
    (``router={"dead_after_s": 5.0}``)."""
    args = {"http": {"max_tokens_limit": 256}, "engine": {"model": "tiny-bd", "slots": slots},
            "resources": {"tp_degrees": sorted(replicas), "replicas": dict(replicas)}}
    for name, keys in sections.items():
        args[name] = {**args.get(name, {}), **keys}
    return args


@contextlib.contextmanager
def local_app(args: dict, replicas: int, port: int):
    """The app on a fresh local Ray cluster; yields its URL once ``replicas`` instances have joined."""
    import ray
    from ray import serve

    from deployments.builder import build_app

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="remask", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, replicas)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def run_faults(requests: int = 200, kills: int = 2, rate: float = 8.0, replicas: int = 3, port: int = 8790,
               timeout: float = 180.0, target: str = "replica", tp: int = 1) -> dict:
    if target not in ("replica", "tp-worker") or (target == "tp-worker" and tp < 2):
        raise ValueError("target is 'replica' or 'tp-worker' (which needs tp >= 2)")
    args = app_args({tp: replicas}, 16, router={"dead_after_s": 5.0})
    with local_app(args, replicas, port) as url:
        results, reports, dispatch, wall = asyncio.run(_drive(url, requests, rate, kills, timeout, target))
    _recovery(results, reports)
    outcomes = {k: sum(r["outcome"] == k for r in results) for k in ("completed", "failed", "lost")}
    done = [r for r in results if r["outcome"] == "completed"]
    return {"requests": requests, "target": target, "tp": tp, "kills": len(reports), **outcomes,
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


# ---- overload and cancellation ----------------------------------------------------------------------
def _replica_rss_mb() -> dict[str, float]:
    """Resident memory of this app's Serve replica processes (Ingress, Denoisers), by process title."""
    import psutil

    out: dict[str, float] = {}
    for p in psutil.process_iter(["cmdline", "memory_info"]):
        title = " ".join(p.info["cmdline"] or [])
        found = re.search(r"ServeReplica:remask:([A-Za-z0-9_]+)", title)
        if found and p.info["memory_info"] is not None:  # the title may carry the running method after a dot
            out[found.group(1)] = out.get(found.group(1), 0.0) + p.info["memory_info"].rss / 2**20
    return {k: round(v, 1) for k, v in sorted(out.items())}


def planner_rate(max_tokens: int, prompt_tokens: int, profile: str = "cpu-tiny-bd") -> tuple[float, float]:
    """The highest request rate Stage 1 says one TP-1 instance holds for this request shape (bisection
    on feasibility with the configuration fixed), and the SLO it plans for (ms)."""
    from engine.latency_profile import load_tp_profiles
    from planner.stage1 import plan_capacity
    from planner.workload import WorkloadClass

    profiles = load_tp_profiles(profile, [1])

    def plan(rate: float):
        return plan_capacity([WorkloadClass("req", rate, prompt_tokens, max_tokens)], 1, profiles,
                             fixed_counts={1: 1})

    lo, hi = 0.0, 1.0
    while plan(hi).feasible and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if plan(mid).feasible else (lo, mid)
    return lo, plan(max(lo, 1e-3)).slo_ms["req"]


async def _offer(url: str, rate: float, seconds: float, body, timeout: float) -> list[dict]:
    from loadgen.http import RawTransport

    transport = RawTransport(url, timeout_s=timeout)
    jobs, t0, i = [], time.monotonic(), 0

    async def one(i: int) -> dict:
        out = await _one(transport, body(i), timeout)
        out["sent_s"] = i / rate
        return out

    try:
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            jobs.append(asyncio.create_task(one(i)))
            i += 1
        return await asyncio.gather(*jobs)
    finally:
        await transport.aclose()


OVERLOAD_WORKLOADS = {  # categories, max_tokens, typical prompt tokens (after the template)
    "short": (("reverse", "choice", "arith"), 32, 20),  # a few rounds each: the HTTP path dominates on CPU
    "prose": (("prose",), 200, 16),  # ~20 rounds each: the model dominates, as with a DLM on a GPU
}


def run_overload(factor: float = 10.0, seconds: float = 20.0, port: int = 8790, workload: str = "short",
                 extra_args: dict | None = None) -> dict:
    """Offer ``factor`` x the rate the planner says one TP-1 instance holds, with the planner's SLO on
    every request: how much is shed (429 + Retry-After), whether the admitted requests meet their SLO,
    and whether the replicas' memory stays bounded. ``extra_args``: more config keys, by section
    (``{"router": {"shed_over_capacity": False}}``)."""
    import httpx

    import tasksuite as tasks

    if workload not in OVERLOAD_WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(OVERLOAD_WORKLOADS)}")
    categories, max_tokens, prompt_tokens = OVERLOAD_WORKLOADS[workload]
    examples = [e for e in tasks.heldout_set(800) if e.category in categories]
    rate, slo_ms = planner_rate(max_tokens, prompt_tokens)
    offered = factor * rate
    args = app_args({1: 1}, 32, **(extra_args or {}))

    def body(i: int) -> dict:
        return {"prompt": examples[i % len(examples)].prompt, "max_tokens": max_tokens, "stream": True,
                "slo_ms": slo_ms}

    with local_app(args, 1, port) as url:
        before = _replica_rss_mb()
        t0 = time.monotonic()
        results = asyncio.run(_offer(url, offered, seconds, body, timeout=120))
        sent_s = time.monotonic() - t0
        after = _replica_rss_mb()
        view = httpx.get(f"{url}/debug/instances", timeout=10).json()
        router = view["router"]
        rounds = sum(i.get("rounds", 0) for i in view["instances"].values())
        mean_batch = sum(i.get("filled_slots", 0) for i in view["instances"].values()) / max(rounds, 1)
        server = _slo_counters(httpx.get(f"{url}/metrics", timeout=10).text)
    codes: dict[str, int] = {}
    for r in results:
        codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
    admitted = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 429]
    met = [r for r in admitted if r["outcome"] == "completed" and r["e2e_s"] * 1000 <= slo_ms]
    return {"workload": workload, "planner_rate_rps": round(rate, 2), "slo_ms": round(slo_ms, 1),
            "offered_rps": round(offered, 2),
            "seconds": seconds, "requests": len(results), "sent_rps": round(len(results) / sent_s, 2),
            "status_codes": codes, "latency_scale": router.get("latency_scale"),
            "rounds": rounds, "mean_batch": round(mean_batch, 1),
            "admission_util": router.get("admission_util"), "admission_cuts": router.get("admission_cuts"),
            "shed_with_retry_after": sum(r.get("retry_after") is not None for r in shed),
            "admitted": len(admitted), "admitted_rps": round(len(admitted) / seconds, 2),
            "admitted_slo_attainment": round(len(met) / max(len(admitted), 1), 3),
            "admitted_e2e_ms": _quantiles([r["e2e_s"] * 1000 for r in admitted]),
            "by_second_sent": _windows(admitted, met, seconds),
            # measured by the ingress from the request's arrival there (without the HTTP proxy's queue)
            "ingress_slo_attainment": round(server["met"] / max(server["met"] + server["missed"], 1), 3),
            "lost": sum(r["outcome"] == "lost" for r in results),
            "rss_mb_before": before, "rss_mb_after": after}


async def _cancel_cycles(url: str, cycles: int, concurrency: int) -> int:
    import httpx

    done = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(client) -> None:
        nonlocal done
        async with sem:
            body = {"prompt": "story: fox 8", "max_tokens": 200, "threshold": 0.999, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first chunk, then hang up mid-generation
            done += 1

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        await asyncio.gather(*(one(client) for _ in range(cycles)))
    return done


def run_cancel(cycles: int = 1000, concurrency: int = 8, port: int = 8790) -> dict:
    """``cycles`` clients that connect, read one chunk and disconnect: every slot and KV reservation
    must come back, and the replicas' memory must not grow."""
    import httpx

    args = app_args({1: 1}, 32)
    with local_app(args, 1, port) as url:
        asyncio.run(_cancel_cycles(url, 100, concurrency))  # warm-up: allocator pools, caches
        idle = _settle(url)
        before = _replica_rss_mb()
        t0 = time.monotonic()
        n = asyncio.run(_cancel_cycles(url, cycles, concurrency))
        wall = time.monotonic() - t0
        state = _settle(url)
        after = _replica_rss_mb()
        probe = httpx.post(f"{url}/v1/completions", json={"prompt": "rev: abc", "max_tokens": 8}, timeout=60).json()
    growth = {k: round(after.get(k, 0.0) - v, 1) for k, v in before.items()}
    return {"cycles": n, "wall_s": round(wall, 1), "idle_after_warmup": idle, "state_after": state,
            "rss_mb_before": before, "rss_mb_after": after, "rss_growth_mb": growth,
            "served_after": probe["choices"][0]["text"]}


# ---- ingress restart and redeploy ---------------------------------------------------------------------
async def _long_streams(url: str, n: int) -> list:
    """``n`` long streaming completions (one token per step), started together."""
    from loadgen.http import RawTransport

    transport = RawTransport(url, timeout_s=300)
    prompts = [f"story: {a} {k}" for a in ("fox", "owl", "elk", "cat") for k in (6, 8)]
    body = [{"prompt": prompts[i % len(prompts)], "max_tokens": 200, "threshold": 0.9999, "stream": True}
            for i in range(n)]
    return [asyncio.create_task(_one(transport, b, 300)) for b in body]


async def _until_streaming(client, url: str, n: int, limit_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if (await client.get(f"{url}/debug/instances", timeout=30)).json()["live"] >= n:
            return
        await asyncio.sleep(0.05)


async def _probe(client, url: str, t0: float, limit_s: float) -> dict:
    """A short request every 0.25 s until one succeeds: what clients got meanwhile, and when it answered."""
    seen: dict[str, int] = {}
    while time.monotonic() - t0 < limit_s:
        try:
            r = await client.post(f"{url}/v1/completions", json={"prompt": "rev: abc", "max_tokens": 8},
                                  timeout=30)
            key = str(r.status_code)
            if r.status_code == 200 and r.json()["choices"][0]["text"] == "cba":
                return {"answered_after_s": round(time.monotonic() - t0, 2), "meanwhile": seen}
            ctype = r.headers.get("content-type", "")
            key += " json" if ctype.startswith("application/json") and "error" in r.json() else f" {ctype or '-'}"
        except Exception as exc:  # refused or reset while the ingress is down
            key = type(exc).__name__
        seen[key] = seen.get(key, 0) + 1
        await asyncio.sleep(0.25)
    return {"answered_after_s": None, "meanwhile": seen}


def _stream_outcomes(results: list) -> dict:
    out: dict[str, int] = {}
    for r in results:
        key = r["outcome"] if r["outcome"] != "lost" else f"cut ({r.get('error', 'no [DONE]')[:60]})"
        out[key] = out.get(key, 0) + 1
    return out


def run_ingress_restart(streams: int = 8, port: int = 8790) -> dict:
    """Kill the Ingress actor while ``streams`` long streams run: how they end, what new requests get
    while it is down, and when the app answers again (Serve restarts the Ingress; the Denoisers register
    with the new one)."""
    import httpx
    import ray

    args = app_args({1: 2}, 16)

    async def drive(url: str):
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 8)) as client:
            jobs = await _long_streams(url, streams)
            await _until_streaming(client, url, streams)
            (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if f"#{INGRESS}#" in a["name"]]
            t0 = time.monotonic()
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            probe = await _probe(client, url, t0, 120)
            results = await asyncio.gather(*jobs)
            return results, probe

    with local_app(args, 2, port) as url:
        results, probe = asyncio.run(drive(url))
    return {"streams": streams, "stream_outcomes": _stream_outcomes(results), **probe}


def run_redeploy(streams: int = 8, port: int = 8790) -> dict:
    """``serve.run`` of a changed config (a new served model name; what ``serve deploy`` does) while
    ``streams`` long streams run: every one must complete; when the new config answers."""
    import httpx
    from ray import serve

    from deployments.builder import build_app

    args = app_args({1: 2}, 16)

    async def drive(url: str):
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 8)) as client:
            jobs = await _long_streams(url, streams)
            await _until_streaming(client, url, streams)
            t0 = time.monotonic()
            changed = app_args({1: 2}, 16, http={"served_model_name": "tiny-bd-v2"})
            serve.run(build_app(changed), name="remask", route_prefix="/", blocking=False)
            results = await asyncio.gather(*jobs)
            streams_s = time.monotonic() - t0
            new_s = None
            while time.monotonic() - t0 < 180:
                models = (await client.get(f"{url}/v1/models", timeout=30)).json()
                if models.get("data") and models["data"][0]["id"] == "tiny-bd-v2":
                    new_s = round(time.monotonic() - t0, 2)
                    break
                await asyncio.sleep(0.25)
            return results, round(streams_s, 2), new_s

    with local_app(args, 2, port) as url:
        results, streams_s, new_s = asyncio.run(drive(url))
    done = [r for r in results if r["outcome"] == "completed"]
    return {"streams": streams, "stream_outcomes": _stream_outcomes(results),
            "last_stream_ended_after_s": streams_s, "new_config_served_after_s": new_s,
            "mean_stream_s": round(statistics.mean(r["e2e_s"] for r in done), 2) if done else None}


def _windows(admitted: list[dict], met: list[dict], seconds: float, n: int = 5) -> list[dict]:
    """Admitted requests and their SLO attainment in ``n`` equal windows of send time."""
    width = seconds / n
    out = []
    for k in range(n):
        inside = [r for r in admitted if k * width <= r["sent_s"] < (k + 1) * width]
        ok = sum(1 for r in met if k * width <= r["sent_s"] < (k + 1) * width)
        out.append({"from_s": round(k * width, 1), "admitted": len(inside),
                    "slo_attainment": round(ok / len(inside), 3) if inside else None})
    return out


def _slo_counters(text: str) -> dict[str, float]:
    out = {"met": 0.0, "missed": 0.0}
    for line in text.splitlines():
        for key in out:
            if line.startswith(f"remask:slo_{key}_total"):  # remask:slo_met_total{model_name="..."} 3.0
                out[key] += float(line.split()[-1])
    return out


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    return {q: round(v[min(len(v) - 1, int(f * len(v)))], 1) for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def _settle(url: str, limit_s: float = 30.0) -> dict:
    """Wait until no request is running, resident or holding KV on any instance; that state."""
    import httpx

    keys = ("running", "resident", "kv_reserved_tokens", "requests")
    t0 = time.monotonic()
    while True:
        view = httpx.get(f"{url}/debug/instances", timeout=10).json()
        state = {k: sum(v.get(k, 0) for v in view["instances"].values()) for k in keys}
        state["live"] = view.get("live", 0)
        if not any(state.values()) or time.monotonic() - t0 > limit_s:
            state["settle_s"] = round(time.monotonic() - t0, 2)
            return state
        time.sleep(0.2)
