"""``remask bench control``: the control path of a running app, measured.

It streams ``requests`` completions (``concurrency`` at a time) through the
app and then reads the ingress's own timing (``GET /debug/control``): for
every progress event, the time from the replica's round loop publishing it to
the ingress receiving it, and for every request, the time from the ingress
dispatching it to the round loop applying it at a round boundary.

``api_key`` (``--api-key``, default ``$OPENAI_API_KEY``) goes with every request as
``Authorization: Bearer <key>``; a 401 raises :class:`loadgen.client.Unauthorized` saying what to do.
"""

from __future__ import annotations

import concurrent.futures
import time

PROMPTS = ("story: fox 8", "story: owl 6", "rev: abcdef", "max: a3 b9 c1 d2", "57+8=")


def bench_control(url: str, requests: int = 40, concurrency: int = 4, model: str | None = None,
                  timeout: float = 300.0, api_key: str | None = None) -> dict:
    import httpx

    from loadgen.client import Unauthorized, auth_headers, error_message, resolve_api_key, unauthorized_hint

    url = url.rstrip("/")
    api_key = resolve_api_key(api_key)

    def checked(r: httpx.Response) -> httpx.Response:
        if r.status_code == 401:
            raise Unauthorized(f"HTTP 401 from {r.request.method} {r.request.url.path}: {error_message(r.read())} "
                               f"({unauthorized_hint(api_key)})")
        return r

    with httpx.Client(timeout=timeout, headers=auth_headers(api_key)) as client:
        model = model or checked(client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        mark = checked(client.get(f"{url}/debug/control")).json()["events"]

        def one(i: int) -> int:
            body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "stream": True}
            chunks = 0
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                checked(r)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
                for line in r.iter_lines():
                    chunks += line.startswith("data: ")
            return chunks

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            chunks = sum(pool.map(one, range(requests)))
        wall = time.perf_counter() - t0
        stats = checked(client.get(f"{url}/debug/control", params={"since": mark})).json()
    return {"url": url, "requests": requests, "concurrency": concurrency, "sse_chunks": chunks,
            "wall_s": round(wall, 2), "events": stats["samples"], "median_ms": stats["median_ms"],
            "p99_ms": stats["p99_ms"], "add_median_ms": stats["add_median_ms"]}


