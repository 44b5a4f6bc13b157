"""Instance-level experiments (DWISE): one instance, the distribution-driven DWISE workload.

Runs go through ``sim.simulator.simulate`` with the real ``Scheduler`` and ``SimulatedRunner``; a
``_Recorder`` between the simulator and the scheduler logs each round (start, length, filled slots,
prefill-only) and the requests the scheduler holds, from which the round composition (DWISE Table 3)
and the time-average number in the system (Little's law) are computed.

Policies: the registered ones (``fcfs-prefill-first`` is SGLang's former, ``fcfs-mixed``, ``mlfq``,
``ssjf`` on the mixed-phase former, ``dwise``, ``oracle``) plus report-only variants: ``mlfq`` and
``ssjf`` on SGLang's prefill-first former (DWISE Table 2's setting), and DWISE's component ablation
(Figure 8): ranking by prefill blocks only (estimates 0, no refinement) and admission estimates
without refinement.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.clock import VirtualClock
from engine.latency_profile import LatencyProfile
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.policies import DwisePolicy, MlfqPolicy, Policy, SsjfPolicy, make_policy
from sim.report.checks import trace_hash
from sim.runner import SimulatedRunner
from sim.simulator import simulate
from sim.workload import BLOCK, BUDGET_TOKENS, SimRequestSpec, noisy_estimates

PROFILE = "gh200-llada2-mini"
SLOTS = 128
KV_TOKENS = 666_000


class _PrefillFirst:
    """Mixin: SGLang's prefill-first batch former (one prompt block per prefill-only round)."""

    mixed = False
    prefill_per_round = 1


class MlfqPrefillFirst(_PrefillFirst, MlfqPolicy):
    name = "mlfq-prefill-first"


class SsjfPrefillFirst(_PrefillFirst, SsjfPolicy):
    name = "ssjf-prefill-first"


def _zero_estimates(specs: list[SimRequestSpec]) -> list[SimRequestSpec]:
    return [replace(s, admission_est=0.0, refined_est=0.0, extra=dict(s.extra)) for s in specs]


# name -> (policy factory, spec transform)
VARIANTS: dict[str, tuple[Callable[[], Policy], Callable | None]] = {
    "fcfs-prefill-first": (lambda: make_policy("fcfs-prefill-first"), None),
    "mlfq-prefill-first": (MlfqPrefillFirst, None),
    "ssjf-prefill-first": (SsjfPrefillFirst, None),
    "fcfs-mixed": (lambda: make_policy("fcfs-mixed"), None),
    "mlfq": (lambda: make_policy("mlfq"), None),
    "ssjf": (lambda: make_policy("ssjf"), None),
    "dwise-prefill-rank": (lambda: DwisePolicy(refine=False), _zero_estimates),
    "dwise-admission": (lambda: DwisePolicy(refine=False), None),
    "dwise": (lambda: make_policy("dwise"), None),
    "oracle": (lambda: make_policy("oracle"), None),
}


class _Recorder:
    """Stands in for the scheduler in ``simulate``: delegates, and logs rounds and residency."""

    def __init__(self, sched: Scheduler, clock: VirtualClock) -> None:
        self.inner, self.clock = sched, clock
        self.t0: list[float] = []
        self.dt: list[float] = []
        self.filled: list[int] = []
        self.prefill_only: list[bool] = []
        self.held_area = 0.0  # integral of the scheduler's held requests over round time
        self.door_s = 0.0  # arrival -> registration (a request arriving mid-round waits for its end)
        self.offered: list[tuple[str, float]] = []
        self.departed: list[tuple[str, float]] = []
        self._start = 0.0
        self._held = 0

    def add_request(self, req) -> None:
        self.door_s += self.clock.now() - req.arrival
        self.offered.append((req.req_id, req.arrival))
        self.inner.add_request(req)

    def has_work(self) -> bool:
        return self.inner.has_work()

    def schedule(self):
        self._start, self._held = self.clock.now(), len(self.inner.requests)
        return self.inner.schedule()

    def update(self, plan, result):
        now = self.clock.now()
        dt = now - self._start
        self.held_area += self._held * dt
        self.t0.append(self._start)
        self.dt.append(dt)
        self.filled.append(len(plan.slots))
        self.prefill_only.append(plan.prefill_only)
        done = self.inner.update(plan, result)
        self.departed.extend((r.req_id, r.arrival) for r in done)
        return done


@dataclass
class InstanceRun:
    policy: str
    summary: dict
    latencies: list[float]
    ttfts: list[float]
    rounds: dict  # DWISE Table 3's columns
    little: dict  # L from the scheduler's state, X, W
    offered_hash: str
    finished_hash: str
    timeline: dict = field(default_factory=dict)  # per-round start, filled slots, prefill-only (thinned)


def composition(rec: _Recorder, slots: int) -> dict:
    n = len(rec.dt)
    busy = sum(rec.dt)
    pf_time = sum(d for d, p in zip(rec.dt, rec.prefill_only) if p)
    filled = sum(rec.filled)
    return {"rounds": n, "prefill_only_rounds_frac": sum(rec.prefill_only) / max(n, 1),
            "prefill_only_time_frac": pf_time / busy if busy else 0.0,
            "idle_slots_frac": 1.0 - filled / max(n * slots, 1), "filled_slots_per_round": filled / max(n, 1),
            "mean_round_ms": 1000.0 * busy / max(n, 1)}


def run_instance(specs: list[SimRequestSpec], policy: str, profile: LatencyProfile, slots: int = SLOTS,
                 kv_tokens: int = KV_TOKENS, block: int = BLOCK, timeline_points: int = 4000) -> InstanceRun:
    make, transform = VARIANTS[policy]
    clock = VirtualClock()
    sched = Scheduler(make(), SchedulerConfig(slots=slots, kv_capacity_tokens=kv_tokens, block_size=block), clock)
    fresh = [SimRequestSpec(**{**vars(s), "extra": dict(s.extra)}) for s in specs]
    if transform is not None:
        fresh = transform(fresh)
    rec = _Recorder(sched, clock)
    stats = simulate(fresh, rec, SimulatedRunner(profile, block), clock)
    lat = stats.latencies
    x = len(lat) / stats.makespan_s if stats.makespan_s else 0.0
    w = statistics.fmean(lat) if lat else 0.0
    little = {"L": (rec.held_area + rec.door_s) / stats.makespan_s if stats.makespan_s else 0.0, "X": x, "W": w}
    step = max(1, len(rec.t0) // timeline_points)
    timeline = {"t": rec.t0[::step], "filled": rec.filled[::step], "prefill_only": rec.prefill_only[::step]}
    return InstanceRun(policy, stats.summary(slots), list(lat), list(stats.ttfts), composition(rec, slots), little,
                       trace_hash(rec.offered), trace_hash(rec.departed), timeline)


# ---- workload variants --------------------------------------------------------------------------------
def poisson_arrivals(specs: list[SimRequestSpec], rate: float, seed: int) -> list[SimRequestSpec]:
    """Every request Poisson at ``rate`` (DWISE Figure 9's load sweep), in the workload's order."""
    rng = random.Random(seed + 15485863)
    t, out = 0.0, []
    for s in specs:
        out.append(replace(s, arrival=t, extra=dict(s.extra)))
        t += rng.expovariate(rate)
    return out


def _rescale(s: SimRequestSpec, rounds: list[int]) -> SimRequestSpec:
    f = sum(rounds) / max(s.true_rounds, 1)
    return replace(s, block_rounds=rounds, admission_est=s.admission_est * f, refined_est=s.refined_est * f,
                   extra=dict(s.extra))


def rescale_blocks(specs: list[SimRequestSpec], block: int) -> list[SimRequestSpec]:
    """The same token-level work in ``block``-token blocks. Assumption (stated in the report): a request
    unmasks as many tokens per round whatever the block size, but every block needs at least one round.
    Smaller blocks split each 32-token block's rounds evenly (at least one each); larger blocks sum them.
    Prompt blocks follow from the prompt tokens. Estimates scale with the request's total."""
    if block == BLOCK:
        return [replace(s, extra=dict(s.extra)) for s in specs]
    out = []
    for s in specs:
        if block < BLOCK:
            m = BLOCK // block
            rounds = [max(1, r // m + (j < r % m)) for r in s.block_rounds for j in range(m)]
        else:
            m = block // BLOCK
            rounds = [sum(s.block_rounds[i:i + m]) for i in range(0, len(s.block_rounds), m)]
        out.append(_rescale(s, rounds))
    return out


def _continuation(seed: int, i: int) -> random.Random:
    return random.Random(seed * 1_000_003 + i)  # per request: the same continuation at every budget


def calibrate_extra(specs: list[SimRequestSpec], target_mean_tokens: float, budget: int, seed: int) -> float:
    """The mean continuation (tokens) that makes ``extend_budget(specs, budget, seed, it)``'s mean output
    ``target_mean_tokens`` (bisection; the mean output grows with it)."""
    e = [_continuation(seed, i).expovariate(1.0) for i in range(len(specs))]

    def mean_tokens(mu: float) -> float:
        tot = 0
        for s, x in zip(specs, e):
            extra = min(mu * x, budget - BUDGET_TOKENS)
            tot += s.output_tokens + (int(extra) if s.output_tokens >= BUDGET_TOKENS and extra >= 1 else 0)
        return tot / len(specs)

    lo, hi = 0.0, 100.0 * budget
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_tokens(mid) < target_mean_tokens else (lo, mid)
    return (lo + hi) / 2


def extend_budget(specs: list[SimRequestSpec], budget: int, seed: int, mean_extra: float = 680.0
                  ) -> list[SimRequestSpec]:
    """The workload under a larger output budget: requests that used the whole 256-token budget continue
    for an exponential number of tokens (mean ``mean_extra``, cut at the budget); each extra block needs
    about the request's own mean rounds per block (log-normal, sigma 0.3). Estimates are drawn again with
    DWISE's measured rank correlations (0.74 admission, 0.87 refined)."""
    out = []
    for i, s in enumerate(specs):
        rng = _continuation(seed, i)
        extra = min(mean_extra * rng.expovariate(1.0), budget - BUDGET_TOKENS)
        if budget <= BUDGET_TOKENS or s.output_tokens < BUDGET_TOKENS or extra < 1:
            out.append(replace(s, extra=dict(s.extra)))
            continue
        per_block = s.true_rounds / len(s.block_rounds)
        z = [rng.gauss(0, 1) for _ in range(budget // BLOCK)]
        new = [max(1, round(per_block * math.exp(0.3 * z[j]))) for j in range(math.ceil(extra / BLOCK))]
        tokens = s.output_tokens + int(extra)
        out.append(replace(s, block_rounds=s.block_rounds + new, output_tokens=tokens,
                           predicted_output_tokens=s.predicted_output_tokens * tokens / s.output_tokens,
                           extra=dict(s.extra)))
    rng = random.Random(seed + 7)
    true = [s.true_rounds for s in out]
    for s, a, r in zip(out, noisy_estimates(true, 0.74, rng), noisy_estimates(true, 0.87, rng)):
        s.admission_est, s.refined_est = a, r
    return out
