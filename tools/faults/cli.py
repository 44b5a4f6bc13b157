"""``remask faults``: the sub-command, its arguments and the printing of a scenario's result."""

from __future__ import annotations

import contextlib
import json
import sys

from tools.faults.cancel import run_cancel
from tools.faults.checks import summary_line
from tools.faults.ingress import run_ingress_restart
from tools.faults.kill import run_faults
from tools.faults.node import run_node
from tools.faults.overload import run_overload
from tools.faults.redeploy import run_redeploy
from tools.faults.soak import run_soak


def print_checked(res: dict, as_json: bool, out) -> int:
    """Print a content-checked scenario's result (JSON, or its summary line, details and verdict); its exit
    status."""
    if as_json:
        print(json.dumps(res), file=out)
    else:
        print(f"{res['scenario']}: {summary_line(res)}", file=out)
        for k in res.get("kill_reports", []):
            print(f"  kill {k['replica']} ({k['requests_held']} requests): dropped by the ingress after "
                  f"{k.get('detected_s')} s, {k.get('failed_over')} failed over; silence of its requests "
                  f"{k.get('resume_gap_s')} s; replacement joined after {k.get('replaced_s')} s", file=out)
        for key in ("node", "moved", "interrupted", "first_try", "answered_after_s", "new_config_served_after_s",
                    "capacity_rps", "rate_rps", "rss_slope_mb_per_min", "dispatch"):
            if key in res:
                print(f"  {key}: {json.dumps(res[key])}", file=out)
        for e in res.get("error_messages", [])[:5]:
            print(f"  error: {e}", file=out)
        for m in res["mismatches"]:
            print(f"  MISMATCH request {m['request']} ({m['outcome']}; seed {m.get('seed')}, temperature "
                  f"{m.get('temperature')}, threshold {m.get('threshold')}) at character {m['first_difference']}: "
                  f"expected {m['expected']!r}, got {m['got']!r}", file=out)
        print("PASS" if res["passed"] else "FAIL: " + "; ".join(res["problems"]), file=out)
    return 0 if res["passed"] else 1


def cmd_faults(args) -> int:
    out = sys.stdout
    try:  # Ray prints its workers' and raylets' deaths to stdout: they go to stderr, the result alone to stdout
        with contextlib.redirect_stdout(sys.stderr):
            return _run_scenario(args, out)
    except RuntimeError as exc:  # the app did not start, or the reference pass could not complete
        print(f"remask faults: error: {exc}", file=sys.stderr)
        return 1


def _run_scenario(args, out) -> int:
    if args.scenario == "overload":
        res = run_overload(args.factor, args.seconds, args.port, workload=args.workload)
        print(json.dumps(res) if args.json else
              f"{args.workload}: offered {res['offered_rps']} req/s ({args.factor:g} x the planner's "
              f"{res['planner_rate_rps']}) for "
              f"{res['seconds']:g} s: {res['status_codes']}; admitted {res['admitted_rps']} req/s, SLO "
              f"({res['slo_ms']} ms) attainment {res['admitted_slo_attainment']:.3f}; lost {res['lost']}; replica "
              f"memory {res['rss_mb_before']} -> {res['rss_mb_after']} MB", file=out)
        return 0 if res["lost"] == 0 else 1
    if args.scenario == "cancel":
        res = run_cancel(args.cycles, port=args.port)
        verdict_text = "PASS" if res["passed"] else "FAIL: " + "; ".join(res["problems"])
        print(json.dumps(res) if args.json else
              f"{res['cycles']} connect-disconnect cycles in {res['wall_s']} s; after: {res['state_after']}; "
              f"replica memory growth {res['rss_growth_mb']} MB; a request after them: {res['served_after']!r} "
              f"(before: {res['reference']!r}); {verdict_text}", file=out)
        return 0 if res["passed"] else 1
    if args.max_failed < 0:
        raise ValueError("need --max-failed >= 0")
    if args.scenario == "ingress":
        return print_checked(run_ingress_restart(args.streams, args.port), args.json, out)
    if args.scenario == "redeploy":
        return print_checked(run_redeploy(args.streams, args.port), args.json, out)
    if args.scenario == "soak":
        return print_checked(run_soak(args.minutes, args.port, replicas=args.replicas, load=args.load,
                                       kill_every_s=args.kill_every, cancel_frac=args.cancel_frac,
                                       max_failed=args.max_failed, max_rss_slope=args.max_rss_slope), args.json, out)
    if args.requests < 1 or args.rate <= 0:
        raise ValueError("need --requests >= 1 and --rate > 0")
    if args.scenario == "node":
        if args.replicas < 1:
            raise ValueError("need --replicas >= 1")
        return print_checked(run_node(args.requests, args.rate, args.replicas, args.port,
                                       max_failed=args.max_failed), args.json, out)
    if args.kills < 1 or args.replicas < 2:
        raise ValueError("need --kills >= 1 and --replicas >= 2")
    res = run_faults(args.requests, args.kills, args.rate, args.replicas, args.port, target=args.target, tp=args.tp,
                     max_failed=args.max_failed)
    return print_checked(res, args.json, out)


def add_parsers(sub) -> None:
    """Add ``faults`` to the ``remask`` sub-parsers."""
    x = sub.add_parser("faults", help="fault injection under load, every answer checked against a run "
                                      "without the fault")
    x.add_argument("--scenario", choices=["kill", "node", "ingress", "redeploy", "soak", "overload", "cancel"],
                   default="kill",
                   help="kill: Denoiser replica kills under load; node: stop the Ray node holding the Denoisers "
                        "mid-stream (a two-node cluster on this machine); ingress: kill the Ingress under long "
                        "streams; redeploy: serve.run of a changed config under long streams; soak: --minutes of "
                        "mixed traffic at --load x the measured capacity with cancellations and a kill every "
                        "--kill-every s; overload: 10x the planner's rate; cancel: connect-disconnect cycles")
    x.add_argument("--requests", type=int, default=200, help="kill, node: deterministic requests")
    x.add_argument("--kills", type=int, default=2, help="kill: replica kills, spread over the arrivals")
    x.add_argument("--rate", type=float, default=8.0, help="kill, node: requests per second")
    x.add_argument("--replicas", type=int, default=3, help="Denoiser replicas (node: on the node that goes)")
    x.add_argument("--tp", type=int, default=1, help="kill: their tensor-parallel degree")
    x.add_argument("--target", choices=["replica", "tp-worker"], default="replica",
                   help="kill: the replica's process, or its TP rank 1 (needs --tp 2 or more)")
    x.add_argument("--max-failed", type=int, default=0,
                   help="clean failures (an error status or event) allowed before the scenario fails (default 0)")
    x.add_argument("--streams", type=int, default=8, help="ingress, redeploy: long streams in flight")
    x.add_argument("--minutes", type=float, default=30.0, help="soak: how long")
    x.add_argument("--load", type=float, default=0.7, help="soak: offered rate / measured capacity")
    x.add_argument("--kill-every", type=float, default=300.0, help="soak: seconds between Denoiser kills")
    x.add_argument("--cancel-frac", type=float, default=0.1, help="soak: requests whose client hangs up early")
    x.add_argument("--max-rss-slope", type=float, default=1.0,
                   help="soak: MB/min a process observed 10 minutes after its warm-up may grow")
    x.add_argument("--factor", type=float, default=10.0, help="overload: offered / planner rate")
    x.add_argument("--seconds", type=float, default=20.0, help="overload: how long to offer it")
    x.add_argument("--workload", choices=["short", "prose"], default="prose",
                   help="overload: prose (200-token stories, ~20 rounds each: the model is the bottleneck, as "
                        "with a DLM on a GPU) or short (32-token answers, a few rounds: on a 2-core machine "
                        "the HTTP path is)")
    x.add_argument("--cycles", type=int, default=1000, help="cancel: connect-disconnect cycles")
    x.add_argument("--port", type=int, default=8790)
    x.add_argument("--json", action="store_true")
    x.set_defaults(func=cmd_faults)
