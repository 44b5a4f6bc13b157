"""The virtual-time discrete-event simulator of one instance.

It drives the same Scheduler and policy objects as the live engine; only the
runner (simulated or model-in-the-loop) and the clock differ.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from engine.clock import VirtualClock
from engine.scheduler import Scheduler, SchedulerConfig
from sim.workload import BLOCK, SimRequestSpec


@dataclass
class SimStats:
    rounds: int = 0
    prefill_only_rounds: int = 0
    filled_slots: int = 0
    busy_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    correct: list[bool] = field(default_factory=list)

    def summary(self, slots: int) -> dict:
        lat = sorted(self.latencies)

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else 0.0

        out = {
            "requests": len(lat),
            "mean_latency_s": round(statistics.mean(lat), 3) if lat else 0.0,
            "p50_latency_s": pct(0.5),
            "p99_latency_s": pct(0.99),
            "mean_ttft_s": round(statistics.mean(self.ttfts), 3) if self.ttfts else 0.0,
            "throughput_rps": round(len(lat) / self.makespan_s, 3) if self.makespan_s else 0.0,
            "rounds": self.rounds,
            "prefill_only_round_frac": round(self.prefill_only_rounds / max(self.rounds, 1), 4),
            "filled_slots_per_round": round(self.filled_slots / max(self.rounds, 1), 2),
            "slots": slots,
        }
        if self.correct:
            out["accuracy"] = round(sum(self.correct) / len(self.correct), 4)
        return out


def simulate(specs: list[SimRequestSpec], scheduler: Scheduler, runner, clock: VirtualClock,
             max_rounds: int = 10_000_000) -> SimStats:
    """Run ``specs`` to completion.

    ``runner.register(spec) -> SchedRequest`` makes each arrival's request and
    ``runner.execute(plan) -> RoundResult`` runs a round (latency in seconds).
    """
    pending = sorted(specs, key=lambda s: s.arrival)
    stats = SimStats()
    by_id = {}
    i = 0
    while i < len(pending) or scheduler.has_work():
        while i < len(pending) and pending[i].arrival <= clock.now():
            spec = pending[i]
            req = runner.register(spec)
            scheduler.add_request(req)
            by_id[spec.req_id] = spec
            i += 1
        if not scheduler.has_work():
            clock.set(pending[i].arrival)
            continue
        plan = scheduler.schedule()
        if not plan.slots:
            raise RuntimeError("scheduler produced an empty round with work pending (deadlock)")
        result = runner.execute(plan)
        clock.advance(result.latency_s)
        stats.rounds += 1
        stats.busy_s += result.latency_s
        stats.filled_slots += len(plan.slots)
        stats.prefill_only_rounds += plan.prefill_only
        for req in scheduler.update(plan, result):
            stats.latencies.append(req.finish_time - req.arrival)
            stats.ttfts.append(req.first_block_time - req.arrival)
            ok = by_id[req.req_id].extra.get("correct")
            if ok is not None:
                stats.correct.append(bool(ok))
        if stats.rounds >= max_rounds:
            raise RuntimeError(f"simulation exceeded {max_rounds} rounds")
    stats.makespan_s = clock.now() - (pending[0].arrival if pending else 0.0)
    return stats


def run_policy(specs: list[SimRequestSpec], policy: str, profile, slots: int = 128,
               kv_capacity_tokens: int = 666_000, block: int = BLOCK, canvas: bool = False) -> SimStats:
    """``canvas``: DiffusionGemma's rounds (``SimulatedRunner``'s canvas mode)."""
    from engine.scheduler.policies import make_policy
    from sim.runner import SimulatedRunner

    clock = VirtualClock()
    cfg = SchedulerConfig(slots=slots, kv_capacity_tokens=kv_capacity_tokens, block_size=block)
    sched = Scheduler(make_policy(policy), cfg, clock)
    fresh = [SimRequestSpec(**{**vars(s), "extra": dict(s.extra)}) for s in specs]
    return simulate(fresh, sched, SimulatedRunner(profile, block, canvas), clock)
