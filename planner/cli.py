"""``remask plan``: the Stage-1 configuration for a cluster and workload, and Stage 2 from all TP-1."""

from __future__ import annotations

import argparse
import json


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _steps_per_token(text: str | None) -> dict[float, float] | None:
    """--steps: None (the default, LLaDA-shaped), "diffusiongemma" (``costs.dg_steps_per_token``) or a JSON
    object of threshold -> steps per output token."""
    if text is None:
        return None
    if text == "diffusiongemma":
        from planner.costs import dg_steps_per_token

        return dg_steps_per_token()
    try:
        return {float(k): float(v) for k, v in json.loads(text).items()}
    except (ValueError, AttributeError, TypeError):
        raise ValueError(f"--steps: expected 'diffusiongemma' or a JSON object of threshold -> steps per output "
                         f"token, got {text!r}") from None


def cmd_plan(args) -> int:
    from planner.costs import StepModel
    from planner.report import default_classes, format_report, load_classes, plan_report
    from planner.stage1 import Stage1Config
    from planner.stage2 import Cluster

    gpn = args.gpus_per_node
    if args.nodes is not None:
        cluster = Cluster.uniform(args.nodes, gpn)
    else:
        gpus = args.gpus if args.gpus is not None else 16
        cluster = Cluster((gpn,) * (gpus // gpn) + ((gpus % gpn,) if gpus % gpn else ()))
    if cluster.gpus <= 0:
        raise ValueError("the cluster needs at least one GPU")
    classes = load_classes(args.workload) if args.workload else default_classes(
        args.rps if args.rps is not None else 2.0 * cluster.gpus)
    config = Stage1Config(utilisation=args.utilisation, slo_scale=args.slo_scale, solver=args.solver,
                          single_batch=args.single_batch)
    spt = _steps_per_token(args.steps)
    steps = StepModel(block_tokens=args.block, kv_cache=args.kv_cache,
                      **({"steps_per_token": spt} if spt is not None else {}))
    report = plan_report(cluster, classes, args.profile, args.degrees, config, steps, args.solver, args.reference)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("plan", help="two-stage ILP: instances per TP degree and thresholds for a workload")
    p.add_argument("--gpus", type=int, help="GPUs in the cluster (default 16), as nodes of --gpus-per-node")
    p.add_argument("--nodes", type=int, help="nodes of --gpus-per-node GPUs (overrides --gpus)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--rps", type=float, help="requests per second of the default ShareGPT-like mix (2 per GPU)")
    p.add_argument("--workload", help='JSON list of {"name", "rate", "input_tokens", "output_tokens"}')
    p.add_argument("--profile", default="h200-llada8b-measured")
    p.add_argument("--degrees", type=_ints, default=(1, 2, 4))
    p.add_argument("--utilisation", type=float, default=0.9, help="stability: load <= this x capacity")
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO = k x TP-1 isolated latency")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--kv-cache", default="approx", choices=["approx", "none", "exact"],
                   help="approx: a recompute step per block, then cached steps; none: all recompute; exact: all "
                        "cached steps of a block (block-causal models, DiffusionGemma's canvases)")
    p.add_argument("--steps", help="steps per output token by threshold: a JSON object, or 'diffusiongemma' (the "
                   "26B-A4B's modelled canvases by the router's level: planner.costs.dg_steps_per_token; use with "
                   "--block 256 --kv-cache exact and its profile); default: LLaDA-shaped (planner.costs)")
    p.add_argument("--single-batch", action="store_true", help="one batch size per TP degree (slower)")
    p.add_argument("--solver", default="auto", choices=["auto", "highs", "gurobi"])
    p.add_argument("--reference", action="store_true",
                   help="Stage 1 with its first formulation (cvxpy, per-threshold shares), for comparison")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
