"""The ``kill`` scenario: Denoiser replica (or TP rank 1) kills under load, every answer checked."""

from __future__ import annotations

import asyncio
import time

from tools.faults.checks import check, error_messages, fault_requests, gate
from tools.faults.harness import (
    FAULT_ROUTER,
    app_args,
    dispatch_stats,
    get_json,
    kill_busiest,
    local_app,
    recovery,
    reference_pass,
    stream_one,
)


async def _inject(client, url: str, kill_at: list[float], reports: list, target: str = "replica") -> None:
    """A kill at each time in ``kill_at`` (seconds from now), without waiting for the previous one's
    replacement; each kill is watched apart."""
    t0 = time.monotonic()
    watchers = []
    for at in kill_at:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        task = await kill_busiest(client, url, target, reports)
        if task is not None:
            watchers.append(task)
    await asyncio.gather(*watchers)


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
            jobs.append(asyncio.create_task(stream_one(transport, body, timeout)))
        results = await asyncio.gather(*jobs)
        await transport.aclose()
        await injector
        dispatch = (await get_json(client, url, "/debug/instances"))["dispatch"]
    return results, reports, dispatch, time.monotonic() - t0


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
        reference, ref_wall = asyncio.run(reference_pass(url, bodies, 16 * replicas, timeout))
        before = dispatch_stats(url)
        results, reports, dispatch, wall = asyncio.run(_drive(url, bodies, rate, kills, timeout, target))
    recovery(results, reports)
    summary = check(results, reference)
    summary.update(scenario="kill", target=target, tp=tp, replicas=replicas, rate=rate, kills=len(reports),
                   failovers=dispatch["failed_over"] - before["failed_over"], reference_s=round(ref_wall, 1),
                   wall_s=round(wall, 1), kill_reports=reports, dispatch=dispatch,
                   error_messages=error_messages(results))
    return gate(summary, kills, kills, max_failed)
