"""Open-loop replay of a trace: each request is sent at its arrival offset, whatever earlier ones are doing.

The sender only sleeps and spawns a task per request; responses are read by those tasks, so a slow
response never delays a later send (every result records its ``send_lag_ms``). The connection pool
is unbounded for the same reason. Ctrl-C (or SIGTERM) stops sending, cancels the requests in flight
and still returns (and writes) what was measured, marked ``interrupted``.

``max_concurrency`` (``--max-concurrency``, vLLM benchmark_serving's option) caps the requests in flight:
a request that arrives while N are in flight waits for a free slot, then goes out. As in vLLM, its
latencies (TTFT, TPOT, ITL, E2EL) start when it goes out; the wait is recorded as ``queued_ms`` (and
``mean_queue_ms``/``max_queue_ms`` in the summary) and is part of the benchmark's duration.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.client import RequestResult, auth_headers, send
from loadgen.http import make_transport
from loadgen.metrics import DEFAULT_PERCENTILES, summarize
from loadgen.trace import TraceRequest


@dataclass(frozen=True)
class ReplayConfig:
    url: str
    model: str | None = None
    timeout_s: float = 600.0
    lead_s: float = 0.05  # the first arrival is this long after the replay starts
    progress: bool = True
    time_scale: float = 1.0  # arrival offsets are multiplied by this (0.5 = twice the rate)
    transport: str = "raw"  # "raw" | "httpx" (loadgen.http)
    spin_s: float = 0.0  # see _until
    api_key: str | None = field(default=None, repr=False)  # sent as "Authorization: Bearer"; never recorded
    max_concurrency: int | None = None  # at most this many requests in flight (None: unbounded)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES  # of TTFT, TPOT, ITL and E2EL in the summary
    goodput: dict[str, float] | None = None  # {"ttft"|"tpot"|"e2el": ms}: vLLM's --goodput bounds
    path: str | None = None  # the URL path of every request (None: /v1/completions or /v1/chat/completions)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")


async def _until(when: float, stopper: asyncio.Future, spin_s: float) -> None:
    """Return at ``time.perf_counter() >= when`` or once ``stopper`` is done.

    The loop's timers fire up to about 1 ms late (epoll rounds its timeout up to whole ms); with
    ``spin_s`` > 0 the last ``spin_s`` seconds are spent yield-spinning, which sends within tens of
    microseconds but burns CPU the server under test may need (on two busy cores it doubled the TTFT
    error), so it is off by default.
    """
    delay = when - time.perf_counter() - spin_s
    if delay > 0:
        await asyncio.wait([stopper], timeout=delay)
    while time.perf_counter() < when and not stopper.done():
        await asyncio.sleep(0)  # other tasks (responses being read) still run


async def _replay(trace: list[TraceRequest], cfg: ReplayConfig, stop: asyncio.Event) -> dict:
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(trace), unit="req", desc="replay")
    results: list[RequestResult] = []
    tasks: list[asyncio.Task] = []
    client = make_transport(cfg.transport, cfg.url, cfg.timeout_s, auth_headers(cfg.api_key))
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async def gated(req: TraceRequest, res: RequestResult) -> RequestResult:
        if slots is None:
            return await send(client, req, cfg.model, res, t0, cfg.path)
        waited = time.perf_counter()
        async with slots:
            res.queued_ms = (time.perf_counter() - waited) * 1000.0
            return await send(client, req, cfg.model, res, t0, cfg.path)

    try:
        t0 = time.perf_counter() + cfg.lead_s
        stopper = asyncio.ensure_future(stop.wait())
        for req in trace:
            await _until(t0 + req.arrival_s * cfg.time_scale, stopper, cfg.spin_s)
            if stop.is_set():
                break
            res = RequestResult(req.request_id, req.category, req.endpoint, req.arrival_s * cfg.time_scale)
            results.append(res)
            task = asyncio.ensure_future(gated(req, res))
            if bar is not None:
                task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
        everything = asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.wait([stopper, everything], return_when=asyncio.FIRST_COMPLETED)
        interrupted = stop.is_set()
        stopper.cancel()
        everything.cancel()  # cancels the requests still in flight, if any
        await asyncio.gather(everything, return_exceptions=True)
    finally:
        await client.aclose()
    for res in results:
        if res.e2el_ms is None and not res.ok and res.error is None:
            res.cancelled, res.error = True, "cancelled"
    ends = [r.send_s + r.e2el_ms / 1000.0 for r in results if r.e2el_ms is not None]
    duration = max(ends) if ends else time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return {"interrupted": interrupted, "duration": duration, "results": results,
            "not_sent": len(trace) - len(results)}


async def _main(trace: list[TraceRequest], cfg: ReplayConfig) -> dict:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
            pass
    try:
        return await _replay(trace, cfg, stop)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def replay(trace: list[TraceRequest], cfg: ReplayConfig) -> dict:
    """Replay ``trace`` against ``cfg.url``; the results document (see :func:`results_document`)."""
    started = time.time()
    out = asyncio.run(_main(trace, cfg))
    return results_document(out, cfg, started)


def results_document(out: dict, cfg: ReplayConfig, started: float) -> dict:
    results = out["results"]
    summary = summarize(results, out["duration"], out["not_sent"], cfg.percentiles, cfg.goodput)
    summary["max_concurrency"] = cfg.max_concurrency
    return {
        "config": {"url": cfg.url, "model": cfg.model, "time_scale": cfg.time_scale, "transport": cfg.transport,
                   "started_at": started, "api_key_sent": bool(cfg.api_key), "max_concurrency": cfg.max_concurrency,
                   "percentiles": list(cfg.percentiles), "goodput": cfg.goodput},
        "interrupted": out["interrupted"],
        "summary": summary,
        "requests": [r.to_dict() for r in results],
    }


def write_results(doc: dict, path: str | Path) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
