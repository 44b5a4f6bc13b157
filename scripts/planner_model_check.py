"""How well the planner's mixed-rounds Stage 1 predicts the share of requests within SLO: each static
mix of the dilaserve-trace cluster under steady Poisson load, simulated, against the fluid and the queue
model (``Stage1Config.occupancy``) with the counts fixed, as the planner evaluates a configuration.

    .venv/bin/python scripts/planner_model_check.py --slo-factor 1.75 --rates 25,35,40,45,50

Prints one JSON line per rate and a table (reports/planner.md, "The queue model, confirmation and a
forecast"). The requests, profiles and step model are the trace's (``sim.cluster_trace``); the simulator
admits everything; the models refuse would-be-late requests (``--refusals off``: they do not).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIXES = {"16xTP1": {1: 16, 2: 0, 4: 0}, "8xTP2": {1: 0, 2: 8, 4: 0}, "4xTP4": {1: 0, 2: 0, 4: 4}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slo-factor", type=float, default=2.0)
    ap.add_argument("--rates", default="25,35,40,45,50", help="req/s, comma-separated")
    ap.add_argument("--requests", type=int, default=1500, help="simulated arrivals per rate and mix")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--refusals", choices=("on", "off"), default="on")
    ap.add_argument("--no-sim", action="store_true", help="the models only (fast)")
    ap.add_argument("--policy", default="remask", help="the simulated router's policy")
    ap.add_argument("--placement", choices=("class", "group"),
                    help="the models' placement (default: as the policy places; group for remask-fit)")
    ap.add_argument("--mixes", help="mixes to compare, e.g. '16,0,0;12,0,1' (TP-1,TP-2,TP-4 counts; default: "
                    "16xTP1, 8xTP2, 4xTP4)")
    ap.add_argument("--occupancy", default="level,queue", help="the models to compare, comma-separated")
    args = ap.parse_args(argv)

    from cluster import RouterConfig
    from engine.device import set_threads
    from engine.latency_profile import load_tp_profiles
    from planner import Cluster, WorkloadMonitor, plan_capacity
    from sim.cluster import summarize
    from sim.cluster_scenarios import candidate_thresholds, make_specs
    from sim.cluster_trace import TraceScenario, _simulate, _stage1, mix_name, parse_mixes, step_model
    from sim.threshold_table import load_table

    set_threads(1)
    sc = TraceScenario()
    sc = replace(sc, requests=replace(sc.requests, slo_factor=args.slo_factor), policy=args.policy,
                 placement=args.placement)
    mixes = MIXES
    if args.mixes:
        mixes = {mix_name(mix, sc.degrees): dict(zip(sc.degrees, mix)) for mix in parse_mixes(args.mixes)}
    models = tuple(m for m in args.occupancy.split(",") if m)
    q = sc.requests
    table = load_table(q.model, q.table_prompts, thresholds=RouterConfig().thresholds, progress=True)
    rcfg = RouterConfig(thresholds=candidate_thresholds(table, q.quality_tolerance))
    profiles = load_tp_profiles(q.profile, sc.degrees)
    probe = make_specs(q, table, 4000, 1.0, 1, profiles, rcfg.thresholds)  # the trace's step model
    steps = step_model(probe, rcfg.thresholds, q.block_tokens, sc.step_groups)
    stage1 = replace(_stage1(sc, steps), shed=args.refusals == "on")
    slots = Cluster(tuple(sc.nodes)).slots(profiles)
    monitor = WorkloadMonitor(window_s=1.0, buffer=0.0)
    for s in probe:
        monitor.record(0.0, s.prompt_tokens, s.output_tokens)
    shape = monitor.classes(0.0)
    total = sum(c.rate for c in shape)
    rows = []
    for rate in (float(x) for x in args.rates.split(",") if x.strip()):
        classes = [replace(c, rate=c.rate * rate / total) for c in shape]
        row = {"slo_factor": args.slo_factor, "rate": rate}
        for name, counts in mixes.items():
            for occ in models:
                plan = plan_capacity(classes, sum(sc.nodes), profiles, steps, replace(stage1, occupancy=occ), slots,
                                     fixed_counts=counts)
                row[f"{name}_{occ}"] = round(plan.slo_met or 0.0, 3) if plan.feasible else 0.0
            if not args.no_sim:
                specs = make_specs(q, table, args.requests, rate, args.seed, profiles, rcfg.thresholds)
                seq = sum(s.prompt_tokens + s.output_tokens for s in specs) // len(specs)
                tps = tuple(d for d, k in counts.items() for _ in range(k))
                run = _simulate(sc, specs, profiles, rcfg, seq, tps, args.seed)
                row[f"{name}_sim"] = summarize(run.res, specs, [])["slo_attainment"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nSLO {args.slo_factor}x: share within SLO, simulator / " + " / ".join(f"{m} model" for m in models))
    for row in rows:
        cells = [" / ".join([f"{row.get(f'{n}_sim', float('nan')):.3f}"] + [f"{row[f'{n}_{m}']:.3f}" for m in models])
                 for n in mixes]
        print(f"  {row['rate']:5.1f} req/s  " + "  ".join(f"{n}: {c}" for n, c in zip(mixes, cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
