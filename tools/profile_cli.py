"""``remask profile``: measure a latency profile (round time by step kind and batch), or check one against a
real run."""

from __future__ import annotations

import json
import sys

from engine.argtypes import int_list


def cmd_profile(args) -> int:
    from engine.device import parse_dtype
    from engine.latency_profile import load_profile
    from engine.loading import load_engine
    from engine.models.hub import is_hub_id
    from engine.profiling import check_profile, profile_engine
    from tools.generate import _local

    if args.fit:
        res = load_profile(args.fit).fit_report()
        print(json.dumps(res) if args.json else format_fit(res))
        return 0
    dtype = parse_dtype(args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    if args.check is None and args.out is None:
        raise ValueError("give --out FILE to write a profile, --check PROFILE to test one against a real run, "
                         "or --fit PROFILE to print its model's fit")
    check = load_profile(args.check) if args.check else None
    hub = is_hub_id(args.model)  # named as its hub cache spells it: org--name
    name = args.name or (args.model.replace("/", "--") if hub else args.model.split(":")[0])
    args.model = _local(args.model, args.revision)
    if args.tp > 1:
        if check is not None:
            raise ValueError("--check runs one process; check a TP profile's curves with --tp 1")
        from engine.profiling import profile_tp

        prof = profile_tp(args.model, args.tp, args.out, device=args.device, dtype=dtype,
                          name=args.name or f"{name}-tp{args.tp}",
                          batch_sizes=tuple(args.batch_sizes), rounds=args.rounds, progress=True,
                          prompt_lens=tuple(args.prompt_lens or [None]), max_tokens=args.max_tokens)
        print(f"wrote {args.out}: TP-{args.tp}, " + ", ".join(f"{k} {len(v)} points" for k, v in prof.curves.items()))
        return 0
    slots = args.slots if check else max(args.batch_sizes)
    engine = load_engine(args.model, device=args.device, dtype=dtype, max_slots=slots)
    if check is not None:
        res = check_profile(engine, check, requests=args.requests, slots=slots, seed=args.seed,
                            progress=not args.json, warmup=False if args.no_warmup else None)
        print(json.dumps(res) if args.json else format_check(res))
        return 0
    prof = profile_engine(engine, name, args.batch_sizes, args.rounds, progress=True,
                          prompt_lens=tuple(args.prompt_lens or [None]), max_tokens=args.max_tokens)
    prof.save(args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {len(v)} points" for k, v in prof.curves.items())
          + f"; reference context {prof.ref_context:g} tokens, attention {prof.attn_ms_per_pair:.3g} ms per pair")
    for line in prof.meta.get("skipped", []):
        print(f"skipped {line}", file=sys.stderr)
    return 0

def format_fit(res: dict) -> str:
    """The fit per measured point, the coefficients with their units and each kind's measured range."""
    lines = [f"profile {res['profile']}: {res['mode']} model, largest error {res['max_error']:.1%} over "
             f"{len(res['points'])} measured rounds" + (" (points derived from its curves and meta)"
                                                        if res["points_derived"] else "")]
    if res.get("modelled"):
        lines.append("MODELLED: no device measured this profile; its 'measured' points are a model's "
                     "(meta.method, meta.command), until a GPU run replaces it")
    lines.append(f"{'kind':<10} {'steps':>6} {'query':>6} {'context':>8} {'tokens':>7} {'measured ms':>12} "
                 f"{'model ms':>9} {'error':>7}")
    for p in res["points"]:
        lines.append(f"{p['kind']:<10} {p['steps']:>6g} {p['query']:>6g} {p['context']:>8g} {p['tokens']:>7g} "
                     f"{p['ms']:>12.3f} {p['model_ms']:>9.3f} {p['error']:>+7.1%}")
    lines.append("coefficients:")
    for name, c in res["coefficients"].items():
        lines.append(f"  {name:<20} {c['value']:>12.6g} {c['unit']:<30} {c['what']}")
    lines.append("measured (tokens per forward; elsewhere modelled): "
                 + "; ".join(f"{k} {lo:g}-{hi:g}" for k, (lo, hi) in res["measured"].items()))
    return "\n".join(lines)


def format_check(res: dict) -> str:
    """The check's figures: the whole timed run, then the warm-up pass's (kept out of it by design)."""
    line = (f"{res['rounds']} rounds of a real run ({res['requests']} requests, {res['model']} on {res['device']}): "
            f"measured {res['measured_s']} s, profile {res['profile']} predicts {res['predicted_s']} s "
            f"(error {res['total_error']:.1%} over the whole run); per round: median error "
            f"{res['median_round_error']:.1%}, p90 {res['p90_round_error']:.1%}; "
            f"{res['warming_rounds']} of its rounds met a shape first or captured its CUDA graph")
    if "steady" in res and res["warming_rounds"]:
        line += f" (without them: error {res['steady']['total_error']:.1%})"
    if w := res.get("warmup"):
        line += (f"\nwarm-up (the same run once before, untimed in the figures above): {w['rounds']} rounds, "
                 f"measured {w['measured_s']} s against {w['predicted_s']} s predicted (error {w['total_error']:.1%}), "
                 f"{w['warming_rounds']} rounds met a shape first or captured its CUDA graph")
    else:
        line += "\nno warm-up pass (--no-warmup, or a CPU without graphs: no one-off costs to keep out)"
    return line


def add_parsers(sub) -> None:
    """Add ``profile`` to the ``remask`` sub-parsers."""
    f = sub.add_parser("profile", help="measure a latency profile (round time by step kind and batch)")
    f.add_argument("--model", default="tiny-bd", help="an embedded model, a local directory, a hub id (org/name) "
                                                      "or a shape preset (llada-8b-shape, dream-7b-shape, "
                                                      "sdar-8b-shape, llada2-mini-shape, "
                                                      "diffusiongemma-26b-a4b-shape[:overrides])")
    f.add_argument("--revision", help="a hub id's branch, tag or commit (default: main)")
    f.add_argument("--out", help="write the profile here (JSON)")
    f.add_argument("--check", metavar="PROFILE", help="instead: time a real run of mixed requests round by round "
                                                      "and compare with this profile's predictions")
    f.add_argument("--fit", metavar="PROFILE", help="instead: print the profile's round-time model against each of "
                                                    "its measured rounds (measured ms, model ms, error) and its "
                                                    "coefficients")
    f.add_argument("--name")
    f.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32, 64])
    f.add_argument("--prompt-lens", type=int_list, help="prompt tokens, e.g. 64,512: the first sets the curves' "
                                                        "context, the others fit the attention term")
    f.add_argument("--max-tokens", type=int, help="answer tokens of each profiled request (default: the model's)")
    f.add_argument("--rounds", type=int, default=6)
    f.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: one process per rank (GPU r on CUDA, "
                                                    "gloo on a CPU); name the output NAME-tpN.json for the planner")
    f.add_argument("--device", default="cpu")
    f.add_argument("--dtype", help="float32 (default on CPU), bfloat16 (default on CUDA) or float16")
    f.add_argument("--requests", type=int, default=48, help="--check: requests in the recorded run")
    f.add_argument("--slots", type=int, default=16, help="--check: batch slots")
    f.add_argument("--no-warmup", action="store_true",
                   help="--check: time the run without running it once first (one-off costs included)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_profile)
