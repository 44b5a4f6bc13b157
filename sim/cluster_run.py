"""Run a cluster scenario (``sim/cluster_scenarios.py``) under each router policy, or the reconfiguration
trace (``sim/cluster_trace.py``) for ``dilaserve-trace``."""

from __future__ import annotations

import time
from dataclasses import replace

from cluster import RouterConfig
from engine.latency_profile import load_tp_profiles
from sim.cluster import ClusterConfig, ClusterSimulator, sheds, summarize
from sim.cluster_scenarios import (
    accuracy_of,
    candidate_thresholds,
    get_cluster_scenario,
    make_specs,
    offered_rate,
    scenario_capacity,
)
from sim.cluster_trace import TraceScenario, run_trace
from sim.threshold_table import load_table


def run_cluster_scenario(name: str, policies: list[str] | None, n: int, seed: int = 0, rate: float | None = None,
                         progress: bool = False, load: float | None = None, estimator: str = "table",
                         shed: bool | None = None, refit_every: int = 100, refit_early: tuple[int, ...] = (25, 50),
                         min_requests: int = 25, make_before_break: bool = True, workers: int = 1, **overrides) -> dict:
    """Simulate scenario ``name`` under each policy. ``estimator``: ``table`` (oracle totals with a
    synthetic error) or ``online`` (learnt from the run's own traffic, started cold: refits after
    ``refit_every`` more finished requests once ``min_requests`` finished, and at ``refit_early``);
    ``shed``: admission at arrival (None: remask only). dilaserve-trace: ``make_before_break`` transitions,
    ``workers`` processes. ``rate`` (req/s) or ``load`` (a multiple of ``scenario_capacity``, the cluster's
    capacity at the top candidate threshold for the scenario's mix; dilaserve-trace: of its 16 TP-1
    instances, as its mean rate); the report carries ``capacity_rps``, ``load`` and the rate."""
    sc = replace(get_cluster_scenario(name), **overrides)
    offered_rate(rate, load, 1.0, 1.0)  # both, or a non-positive one: an error before any work
    if name == "dilaserve-trace":
        if policies is not None and len(policies) != 1:
            raise ValueError("dilaserve-trace compares instance mixes under one router policy; give one")
        trace = TraceScenario(requests=sc, policy=(policies or sc.policies)[0], make_before_break=make_before_break)
        if shed is not None:
            trace = replace(trace, shed=shed)
        cap = None
        if load is not None:
            table = load_table(sc.model, sc.table_prompts, thresholds=RouterConfig().thresholds, progress=progress)
            thresholds = candidate_thresholds(table, sc.quality_tolerance)
            cap = scenario_capacity(sc, table, load_tp_profiles(sc.profile, [1]), thresholds, (1,) * sum(trace.nodes))
            rate = offered_rate(None, load, cap.rps, 0.0)
        report = run_trace(trace, n, seed, rate, progress=progress, workers=workers)
        if cap is not None:
            report |= {"load": load, "capacity_rps": round(cap.rps, 3), "capacity": cap.to_dict()}
        return report
    policies = list(policies or sc.policies)
    from cluster import make_router_policy

    for p in policies:
        make_router_policy(p)  # fail fast on unknown names
    table = load_table(sc.model, sc.table_prompts, thresholds=RouterConfig().thresholds, progress=progress)
    rcfg = RouterConfig(thresholds=candidate_thresholds(table, sc.quality_tolerance))
    profiles = load_tp_profiles(sc.profile, sorted(set(sc.tp_degrees) | {1}))
    cap = scenario_capacity(sc, table, profiles, rcfg.thresholds)
    rate = offered_rate(rate, load, cap.rps, sc.load * cap.rps)
    specs = make_specs(sc, table, n, rate, seed, profiles, rcfg.thresholds)
    cfg = ClusterConfig(sc.tp_degrees, sc.slots, sc.block_tokens,
                        sum(s.prompt_tokens + s.output_tokens for s in specs) // max(len(specs), 1), router=rcfg,
                        estimator=estimator, online_refit_every=refit_every, online_min_requests=min_requests,
                        online_early=tuple(refit_early))
    results = {}
    for policy in policies:
        t0 = time.perf_counter()
        sim = ClusterSimulator(replace(cfg, shed=sheds(policy, shed)), profiles, policy, seed)
        res = sim.run(specs)
        sim_s = time.perf_counter() - t0
        results[policy] = summarize(res, specs, accuracy_of(table, res.finished, sc.model))
        results[policy]["shedding"] = sim.cfg.shed
        results[policy]["simulation_wall_s"] = round(sim_s, 2)
    return {"scenario": name, "requests": n, "seed": seed, "profile": sc.profile,
            "instances": {f"tp{d}": sc.tp_degrees.count(d) for d in sorted(set(sc.tp_degrees))},
            "slots": sc.slots, "arrival_rate_rps": rate, "capacity_rps": round(cap.rps, 3),
            "load": round(rate / cap.rps, 4), "capacity": cap.to_dict(), "slo_factor": sc.slo_factor, "mix": sc.mix,
            "candidate_thresholds": list(rcfg.thresholds), "estimator": estimator,
            "fixed_threshold_accuracy": {f"{t:g}": round(table.accuracy(i), 4) for i, t in enumerate(table.thresholds)},
            "policies": results}


def capacity_table(name: str, profile: str | None = None) -> dict:
    """How much of a request's work a lower threshold removes, for scenario ``name`` (``profile``: another
    latency profile): per threshold of the model's table, the mean request's steps, the cluster's capacity with
    every step at it (``scenario_capacity``), and the instance time of a recompute and of a cached step in the
    rounds an instance runs at that SLO occupancy (``cluster.capacity.step_costs``), with the recompute steps'
    share of a request's work. A threshold only removes cached steps: one recompute step per block stays."""
    from cluster import StepShape, TpLatencyModel
    from cluster.capacity import step_costs
    from sim.cluster_scenarios import mean_request, mix_accuracy

    sc = get_cluster_scenario(name)
    if profile:
        sc = replace(sc, profile=profile)
    table = load_table(sc.model, sc.table_prompts, thresholds=RouterConfig().thresholds)
    candidates = candidate_thresholds(table, sc.quality_tolerance)
    profiles = load_tp_profiles(sc.profile, sorted(set(sc.tp_degrees) | {1}))
    prompt, _ = mean_request(sc, table, table.thresholds)
    blocks = -(-sc.output_tokens // sc.block_tokens)
    lat = TpLatencyModel({1: profiles[1]}, sc.slots, StepShape(sc.block_tokens, round(prompt + sc.output_tokens)))
    rows, top = [], None
    for t in table.thresholds:
        _, steps = mean_request(sc, table, (t,))
        cap = scenario_capacity(sc, table, profiles, (t,))
        level = cap.levels[min(cap.levels)]
        heavy, light = step_costs(lat, 1, level, blocks / steps)
        work = blocks * heavy + (steps - blocks) * light
        top = top or (steps, cap.rps, work)
        rows.append({"threshold": t, "candidate": t in candidates, "mean_steps": round(steps, 2),
                     "steps_removed": round(1 - steps / top[0], 4), "capacity_rps": round(cap.rps, 3),
                     "capacity_gain": round(cap.rps / top[1], 4), "slo_occupancy": level,
                     "recompute_step_ms": round(heavy, 3), "cached_step_ms": round(light, 3),
                     "work_ms": round(work, 2), "work_removed": round(1 - work / top[2], 4),
                     "recompute_share_of_work": round(blocks * heavy / work, 4),
                     "accuracy_mix": round(mix_accuracy(sc, table, t), 4),
                     "accuracy_held_out": round(table.accuracy(table.thresholds.index(t)), 4)})
    return {"scenario": name, "profile": sc.profile, "mix": sc.mix, "mean_prompt_tokens": round(prompt, 1),
            "blocks": blocks, "instances": len(sc.tp_degrees), "slo_factor": sc.slo_factor, "thresholds": rows}
