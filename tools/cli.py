"""The ``remask`` command line: its root. Each package registers its own subcommands with ``add_parsers(sub)``
(adding its parsers and setting each one's handler as ``func``); ``COMMAND_MODULES`` lists those packages' modules
in the order ``remask --help`` shows their commands. Handlers import their heavy modules when they run, so
building the parser stays cheap."""

from __future__ import annotations

import argparse
import json
import sys

from loadgen import cli as loadgen_cli
from planner import cli as planner_cli
from predictors import cli as predictors_cli
from sim import cli as sim_cli
from sim.report import cli as report_cli
from tools import bench_cli, generate, model_cli, profile_cli


def cmd_faults(args) -> int:
    from tools import faults

    if args.scenario == "overload":
        res = faults.run_overload(args.factor, args.seconds, args.port, workload=args.workload)
        print(json.dumps(res) if args.json else
              f"{args.workload}: offered {res['offered_rps']} req/s ({args.factor:g} x the planner's "
              f"{res['planner_rate_rps']}) for "
              f"{res['seconds']:g} s: {res['status_codes']}; admitted {res['admitted_rps']} req/s, SLO "
              f"({res['slo_ms']} ms) attainment {res['admitted_slo_attainment']:.3f}; lost {res['lost']}; replica "
              f"memory {res['rss_mb_before']} -> {res['rss_mb_after']} MB")
        return 0 if res["lost"] == 0 else 1
    if args.scenario == "cancel":
        res = faults.run_cancel(args.cycles, port=args.port)
        print(json.dumps(res) if args.json else
              f"{res['cycles']} connect-disconnect cycles in {res['wall_s']} s; after: {res['state_after']}; "
              f"replica memory growth {res['rss_growth_mb']} MB; a request after them: {res['served_after']!r}")
        return 0 if not any(v for k, v in res["state_after"].items() if k != "settle_s") else 1
    if args.scenario in ("ingress", "redeploy"):
        res = (faults.run_ingress_restart if args.scenario == "ingress" else faults.run_redeploy)(args.streams,
                                                                                                 args.port)
        print(json.dumps(res) if args.json else json.dumps(res, indent=1))
        return 0
    run_faults = faults.run_faults
    if args.requests < 1 or args.kills < 0 or args.rate <= 0 or args.replicas < 2:
        raise ValueError("need --requests >= 1, --kills >= 0, --rate > 0 and --replicas >= 2")
    res = run_faults(args.requests, args.kills, args.rate, args.replicas, args.port, target=args.target, tp=args.tp)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['requests']} requests, {res['kills']} {res['target']} kills (TP-{res['tp']} replicas): "
              f"{res['completed']} completed, "
              f"{res['failed']} failed cleanly, {res['lost']} lost; accuracy {res['accuracy']:.3f}")
        for k in res["kill_reports"]:
            print(f"  kill {k['replica']} ({k['requests_held']} requests): dropped by the ingress after "
                  f"{k.get('detected_s')} s; silence of its requests {k.get('resume_gap_s')} s; replacement "
                  f"joined after {k.get('replaced_s')} s")
        print(f"  dispatcher: {res['dispatch']}")
    return 0 if res["lost"] == 0 else 1


def add_parsers(sub) -> None:
    """Add ``faults`` to the ``remask`` sub-parsers (its parser moves to tools/faults.py with the harness)."""
    x = sub.add_parser("faults", help="fault injection: kill Denoiser replicas of a live app under load")
    x.add_argument("--scenario", choices=["kill", "overload", "cancel", "ingress", "redeploy"], default="kill",
                   help="kill: replica kills under load; overload: 10x the planner's rate; cancel: "
                        "connect-disconnect cycles; ingress: kill the Ingress under long streams; redeploy: "
                        "serve.run of a changed config under long streams")
    x.add_argument("--streams", type=int, default=8, help="ingress, redeploy: long streams in flight")
    x.add_argument("--factor", type=float, default=10.0, help="overload: offered / planner rate")
    x.add_argument("--seconds", type=float, default=20.0, help="overload: how long to offer it")
    x.add_argument("--workload", choices=["short", "prose"], default="prose",
                   help="overload: prose (200-token stories, ~20 rounds each: the model is the bottleneck, as "
                        "with a DLM on a GPU) or short (32-token answers, a few rounds: on a 2-core machine "
                        "the HTTP path is)")
    x.add_argument("--cycles", type=int, default=1000, help="cancel: connect-disconnect cycles")
    x.add_argument("--requests", type=int, default=200)
    x.add_argument("--kills", type=int, default=2)
    x.add_argument("--rate", type=float, default=8.0, help="requests per second")
    x.add_argument("--replicas", type=int, default=3, help="Denoiser replicas")
    x.add_argument("--tp", type=int, default=1, help="kill: their tensor-parallel degree")
    x.add_argument("--target", choices=["replica", "tp-worker"], default="replica",
                   help="kill: the replica's process, or its TP rank 1 (needs --tp 2 or more)")
    x.add_argument("--port", type=int, default=8790)
    x.add_argument("--json", action="store_true")
    x.set_defaults(func=cmd_faults)


COMMAND_MODULES = (
    model_cli,  # remask train-default, eval
    generate,  # remask generate
    sim_cli,  # remask simulate
    planner_cli,  # remask plan
    bench_cli,  # remask bench
    loadgen_cli,  # remask loadgen {synth,replay,plot,overhead}, remask chat
    profile_cli,  # remask profile
    sys.modules[__name__],  # remask faults (add_parsers above)
    predictors_cli,  # remask predictors
    report_cli,  # remask report
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remask", description="Serve diffusion language models with SLOs.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"remask: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
