"""``remask bench router``: the router's own cost per step event (pure Python).

A cluster of ``instances`` TP-1 instances (h200-llada8b-measured profile) holds
``requests`` active requests. Each event is one instance finishing a round
of up to ``slots`` of its requests: the router takes the step results
(``on_step``: estimates, step kinds, loads, load control on its interval,
migration decisions) and chooses the thresholds of that instance's next
round (``plan_thresholds``, Alg. 1). Both are timed together; writing the
progress fields (the instance's job) is not. Finished requests are replaced
by arrivals (``add_request``, timed separately). Virtual time advances by a
round's latency over the number of instances per event, so load control
(Alg. 2, every ``load_control_interval_s``) runs on its real cadence and is
included in the distribution.
"""

from __future__ import annotations

import random
import statistics
import time

from cluster.estimator import TableStepEstimator
from cluster.latency import StepShape, TpLatencyModel
from cluster.router import Router
from cluster.state import RequestState


def bench_router(instances: int = 16, requests: int = 1000, events: int = 5000, slots: int = 32,
                 policy: str = "remask", profile: str = "h200-llada8b-measured", seed: int = 0) -> dict:
    from engine.latency_profile import load_tp_profiles

    rng = random.Random(seed)
    latency = TpLatencyModel(load_tp_profiles(profile, [1]), slots, StepShape())
    totals: dict[str, tuple[float, ...]] = {}
    router = Router(policy, latency, TableStepEstimator((0.9, 0.8, 0.7, 0.6, 0.5), lambda s: totals[s.req_id],
                                                       seed=seed), [(i, 1) for i in range(instances)])
    now, counter = 0.0, 0
    arrive_ms: list[float] = []

    def arrive() -> None:
        nonlocal counter
        rid = f"r{counter}"
        counter += 1
        steps = rng.uniform(8, 240)
        totals[rid] = tuple(max(8.0, steps * f) for f in (1.0, 0.9, 0.78, 0.65, 0.55))
        req = RequestState(rid, now, now + rng.uniform(0.5, 10.0), rng.randint(40, 280), 256)
        req.extra["progress"] = 0.0
        t0 = time.perf_counter()
        router.add_request(req, now)
        arrive_ms.append((time.perf_counter() - t0) * 1000)

    for _ in range(requests):
        arrive()
    index = {t: i for i, t in enumerate(router.cfg.thresholds)}
    cursor = [0] * instances
    times = []
    for e in range(events):
        inst = router.instances[e % instances]
        ids = sorted(inst.requests)
        if not ids:
            continue
        start = cursor[inst.inst_id] % len(ids)
        batch = [router.requests[r] for r in (ids[start:] + ids[:start])[:slots]]
        cursor[inst.inst_id] += len(batch)
        for req in batch:  # the thresholds this round ran with
            if req.threshold is None:
                req.threshold = 0.9
        stepped = []
        for req in batch:  # the instance's part: progress of the step (not timed)
            f = min(1.0, req.progress + 1.0 / totals[req.req_id][index[req.threshold]])
            block = min(int(f * 8 + 1e-9), 8)
            heavy = block > 8 - req.blocks_left
            req.progress, req.blocks_left = f, 8 - block
            stepped.append((req, heavy, f >= 1.0 - 1e-9))
        now += latency.round_ms(1, inst.n_heavy, inst.n_light) / 1000.0 / instances
        t0 = time.perf_counter()
        router.on_step(inst.inst_id, stepped, now)
        nxt = [router.requests[r] for r in sorted(inst.requests)[:slots]]
        router.plan_thresholds(inst.inst_id, nxt, now)
        times.append((time.perf_counter() - t0) * 1000)
        for _ in range(requests - len(router.requests)):
            arrive()
    times.sort()
    return {"policy": policy, "instances": instances, "requests": len(router.requests), "slots": slots,
            "events": len(times), "median_ms_per_event": round(statistics.median(times), 4),
            "p99_ms_per_event": round(times[int(0.99 * (len(times) - 1))], 4),
            "mean_ms_per_event": round(statistics.mean(times), 4),
            "median_ms_per_arrival": round(statistics.median(arrive_ms), 4),
            "load_control_runs": router.stats["load_control_runs"], "migrations": router.stats["migrations"]}
