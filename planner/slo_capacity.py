"""A configuration's capacity in the mixed-rounds model of Stage 1: what its instances complete per second with
every request at one threshold, each instance at its SLO occupancy (``slo_capacity``). The cluster simulator
writes its loads as multiples of it (``sim.cluster_scenarios.scenario_capacity``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.stage1_mixed import mixed_tables
from planner.workload import WorkloadClass


@dataclass(frozen=True)
class SloCapacity:
    """What a set of instances completes per second with every request at one threshold, each instance at its
    *SLO occupancy*: the most requests per round at which the mean request still meets its SLO (``slo_capacity``)."""

    rps: float  # requests per second, all instances together
    threshold: float
    levels: dict[int, int]  # TP degree -> SLO occupancy (requests per round)
    per_instance_rps: dict[int, float]  # TP degree -> one instance's requests per second at its SLO occupancy
    mean_steps: float  # steps of the mean request at the threshold
    isolated_ms: float  # the mean request alone on the base degree (the SLO's base)
    slo_ms: float

    def to_dict(self) -> dict:
        return {"capacity_rps": round(self.rps, 3), "threshold": self.threshold,
                "slo_occupancy": {f"tp{d}": v for d, v in self.levels.items()},
                "per_instance_rps": {f"tp{d}": round(v, 4) for d, v in self.per_instance_rps.items()},
                "mean_steps": round(self.mean_steps, 2), "isolated_ms": round(self.isolated_ms, 2),
                "slo_ms": round(self.slo_ms, 2)}


def slo_capacity(mean: WorkloadClass, profiles: dict, model, counts: dict[int, int], slots: int,
                 slo_scale: float, threshold: float | None = None) -> SloCapacity:
    """The capacity of ``counts`` (TP degree -> instances) for requests shaped like ``mean`` (its rate is
    ignored), every step at ``threshold`` (default: ``model``'s highest), in the mixed-rounds model of Stage 1
    (``planner.stage1_mixed.mixed_tables``): rounds hold every request an instance runs, recompute and cached
    steps in the workload's proportion. At occupancy l a TP-d instance completes l / (steps x round time)
    requests per second, and a request's latency grows with l; its SLO occupancy is the largest l up to
    ``slots`` at which the mean request's latency is within ``slo_scale`` x its isolated latency on the lowest
    degree (1 if none is). The capacity is the sum over instances of that throughput: past it, either rounds
    are too full for SLOs or queues grow."""
    if slots < 1:
        raise ValueError("slots must be at least 1")
    if not counts or any(n < 0 for n in counts.values()) or not any(counts.values()):
        raise ValueError(f"counts needs at least one instance, got {counts}")
    missing = sorted(d for d, n in counts.items() if n and d not in profiles)
    if missing:
        raise ValueError(f"no latency profile for TP degree(s) {missing}; have {sorted(profiles)}")
    top = max(model.thresholds) if threshold is None else threshold
    if top not in model.steps_per_token:
        raise ValueError(f"threshold {top} is not one of the step model's {model.thresholds}")
    one = replace(model, steps_per_token={top: model.steps_per_token[top]}, spread=((1.0, 1.0),))
    used = {d: profiles[d] for d in sorted(profiles) if d == min(profiles) or counts.get(d)}
    tab = mixed_tables([replace(mean, rate=1.0)], used, one, tuple(range(1, slots + 1)), 1.0)
    slo = slo_scale * float(tab.isolated[0])
    steps = float(tab.mean_steps[0])
    levels, per = {}, {}
    for k, d in enumerate(tab.degrees):
        if not counts.get(d):
            continue
        ok = [i for i in range(slots) if tab.latency[0, 0, k, i] <= slo * (1 + 1e-9)]
        i = ok[-1] if ok else 0
        levels[d] = i + 1
        per[d] = 1000.0 / (steps * float(tab.step_ms[0, k, i]))
    rps = sum(per[d] * counts[d] for d in per)
    return SloCapacity(rps, top, levels, per, steps, float(tab.isolated[0]), slo)
