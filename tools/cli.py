"""The ``remask`` command line: its root. Each package registers its own subcommands with ``add_parsers(sub)``
(adding its parsers and setting each one's handler as ``func``); ``COMMAND_MODULES`` lists those packages' modules
in the order ``remask --help`` shows their commands. Handlers import their heavy modules when they run, so
building the parser stays cheap."""

from __future__ import annotations

import argparse
import sys

from loadgen import cli as loadgen_cli
from planner import cli as planner_cli
from predictors import cli as predictors_cli
from sim import cli as sim_cli
from sim.report import cli as report_cli
from tools import bench_cli, export_cli, faults, generate, model_cli, profile_cli, serve_cli

COMMAND_MODULES = (
    model_cli,  # remask train-default, eval
    generate,  # remask generate
    export_cli,  # remask export
    serve_cli,  # remask serve
    sim_cli,  # remask simulate
    planner_cli,  # remask plan
    bench_cli,  # remask bench
    loadgen_cli,  # remask loadgen {synth,replay,plot,overhead}, remask chat
    profile_cli,  # remask profile
    faults,  # remask faults
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
