"""Stage 1's answer (``CapacityPlan``) and what both of its models share when they fill it in."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner.solver import SolveInfo


@dataclass(frozen=True)
class CapacityPlan:
    counts: dict[int, int]  # TP degree -> instances
    thresholds: dict[str, float]  # class -> threshold
    primary: float  # average threshold per output token
    secondary: float | None  # average relative SLO slack (None when infeasible)
    feasible: bool
    gpus: int
    batch_recompute: dict[int, int] = field(default_factory=dict)
    batch_cached: dict[int, int] = field(default_factory=dict)
    utilisation: dict[int, float] = field(default_factory=dict)  # load / capacity per TP group
    latency_ms: dict[str, float] = field(default_factory=dict)
    slo_ms: dict[str, float] = field(default_factory=dict)
    solves: tuple[SolveInfo, ...] = ()

    @property
    def solve_seconds(self) -> float:
        return sum(s.seconds for s in self.solves)

    @property
    def gpus_used(self) -> int:
        return sum(d * n for d, n in self.counts.items())

    secondary_weight: float = 1e-3
    slo_met: float | None = None  # "mixed": share of requests in step groups within their SLOs (None: not modelled)
    groups: list[dict] = field(default_factory=list)  # "mixed": per step group, its latency, SLO and whether met

    @property
    def objective(self) -> float | None:
        """What the MILP maximises (primary + secondary_weight x secondary); None when infeasible."""
        return None if self.secondary is None else self.primary + self.secondary_weight * self.secondary


def _fill(counts: dict[int, int], load: np.ndarray, degrees, gpus: int, cap) -> dict[int, int]:
    """Spare GPUs only lower utilisation: drop groups that carry no load, give the rest to loaded groups,
    highest TP degree first (lowest step latency); stability and the SLO model are unchanged."""
    out = {d: (n if load[i] > 1e-9 else 0) for i, (d, n) in enumerate(counts.items())}
    if not any(out.values()):
        return counts
    for i in sorted(range(len(degrees)), key=lambda i: -degrees[i]):
        d = degrees[i]
        if out[d]:
            free = gpus - sum(k * n for k, n in out.items())
            out[d] += max(min(free // d, int(cap[i]) - out[d]), 0)
    return out


def _infeasible_mixed(classes, thresholds, degrees, w, gpus: int, cap, slo, fixed_counts, solves) -> CapacityPlan:
    """The mixed-rounds model's fallback (only an unstable load is infeasible there): as ``_infeasible``."""
    if fixed_counts is not None:
        counts = {d: fixed_counts.get(d, 0) for d in degrees}
    else:
        counts = {d: (int(min(gpus // d, cap[i])) if i == 0 else 0) for i, d in enumerate(degrees)}
    return CapacityPlan(counts=counts, thresholds={c.name: thresholds[0] for c in classes},
                        primary=float(w.sum() * thresholds[0]), secondary=None, feasible=False, gpus=gpus,
                        slo_ms=dict(zip([c.name for c in classes], np.round(slo, 3).tolist())), solves=tuple(solves),
                        slo_met=0.0)
