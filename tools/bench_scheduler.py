"""Benchmarks that print measured numbers."""

from __future__ import annotations

import random
import statistics
import time

from engine.clock import VirtualClock
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.policies import make_policy
from engine.scheduler.types import RoundResult, SchedRequest, StepKind, StepOutcome


def bench_scheduler(slots: int = 128, resident: int = 1024, rounds: int = 500, policy: str = "dwise",
                    seed: int = 0) -> dict:
    """Time schedule() + update() per round (ranking, admission, plan, result
    processing) with ``resident`` resident requests and as many waiting,
    refilled as requests finish; the model's work is not part of it."""
    rng = random.Random(seed)
    clock = VirtualClock()
    sched = Scheduler(make_policy(policy), SchedulerConfig(slots=slots, resident_factor=max(1, resident // slots),
                                                           kv_capacity_tokens=1 << 40), clock)
    counter = 0

    def add(n: int) -> None:
        nonlocal counter
        for _ in range(n):
            true = rng.randint(1, 280)
            sched.add_request(SchedRequest(f"r{counter}", rng.randint(0, 8), 8, true * rng.lognormvariate(0, 0.5),
                                           arrival=clock.now(), predicted_output_tokens=rng.uniform(1, 256),
                                           true_rounds=true))
            counter += 1

    add(2 * resident)
    sched.fill_resident(resident)
    times, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = sched.schedule()
        t_plan, c_plan = time.perf_counter() - t0, time.thread_time() - c0
        outcomes = []  # the runner's part, not timed
        for s in plan.slots:
            req = sched.requests[s.req_id]
            done = s.kind is not StepKind.PREFILL and req.rounds_done + 1 >= (req.true_rounds or 1)
            nxt = StepKind.PREFILL if s.kind is StepKind.PREFILL and req.remaining_prefill > 1 else StepKind.DENOISE
            outcomes.append(StepOutcome(s.req_id, s.kind, 32 if done else 0, done, done, nxt,
                                        float(req.true_rounds or 1) if req.rounds_done == 0 else None))
        t1, c1 = time.perf_counter(), time.thread_time()
        finished = sched.update(plan, RoundResult(outcomes))
        times.append((t_plan + time.perf_counter() - t1) * 1000)
        cpu.append((c_plan + time.thread_time() - c1) * 1000)
        clock.advance(0.095)
        add(len(finished))
        sched.fill_resident(resident)  # keep the resident set at its size (not timed)
    times.sort()
    return {"policy": policy, "slots": slots, "resident": len(sched.resident), "rounds": rounds,
            "median_ms_per_round": round(statistics.median(times), 4),
            "p99_ms_per_round": round(times[int(0.99 * (len(times) - 1))], 4),
            "median_cpu_ms_per_round": round(statistics.median(cpu), 4)}
