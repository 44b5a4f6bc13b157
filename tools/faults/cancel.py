"""The ``cancel`` scenario: connect-disconnect cycles; every slot and KV reservation must come back."""

from __future__ import annotations

import asyncio
import time

from tools.faults.harness import app_args, local_app, replica_rss_mb


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
        before = replica_rss_mb()
        t0 = time.monotonic()
        n = asyncio.run(_cancel_cycles(url, cycles, concurrency))
        wall = time.monotonic() - t0
        state = _settle(url)
        after = replica_rss_mb()
        served = answer(url)
    growth = {k: round(after.get(k, 0.0) - v, 1) for k, v in before.items()}
    problems = [f"{k} {v} left after the cycles" for k, v in state.items() if k != "settle_s" and v]
    if served != reference:
        problems.append(f"the request after the cycles answered {served!r}, before them {reference!r}")
    return {"scenario": "cancel", "cycles": n, "wall_s": round(wall, 1), "idle_after_warmup": idle,
            "state_after": state, "rss_mb_before": before, "rss_mb_after": after, "rss_growth_mb": growth,
            "served_after": served, "reference": reference, "problems": problems, "passed": not problems}


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
