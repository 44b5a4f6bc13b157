"""``remask bench control``: the control path of a running app, measured.

It streams ``requests`` completions (``concurrency`` at a time) through the
app and then reads the ingress's own timing (``GET /debug/control``): for
every progress event, the time from the replica's round loop publishing it to
the ingress receiving it, and for every request, the time from the ingress
dispatching it to the round loop applying it at a round boundary.
"""

from __future__ import annotations

import concurrent.futures
import time

PROMPTS = ("story: fox 8", "story: owl 6", "rev: abcdef", "max: a3 b9 c1 d2", "57+8=")


def bench_control(url: str, requests: int = 40, concurrency: int = 4, model: str | None = None,
                  timeout: float = 300.0) -> dict:
    import httpx

    url = url.rstrip("/")
    with httpx.Client(timeout=timeout) as client:
        model = model or client.get(f"{url}/v1/models").json()["data"][0]["id"]
        mark = client.get(f"{url}/debug/control").json()["events"]

        def one(i: int) -> int:
            body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "stream": True}
            chunks = 0
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
                for line in r.iter_lines():
                    chunks += line.startswith("data: ")
            return chunks

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            chunks = sum(pool.map(one, range(requests)))
        wall = time.perf_counter() - t0
        stats = client.get(f"{url}/debug/control", params={"since": mark}).json()
    return {"url": url, "requests": requests, "concurrency": concurrency, "sse_chunks": chunks,
            "wall_s": round(wall, 2), "events": stats["samples"], "median_ms": stats["median_ms"],
            "p99_ms": stats["p99_ms"], "add_median_ms": stats["add_median_ms"]}


