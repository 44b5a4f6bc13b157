"""Stage 1: quality-aware capacity planning (DiLaServe §3.3, §3.4), one MILP aggregated by TP degree.

Indices: class c, threshold t, TP degree d, batch size b, step kind k (recompute, cached). Variables:

- ``x[c, t]`` (binary): class c runs at threshold t; one threshold per class;
- ``R[d]`` (integer): TP-d instances;
- ``g[k, c, d, b]`` (>= 0): class c's steps of kind k, per request, run on TP-d instances at batch b.
  Token unmasking completeness and step allocation consistency: ``sum_db g[k, c] = sum_t s_k[c, t] x[c, t]``,
  so every one of the s (recompute) and s' (cached) steps a request needs at its threshold runs somewhere.

Constraints: SLO (a class's steps times their step latencies within its SLO), GPUs
(sum_d d R[d] <= G, R[d] <= the TP-d slots), stability (per TP group, the instance time its steps
cost per second, recompute steps at alpha_d and cached steps at beta_d, stays below
``utilisation x R[d]``: queues stay bounded). Objective: maximise the average threshold per output
token plus ``secondary_weight`` x the average SLO slack (1 - latency / SLO, rate-weighted): the
primary objective decides, the slack breaks ties. Infeasible: all TP-1 at the lowest thresholds
(maximum throughput), ``feasible=False``. Size is independent of the GPU count: 1,024 GPUs cost
what 16 do.

The model is the one of ``stage1_reference`` (a share ``f[c t, d b]`` of class c's steps per
threshold and (d, b), in cvxpy) in fewer columns, with the same optimum:

- ``g = sum_t s[c, t] f[c t, .]``: with one threshold per class only the chosen t's shares are
  non-zero, so aggregating over t loses nothing (and the LP relaxations project onto each other);
- a (d, b) column of a class and step kind is dropped when a convex combination of the other batch
  sizes of that degree is at most as slow *and* at most as costly (it lies off the lower-left convex
  frontier of (step latency, instance time per step)): any flow on it moves to that combination
  without raising a class's latency or a group's load. Not with ``single_batch`` (one batch per
  degree: a dropped batch could be the best single one);
- thresholds a class cannot meet its SLO with even at its fastest (d, b) are fixed to 0.

It is built as arrays and solved by HiGHS directly (``planner.milp``): no modelling layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from engine.latency_profile import LatencyProfile
from planner.capacity import CapacityPlan, _fill
from planner.costs import DEFAULT_BATCHES, CostTables, StepModel, cost_tables
from planner.milp import SOLVED, Milp, Rows, solve_milp
from planner.stage1_mixed import plan_capacity_mixed
from planner.workload import WorkloadClass


@dataclass(frozen=True)
class Stage1Config:
    utilisation: float = 0.9  # stability: load <= utilisation x capacity
    slo_scale: float = 5.0  # default SLO: k x isolated TP-1 latency at the highest threshold
    batches: tuple[int, ...] = DEFAULT_BATCHES
    solver: str = "auto"
    secondary_weight: float = 1e-3  # primary + w x secondary: primary kept within w of its optimum
    time_limit_s: float | None = 1.5  # search cap; the best configuration found by then is used
    single_batch: bool = False  # True: one batch size per TP degree and step kind (binary z, z'; slower)
    # "separate": rounds of one step kind at a batch size, a class's mean request (the model above);
    # "mixed": rounds of every request an instance holds, both kinds, and a class's step groups
    # (``StepModel.spread``) each within its own SLO (``planner.stage1_mixed``)
    rounds: str = "separate"
    levels: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32)  # "mixed": occupancy levels
    # "mixed": "milp" chooses the counts by the MILP (and the single-degree configurations as a floor);
    # "single-degree" compares only the configurations with every GPU in one TP degree; "every" compares every
    # configuration that uses all the GPUs (one fixed-count solve each)
    mixed_search: str = "milp"
    # "mixed": where the router puts a request. "class": by its class only (a class's step groups share a
    # placement); "group": each step group on its own (an SLO-fit router, ``remask-fit``, sends a request where
    # its predicted steps meet its SLO, so a class's short requests can go to fast instances, its long ones not)
    placement: str = "class"
    shed: bool = True  # "mixed": requests that would miss their SLO may be refused (admission control), costing nothing
    # "mixed": the occupancy a request meets at a level. "level": exactly the level (the fluid model: a group's
    # requests are all within their SLO there or all outside); "queue": a birth-death queue at the arrival rate
    # the level carries, so a share of a group meets more than the level (``MixedTables.within_slo``)
    occupancy: str = "level"

    def __post_init__(self) -> None:
        if self.rounds not in ("separate", "mixed"):
            raise ValueError(f"rounds must be 'separate' or 'mixed', got {self.rounds!r}")
        if self.mixed_search not in ("milp", "single-degree", "every"):
            raise ValueError(f"mixed_search must be 'milp', 'single-degree' or 'every', got {self.mixed_search!r}")
        if self.placement not in ("class", "group"):
            raise ValueError(f"placement must be 'class' or 'group', got {self.placement!r}")
        if self.occupancy not in ("queue", "level"):
            raise ValueError(f"occupancy must be 'queue' or 'level', got {self.occupancy!r}")


def default_slos(classes: list[WorkloadClass], tab: CostTables, scale: float) -> np.ndarray:
    iso = tab.s_rec[:, -1] * tab.t_rec[:, 0, 0] + tab.s_cac[:, -1] * tab.t_cac[:, 0, 0]
    return np.array([c.slo_ms if c.slo_ms is not None else scale * iso[i] for i, c in enumerate(classes)])


def frontier(lat: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Bool mask of the points on the lower-left convex frontier of (lat, cost): those no convex
    combination of the others matches or beats in both coordinates (ties and collinear points: the ends)."""
    order = np.lexsort((cost, lat))  # by latency, then cost
    pareto, best = [], np.inf
    for i in order:
        if cost[i] < best:
            pareto.append(i)
            best = cost[i]
    hull: list[int] = []
    for i in pareto:  # lower convex hull, left to right: pop while the turn is not strictly convex
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (lat[b] - lat[a]) * (cost[i] - cost[a]) - (cost[b] - cost[a]) * (lat[i] - lat[a]) <= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    keep = np.zeros(len(lat), dtype=bool)
    keep[hull] = True
    return keep


@dataclass(frozen=True)
class _Model:
    milp: Milp
    C: int
    T: int
    D: int
    g_kind: np.ndarray  # per flow column: step kind (0 recompute, 1 cached), class, degree, batch index
    g_c: np.ndarray
    g_d: np.ndarray
    g_b: np.ndarray
    g_lat: np.ndarray  # ms of latency per unit of flow (one step)
    g_load: np.ndarray  # instance-seconds per second per unit of flow


def _build(tab: CostTables, rate, w, v, slo, gpus: int, cap, config: Stage1Config, fixed) -> _Model:
    C, T = tab.s_rec.shape
    D, B = len(tab.degrees), len(tab.batches)
    lat = np.stack([tab.t_rec, tab.t_cac])  # (2, C, D, B): ms per step at that batch (the step latency)
    per = np.stack([tab.alpha, tab.beta])  # (2, C, D, B): instance ms per step
    steps = np.stack([tab.s_rec, tab.s_cac])  # (2, C, T)
    if config.single_batch:
        keep = np.ones(lat.shape, dtype=bool)
    else:
        keep = np.zeros(lat.shape, dtype=bool)
        for k in range(2):
            for c in range(C):
                for d in range(D):  # a class without traffic costs nothing: only its latency counts
                    keep[k, c, d] = frontier(lat[k, c, d], per[k, c, d] if rate[c] > 0 else np.zeros(B))
    gk, gc, gd, gb = np.nonzero(keep)
    g_lat = lat[gk, gc, gd, gb]
    g_load = rate[gc] * per[gk, gc, gd, gb] / 1e3
    F, nx = len(gk), C * T
    ox, oR, og = 0, nx, nx + D  # column offsets
    oz = og + F
    nz = 2 * D * B if config.single_batch else 0
    n = oz + nz
    xc, xt = np.repeat(np.arange(C), T), np.tile(np.arange(T), C)
    gcol = og + np.arange(F)
    rows = Rows()
    block = rows.add

    block(xc, ox + np.arange(nx), np.ones(nx), np.ones(C), np.ones(C))  # one threshold per class
    # completeness and consistency: per (kind, class), flows = the steps of the chosen threshold
    block(np.r_[gk * C + gc, xc, C + xc], np.r_[gcol, ox + np.arange(nx), ox + np.arange(nx)],
          np.r_[np.ones(F), -steps[0, xc, xt], -steps[1, xc, xt]], np.zeros(2 * C), np.zeros(2 * C))
    block(gc, gcol, g_lat, np.full(C, -np.inf), slo)  # SLO
    block(np.r_[gd, np.arange(D)], np.r_[gcol, oR + np.arange(D)], np.r_[g_load, np.full(D, -config.utilisation)],
          np.full(D, -np.inf), np.zeros(D))  # stability
    deg = np.asarray(tab.degrees, dtype=float)
    block(np.zeros(D, dtype=int), oR + np.arange(D), deg, [-np.inf], [gpus])  # GPUs
    if config.single_batch:  # at most one recompute and one cached batch per degree; flows only there
        zk, zd = np.repeat([0, 1], D * B), np.tile(np.repeat(np.arange(D), B), 2)
        block(zk * D + zd, oz + np.arange(nz), np.ones(nz), np.full(2 * D, -np.inf), np.ones(2 * D))
        big = steps.max(axis=2)[gk, gc]  # the most steps of that kind the class can need
        block(np.r_[np.arange(F), np.arange(F)], np.r_[gcol, oz + (gk * D + gd) * B + gb], np.r_[np.ones(F), -big],
              np.full(F, -np.inf), np.zeros(F))
    A = rows.matrix(n)
    col_lo, col_hi = np.zeros(n), np.full(n, np.inf)
    # a threshold even the fastest (d, b) cannot serve within the SLO is out
    fastest = (steps * lat.min(axis=(2, 3))[:, :, None]).sum(axis=0)  # (C, T)
    col_hi[ox:ox + nx] = np.where(fastest.ravel() <= slo[xc] * (1 + 1e-9), 1.0, 0.0)
    col_hi[oR:oR + D] = cap
    if fixed is not None:
        col_lo[oR:oR + D] = col_hi[oR:oR + D] = fixed
    col_hi[oz:] = 1.0
    integer = np.zeros(n, dtype=bool)
    integer[:og] = True
    integer[oz:] = True
    cost = np.zeros(n)  # minimise -(primary + w x secondary); the constant w x 1 is added back
    cost[ox:ox + nx] = -(w[xc] * np.asarray(tab.thresholds)[xt])
    cost[gcol] = config.secondary_weight * v[gc] * g_lat / slo[gc]
    return _Model(Milp(cost, A, *rows.bounds(), col_lo, col_hi, integer),
                  C, T, D, gk, gc, gd, gb, g_lat, g_load)


def plan_capacity(classes: list[WorkloadClass], gpus: int, profiles: dict[int, LatencyProfile],
                  model: StepModel | None = None, config: Stage1Config | None = None,
                  slots: dict[int, int] | None = None, fixed_counts: dict[int, int] | None = None) -> CapacityPlan:
    """Solve Stage 1. ``slots``: most TP-d instances the nodes hold (default gpus // d);
    ``fixed_counts``: evaluate this configuration instead of choosing one (fallback disabled).
    The reported solve time covers building the cost tables and the model as well as the solve."""
    if not classes:
        raise ValueError("Stage 1 needs at least one workload class")
    model, config = model or StepModel(), config or Stage1Config()
    if config.rounds == "mixed":
        return plan_capacity_mixed(classes, gpus, profiles, model, config, slots, fixed_counts)
    start = time.perf_counter()
    tab = cost_tables(classes, profiles, model, config.batches)
    C = len(classes)
    rate = np.array([c.rate for c in classes], dtype=float)
    out = np.array([c.output_tokens for c in classes], dtype=float)
    slo = default_slos(classes, tab, config.slo_scale)
    w = rate * out if rate.sum() > 0 else out  # average per output token
    w = w / w.sum()
    v = rate / rate.sum() if rate.sum() > 0 else np.full(C, 1.0 / C)
    cap = np.array([(slots or {}).get(d, gpus // d) for d in tab.degrees], dtype=float)
    fixed = None if fixed_counts is None else np.array([fixed_counts.get(d, 0) for d in tab.degrees], dtype=float)
    m = _build(tab, rate, w, v, slo, gpus, cap, config, fixed)
    res = solve_milp(m.milp, config.solver, config.time_limit_s)
    if res.status not in SOLVED or res.z is None:
        info = replace(res.info, seconds=time.perf_counter() - start)
        return _infeasible(classes, tab, w, gpus, cap, slo, fixed_counts, (info,))

    z, T, D = res.z, m.T, m.D
    x = z[:C * T].reshape(C, T)
    R = z[C * T:C * T + D]
    g = np.maximum(z[C * T + D:C * T + D + len(m.g_c)], 0.0)
    latency = np.bincount(m.g_c, g * m.g_lat, minlength=C)
    load = np.bincount(m.g_d, g * m.g_load, minlength=D)
    chosen = x.argmax(axis=1)
    th = np.asarray(tab.thresholds)
    primary = float((w * th[chosen]).sum())
    secondary = float(1.0 - v @ (latency / slo))
    counts = {d: int(round(n)) for d, n in zip(tab.degrees, R)}
    if fixed_counts is None:
        counts = _fill(counts, load, tab.degrees, gpus, cap)
    names = [c.name for c in classes]
    flow_load = g * m.g_load
    info = replace(res.info, seconds=time.perf_counter() - start)
    return CapacityPlan(
        counts=counts, thresholds={n: tab.thresholds[t] for n, t in zip(names, chosen)},
        primary=primary, secondary=secondary, feasible=True, gpus=gpus,
        batch_recompute=_batch_of(flow_load, m, 0, tab), batch_cached=_batch_of(flow_load, m, 1, tab),
        utilisation={d: float(load[i] / counts[d]) for i, d in enumerate(tab.degrees) if counts[d]},
        latency_ms=dict(zip(names, latency.round(3).tolist())),
        slo_ms=dict(zip(names, slo.round(3).tolist())), solves=(info,), secondary_weight=config.secondary_weight)


def _batch_of(flow_load: np.ndarray, m: _Model, kind: int, tab: CostTables) -> dict[int, int]:
    """Per TP degree, the batch level carrying most of its load of that step kind."""
    sel = m.g_kind == kind
    per = np.zeros((len(tab.degrees), len(tab.batches)))
    np.add.at(per, (m.g_d[sel], m.g_b[sel]), flow_load[sel])
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

