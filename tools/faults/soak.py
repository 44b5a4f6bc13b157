"""The ``soak`` scenario: mixed traffic at a share of the measured capacity, with cancellations, a kill
every few minutes, and the replicas' memory slope."""

from __future__ import annotations

import asyncio
import random
import sys
import time

from tools.faults.checks import check, error_messages, fault_requests, gate, verdict
from tools.faults.harness import (
    FAULT_ROUTER,
    app_args,
    get_json,
    kill_busiest,
    local_app,
    recovery,
    reference_pass,
    rss_by_pid,
    stream_one,
)


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
            r = await stream_one(transport, bodies[next(counter) % len(bodies)], timeout)
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
            for pid, (name, mb) in rss_by_pid().items():
                series.setdefault(pid, (name, []))[1].append((now, mb))
            await asyncio.sleep(sample_s)

    async def killer(client) -> None:
        watchers = []
        k = 1
        while t0 + k * kill_every < t0 + seconds:
            await asyncio.sleep(max(0.0, t0 + k * kill_every - time.monotonic()))
            task = await kill_busiest(client, url, "replica", reports)
            log(f"{(time.monotonic() - t0) / 60:.1f} min: killed {reports[-1]['replica'] if task else 'nothing'}")
            if task is not None:
                watchers.append(task)
            k += 1
        await asyncio.gather(*watchers)

    async def one(i: int, cancel: int | None) -> None:
        r = await stream_one(transport, bodies[i % len(bodies)], timeout, cancel_after=cancel)
        r["index"] = i % len(bodies)
        results.append(r)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
        before = (await get_json(client, url, "/debug/instances"))["dispatch"]
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
        dispatch = (await get_json(client, url, "/debug/instances"))["dispatch"]
    await transport.aclose()
    recovery(results, reports)
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
        reference, ref_wall = asyncio.run(reference_pass(url, bodies, 16 * replicas, timeout))
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
                   error_messages=error_messages(results))
    if kills == 0:  # a soak shorter than one kill period: no kill is due, none is required
        summary["problems"] = verdict({**summary, "kills": 1}, 1, 0, max_failed) + extra
        summary["max_failed"] = max_failed
        summary["passed"] = not summary["problems"]
        return summary
    return gate(summary, kills, kills, max_failed, extra)
