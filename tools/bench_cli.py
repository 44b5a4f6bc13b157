"""``remask bench``: the benchmarks that print measured numbers (scheduler, control path, router, engine,
one round); each lives in its own ``tools/bench_*.py``."""

from __future__ import annotations

import json
from pathlib import Path


def cmd_bench(args) -> int:
    from tools.bench_scheduler import bench_scheduler

    if args.what == "round" and args.recompute:
        from tools.bench_round import bench_recompute, format_recompute

        sizes = tuple(int(n) for n in args.recompute.split(","))
        res = bench_recompute(args.model or "llada-8b-shape", device=args.device, dtype=args.dtype, sizes=sizes,
                              canvas=args.canvas, repeats=args.repeats)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        print(json.dumps(res) if args.json else format_recompute(res))
        return 0
    if args.what == "round":
        from tools.bench_round import bench_round, format_round

        res = bench_round(args.model or "llada-8b-shape", device=args.device, dtype=args.dtype,
                          slots=128 if args.slots is None else args.slots, tokens=args.tokens,
                          context=args.context, repeats=args.repeats, gaps=args.gaps)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        print(json.dumps(res) if args.json else format_round(res))
        return 0
    if args.what == "engine":
        from tools.bench_engine import bench_engine, format_report

        requests = 16 if args.requests is None else args.requests
        res = bench_engine(args.model or "tiny-mdm", device=args.device, dtype=args.dtype or "float32",
                           requests=requests,
                           prompt_len=args.prompt_len, gen_length=args.gen_length, threshold=args.threshold,
                           steps_per_block=args.steps_per_block, cache=args.cache, seed=args.seed,
                           progress=not args.quiet)
        print(json.dumps(res) if args.json else format_report(res))
        return 0
    if args.what == "control":
        from tools.bench_control import bench_control

        res = bench_control(args.url, 40 if args.requests is None else args.requests, args.concurrency,
                            api_key=args.api_key)
        print(json.dumps(res) if args.json else
              f"control path: median {res['median_ms']} ms per round event (p99 {res['p99_ms']} ms) over "
              f"{res['events']} events; request dispatch to round boundary median {res['add_median_ms']} ms")
        return 0
    if args.what == "router":
        from tools.bench_router import bench_router

        res = bench_router(args.instances, args.active, args.events, args.slots or 32, args.router_policy,
                           seed=args.seed)
        print(json.dumps(res) if args.json else
              f"router ({res['policy']}, {res['instances']} instances, {res['requests']} active requests): median "
              f"{res['median_ms_per_event']} ms per step event (p99 {res['p99_ms_per_event']}, mean "
              f"{res['mean_ms_per_event']}) over {res['events']} events")
        return 0
    if args.what != "scheduler":
        raise ValueError(f"unknown benchmark {args.what!r}; known: scheduler, control, router, engine, round")
    result = bench_scheduler(args.slots or 128, args.resident, args.rounds, args.policy, args.seed)
    print(json.dumps(result) if args.json else
          f"{args.policy}: median {result['median_ms_per_round']:.3f} ms per round "
          f"(p99 {result['p99_ms_per_round']:.3f} ms) over {result['rounds']} rounds")
    return 0

def add_parsers(sub) -> None:
    """Add ``bench`` to the ``remask`` sub-parsers."""
    b = sub.add_parser("bench", help="benchmarks that print measured numbers")
    b.add_argument("what", choices=["scheduler", "control", "router", "engine", "round"])
    b.add_argument("--url", default="http://127.0.0.1:8000", help="control: the running app")
    b.add_argument("--requests", type=int,
                   help="control: streamed completions (default 40); engine: requests per contender (default 16)")
    b.add_argument("--concurrency", type=int, default=4, help="control: requests at a time")
    b.add_argument("--api-key", help="control: sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    b.add_argument("--slots", type=int, help="scheduler, round: default 128; router: slots per instance, default 32")
    b.add_argument("--instances", type=int, default=16, help="router: TP-1 instances")
    b.add_argument("--active", type=int, default=1000, help="router: active requests")
    b.add_argument("--events", type=int, default=5000, help="router: step events measured")
    b.add_argument("--router-policy", default="remask", help="router: policy")
    b.add_argument("--resident", type=int, default=1024)
    b.add_argument("--rounds", type=int, default=500)
    b.add_argument("--policy", default="dwise")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--model",
                   help="engine: a bidirectional model (default tiny-mdm; llada-8b-shape, dream-7b-shape[:overrides], "
                        "a local directory); round: a shape preset (default llada-8b-shape)")
    b.add_argument("--device", default="cpu", help="engine, round: cpu, cuda, cuda:1 ...")
    b.add_argument("--dtype", help="engine, round: float32, bfloat16 or float16 (default: engine float32; round "
                                   "bfloat16 on CUDA, float32 on a CPU)")
    b.add_argument("--prompt-len", type=int, default=64,
                   help="engine: prompt tokens of a preset (random ids); task models use held-out task prompts")
    b.add_argument("--gen-length", type=int, help="engine: max output tokens (default: the model's)")
    b.add_argument("--threshold", type=float, default=0.9,
                   help="engine: confidence threshold of the engine and the Fast-dLLM loop")
    b.add_argument("--steps-per-block", type=int,
                   help="engine: the LLaDA loop's steps per block (default: the block size, one token a step)")
    b.add_argument("--cache", default="dual", choices=["none", "prefix", "dual"], help="engine: the engine's cache")
    b.add_argument("--quiet", action="store_true", help="engine: no progress bar")
    b.add_argument("--tokens", type=int, default=32, help="round: query tokens per slot (a block)")
    b.add_argument("--context", type=int, default=300, help="round: cached tokens per slot")
    b.add_argument("--gaps", type=int, default=0, help="round: KV pool slots among the round's held by requests "
                                                       "not in it (filler rows, or contexts copied)")
    b.add_argument("--repeats", type=int, default=10, help="round: timed rounds per variant (median)")
    b.add_argument("--recompute", metavar="SIZES",
                   help="round: instead, a recompute round of N tokens against a cached round of N tokens at each "
                        "of these N (comma-separated, multiples of --canvas), with ops, copies and memory")
    b.add_argument("--canvas", type=int, default=128,
                   help="round --recompute: tokens of each recompute request (its cached rounds' keys too)")
    b.add_argument("--out", help="round: also write the JSON result here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)
