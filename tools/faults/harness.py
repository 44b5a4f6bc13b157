"""The fault harness's machinery, shared by the scenarios: one checked stream (``stream_one``), the
reference pass, the app on a local Ray cluster (``app_args``, ``local_app``), killing the busiest Denoiser
and watching its replacement (``kill_busiest``, ``watch_kill``, ``recovery``), and this app's processes
and their memory (``my_processes``, ``rss_by_pid``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import time


async def stream_one(transport, body: dict, timeout: float, cancel_after: int | None = None) -> dict:
    """Stream one completion: its outcome, status, text, the times of its content chunks, and e2e time.
    ``cancel_after``: hang up after that many content chunks (outcome ``cancelled``).

    ``transport``: ``loadgen.http.RawTransport`` (about 0.3 ms of client CPU per request against httpx's
    2-4 ms: at 10x overload on two cores the client must not take the CPU the service is measured on)."""
    out = {"outcome": "lost", "text": "", "chunks": [], "status": None, "retry_after": None, "body": body}
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
                            if cancel_after is not None and len(out["chunks"]) >= cancel_after:
                                out["outcome"] = "cancelled"
                                break  # leaving the stream closes its connection: the client went away
                        if choice.get("finish_reason"):
                            finished = True
    except Exception as exc:  # a broken connection or a timeout: lost
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["e2e_s"] = time.monotonic() - t0
    return out


async def reference_pass(url: str, bodies: list[dict], concurrency: int, timeout: float) -> tuple[list[str], float]:
    """Every request once, ``concurrency`` at a time, with no fault: the reference texts (a request that
    does not complete is tried twice more; the pass fails if it never does), and the pass's wall time."""
    from loadgen.http import RawTransport

    transport = RawTransport(url, timeout_s=timeout)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, body: dict) -> str:
        for _ in range(3):
            async with sem:
                r = await stream_one(transport, body, timeout)
            if r["outcome"] == "completed":
                return r["text"]
        raise RuntimeError(f"the reference pass could not complete request {i} ({r['outcome']}: "
                           f"{r.get('error', '')[:200]})")

    t0 = time.monotonic()
    try:
        texts = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    finally:
        await transport.aclose()
    return list(texts), time.monotonic() - t0


async def get_json(client, url: str, path: str) -> dict:
    return (await client.get(f"{url}{path}", timeout=30)).json()


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
        wait_ready(url, replicas)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_ready(url: str, replicas: int, limit_s: float = 300.0) -> None:
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


# The fault scenarios' router: a dead instance is declared after 5 s without ticks, and nothing is shed while
# capacity is down (shedding under load is the overload scenario's subject; here every request must complete).
FAULT_ROUTER = {"dead_after_s": 5.0, "shed_over_capacity": False}


def dispatch_stats(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/debug/instances", timeout=30).json()["dispatch"]


async def busiest(client, url: str, limit_s: float = 10.0):
    """The instances' view and the busiest instance, once it holds a request (or after ``limit_s``)."""
    t0 = time.monotonic()
    while True:
        view = await get_json(client, url, "/debug/instances")
        best = max(view["instances"].values(), key=lambda v: v["requests"], default=None)
        if (best is not None and best["requests"] >= 1) or time.monotonic() - t0 > limit_s:
            return view, best
        await asyncio.sleep(0.05)


async def kill_busiest(client, url: str, target: str, reports: list) -> asyncio.Task | None:
    """Kill the busiest Denoiser replica (``target="replica"``) or its tensor-parallel rank 1 (``"tp-worker"``:
    the replica's round breaks and it fails over); a task watching its detection and replacement."""
    import ray

    view, victim = await busiest(client, url)
    if victim is None:
        return None
    actor = victim["actor"] if target == "replica" else victim["workers"][0]
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
    rep = {"replica": victim["replica"], "requests_held": victim["requests"], "t": time.monotonic(),
           "failed_over_before": view["dispatch"]["failed_over"]}
    reports.append(rep)
    return asyncio.create_task(watch_kill(client, url, rep, {i["replica"] for i in view["instances"].values()}))


async def watch_kill(client, url: str, rep: dict, known: set, limit_s: float = 180.0) -> None:
    """Until the ingress dropped the dead replica (then: the requests it failed over, by the dispatcher's
    counter) and a new replica (not in ``known``) has joined."""
    while time.monotonic() - rep["t"] < limit_s:
        await asyncio.sleep(0.1)
        view = await get_json(client, url, "/debug/instances")
        now = time.monotonic() - rep["t"]
        if "detected_s" not in rep and all(i["replica"] != rep["replica"] for i in view["instances"].values()):
            rep["detected_s"] = round(now, 3)
            rep["failed_over"] = view["dispatch"]["failed_over"] - rep.pop("failed_over_before")
        new = {i["replica"] for i in view["instances"].values()} - known
        if new:
            rep["replaced_s"] = round(now, 3)
            known |= new  # the other kill's watcher must see its own replacement
            return
    rep["replaced_s"] = None


def recovery(results: list, reports: list) -> None:
    """Per kill: the longest silence of a request across the kill (it was streaming before it)."""
    for rep in reports:
        t = rep.pop("t")
        gaps = []
        for r in results:
            before = [c for c in r["chunks"] if c <= t]
            after = [c for c in r["chunks"] if c > t]
            if before and after and after[0] - before[-1] > 0:
                gaps.append(after[0] - t)
        rep["resume_gap_s"] = {"max": round(max(gaps), 3), "median": round(statistics.median(gaps), 3)} if gaps \
            else None


async def until_streaming(client, url: str, n: int, limit_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if (await get_json(client, url, "/debug/instances"))["live"] >= n:
            return
        await asyncio.sleep(0.05)


def stream_outcomes(results: list) -> dict:
    out: dict[str, int] = {}
    for r in results:
        key = r["outcome"] if r["outcome"] != "lost" else f"cut ({r.get('error', 'no [DONE]')[:60]})"
        out[key] = out.get(key, 0) + 1
    return out


def my_processes(pattern: str) -> dict[int, str]:
    """This process's descendants (its own Ray cluster, not another one on the machine) whose title matches
    ``pattern``: pid -> the matched group."""
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            found = re.search(pattern, " ".join(p.cmdline()))
        except psutil.Error:
            continue
        if found:
            out[p.pid] = found.group(1)
    return out


REPLICA_TITLE = r"ServeReplica:remask:([A-Za-z0-9_]+)"


def rss_by_pid() -> dict[int, tuple[str, float]]:
    """This app's Serve replica processes (this process's own Ray cluster): pid -> (deployment, RSS MB)."""
    import psutil

    out = {}
    for pid, name in my_processes(REPLICA_TITLE).items():
        with contextlib.suppress(psutil.Error):
            out[pid] = (name, psutil.Process(pid).memory_info().rss / 2**20)
    return out


def replica_rss_mb() -> dict[str, float]:
    """Resident memory of this app's Serve replica processes (Ingress, Denoisers), by deployment."""
    out: dict[str, float] = {}
    for name, mb in rss_by_pid().values():
        out[name] = out.get(name, 0.0) + mb
    return {k: round(v, 1) for k, v in sorted(out.items())}
