"""The ``node`` scenario: a two-node Ray cluster whose second node holds the Denoisers; the node's
processes are killed mid-stream and every request must complete elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import time

from tools.faults.checks import check, error_messages, fault_requests, gate
from tools.faults.harness import (
    FAULT_ROUTER,
    app_args,
    busiest,
    get_json,
    my_processes,
    reference_pass,
    stream_one,
    wait_ready,
)

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
    return {pid: _node_of(pid) for pid in my_processes(DENOISER_TITLE)}


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
        wait_ready(url, replicas)
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
                jobs.append(asyncio.create_task(stream_one(transport, body, timeout)))
                if removed is None and i >= len(bodies) // 2:
                    view, _ = await busiest(client, url)
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
            dispatch = (await get_json(client, url, "/debug/instances"))["dispatch"]
        return results, dispatch, dispatch["failed_over"] - before, time.monotonic() - t0

    with two_node_app(args, replicas, port) as (cluster, node_b, url):
        on_b = _denoiser_nodes()
        placed = {"replicas": len(on_b), "on_node_b": sum(1 for n in on_b.values() if n == node_b.node_id)}
        reference, ref_wall = asyncio.run(reference_pass(url, bodies, 16 * replicas, timeout))
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
                   error_messages=error_messages(results))
    return gate(summary, 1, 1, max_failed, extra)


async def _watch_node(client, url: str, t: float, known: set, rep: dict, limit_s: float = 240.0) -> None:
    """After the node went: when the ingress had dropped all its instances, and when a replacement joined."""
    while time.monotonic() - t < limit_s:
        await asyncio.sleep(0.2)
        view = await get_json(client, url, "/debug/instances")
        now = round(time.monotonic() - t, 3)
        current = {i["replica"] for i in view["instances"].values()}
        if "detected_s" not in rep and not current & known:
            rep["detected_s"] = now
        if current - known:
            rep["replaced_s"] = now
            return
    rep["replaced_s"] = None
