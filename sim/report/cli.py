"""``remask report``: every simulator scenario with fixed seeds -> REPORT.md, PNG plots, results.json."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def add_parsers(sub) -> None:
    p = sub.add_parser("report", help="run every simulator scenario (fixed seeds) and write REPORT.md with plots")
    p.add_argument("--out", default="reports", help="output directory (default: reports/)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="fewer requests and sweep points (under 10 min on 2 cores)")
    size.add_argument("--tiny", action="store_true",
                      help="a smoke test of the machinery (seconds; numbers meaningless)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="comma-separated sections (default: all; names in sim/report/experiments.py)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--profile", help="the cluster sections' latency profile: a name in profiles/ or a JSON file's "
                   "path (default: the scenarios', h200-llada8b-measured); loads follow its capacity")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from sim.report.experiments import SECTIONS, run_all
    from sim.report.render import all_checks, report_profiles, write_report
    from sim.report.sizes import PLANS
    from sim.report.stamp import report_stamp

    plan = PLANS["tiny" if args.tiny else "quick" if args.quick else "full"]
    only = None
    if args.only:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = only - set(SECTIONS)
        if unknown:
            print(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}", file=sys.stderr)
            return 2
    t0, c0 = time.perf_counter(), time.process_time()
    stamp = report_stamp(report_profiles(plan, args.profile), Path(args.out))  # before the run writes anything
    runner = run_all(plan, args.seed, progress=not args.quiet, only=only, profile=args.profile)
    cmd = "remask report" + (" --quick" if args.quick else " --tiny" if args.tiny else "") + f" --out {args.out}"
    if args.seed:
        cmd += f" --seed {args.seed}"
    if only:
        cmd += f" --only {','.join(sorted(only))}"
    if args.profile:
        cmd += f" --profile {args.profile}"
    path = write_report(runner, Path(args.out), cmd, time.perf_counter() - t0, time.process_time() - c0, stamp)
    checks = all_checks(runner)
    failed = [c for c in checks if not c.passed]
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s); fidelity checks: {len(checks) - len(failed)} of "
          f"{len(checks)} PASS" + (f"; FAIL: {', '.join(c.name for c in failed)}" if failed else ""))
    # the planner trace is another component's scenario: its failure is reported, not fatal
    own = {k: v for k, v in runner.errors.items() if k != "cluster_trace"}
    for name, err in runner.errors.items():
        print(f"section {name} failed: {err}", file=sys.stderr)
    return 1 if own else 0
