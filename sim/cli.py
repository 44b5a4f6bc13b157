"""``remask simulate``: virtual-time simulation of one instance, or of a cluster (the dilaserve-* scenarios),
under several policies."""

from __future__ import annotations

import json


def _simulate_cluster(args) -> int:
    from engine.device import set_threads
    from sim.cluster_run import run_cluster_scenario

    set_threads(1)  # the tiny model's decodes: a second thread only spins on a shared machine
    if args.capacity:
        return _print_capacity(args)
    trace = args.scenario == "dilaserve-trace"
    if args.plot and not trace and args.estimator != "online":
        raise ValueError("--plot draws the reconfiguration timeline of dilaserve-trace, or the learning curve of "
                         f"--estimator online; not of {args.scenario} with --estimator {args.estimator}")
    if trace and args.estimator != "table":
        raise ValueError("dilaserve-trace runs with the table estimator; drop --estimator")
    if not trace and (args.break_before_make or args.workers != 1):
        raise ValueError("--break-before-make and --workers are dilaserve-trace's")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    online = {}
    if args.slo_factor is not None:
        if args.slo_factor <= 0:
            raise ValueError("--slo-factor must be positive")
        online["slo_factor"] = args.slo_factor
    shed = {"auto": None, "on": True, "off": False}[args.shed]
    if trace:
        online.update(make_before_break=not args.break_before_make, workers=args.workers, shed=shed)
    if not trace:
        early = tuple(int(x) for x in args.refit_early.split(",") if x.strip()) if args.refit_early else ()
        online |= {"estimator": args.estimator, "shed": shed,
                  "refit_every": args.refit_every, "refit_early": early,
                  "min_requests": min(early) if early else args.refit_every * 2}
    if args.profile:
        online["profile"] = args.profile
    report = run_cluster_scenario(args.scenario, policies, args.requests or 2000, args.seed, args.rate,
                                  progress=not args.quiet, load=args.load, **online)
    if args.plot and trace:
        from sim.cluster_trace import plot_trace

        plot_trace(report, args.plot)
    elif args.plot:
        from sim.report.plots import learning_curve

        learning_curve(report, args.plot)
    if leads(report):
        report["remask_lead"] = leads(report)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"scenario {report['scenario']}: {report['requests']} requests at {report['arrival_rate_rps']:.2f} req/s"
          + (f" = load {report['load']:g} x capacity {report['capacity_rps']:.2f} req/s" if "load" in report else "")
          + f", profile {report.get('profile', '?')}, seed {report['seed']}, "
          f"candidate thresholds {report.get('candidate_thresholds')}")
    for name, r in report["policies"].items():
        print(f"  {name:24s} SLO attainment {r['slo_attainment']:.3f}  accuracy {r['accuracy']:.4f}  "
              f"mean {r['mean_latency_s']:7.2f}s  p99 {r['p99_latency_s']:7.2f}s  "
              f"mean threshold {r['mean_threshold']:.3f}  migrations {r['migrations']}  shed {r['shed']}")
    for line in lead_lines(report):
        print(line)
    return 0


def _print_capacity(args) -> int:
    from sim.cluster_run import capacity_table

    if args.scenario == "dilaserve-trace":
        raise ValueError("--capacity is the load scenarios' (dilaserve-bench, dilaserve-ablation, ...)")
    rep = capacity_table(args.scenario, args.profile)
    if args.json:
        print(json.dumps(rep))
        return 0
    print(f"scenario {rep['scenario']}, profile {rep['profile']}: {rep['instances']} instances, mean prompt "
          f"{rep['mean_prompt_tokens']:g} tokens, {rep['blocks']} blocks (one recompute step each), SLO "
          f"{rep['slo_factor']:g}x isolated")
    print("  threshold  steps  removed  capacity (req/s)  gain   occupancy  recompute/cached step (ms)  "
          "work removed  recompute share  accuracy (mix / held-out)")
    for r in rep["thresholds"]:
        print(f"  {r['threshold']:<5g}{'*' if r['candidate'] else ' '}    {r['mean_steps']:6.1f}  "
              f"{100 * r['steps_removed']:5.1f}%  {r['capacity_rps']:10.2f}        x{r['capacity_gain']:.3f}  "
              f"{r['slo_occupancy']:5d}      {r['recompute_step_ms']:7.2f} / {r['cached_step_ms']:5.2f}          "
              f"{100 * r['work_removed']:5.1f}%        {100 * r['recompute_share_of_work']:5.1f}%      "
              f"{r['accuracy_mix']:.4f} / {r['accuracy_held_out']:.4f}")
    print(f"  (* a candidate threshold; accuracy with every step at the threshold, on the scenario's {rep['mix']} mix "
          "and on the held-out set's own, which chooses the candidates)")
    return 0


def leads(report: dict) -> dict[str, dict]:
    """Per baseline (the fixed-threshold policies infaas and llumnix that ran), remask's lead: SLO attainment
    in percentage points and accuracy in points (remask minus the baseline). Empty without remask."""
    pols = report.get("policies", {})
    ours = pols.get("remask")
    if not ours:
        return {}
    out = {}
    for base in ("infaas", "llumnix"):
        b = pols.get(base)
        if b:
            out[base] = {"slo_pp": round(100 * (ours["slo_attainment"] - b["slo_attainment"]), 1),
                         "accuracy_points": round(100 * (ours["accuracy"] - b["accuracy"]), 2)}
    return out


def lead_lines(report: dict) -> list[str]:
    return [f"  remask vs {base:8s} SLO attainment {v['slo_pp']:+.1f} pp, accuracy {v['accuracy_points']:+.2f} points"
            for base, v in leads(report).items()]


def cmd_simulate(args) -> int:
    from sim.cluster_scenarios import CLUSTER_SCENARIOS
    from sim.scenarios import run_scenario, speedups

    if args.scenario in CLUSTER_SCENARIOS:
        return _simulate_cluster(args)
    policies = [p.strip() for p in (args.policies or "fcfs-prefill-first,dwise,oracle").split(",") if p.strip()]
    from engine.scheduler.policies import make_policy

    for p in policies:
        make_policy(p)  # fail fast on unknown names
    default_n = 512 if args.scenario.startswith("tiny-") else 4096  # model in the loop decodes every request
    if args.load is not None:
        raise ValueError("--load is the cluster scenarios'; a single instance takes --rate")
    report = run_scenario(args.scenario, policies, args.requests or default_n, args.seed, progress=not args.quiet,
                          rate=args.rate, profile=args.profile, threshold=args.threshold)
    report["speedup_vs_" + policies[0]] = speedups(report, policies[0])
    if args.json:
        print(json.dumps(report))
    else:
        print(f"scenario {report['scenario']}: {report['requests']} requests, seed {report['seed']}, profile "
              f"{report['profile']}" + ("" if report["arrival_rate_rps"] is None else
                                        f", {report['arrival_rate_rps']:g} req/s"))
        if "level" in report:
            print(f"  level {report['level']:g} -> entropy bound {report['entropy_bound']:g}: "
                  f"{report['steps_per_canvas']:g} steps per canvas, {report['canvases_per_request']:g} canvases "
                  "per request" + (" (modelled profile)" if report["modelled_profile"] else ""))
        for name, r in report["policies"].items():
            print(f"  {name:20s} mean {r['mean_latency_s']:9.2f}s  p50 {r['p50_latency_s']:9.2f}s  "
                  f"p99 {r['p99_latency_s']:9.2f}s  ttft {r['mean_ttft_s']:8.2f}s  rounds {r['rounds']:7d}  "
                  f"prefill-only {r['prefill_only_round_frac']:.3f}  slots/round {r['filled_slots_per_round']:6.1f}"
                  + (f"  accuracy {r['accuracy']:.3f}" if "accuracy" in r else ""))
    return 0

def add_parsers(sub) -> None:
    """Add ``simulate`` to the ``remask`` sub-parsers."""
    s = sub.add_parser("simulate", help="virtual-time simulation of one instance (or a cluster: dilaserve-*) "
                       "under several policies")
    s.add_argument("--scenario", default="dwise-burst-poisson")
    s.add_argument("--policies", help="comma-separated (default: fcfs-prefill-first,dwise,oracle; a cluster "
                   "scenario's own list for dilaserve-*)")
    s.add_argument("--requests", type=int, help="default 4096 (model in the loop: 512; cluster scenarios: 2000)")
    s.add_argument("--rate", type=float, help="arrival rate, requests per second (cluster scenarios; the Poisson "
                   "rate of a single instance's burst-poisson and poisson scenarios)")
    s.add_argument("--threshold", type=float, help="DiffusionGemma scenarios (dg-*): the router's level, whose "
                   "entropy bound sets each canvas's steps (0.9: the checkpoint's bound; each 0.1 lower doubles it)")
    s.add_argument("--load", type=float, help="cluster scenarios: arrival rate as a multiple of the cluster's "
                   "capacity at the top candidate threshold for the scenario's mix (planner.slo_capacity.slo_capacity; "
                   "printed beside it, and capacity_rps, load, arrival_rate_rps in --json); default 1.0 where "
                   "--rate is not given; dilaserve-trace: its mean rate, of 16 TP-1 instances")
    s.add_argument("--capacity", action="store_true", help="cluster scenarios: print, per threshold, the mean "
                   "request's steps, the cluster's capacity and the share of a request's work a lower threshold "
                   "removes (recompute steps stay), then exit")
    s.add_argument("--profile", help="latency profile, a name in profiles/ or a JSON file's path (default: the "
                   "scenario's: h200-llada8b-measured for the cluster scenarios, "
                   "h200-diffusiongemma-26b-a4b-modelled for dg-*)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--plot", help="dilaserve-trace: write the offered rate, instance mix and SLO attainment "
                                  "over time to this PNG; --estimator online: the step predictor's learning curve")
    s.add_argument("--estimator", choices=["table", "online"], default="table",
                   help="cluster scenarios: the router's step estimates, from the oracle totals with a synthetic "
                        "error (table) or learnt online from the run's own finished requests, started cold (online)")
    s.add_argument("--refit-every", type=int, default=100, help="--estimator online: refit after this many more "
                   "finished requests (the first at the first --refit-early count, or once twice as many finished)")
    s.add_argument("--refit-early", default="25,50", help="--estimator online: extra refits at these finished-request "
                   "counts, comma-separated; '' for none")
    s.add_argument("--shed", choices=["auto", "on", "off"], default="auto",
                   help="cluster scenarios: refuse arrivals that cannot meet their SLO, as the live ingress does "
                        "(auto: remask and remask-fit shed, the papers' baselines admit everything: "
                        "sim.cluster.SHED_DEFAULT; "
                        "dilaserve-trace: off, where it costs more than it saves); refused requests are SLO misses")
    s.add_argument("--slo-factor", type=float, help="cluster scenarios: SLO = this x the isolated TP-1 latency "
                   "(default: the scenario's)")
    s.add_argument("--break-before-make", action="store_true", help="dilaserve-trace: a new instance starts only "
                   "once the GPUs it needs are free (default: it loads beside the old ones, which serve meanwhile)")
    s.add_argument("--workers", type=int, default=1, help="dilaserve-trace: processes (2: the static mixes beside "
                   "the reconfigured run)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_simulate)
