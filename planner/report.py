"""What ``remask plan`` prints: Stage 1 on a workload, and Stage 2 from an all-TP-1 start."""

from __future__ import annotations

import json
from pathlib import Path

from engine.latency_profile import TP_SPEEDUP, LatencyProfile, load_tp_profiles
from planner.costs import StepModel
from planner.stage1 import CapacityPlan, Stage1Config, plan_capacity
from planner.stage2 import Cluster, Stage2Config, plan_transition
from planner.transition import Instance
from planner.workload import WorkloadClass

# ShareGPT-like mix (DiLaServe Table 2: prompt mean 140, output mean 264): (name, share, input, output)
DEFAULT_MIX = (("short-short", 0.25, 64, 64), ("short-long", 0.40, 140, 256),
               ("long-short", 0.15, 300, 64), ("long-long", 0.20, 300, 512))


def default_classes(rps: float) -> list[WorkloadClass]:
    return [WorkloadClass(n, share * rps, i, o) for n, share, i, o in DEFAULT_MIX]


def load_classes(path: str) -> list[WorkloadClass]:
    """A JSON list of {"name", "rate", "input_tokens", "output_tokens"[, "slo_ms"]}."""
    try:
        return [WorkloadClass(**c) for c in json.loads(Path(path).read_text())]
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"workload file {path}: {exc}") from exc


def capacity_dict(plan: CapacityPlan) -> dict:
    return {
        "feasible": plan.feasible, "gpus": plan.gpus, "gpus_used": plan.gpus_used,
        "counts": {str(d): n for d, n in plan.counts.items()},
        "thresholds": plan.thresholds, "primary_avg_threshold": round(plan.primary, 6),
        "secondary_slo_slack": None if plan.secondary is None else round(plan.secondary, 6),
        "batch_recompute": {str(d): b for d, b in plan.batch_recompute.items()},
        "batch_cached": {str(d): b for d, b in plan.batch_cached.items()},
        "utilisation": {str(d): round(u, 4) for d, u in plan.utilisation.items()},
        "latency_ms": plan.latency_ms, "slo_ms": plan.slo_ms,
        "solver": plan.solves[-1].solver if plan.solves else None,
        "fallback": next((s.fallback for s in plan.solves if s.fallback), None),
        "solve_ms": round(plan.solve_seconds * 1e3, 2),
    }


def profile_source(d: int, prof: LatencyProfile) -> str:
    """Where TP-``d``'s profile came from: its own file (measured, or modelled: its ``meta`` says which) or TP-1's
    scaled by ``TP_SPEEDUP``."""
    if d == 1 or prof.meta.get("tp") == d:
        return f"{prof.name.removesuffix('-tp1')} ({'modelled' if prof.modelled else 'measured'})"
    return f"TP-1's x {TP_SPEEDUP.get(d)} (TP_SPEEDUP)"


def plan_report(cluster: Cluster, classes: list[WorkloadClass], profile: str = "h200-llada8b-measured",
                degrees: tuple[int, ...] = (1, 2, 4), stage1: Stage1Config | None = None,
                steps: StepModel | None = None, solver: str = "auto", reference: bool = False) -> dict:
    """``reference``: Stage 1 with its first formulation (``stage1_reference``), for comparison."""
    profiles = load_tp_profiles(profile, degrees)
    solve = plan_capacity
    if reference:
        from planner.stage1_reference import plan_capacity_reference as solve
    plan = solve(classes, cluster.gpus, profiles, steps, stage1, cluster.slots(degrees))
    start = [Instance(f"init-{n}-{k}", n, 1) for n, g in enumerate(cluster.gpus_per_node) for k in range(g)]
    trans = plan_transition(cluster, start, plan.counts, Stage2Config(solver=solver))
    return {
        "nodes": len(cluster.gpus_per_node), "gpus": cluster.gpus, "profile": profile,
        "tp_profiles": {str(d): profile_source(d, p) for d, p in profiles.items()},
        "workload": [{"name": c.name, "rate": round(c.rate, 4), "input_tokens": c.input_tokens,
                      "output_tokens": c.output_tokens} for c in classes],
        "stage1": capacity_dict(plan) | {"formulation": "reference" if reference else "aggregated"},
        "stage2_from_all_tp1": {"kept": len(trans.kept), "starts": sum(a.kind == "start" for a in trans.actions),
                                "stops": sum(a.kind == "stop" for a in trans.actions), "unplaced": trans.unplaced,
                                "solver": trans.solve.solver, "solve_ms": round(trans.solve.seconds * 1e3, 2)},
    }


def format_report(r: dict) -> str:
    s1, s2 = r["stage1"], r["stage2_from_all_tp1"]
    lines = [f"{r['gpus']} GPUs on {r['nodes']} nodes, profile {r['profile']}, "
             f"{sum(c['rate'] for c in r['workload']):.2f} req/s in {len(r['workload'])} classes",
             "TP profiles: " + "  ".join(f"TP-{d} {src}" for d, src in r.get("tp_profiles", {}).items()),
             "stage 1: " + ("" if s1["feasible"] else "INFEASIBLE, fallback ") +
             "  ".join(f"TP-{d} x {n}" for d, n in s1["counts"].items()) + f"  ({s1['gpus_used']} GPUs)",
             "  thresholds: " + "  ".join(f"{k}={v}" for k, v in s1["thresholds"].items()),
             f"  average threshold per output token {s1['primary_avg_threshold']:.4f}, SLO slack "
             f"{s1['secondary_slo_slack']}",
             f"  solver {s1['solver']}, {s1['solve_ms']:.1f} ms" + (f" ({s1['fallback']})" if s1["fallback"] else ""),
             f"stage 2 from all TP-1: keep {s2['kept']}, start {s2['starts']}, stop {s2['stops']}; "
             f"{s2['solver']}, {s2['solve_ms']:.1f} ms"]
    return "\n".join(lines)
