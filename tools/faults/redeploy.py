"""The ``redeploy`` scenario: ``serve.run`` of a changed config under long streams."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

from tools.faults.checks import check, error_messages, fault_requests, gate
from tools.faults.harness import (
    app_args,
    get_json,
    local_app,
    reference_pass,
    stream_one,
    stream_outcomes,
    until_streaming,
)


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
        reference, _ = await reference_pass(url, bodies, streams, timeout)
        transport = RawTransport(url, timeout_s=timeout)
        moved = {"drained": 0, "failed_over": 0, "migrated": 0}
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 8)) as client:
            old = {v["replica"] for v in (await get_json(client, url, "/debug/instances"))["instances"].values()}
            jobs = [asyncio.create_task(stream_one(transport, b, timeout)) for b in bodies]
            await until_streaming(client, url, streams)
            t0 = time.monotonic()
            changed = app_args({1: 2}, 16, http={"served_model_name": "tiny-bd-v2"})
            serve.run(build_app(changed), name="remask", route_prefix="/", blocking=False)
            while not all(j.done() for j in jobs):
                with contextlib.suppress(Exception):
                    d = (await get_json(client, url, "/debug/instances"))["dispatch"]
                    moved = {k: max(v, d.get(k, 0)) for k, v in moved.items()}
                await asyncio.sleep(0.5)
            results = [j.result() for j in jobs]
            streams_s = time.monotonic() - t0
            new_s = None
            while time.monotonic() - t0 < 180:
                models = await get_json(client, url, "/v1/models")
                if models.get("data") and models["data"][0]["id"] == "tiny-bd-v2":
                    new_s = round(time.monotonic() - t0, 2)
                    break
                await asyncio.sleep(0.25)
            now = {v["replica"] for v in (await get_json(client, url, "/debug/instances"))["instances"].values()}
            await transport.aclose()
            return reference, results, round(streams_s, 2), new_s, len(old - now), moved

    with local_app(args, 2, port) as url:
        reference, results, streams_s, new_s, replaced, moved = asyncio.run(drive(url))
    summary = check(results, reference)
    done = [r for r in results if r["outcome"] == "completed"]
    extra = [] if new_s is not None else ["the new config did not answer within 180 s"]
    summary.update(scenario="redeploy", streams=streams, kills=replaced, kills_are="old Denoisers replaced",
                   failovers=sum(moved.values()), failovers_are="requests the old ingress moved", moved=moved,
                   stream_outcomes=stream_outcomes(results), last_stream_ended_after_s=streams_s,
                   new_config_served_after_s=new_s, error_messages=error_messages(results),
                   mean_stream_s=round(statistics.mean(r["e2e_s"] for r in done), 2) if done else None)
    return gate(summary, 1, 0, 0, extra)
