"""The ``ingress`` scenario: the Ingress killed under long streams; clients retry the cut ones."""

from __future__ import annotations

import asyncio
import time

from tools.faults.checks import check, error_messages, fault_requests, gate
from tools.faults.harness import app_args, local_app, reference_pass, stream_one, stream_outcomes, until_streaming


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
        reference, _ = await reference_pass(url, bodies, streams, timeout)
        transport = RawTransport(url, timeout_s=timeout)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 8)) as client:
            jobs = [asyncio.create_task(stream_one(transport, b, timeout)) for b in bodies]
            await until_streaming(client, url, streams)
            (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if f"#{INGRESS}#" in a["name"]]
            t0 = time.monotonic()
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            probe = await _probe(client, url, t0, 120)
            first = await asyncio.gather(*jobs)
            retry_transport = RawTransport(url, timeout_s=timeout)
            again = await asyncio.gather(*(stream_one(retry_transport, bodies[i], timeout)
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
                   interrupted_bound=streams, first_try=stream_outcomes(first),
                   failovers=sum(1 for i in interrupted if final[i]["outcome"] == "completed"
                                 and final[i]["text"] == reference[i]), error_messages=error_messages(final), **probe)
    return gate(summary, 1, 1, 0, extra)
