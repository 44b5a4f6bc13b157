"""``remask faults``: fault injection against a real Ray Serve app, every answer checked.

Each fault scenario starts the app (tiny-bd) on a local Ray cluster and sends *deterministic* streaming
completions: a client-fixed threshold (so the router never chooses one), greedy (temperature 0) or seeded
sampling. Before the fault it runs every request once on the same app (the *reference pass*); after it,
each request's final text must equal its reference byte for byte, and a stream that ended early (cancelled
by its client, cut, failed cleanly) must have received a prefix of it (``check``). A request is

- *completed* when it streamed its finish_reason and ``[DONE]`` with the reference text;
- *mismatched* when anything it received differs from the reference (whatever its outcome);
- *failed* (cleanly) when it got an HTTP error with an OpenAI-style body, Serve's proxy's 429 +
  ``Retry-After``, or an SSE error event;
- *lost* otherwise (a broken stream, a plain 500, a hang past the timeout).

``verdict`` turns the counts into the exit status: non-zero on any lost or mismatched request, on fewer
kills than asked (so on zero kills), on fewer failovers (requests the dispatcher resumed elsewhere, from its
``/debug/instances`` counters) than kills, or on more clean failures than the scenario's stated bound.

Scenarios: ``kill`` (``ray.kill`` of the busiest Denoiser replica, or its TP rank 1, under load),
``node`` (a two-node Ray cluster whose second node holds the Denoisers; the node's processes are killed
mid-stream), ``ingress`` (the Ingress killed under long streams; clients retry the cut ones), ``redeploy``
(``serve.run`` of a changed config under long streams), ``soak`` (mixed traffic at ~70% of the measured
capacity with cancellations and a kill every 5 minutes, and the replicas' memory slope), and the load
scenarios ``overload`` and ``cancel``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import sys
import time

PROMPTS_CATEGORIES = ("reverse", "choice", "arith", "prose")
LONG_PROMPTS = tuple(f"story: {a} {k}" for a in ("fox", "owl", "elk", "cat") for k in (6, 8))


# ---- deterministic requests and their check ---------------------------------------------------------------
def fault_requests(n: int, long: bool = False) -> list[dict]:
    """``n`` deterministic streaming completions. Even-numbered ones are greedy (temperature 0), odd ones
    sampled (temperature 1, seed 1000 + their number); every one carries a fixed threshold, so the router
    never picks it. Short ones: task-suite prompts, 24 tokens (96 for stories), thresholds 0.999 and 0.9 in
    turn by pairs. ``long``: 200-token stories at 0.9999 (about one token a step: long streams)."""
    import tasksuite as tasks

    if n < 1:
        raise ValueError("need at least one request")
    examples = [] if long else [e for e in tasks.heldout_set(2 * n + 8) if e.category in PROMPTS_CATEGORIES][:n]
    out = []
    for i in range(n):
        if long:
            body = {"prompt": LONG_PROMPTS[i % len(LONG_PROMPTS)], "max_tokens": 200, "threshold": 0.9999}
        else:
            ex = examples[i]
            body = {"prompt": ex.prompt, "max_tokens": 96 if ex.category == "prose" else 24,
                    "threshold": 0.999 if (i // 2) % 2 == 0 else 0.9}
        body.update({"temperature": 1.0, "seed": 1000 + i} if i % 2 else {"temperature": 0.0})
        out.append({**body, "stream": True})
    return out


def consistent(result: dict, want: str) -> bool:
    """Whether what a request received agrees with its reference text: all of it when it completed, a prefix
    of it otherwise (a stream that ended early)."""
    return result["text"] == want if result["outcome"] == "completed" else want.startswith(result["text"])


def check(results: list[dict], reference: list[str]) -> dict:
    """Compare each result (``_one``'s: ``outcome``, ``text``) with the reference text of the same request:
    the counts (``completed``, ``mismatched``, ``failed``, ``lost``, ``cancelled``; each request in one), the
    mismatched requests' positions and the first ten mismatches with where they differ."""
    if len(results) != len(reference):
        raise ValueError(f"{len(results)} results for {len(reference)} reference texts")
    out = {"requests": len(results), "completed": 0, "mismatched": 0, "failed": 0, "lost": 0, "cancelled": 0}
    mismatches, wrong = [], []
    for i, (r, want) in enumerate(zip(results, reference)):
        if r["outcome"] not in ("completed", "failed", "lost", "cancelled"):
            raise ValueError(f"unknown outcome {r['outcome']!r}")
        if consistent(r, want):
            out[r["outcome"]] += 1
            continue
        out["mismatched"] += 1
        wrong.append(i)
        if len(mismatches) < 10:
            got = r["text"]
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatches.append({"request": r.get("index", i), "outcome": r["outcome"],
                               **{k: r["body"][k] for k in ("prompt", "max_tokens", "threshold", "temperature",
                                                            "seed") if k in r.get("body", {})},
                               "first_difference": at, "expected": want, "got": got})
    out["mismatches"], out["mismatched_at"] = mismatches, wrong
    out["reference_chars"] = sum(len(w) for w in reference)
    return out


def verdict(summary: dict, kills: int, failovers: int, max_failed: int) -> list[str]:
    """Why a scenario failed (empty: it passed): any lost or mismatched request, fewer than ``kills``
    faults injected (``kills`` >= 1: zero never passes), fewer than ``failovers`` failovers, more than
    ``max_failed`` clean failures, or nothing to compare (every reference text empty)."""
    problems = []
    if summary["lost"]:
        problems.append(f"{summary['lost']} requests lost")
    if summary["mismatched"]:
        problems.append(f"{summary['mismatched']} requests received another text than their reference")
    if summary["kills"] < max(kills, 1):
        problems.append(f"{summary['kills']} kills, not {max(kills, 1)}: the fault was not injected")
    if summary["failovers"] < failovers:
        problems.append(f"{summary['failovers']} failovers, not at least {failovers}: no request was resumed "
                        f"elsewhere, so the kill tested nothing")
    if summary["failed"] > max_failed:
        problems.append(f"{summary['failed']} clean failures, over the bound of {max_failed}")
    if summary["reference_chars"] == 0:
        problems.append("every reference text is empty: nothing was compared")
    return problems


def summary_line(s: dict) -> str:
    kills = f"{s['kills']} kills" + (f" ({s['kills_are']})" if s.get("kills_are") else "")
    failovers = f"{s['failovers']} failovers" + (f" ({s['failovers_are']})" if s.get("failovers_are") else "")
    return (f"{s['lost']} lost, {s['mismatched']} mismatched; {kills}, {failovers}, "
            f"{s['failed']} failed cleanly (bound {s['max_failed']}); {s['completed']} of {s['requests']} "
            f"completed with the reference text" + (f", {s['cancelled']} cancelled" if s.get("cancelled") else "")
            + f" ({s['reference_chars']} reference characters)")


def _gate(summary: dict, kills: int, failovers: int, max_failed: int, extra: list[str] = ()) -> dict:
    summary["max_failed"] = max_failed
    summary["problems"] = verdict(summary, kills, failovers, max_failed) + list(extra)
    summary["passed"] = not summary["problems"]
    return summary


# ---- one request ---------------------------------------------------------------------------------------------
async def _one(transport, body: dict, timeout: float, cancel_after: int | None = None) -> dict:
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


async def _reference(url: str, bodies: list[dict], concurrency: int, timeout: float) -> tuple[list[str], float]:
    """Every request once, ``concurrency`` at a time, with no fault: the reference texts (a request that
    does not complete is tried twice more; the pass fails if it never does), and the pass's wall time."""
    from loadgen.http import RawTransport

    transport = RawTransport(url, timeout_s=timeout)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, body: dict) -> str:
        for _ in range(3):
            async with sem:
                r = await _one(transport, body, timeout)
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


async def _get(client, url: str, path: str) -> dict:
    return (await client.get(f"{url}{path}", timeout=30)).json()


def _errors(results: list[dict]) -> list[str]:
    """The distinct errors of the requests that failed or were lost (the first ten)."""
    return sorted({f"{r['outcome']}: {r.get('error', 'no [DONE]')[:160]}" for r in results
                   if r["outcome"] in ("failed", "lost")})[:10]


# ---- replica kills ---------------------------------------------------------------------------------------------
async def _busiest(client, url: str, limit_s: float = 10.0):
    """The instances' view and the busiest instance, once it holds a request (or after ``limit_s``)."""
    t0 = time.monotonic()
    while True:
        view = await _get(client, url, "/debug/instances")
        best = max(view["instances"].values(), key=lambda v: v["requests"], default=None)
        if (best is not None and best["requests"] >= 1) or time.monotonic() - t0 > limit_s:
            return view, best
        await asyncio.sleep(0.05)


async def _kill_busiest(client, url: str, target: str, reports: list) -> asyncio.Task | None:
    """Kill the busiest Denoiser replica (``target="replica"``) or its tensor-parallel rank 1 (``"tp-worker"``:
    the replica's round breaks and it fails over); a task watching its detection and replacement."""
    import ray

    view, victim = await _busiest(client, url)
    if victim is None:
        return None
    actor = victim["actor"] if target == "replica" else victim["workers"][0]
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
    rep = {"replica": victim["replica"], "requests_held": victim["requests"], "t": time.monotonic(),
           "failed_over_before": view["dispatch"]["failed_over"]}
    reports.append(rep)
    return asyncio.create_task(_watch(client, url, rep, {i["replica"] for i in view["instances"].values()}))


async def _inject(client, url: str, kill_at: list[float], reports: list, target: str = "replica") -> None:
    """A kill at each time in ``kill_at`` (seconds from now), without waiting for the previous one's
    replacement; each kill is watched apart."""
    t0 = time.monotonic()
    watchers = []
    for at in kill_at:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        task = await _kill_busiest(client, url, target, reports)
        if task is not None:
            watchers.append(task)
    await asyncio.gather(*watchers)


async def _watch(client, url: str, rep: dict, known: set, limit_s: float = 180.0) -> None:
    """Until the ingress dropped the dead replica (then: the requests it failed over, by the dispatcher's
    counter) and a new replica (not in ``known``) has joined."""
    while time.monotonic() - rep["t"] < limit_s:
        await asyncio.sleep(0.1)
        view = await _get(client, url, "/debug/instances")
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


async def _drive(url: str, bodies: list[dict], rate: float, kills: int, timeout: float,
                 target: str = "replica") -> tuple[list, list, dict, float]:
    import httpx

    from loadgen.http import RawTransport

    reports: list = []
    transport = RawTransport(url, timeout_s=timeout)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
        t0 = time.monotonic()
        span = len(bodies) / rate
        kill_at = [span * (k + 1) / (kills + 1) for k in range(kills)]  # spread over the arrivals
        injector = asyncio.create_task(_inject(client, url, kill_at, reports, target))
        jobs = []
        for i, body in enumerate(bodies):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            jobs.append(asyncio.create_task(_one(transport, body, timeout)))
        results = await asyncio.gather(*jobs)
        await transport.aclose()
        await injector
        dispatch = (await _get(client, url, "/debug/instances"))["dispatch"]
    return results, reports, dispatch, time.monotonic() - t0


def _recovery(results: list, reports: list) -> None:
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


# The fault scenarios' router: a dead instance is declared after 5 s without ticks, and nothing is shed while
# capacity is down (shedding under load is the overload scenario's subject; here every request must complete).
FAULT_ROUTER = {"dead_after_s": 5.0, "shed_over_capacity": False}


def _dispatch_stats(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/debug/instances", timeout=30).json()["dispatch"]


def run_faults(requests: int = 200, kills: int = 2, rate: float = 8.0, replicas: int = 3, port: int = 8790,
               timeout: float = 180.0, target: str = "replica", tp: int = 1, max_failed: int = 0) -> dict:
    """The ``kill`` scenario: ``requests`` deterministic requests at ``rate`` req/s, ``kills`` kills of the
    busiest replica (or its TP rank 1) spread over the arrivals, every text checked against the reference
    pass. Gates: 0 lost, 0 mismatched, ``kills`` kills, at least as many failovers, at most ``max_failed``
    clean failures."""
    if target not in ("replica", "tp-worker") or (target == "tp-worker" and tp < 2):
        raise ValueError("target is 'replica' or 'tp-worker' (which needs tp >= 2)")
    bodies = fault_requests(requests)
    args = app_args({tp: replicas}, 16, router=FAULT_ROUTER)
    with local_app(args, replicas, port) as url:
        reference, ref_wall = asyncio.run(_reference(url, bodies, 16 * replicas, timeout))
        before = _dispatch_stats(url)
        results, reports, dispatch, wall = asyncio.run(_drive(url, bodies, rate, kills, timeout, target))
    _recovery(results, reports)
    summary = check(results, reference)
    summary.update(scenario="kill", target=target, tp=tp, replicas=replicas, rate=rate, kills=len(reports),
                   failovers=dispatch["failed_over"] - before["failed_over"], reference_s=round(ref_wall, 1),
                   wall_s=round(wall, 1), kill_reports=reports, dispatch=dispatch,
                   error_messages=_errors(results))
    return _gate(summary, kills, kills, max_failed)


# ---- node loss -------------------------------------------------------------------------------------------------
DENOISER_RESOURCE = "remask_denoiser"  # the custom resource only Denoiser nodes have (node scenario)
HEAD_RESOURCE = "remask_head"  # the head's: the Ingress stays there


def node_serve_config(args: dict, port: int, cpus_per_replica: float = 0.5) -> dict:
    """The node scenario's Serve config: the app of ``args``, with every Denoiser requiring one unit of
    ``DENOISER_RESOURCE`` (its ray_actor_options and placement bundle; only Denoiser nodes have it) and the
    Ingress a share of ``HEAD_RESOURCE`` (so losing a Denoiser node never takes the Ingress)."""
    from app.config import INGRESS, denoiser_name  # lazily: `remask` on a device image has no pydantic

    deployments = [{"name": INGRESS, "ray_actor_options": {"num_cpus": 1, "resources": {HEAD_RESOURCE: 0.01}}}]
    for d in args["resources"]["tp_degrees"]:
        if d != 1:
            raise ValueError("the node scenario places TP-1 Denoisers")
        deployments.append({
            "name": denoiser_name(d), "placement_group_strategy": "PACK",
            "placement_group_bundles": [{"CPU": cpus_per_replica, DENOISER_RESOURCE: 1}],
            "ray_actor_options": {"num_cpus": cpus_per_replica, "resources": {DENOISER_RESOURCE: 1}}})
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "remask", "route_prefix": "/", "import_path": "deployments.builder:build_app",
                              "args": {**args, "resources": {**args["resources"],
                                                             "cpus_per_replica": cpus_per_replica}},
                              "deployments": deployments}]}


def _my_processes(pattern: str) -> dict[int, str]:
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


def _node_of(pid: int) -> str | None:
    """The Ray node id of a worker process: its raylet's ``--node_id``."""
    import psutil

    try:
        p = psutil.Process(pid)
        while p is not None:
            found = re.search(r"--node_id=([0-9a-f]+)", " ".join(p.cmdline()))
            if found:
                return found.group(1)
            p = p.parent()
    except psutil.Error:
        return None
    return None


DENOISER_TITLE = r"ServeReplica:remask:(Denoiser_TP\d+)"


def _denoiser_nodes() -> dict[int, str | None]:
    return {pid: _node_of(pid) for pid in _my_processes(DENOISER_TITLE)}


@contextlib.contextmanager
def two_node_app(args: dict, replicas: int, port: int):
    """A two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head with the Ingress, node B
    with ``replicas`` units of ``DENOISER_RESOURCE``), the app deployed on it with ``node_serve_config``
    (``serve run --non-blocking`` of a config file: the per-deployment overrides are Serve's own); yields
    (cluster, node B, URL) once ``replicas`` instances have joined. Logical resources only: it runs on 2 cores."""
    import subprocess
    import tempfile

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False,
                                                            "resources": {HEAD_RESOURCE: 1}})
    try:
        node_b = cluster.add_node(num_cpus=2, resources={DENOISER_RESOURCE: replicas})
        ray.init(address=cluster.address, log_to_driver=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "node_scenario.yaml")
            with open(path, "w") as f:  # JSON is YAML: serve run reads it
                json.dump(node_serve_config(args, port), f)
            serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
            done = subprocess.run([serve_cli, "run", "--non-blocking", "--address", cluster.address, path],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"serve run failed: {done.stderr[-2000:]}")
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, replicas)
        yield cluster, node_b, url
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def run_node(requests: int = 120, rate: float = 10.0, replicas: int = 2, port: int = 8790, timeout: float = 300.0,
             max_failed: int = 0) -> dict:
    """The ``node`` scenario: the Denoisers on node B, a spare node C (the same resource) added once they
    serve, ``requests`` deterministic requests at ``rate``; halfway through the arrivals node B's processes
    are killed (``Cluster.remove_node``, not graceful: its raylet and workers die as in a crash). Every
    request must complete elsewhere with its reference text (they wait, parked, for the replacements:
    ``router.park_s`` 180 s here), and the replacements must run on a live node. Kills: the replicas lost
    with the node."""
    import httpx
    import ray

    from loadgen.http import RawTransport

    bodies = fault_requests(requests)
    args = app_args({1: replicas}, 16, router={**FAULT_ROUTER, "park_s": 180.0})
    node: dict = {}

    async def drive(url: str, cluster, node_b):
        transport = RawTransport(url, timeout_s=timeout)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
            t0 = time.monotonic()
            jobs, removed, watch, before = [], None, None, 0
            for i, body in enumerate(bodies):
                await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                jobs.append(asyncio.create_task(_one(transport, body, timeout)))
                if removed is None and i >= len(bodies) // 2:
                    view, _ = await _busiest(client, url)
                    node["replicas_lost"] = sum(1 for n in _denoiser_nodes().values() if n == node_b.node_id)
                    node["requests_held"] = sum(v["requests"] for v in view["instances"].values())
                    known = {v["replica"] for v in view["instances"].values()}
                    before = view["dispatch"]["failed_over"]
                    removed = time.monotonic()
                    await asyncio.to_thread(cluster.remove_node, node_b, allow_graceful=False)  # streams go on
                    watch = asyncio.create_task(_watch_node(client, url, removed, known, node))
            results = await asyncio.gather(*jobs)
            await transport.aclose()
            if watch is not None:
                await watch
            dispatch = (await _get(client, url, "/debug/instances"))["dispatch"]
        return results, dispatch, dispatch["failed_over"] - before, time.monotonic() - t0

    with two_node_app(args, replicas, port) as (cluster, node_b, url):
        on_b = _denoiser_nodes()
        placed = {"replicas": len(on_b), "on_node_b": sum(1 for n in on_b.values() if n == node_b.node_id)}
        reference, ref_wall = asyncio.run(_reference(url, bodies, 16 * replicas, timeout))
        node_c = cluster.add_node(num_cpus=2, resources={DENOISER_RESOURCE: replicas})  # the spare
        results, dispatch, failovers, wall = asyncio.run(drive(url, cluster, node_b))
        alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        after = _denoiser_nodes()
        node.update(removed=node_b.node_id, removed_alive=alive.get(node_b.node_id), spare=node_c.node_id,
                    initial_placement=placed,
                    replacements=[{"pid": pid, "node": n, "alive": alive.get(n, False)}
                                  for pid, n in after.items() if pid not in on_b])
    summary = check(results, reference)
    extra = []
    if placed["on_node_b"] != placed["replicas"] or placed["replicas"] < replicas:
        extra.append(f"the Denoisers were not all on node B before the fault: {placed}")
    if not node["replacements"] or not all(r["alive"] and r["node"] != node["removed"] for r in node["replacements"]):
        extra.append(f"no replacement replica runs on a live node: {node['replacements']}")
    summary.update(scenario="node", replicas=replicas, rate=rate, kills=node.get("replicas_lost", 0),
                   kills_are="Denoisers lost with the node",
                   failovers=failovers, reference_s=round(ref_wall, 1), wall_s=round(wall, 1), node=node,
                   dispatch=dispatch,
                   error_messages=_errors(results))
    return _gate(summary, 1, 1, max_failed, extra)


async def _watch_node(client, url: str, t: float, known: set, rep: dict, limit_s: float = 240.0) -> None:
    """After the node went: when the ingress had dropped all its instances, and when a replacement joined."""
    while time.monotonic() - t < limit_s:
        await asyncio.sleep(0.2)
        view = await _get(client, url, "/debug/instances")
        now = round(time.monotonic() - t, 3)
        current = {i["replica"] for i in view["instances"].values()}
        if "detected_s" not in rep and not current & known:
            rep["detected_s"] = now
        if current - known:
            rep["replaced_s"] = now
            return
    rep["replaced_s"] = None


# ---- ingress restart and redeploy ------------------------------------------------------------------------------
async def _until_streaming(client, url: str, n: int, limit_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if (await _get(client, url, "/debug/instances"))["live"] >= n:
            return
        await asyncio.sleep(0.05)


async def _probe(client, url: str, t0: float, limit_s: float) -> dict:
    """A short request every 0.25 s until one answers with its known text: what clients got meanwhile, and when
    it answered."""
    seen: dict[str, int] = {}
    while time.monotonic() - t0 < limit_s:
        try:
            r = await client.post(f"{url}/v1/completions", json={"prompt": "rev: abc", "max_tokens": 8,
                                                                 "temperature": 0.0}, timeout=30)
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


def run_ingress_restart(streams: int = 8, port: int = 8790, timeout: float = 300.0) -> dict:
    """Kill the Ingress actor while ``streams`` long deterministic streams run. By design the crash cuts
    every open stream (or gets Serve's plain 500: nothing of ours is left to write an error): those are
    *interrupted*, bounded by ``streams``, and must have received a prefix of their reference text; each
    client then retries its interrupted request once the app answers again, and the retry must complete
    with the reference text. Gates: 0 lost (no identical completion, first try or retry), 0 mismatched,
    the kill, at least one interrupted stream retried to completion (the failover a client does here), and
    the app answering again."""
    import httpx
    import ray

    from app.config import INGRESS
    from loadgen.http import RawTransport

    args = app_args({1: 2}, 16)
    bodies = fault_requests(streams, long=True)

    async def drive(url: str):
        reference, _ = await _reference(url, bodies, streams, timeout)
        transport = RawTransport(url, timeout_s=timeout)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 8)) as client:
            jobs = [asyncio.create_task(_one(transport, b, timeout)) for b in bodies]
            await _until_streaming(client, url, streams)
            (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if f"#{INGRESS}#" in a["name"]]
            t0 = time.monotonic()
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            probe = await _probe(client, url, t0, 120)
            first = await asyncio.gather(*jobs)
            retry_transport = RawTransport(url, timeout_s=timeout)
            again = await asyncio.gather(*(_one(retry_transport, bodies[i], timeout)
                                           for i, r in enumerate(first) if r["outcome"] != "completed"))
            await transport.aclose()
            await retry_transport.aclose()
        return reference, first, again, probe

    with local_app(args, 2, port) as url:
        reference, first, again, probe = asyncio.run(drive(url))
    interrupted = [i for i, r in enumerate(first) if r["outcome"] != "completed"]
    before = check(first, reference)  # what the crash delivered: prefixes, or whole identical texts
    retried = dict(zip(interrupted, again))
    final = [retried.get(i, r) for i, r in enumerate(first)]
    after = check(final, reference)
    wrong = sorted(set(before["mismatched_at"]) | set(after["mismatched_at"]))
    summary = {**after, "mismatched": len(wrong), "mismatched_at": wrong,
               "mismatches": (before["mismatches"] + after["mismatches"])[:10]}
    extra = [] if probe["answered_after_s"] is not None else ["the app did not answer again within 120 s"]
    summary.update(scenario="ingress", streams=streams, kills=1, kills_are="the Ingress",
                   failovers_are="interrupted streams retried to completion", interrupted=len(interrupted),
                   interrupted_bound=streams, first_try=_stream_outcomes(first),
                   failovers=sum(1 for i in interrupted if final[i]["outcome"] == "completed"
                                 and final[i]["text"] == reference[i]), error_messages=_errors(final), **probe)
    return _gate(summary, 1, 1, 0, extra)


def run_redeploy(streams: int = 8, port: int = 8790, timeout: float = 300.0) -> dict:
    """``serve.run`` of a changed config (a new served model name, so every deployment is replaced: what
    ``serve deploy`` does) while ``streams`` long deterministic streams run. Gates: every stream completes
    with its reference text (no clean failure either), the new config answers within 180 s, and the old
    Denoiser replicas are gone (the *kills* here: each was stopped and drained). The requests the old ingress
    moved (``drained``, ``failed_over``, ``migrated`` as last seen) are reported, not required: with no other
    instance yet they finish where they are."""
    import httpx
    from ray import serve

    from deployments.builder import build_app
    from loadgen.http import RawTransport

    args = app_args({1: 2}, 16)
    bodies = fault_requests(streams, long=True)

    async def drive(url: str):
        reference, _ = await _reference(url, bodies, streams, timeout)
        transport = RawTransport(url, timeout_s=timeout)
        moved = {"drained": 0, "failed_over": 0, "migrated": 0}
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 8)) as client:
            old = {v["replica"] for v in (await _get(client, url, "/debug/instances"))["instances"].values()}
            jobs = [asyncio.create_task(_one(transport, b, timeout)) for b in bodies]
            await _until_streaming(client, url, streams)
            t0 = time.monotonic()
            changed = app_args({1: 2}, 16, http={"served_model_name": "tiny-bd-v2"})
            serve.run(build_app(changed), name="remask", route_prefix="/", blocking=False)
            while not all(j.done() for j in jobs):
                with contextlib.suppress(Exception):
                    d = (await _get(client, url, "/debug/instances"))["dispatch"]
                    moved = {k: max(v, d.get(k, 0)) for k, v in moved.items()}
                await asyncio.sleep(0.5)
            results = [j.result() for j in jobs]
            streams_s = time.monotonic() - t0
            new_s = None
            while time.monotonic() - t0 < 180:
                models = await _get(client, url, "/v1/models")
                if models.get("data") and models["data"][0]["id"] == "tiny-bd-v2":
                    new_s = round(time.monotonic() - t0, 2)
                    break
                await asyncio.sleep(0.25)
            now = {v["replica"] for v in (await _get(client, url, "/debug/instances"))["instances"].values()}
            await transport.aclose()
            return reference, results, round(streams_s, 2), new_s, len(old - now), moved

    with local_app(args, 2, port) as url:
        reference, results, streams_s, new_s, replaced, moved = asyncio.run(drive(url))
    summary = check(results, reference)
    done = [r for r in results if r["outcome"] == "completed"]
    extra = [] if new_s is not None else ["the new config did not answer within 180 s"]
    summary.update(scenario="redeploy", streams=streams, kills=replaced, kills_are="old Denoisers replaced",
                   failovers=sum(moved.values()), failovers_are="requests the old ingress moved", moved=moved,
                   stream_outcomes=_stream_outcomes(results), last_stream_ended_after_s=streams_s,
                   new_config_served_after_s=new_s, error_messages=_errors(results),
                   mean_stream_s=round(statistics.mean(r["e2e_s"] for r in done), 2) if done else None)
    return _gate(summary, 1, 0, 0, extra)


# ---- soak ------------------------------------------------------------------------------------------------------
REPLICA_TITLE = r"ServeReplica:remask:([A-Za-z0-9_]+)"


def _rss_by_pid() -> dict[int, tuple[str, float]]:
    """This app's Serve replica processes (this process's own Ray cluster): pid -> (deployment, RSS MB)."""
    import psutil

    out = {}
    for pid, name in _my_processes(REPLICA_TITLE).items():
        with contextlib.suppress(psutil.Error):
            out[pid] = (name, psutil.Process(pid).memory_info().rss / 2**20)
    return out


def rss_slope(samples: list[tuple[float, float]], warmup_s: float) -> tuple[float | None, float]:
    """MB per minute of a least-squares line through ``samples`` ((seconds, MB)) after the first
    ``warmup_s`` of them, and the minutes it spans (None with fewer than 3 points after the warm-up)."""
    if not samples:
        return None, 0.0
    start = samples[0][0] + warmup_s
    pts = [(t, m) for t, m in samples if t >= start]
    if len(pts) < 3:
        return None, 0.0
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mm = sum(m for _, m in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var == 0:
        return None, 0.0
    slope = sum((t - mt) * (m - mm) for t, m in pts) / var
    return slope * 60.0, (pts[-1][0] - pts[0][0]) / 60.0


async def _closed_loop(url: str, bodies: list[dict], concurrency: int, seconds: float, timeout: float) -> float:
    """Completions per second with ``concurrency`` clients sending back to back for ``seconds`` (those
    that complete in the window, after a ramp of 5 s)."""
    from loadgen.http import RawTransport

    transport = RawTransport(url, timeout_s=timeout)
    t0 = time.monotonic()
    ends: list[float] = []
    counter = iter(range(10**9))

    async def client() -> None:
        while time.monotonic() - t0 < seconds + 5:
            r = await _one(transport, bodies[next(counter) % len(bodies)], timeout)
            if r["outcome"] == "completed":
                ends.append(time.monotonic() - t0)

    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        await transport.aclose()
    return sum(1 for e in ends if 5 <= e < 5 + seconds) / seconds


async def _soak(url: str, bodies: list[dict], rate: float, seconds: float, kill_every: float,
                cancel_frac: float, timeout: float, seed: int, sample_s: float, log) -> dict:
    import httpx

    from loadgen.http import RawTransport

    rng = random.Random(seed)
    transport = RawTransport(url, timeout_s=timeout)
    series: dict[int, tuple[str, list]] = {}
    reports: list = []
    results: list[dict] = []
    t0 = time.monotonic()

    async def sampler() -> None:
        while time.monotonic() - t0 < seconds:
            now = time.monotonic() - t0
            for pid, (name, mb) in _rss_by_pid().items():
                series.setdefault(pid, (name, []))[1].append((now, mb))
            await asyncio.sleep(sample_s)

    async def killer(client) -> None:
        watchers = []
        k = 1
        while t0 + k * kill_every < t0 + seconds:
            await asyncio.sleep(max(0.0, t0 + k * kill_every - time.monotonic()))
            task = await _kill_busiest(client, url, "replica", reports)
            log(f"{(time.monotonic() - t0) / 60:.1f} min: killed {reports[-1]['replica'] if task else 'nothing'}")
            if task is not None:
                watchers.append(task)
            k += 1
        await asyncio.gather(*watchers)

    async def one(i: int, cancel: int | None) -> None:
        r = await _one(transport, bodies[i % len(bodies)], timeout, cancel_after=cancel)
        r["index"] = i % len(bodies)
        results.append(r)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
        before = (await _get(client, url, "/debug/instances"))["dispatch"]
        tasks = [asyncio.create_task(sampler()), asyncio.create_task(killer(client))]
        jobs, i, at, last_log = [], 0, 0.0, 0.0
        while at < seconds:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            cancel = rng.randint(1, 4) if rng.random() < cancel_frac else None
            jobs.append(asyncio.create_task(one(i, cancel)))
            i += 1
            at += rng.expovariate(rate)
            if at - last_log >= 60:
                last_log = at
                done = [r for r in results if r["outcome"] != "completed"]
                log(f"{at / 60:.1f} min: {i} sent, {len(results)} ended, {len(done)} not completed (cancelled "
                    f"included)")
        await asyncio.gather(*jobs)
        await asyncio.gather(*tasks)
        dispatch = (await _get(client, url, "/debug/instances"))["dispatch"]
    await transport.aclose()
    _recovery(results, reports)
    return {"results": results, "series": series, "reports": reports, "sent": i,
            "failovers": dispatch["failed_over"] - before["failed_over"], "dispatch": dispatch}


def soak_kills(seconds: float, every_s: float) -> int:
    """The kills a soak of ``seconds`` makes: one at each multiple of ``every_s`` before its end."""
    if every_s <= 0:
        raise ValueError("need --kill-every > 0")
    return max(0, -int(-seconds // every_s) - 1)


def run_soak(minutes: float = 30.0, port: int = 8790, replicas: int = 3, load: float = 0.7, kill_every_s: float = 300.0,
             cancel_frac: float = 0.1, pool: int = 160, capacity_s: float = 40.0, timeout: float = 300.0,
             max_failed: int = 0, max_rss_slope: float = 1.0, min_fit_minutes: float = 10.0, seed: int = 0,
             log=None) -> dict:
    """The ``soak`` scenario: ``pool`` deterministic requests (the reference pass), the capacity measured with
    them (``capacity_s`` of closed-loop clients, one per slot of every replica), then ``minutes`` of Poisson
    arrivals at ``load`` x that capacity cycling through the pool, ``cancel_frac`` of them hung up after 1-4
    chunks, and a kill of the busiest Denoiser every ``kill_every_s``. Reports lost, mismatched, errors (clean
    failures) and the RSS slope (MB/min, least squares after a warm-up of 20% of the run, at least 1 and at most
    5 minutes, from each process's first sample) of the Ingress and each Denoiser process. Gates: 0 lost, 0
    mismatched, at most ``max_failed`` errors, every kill made and failed over, and every process observed for
    ``min_fit_minutes`` after its warm-up under ``max_rss_slope``."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if minutes <= 0 or not 0 < load <= 1 or not 0 <= cancel_frac < 1:
        raise ValueError("need --minutes > 0, 0 < --load <= 1 and 0 <= --cancel-frac < 1")
    seconds = minutes * 60
    kills = soak_kills(seconds, kill_every_s)
    bodies = fault_requests(pool)
    args = app_args({1: replicas}, 16, router=FAULT_ROUTER)
    with local_app(args, replicas, port) as url:
        reference, ref_wall = asyncio.run(_reference(url, bodies, 16 * replicas, timeout))
        log(f"reference pass: {pool} requests in {ref_wall:.1f} s")
        capacity = asyncio.run(_closed_loop(url, bodies, 16 * replicas, capacity_s, timeout))
        rate = load * capacity
        log(f"capacity {capacity:.2f} req/s ({16 * replicas} closed-loop clients, {capacity_s:g} s); soak at "
            f"{rate:.2f} req/s for {minutes:g} min")
        run = asyncio.run(_soak(url, bodies, rate, seconds, kill_every_s, cancel_frac, timeout, seed,
                                10.0, log))
    results = run["results"]
    summary = check(results, [reference[r["index"]] for r in results])
    warmup_s = min(300.0, max(60.0, 0.2 * seconds))
    slopes = {}
    for pid, (name, samples) in sorted(run["series"].items()):
        slope, span = rss_slope(samples, warmup_s)
        slopes[str(pid)] = {"deployment": name, "mb_per_min": None if slope is None else round(slope, 3),
                            "fit_minutes": round(span, 1), "first_mb": round(samples[0][1], 1),
                            "last_mb": round(samples[-1][1], 1), "gated": span >= min_fit_minutes}
    extra = [f"{v['deployment']} (pid {pid}) grew {v['mb_per_min']} MB/min over {v['fit_minutes']} min, over "
             f"{max_rss_slope}" for pid, v in slopes.items() if v["gated"] and v["mb_per_min"] > max_rss_slope]
    e2e = sorted(r["e2e_s"] for r in results if r["outcome"] == "completed")
    summary.update(scenario="soak", minutes=minutes, capacity_rps=round(capacity, 2), rate_rps=round(rate, 2),
                   load=load, sent=run["sent"], errors=summary["failed"], kills=len(run["reports"]),
                   failovers=run["failovers"], kill_reports=run["reports"], dispatch=run["dispatch"],
                   warmup_s=warmup_s, rss_slopes=slopes,
                   rss_slope_mb_per_min={name: max((v["mb_per_min"] for v in slopes.values()
                                                    if v["deployment"] == name and v["mb_per_min"] is not None),
                                                   default=None)
                                         for name in sorted({v["deployment"] for v in slopes.values()})},
                   e2e_s={q: round(e2e[min(len(e2e) - 1, int(f * len(e2e)))], 2) for q, f in
                          (("p50", 0.5), ("p99", 0.99))} if e2e else {},
                   error_messages=_errors(results))
    if kills == 0:  # a soak shorter than one kill period: no kill is due, none is required
        summary["problems"] = verdict({**summary, "kills": 1}, 1, 0, max_failed) + extra
        summary["max_failed"] = max_failed
        summary["passed"] = not summary["problems"]
        return summary
    return _gate(summary, kills, kills, max_failed, extra)


# ---- overload and cancellation -------------------------------------------------------------------------------
def _replica_rss_mb() -> dict[str, float]:
    """Resident memory of this app's Serve replica processes (Ingress, Denoisers), by deployment."""
    out: dict[str, float] = {}
    for name, mb in _rss_by_pid().values():
        out[name] = out.get(name, 0.0) + mb
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
    (``{"router": {"shed_over_capacity": False}}``). Its requests let the router choose their thresholds (what
    is measured), so their texts are not compared; it gates on lost requests."""
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
    must come back, the replicas' memory must not grow, and a deterministic request answers afterwards as
    it did before them."""
    import httpx

    args = app_args({1: 1}, 32)
    probe = {"prompt": "story: owl 6", "max_tokens": 96, "threshold": 0.999, "temperature": 0.0}

    def answer(url: str) -> str:
        return httpx.post(f"{url}/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]

    with local_app(args, 1, port) as url:
        reference = answer(url)
        asyncio.run(_cancel_cycles(url, 100, concurrency))  # warm-up: allocator pools, caches
        idle = _settle(url)
        before = _replica_rss_mb()
        t0 = time.monotonic()
        n = asyncio.run(_cancel_cycles(url, cycles, concurrency))
        wall = time.monotonic() - t0
        state = _settle(url)
        after = _replica_rss_mb()
        served = answer(url)
    growth = {k: round(after.get(k, 0.0) - v, 1) for k, v in before.items()}
    problems = [f"{k} {v} left after the cycles" for k, v in state.items() if k != "settle_s" and v]
    if served != reference:
        problems.append(f"the request after the cycles answered {served!r}, before them {reference!r}")
    return {"scenario": "cancel", "cycles": n, "wall_s": round(wall, 1), "idle_after_warmup": idle,
            "state_after": state, "rss_mb_before": before, "rss_mb_after": after, "rss_growth_mb": growth,
            "served_after": served, "reference": reference, "problems": problems, "passed": not problems}


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


# ---- the command ---------------------------------------------------------------------------------------------
def _print_checked(res: dict, as_json: bool, out) -> int:
    """Print a content-checked scenario's result (JSON, or its summary line, details and verdict); its exit
    status."""
    if as_json:
        print(json.dumps(res), file=out)
    else:
        print(f"{res['scenario']}: {summary_line(res)}", file=out)
        for k in res.get("kill_reports", []):
            print(f"  kill {k['replica']} ({k['requests_held']} requests): dropped by the ingress after "
                  f"{k.get('detected_s')} s, {k.get('failed_over')} failed over; silence of its requests "
                  f"{k.get('resume_gap_s')} s; replacement joined after {k.get('replaced_s')} s", file=out)
        for key in ("node", "moved", "interrupted", "first_try", "answered_after_s", "new_config_served_after_s",
                    "capacity_rps", "rate_rps", "rss_slope_mb_per_min", "dispatch"):
            if key in res:
                print(f"  {key}: {json.dumps(res[key])}", file=out)
        for e in res.get("error_messages", [])[:5]:
            print(f"  error: {e}", file=out)
        for m in res["mismatches"]:
            print(f"  MISMATCH request {m['request']} ({m['outcome']}; seed {m.get('seed')}, temperature "
                  f"{m.get('temperature')}, threshold {m.get('threshold')}) at character {m['first_difference']}: "
                  f"expected {m['expected']!r}, got {m['got']!r}", file=out)
        print("PASS" if res["passed"] else "FAIL: " + "; ".join(res["problems"]), file=out)
    return 0 if res["passed"] else 1


def cmd_faults(args) -> int:
    out = sys.stdout
    try:  # Ray prints its workers' and raylets' deaths to stdout: they go to stderr, the result alone to stdout
        with contextlib.redirect_stdout(sys.stderr):
            return _run_scenario(args, out)
    except RuntimeError as exc:  # the app did not start, or the reference pass could not complete
        print(f"remask faults: error: {exc}", file=sys.stderr)
        return 1


def _run_scenario(args, out) -> int:
    if args.scenario == "overload":
        res = run_overload(args.factor, args.seconds, args.port, workload=args.workload)
        print(json.dumps(res) if args.json else
              f"{args.workload}: offered {res['offered_rps']} req/s ({args.factor:g} x the planner's "
              f"{res['planner_rate_rps']}) for "
              f"{res['seconds']:g} s: {res['status_codes']}; admitted {res['admitted_rps']} req/s, SLO "
              f"({res['slo_ms']} ms) attainment {res['admitted_slo_attainment']:.3f}; lost {res['lost']}; replica "
              f"memory {res['rss_mb_before']} -> {res['rss_mb_after']} MB", file=out)
        return 0 if res["lost"] == 0 else 1
    if args.scenario == "cancel":
        res = run_cancel(args.cycles, port=args.port)
        verdict_text = "PASS" if res["passed"] else "FAIL: " + "; ".join(res["problems"])
        print(json.dumps(res) if args.json else
              f"{res['cycles']} connect-disconnect cycles in {res['wall_s']} s; after: {res['state_after']}; "
              f"replica memory growth {res['rss_growth_mb']} MB; a request after them: {res['served_after']!r} "
              f"(before: {res['reference']!r}); {verdict_text}", file=out)
        return 0 if res["passed"] else 1
    if args.max_failed < 0:
        raise ValueError("need --max-failed >= 0")
    if args.scenario == "ingress":
        return _print_checked(run_ingress_restart(args.streams, args.port), args.json, out)
    if args.scenario == "redeploy":
        return _print_checked(run_redeploy(args.streams, args.port), args.json, out)
    if args.scenario == "soak":
        return _print_checked(run_soak(args.minutes, args.port, replicas=args.replicas, load=args.load,
                                       kill_every_s=args.kill_every, cancel_frac=args.cancel_frac,
                                       max_failed=args.max_failed, max_rss_slope=args.max_rss_slope), args.json, out)
    if args.requests < 1 or args.rate <= 0:
        raise ValueError("need --requests >= 1 and --rate > 0")
    if args.scenario == "node":
        if args.replicas < 1:
            raise ValueError("need --replicas >= 1")
        return _print_checked(run_node(args.requests, args.rate, args.replicas, args.port,
                                       max_failed=args.max_failed), args.json, out)
    if args.kills < 1 or args.replicas < 2:
        raise ValueError("need --kills >= 1 and --replicas >= 2")
    res = run_faults(args.requests, args.kills, args.rate, args.replicas, args.port, target=args.target, tp=args.tp,
                     max_failed=args.max_failed)
    return _print_checked(res, args.json, out)


def add_parsers(sub) -> None:
    """Add ``faults`` to the ``remask`` sub-parsers."""
    x = sub.add_parser("faults", help="fault injection under load, every answer checked against a run "
                                      "without the fault")
    x.add_argument("--scenario", choices=["kill", "node", "ingress", "redeploy", "soak", "overload", "cancel"],
                   default="kill",
                   help="kill: Denoiser replica kills under load; node: stop the Ray node holding the Denoisers "
                        "mid-stream (a two-node cluster on this machine); ingress: kill the Ingress under long "
                        "streams; redeploy: serve.run of a changed config under long streams; soak: --minutes of "
                        "mixed traffic at --load x the measured capacity with cancellations and a kill every "
                        "--kill-every s; overload: 10x the planner's rate; cancel: connect-disconnect cycles")
    x.add_argument("--requests", type=int, default=200, help="kill, node: deterministic requests")
    x.add_argument("--kills", type=int, default=2, help="kill: replica kills, spread over the arrivals")
    x.add_argument("--rate", type=float, default=8.0, help="kill, node: requests per second")
    x.add_argument("--replicas", type=int, default=3, help="Denoiser replicas (node: on the node that goes)")
    x.add_argument("--tp", type=int, default=1, help="kill: their tensor-parallel degree")
    x.add_argument("--target", choices=["replica", "tp-worker"], default="replica",
                   help="kill: the replica's process, or its TP rank 1 (needs --tp 2 or more)")
    x.add_argument("--max-failed", type=int, default=0,
                   help="clean failures (an error status or event) allowed before the scenario fails (default 0)")
    x.add_argument("--streams", type=int, default=8, help="ingress, redeploy: long streams in flight")
    x.add_argument("--minutes", type=float, default=30.0, help="soak: how long")
    x.add_argument("--load", type=float, default=0.7, help="soak: offered rate / measured capacity")
    x.add_argument("--kill-every", type=float, default=300.0, help="soak: seconds between Denoiser kills")
    x.add_argument("--cancel-frac", type=float, default=0.1, help="soak: requests whose client hangs up early")
    x.add_argument("--max-rss-slope", type=float, default=1.0,
                   help="soak: MB/min a process observed 10 minutes after its warm-up may grow")
    x.add_argument("--factor", type=float, default=10.0, help="overload: offered / planner rate")
    x.add_argument("--seconds", type=float, default=20.0, help="overload: how long to offer it")
    x.add_argument("--workload", choices=["short", "prose"], default="prose",
                   help="overload: prose (200-token stories, ~20 rounds each: the model is the bottleneck, as "
                        "with a DLM on a GPU) or short (32-token answers, a few rounds: on a 2-core machine "
                        "the HTTP path is)")
    x.add_argument("--cycles", type=int, default=1000, help="cancel: connect-disconnect cycles")
    x.add_argument("--port", type=int, default=8790)
    x.add_argument("--json", action="store_true")
    x.set_defaults(func=cmd_faults)
