"""The ``overload`` scenario: many times the rate the planner says one instance holds, with the
planner's SLO: what is shed, whether the admitted requests meet their SLO, whether memory stays bounded."""

from __future__ import annotations

import asyncio
import time

from tools.faults.harness import app_args, local_app, replica_rss_mb, stream_one


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
        out = await stream_one(transport, body(i), timeout)
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
        before = replica_rss_mb()
        t0 = time.monotonic()
        results = asyncio.run(_offer(url, offered, seconds, body, timeout=120))
        sent_s = time.monotonic() - t0
        after = replica_rss_mb()
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
