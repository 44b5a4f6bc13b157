"""Stage 1: quality-aware capacity planning (DiLaServe §3.3, §3.4), one MILP aggregated by TP degree.

Indices: class c, threshold t, TP degree d, batch size b. Variables:

- ``x[c, t]`` (binary): class c runs at threshold t; one threshold per class;
- ``R[d]`` (integer): TP-d instances; ``zr[d, b]``, ``zc[d, b]`` (binary): the batch TP-d instances
  run recompute (cached) steps at, at most one each and only if ``R[d] >= 1`` (batch choice);
- ``fr[c t, d b]``, ``fc[c t, d b]`` (>= 0): the share of class c's recompute (cached) steps run on
  TP-d instances at batch b. Token unmasking completeness and step allocation consistency: for the
  chosen threshold the shares sum to 1, so every one of the s (recompute) and s' (cached) steps a
  request needs to unmask all its tokens runs somewhere; shares only go to a chosen (d, b).

Constraints: SLO (a class's steps times their step latencies within its SLO), GPUs
(sum_d d R[d] <= G, R[d] <= the TP-d slots), stability (per TP group, the instance time its steps
cost per second, recompute steps at alpha_d and cached steps at beta_d, stays below
``utilisation x R[d]``: queues stay bounded). Objectives, lexicographic (two solves): maximise the
average threshold per output token, then the average SLO slack (1 - latency / SLO, rate-weighted).
Infeasible: all TP-1 at the lowest thresholds (maximum throughput), ``feasible=False``.
Size is independent of the GPU count: 1,024 GPUs cost what 16 do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cvxpy as cp
import numpy as np

from engine.profile import LatencyProfile
from planner.costs import DEFAULT_BATCHES, CostTables, StepModel, cost_tables
from planner.solver import SolveInfo, solve
from planner.workload import WorkloadClass

SOLVED = (cp.OPTIMAL, cp.OPTIMAL_INACCURATE, cp.USER_LIMIT)


@dataclass(frozen=True)
class Stage1Config:
    utilisation: float = 0.9  # stability: load <= utilisation x capacity
    slo_scale: float = 5.0  # default SLO: k x isolated TP-1 latency at the highest threshold
    batches: tuple[int, ...] = DEFAULT_BATCHES
    solver: str = "auto"
    secondary_weight: float = 1e-3  # primary + w x secondary: primary kept within w of its optimum
    time_limit_s: float | None = 1.5  # search cap; the best configuration found by then is used
    single_batch: bool = False  # True: one batch size per TP degree and step kind (binary z, z'; slower)


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


def default_slos(classes: list[WorkloadClass], tab: CostTables, scale: float) -> np.ndarray:
    iso = tab.s_rec[:, -1] * tab.t_rec[:, 0, 0] + tab.s_cac[:, -1] * tab.t_cac[:, 0, 0]
    return np.array([c.slo_ms if c.slo_ms is not None else scale * iso[i] for i, c in enumerate(classes)])


def plan_capacity(classes: list[WorkloadClass], gpus: int, profiles: dict[int, LatencyProfile],
                  model: StepModel | None = None, config: Stage1Config | None = None,
                  slots: dict[int, int] | None = None, fixed_counts: dict[int, int] | None = None) -> CapacityPlan:
    """Solve Stage 1. ``slots``: most TP-d instances the nodes hold (default gpus // d);
    ``fixed_counts``: evaluate this configuration instead of choosing one (fallback disabled)."""
    if not classes:
        raise ValueError("Stage 1 needs at least one workload class")
    model, config = model or StepModel(), config or Stage1Config()
    tab = cost_tables(classes, profiles, model, config.batches)
    C, T, D, B = len(classes), len(tab.thresholds), len(tab.degrees), len(tab.batches)
    K, DB = C * T, D * B
    rate = np.array([c.rate for c in classes])
    out = np.array([c.output_tokens for c in classes])
    slo = default_slos(classes, tab, config.slo_scale)
    w = rate * out if rate.sum() > 0 else out  # average per output token
    w = w / w.sum()
    v = rate / rate.sum() if rate.sum() > 0 else np.full(C, 1.0 / C)
    deg = np.array(tab.degrees)
    cap = np.array([(slots or {}).get(d, gpus // d) for d in tab.degrees])

    x = cp.Variable((C, T), boolean=True)
    R = cp.Variable(D, integer=True)
    fr, fc = cp.Variable((K, DB), nonneg=True), cp.Variable((K, DB), nonneg=True)

    # per (c t, d b): latency a request of class c at threshold t accrues / instance seconds it costs
    lat_r = (tab.s_rec[:, :, None] * tab.t_rec.reshape(C, 1, DB)).reshape(K, DB)
    lat_c = (tab.s_cac[:, :, None] * tab.t_cac.reshape(C, 1, DB)).reshape(K, DB)
    load_r = (rate[:, None, None] * tab.s_rec[:, :, None] * tab.alpha.reshape(C, 1, DB)).reshape(K, DB) / 1e3
    load_c = (rate[:, None, None] * tab.s_cac[:, :, None] * tab.beta.reshape(C, 1, DB)).reshape(K, DB) / 1e3
    per_class = np.kron(np.eye(C), np.ones((1, T)))  # (C, K): sums a class's thresholds
    per_degree = np.kron(np.eye(D), np.ones((1, B)))  # (D, DB): sums a degree's batches

    xk = cp.reshape(x, (K,), order="C")
    latency = per_class @ cp.sum(cp.multiply(fr, lat_r) + cp.multiply(fc, lat_c), axis=1)
    load_db = cp.sum(cp.multiply(fr, load_r) + cp.multiply(fc, load_c), axis=0)
    load = per_degree @ load_db
    cons = [
        cp.sum(x, axis=1) == 1,  # one threshold per class
        cp.sum(fr, axis=1) == xk, cp.sum(fc, axis=1) == xk,  # completeness and consistency
        latency <= slo,  # SLO
        load <= config.utilisation * R,  # stability
        deg @ R <= gpus, R >= 0, R <= cap,  # GPUs and slots
    ]
    zr = zc = None
    if config.single_batch:  # the paper's simplification: one recompute and one cached batch per TP degree
        zr, zc = cp.Variable((D, B), boolean=True), cp.Variable((D, B), boolean=True)
        ones = np.ones((K, 1))
        cons += [cp.sum(zr, axis=1) <= 1, cp.sum(zc, axis=1) <= 1,
                 fr <= ones @ cp.reshape(zr, (1, DB), order="C"), fc <= ones @ cp.reshape(zc, (1, DB), order="C")]
    if fixed_counts is not None:
        cons.append(R == np.array([fixed_counts.get(d, 0) for d in tab.degrees]))
    primary = cp.sum(cp.multiply(x, w[:, None] * np.array(tab.thresholds)[None, :]))
    secondary = 1 - v @ cp.multiply(latency, 1 / slo)

    problem = cp.Problem(cp.Maximize(primary + config.secondary_weight * secondary), cons)
    info = solve(problem, config.solver, config.time_limit_s)
    if problem.status not in SOLVED or problem.value is None:
        return _infeasible(classes, tab, w, gpus, cap, slo, fixed_counts, (info,))

    ld = np.asarray(load.value)
    counts = {d: int(round(n)) for d, n in zip(tab.degrees, R.value)}
    if fixed_counts is None:
        counts = _fill(counts, ld, tab.degrees, gpus, cap)
    names = [c.name for c in classes]
    chosen = np.asarray(x.value).argmax(axis=1)
    return CapacityPlan(
        counts=counts, thresholds={n: tab.thresholds[t] for n, t in zip(names, chosen)},
        primary=float(primary.value), secondary=float(secondary.value), feasible=True, gpus=gpus,
        batch_recompute=_batches(fr.value, load_r, tab), batch_cached=_batches(fc.value, load_c, tab),
        utilisation={d: float(ld[i] / counts[d]) for i, d in enumerate(tab.degrees) if counts[d]},
        latency_ms=dict(zip(names, np.asarray(latency.value).round(3).tolist())),
        slo_ms=dict(zip(names, slo.round(3).tolist())), solves=(info,))


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


def _batches(share: np.ndarray, load: np.ndarray, tab: CostTables) -> dict[int, int]:
    """Per TP degree, the batch level carrying most of its load."""
    per = (np.asarray(share) * load).sum(axis=0).reshape(len(tab.degrees), len(tab.batches))
    return {d: tab.batches[int(row.argmax())] for d, row in zip(tab.degrees, per) if row.max() > 1e-9}


def _infeasible(classes, tab: CostTables, w, gpus: int, cap, slo, fixed_counts, solves) -> CapacityPlan:
    """All TP-1 at the lowest thresholds (or the fixed configuration being evaluated)."""
    if fixed_counts is not None:
        counts = {d: fixed_counts.get(d, 0) for d in tab.degrees}
    else:
        counts = {d: (int(min(gpus // d, cap[i])) if i == 0 else 0) for i, d in enumerate(tab.degrees)}
    return CapacityPlan(counts=counts, thresholds={c.name: tab.thresholds[0] for c in classes},
                        primary=float(w.sum() * tab.thresholds[0]), secondary=None, feasible=False, gpus=gpus,
                        slo_ms=dict(zip([c.name for c in classes], slo.round(3).tolist())), solves=tuple(solves))
