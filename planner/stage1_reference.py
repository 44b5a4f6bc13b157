"""Stage 1 in its first formulation, kept as the reference the fast model is checked against.

The same MILP as ``stage1`` written with cvxpy expressions over a share ``f[c t, d b]`` of class
c's steps per (threshold, degree, batch), every batch size kept, canonicalised by cvxpy on every
call. ``stage1`` aggregates the shares over thresholds, drops batch columns off the convex
frontier and builds the arrays itself; the optimum is the same (``tests/test_planner_reference.py``),
the solve 5-20x faster. ``remask plan --reference`` runs this one.
"""

from __future__ import annotations

import time
from dataclasses import replace

import cvxpy as cp
import numpy as np

from engine.latency_profile import LatencyProfile
from planner.costs import StepModel, cost_tables
from planner.milp import SOLVED
from planner.solver import solve
from planner.stage1 import CapacityPlan, Stage1Config, _fill, _infeasible, default_slos
from planner.workload import WorkloadClass


def plan_capacity_reference(classes: list[WorkloadClass], gpus: int, profiles: dict[int, LatencyProfile],
                            model: StepModel | None = None, config: Stage1Config | None = None,
                            slots: dict[int, int] | None = None,
                            fixed_counts: dict[int, int] | None = None) -> CapacityPlan:
    if not classes:
        raise ValueError("Stage 1 needs at least one workload class")
    start = time.perf_counter()
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
    if config.single_batch:  # one recompute and one cached batch per TP degree
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
    info = replace(info, seconds=time.perf_counter() - start)
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
        utilisation={d: float(ld[i] / counts[d]) for i, d in enumerate(tab.degrees) if counts[d]},
        latency_ms=dict(zip(names, np.asarray(latency.value).round(3).tolist())),
        slo_ms=dict(zip(names, slo.round(3).tolist())), solves=(info,), secondary_weight=config.secondary_weight)
