"""The ``remask`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.argtypes import category_mix as _mix
from engine.argtypes import int_list
from engine.argtypes import thresholds as _thresholds


def cmd_train_default(args) -> int:
    from engine.loading import DEFAULT_MODELS, DEFAULTS_DIR
    from tools.training import average_checkpoints, train, train_default

    if args.average:
        if not args.out:
            raise ValueError("--average needs --out")
        print(f"saved the average of {len(args.average)} checkpoints to {average_checkpoints(args.average, args.out)}")
        return 0
    names = DEFAULT_MODELS if args.model == "all" else (args.model,)
    for name in names:
        out = args.out or str(DEFAULTS_DIR / name)
        if len(names) > 1 and args.out:
            out = f"{args.out}/{name}"
        if args.steps is None and args.init is None:  # the two-phase recipe of the shipped weights
            train_default(name, out, minutes=args.minutes, device=args.device, threads=args.threads, seed=args.seed,
                          batch_size=args.batch_size)
        else:
            train(name, out, steps=args.steps or 20000, minutes=args.minutes, batch_size=args.batch_size, lr=args.lr,
                  seed=args.seed, device=args.device, threads=args.threads, init=args.init, mix=args.mix,
                  lookup_canvas=args.lookup_canvas)
        print(f"saved {name} to {out}")
    return 0


def cmd_eval(args) -> int:
    from engine.loading import load_engine
    from tools.evaluate import evaluate

    engine = load_engine(args.model, device=args.device, cache=args.cache, max_slots=args.slots)
    results = evaluate(engine, args.thresholds, n=args.n, seed=args.seed, progress=not args.quiet)
    if args.json:
        print(json.dumps({"model": args.model, "results": results}))
    else:
        for r in results:
            cats = "  ".join(f"{c}={v['accuracy']:.2f}/{v['mean_rounds']:.1f}" for c, v in r["by_category"].items())
            print(f"threshold {r['threshold']:.2f}: accuracy {r['accuracy']:.3f}  mean rounds {r['mean_rounds']:.2f}"
                  f"  (p10 {r['rounds_p10']:.0f}, max {r['rounds_max']})  [{cats}]")
    return 0


def _show(engine, seq, report) -> None:
    tok = engine.tokenizer
    text = tok.decode(seq.canvas()[: seq.max_tokens], skip_special=False).replace("<eos>", "·")
    print(f"step {len(seq.history):3d} {report.kind.value:9s} +{report.committed:<2d} |{text}|")


def cmd_generate(args) -> int:
    from engine.loading import load_engine
    from engine.sequence import SamplingParams

    engine = load_engine(args.model, device=args.device, cache=args.cache)
    tok, block = engine.tokenizer, engine.cfg.block_size
    defaults = getattr(tok, "generation_defaults", {})
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    sampling = {k: v if v is not None else defaults.get(k) for k, v in sampling.items()}
    params = SamplingParams(max_tokens=args.max_tokens, threshold=args.threshold, seed=args.seed,
                            **{k: v for k, v in sampling.items() if v is not None})

    def prompt_ids(text: str) -> list[int]:
        if args.raw:
            return tok.completion_ids(text, block)
        system = [{"role": "system", "content": args.system}] if args.system else []
        return tok.chat_ids([*system, {"role": "user", "content": text}], block)
    prompts = [args.prompt] if args.prompt is not None else None
    interactive = prompts is None
    while True:
        if interactive:
            try:
                line = input("prompt> ").strip()
            except EOFError:
                return 0
            if not line:
                continue
            prompts = [line]
        for prompt in prompts:
            seq = engine.add_request(prompt_ids(prompt), params)
            while not seq.finished:
                result = engine.step([seq])
                if args.show_steps:
                    _show(engine, seq, result.reports[0])
            out = engine.output(seq)
            engine.sequences.pop(seq.seq_id, None)
            print(out.text)
            if args.show_steps or interactive:
                print(f"[{out.finish_reason}; {out.rounds} rounds, {out.prefill_steps} prefill steps]")
        if not interactive:
            return 0


def _simulate_cluster(args) -> int:
    import torch

    from sim.cluster_run import run_cluster_scenario

    torch.set_num_threads(1)  # the tiny model's decodes: a second thread only spins on a shared machine
    trace = args.scenario == "dilaserve-trace"
    if args.plot and not trace and args.estimator != "online":
        raise ValueError("--plot draws the reconfiguration timeline of dilaserve-trace, or the learning curve of "
                         f"--estimator online; not of {args.scenario} with --estimator {args.estimator}")
    if trace and (args.estimator != "table" or args.shed != "auto"):
        raise ValueError("dilaserve-trace runs with the table estimator and its own admission; drop --estimator/--shed")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    online = {}
    if not trace:
        early = tuple(int(x) for x in args.refit_early.split(",") if x.strip()) if args.refit_early else ()
        online = {"estimator": args.estimator, "shed": {"auto": None, "on": True, "off": False}[args.shed],
                  "refit_every": args.refit_every, "refit_early": early,
                  "min_requests": min(early) if early else args.refit_every * 2}
    report = run_cluster_scenario(args.scenario, policies, args.requests or 2000, args.seed, args.rate,
                                  progress=not args.quiet, **online)
    if args.plot and trace:
        from sim.cluster_trace import plot_trace

        plot_trace(report, args.plot)
    elif args.plot:
        from sim.report.plots import learning_curve

        learning_curve(report, args.plot)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"scenario {report['scenario']}: {report['requests']} requests at {report['arrival_rate_rps']} req/s, "
          f"seed {report['seed']}, candidate thresholds {report['candidate_thresholds']}")
    for name, r in report["policies"].items():
        print(f"  {name:24s} SLO attainment {r['slo_attainment']:.3f}  accuracy {r['accuracy']:.4f}  "
              f"mean {r['mean_latency_s']:7.2f}s  p99 {r['p99_latency_s']:7.2f}s  "
              f"mean threshold {r['mean_threshold']:.3f}  migrations {r['migrations']}  shed {r['shed']}")
    return 0


def cmd_simulate(args) -> int:
    from sim.cluster_scenarios import CLUSTER_SCENARIOS
    from sim.scenarios import run_scenario, speedups

    if args.scenario in CLUSTER_SCENARIOS:
        return _simulate_cluster(args)
    policies = [p.strip() for p in (args.policies or "fcfs-prefill-first,dwise,oracle").split(",") if p.strip()]
    from engine.sched_policies import make_policy

    for p in policies:
        make_policy(p)  # fail fast on unknown names
    default_n = 512 if args.scenario.startswith("tiny-") else 4096  # model in the loop decodes every request
    report = run_scenario(args.scenario, policies, args.requests or default_n, args.seed, progress=not args.quiet)
    report["speedup_vs_" + policies[0]] = speedups(report, policies[0])
    if args.json:
        print(json.dumps(report))
    else:
        print(f"scenario {report['scenario']}: {report['requests']} requests, seed {report['seed']}")
        for name, r in report["policies"].items():
            print(f"  {name:20s} mean {r['mean_latency_s']:9.2f}s  p50 {r['p50_latency_s']:9.2f}s  "
                  f"p99 {r['p99_latency_s']:9.2f}s  ttft {r['mean_ttft_s']:8.2f}s  rounds {r['rounds']:7d}  "
                  f"prefill-only {r['prefill_only_round_frac']:.3f}  slots/round {r['filled_slots_per_round']:6.1f}"
                  + (f"  accuracy {r['accuracy']:.3f}" if "accuracy" in r else ""))
    return 0


def cmd_bench(args) -> int:
    from tools.bench_scheduler import bench_scheduler

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


def cmd_profile(args) -> int:
    from engine.device import parse_dtype
    from engine.latency_profile import load_profile
    from engine.loading import load_engine
    from engine.profiling import check_profile, profile_engine

    dtype = parse_dtype(args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    if args.check is None and args.out is None:
        raise ValueError("give --out FILE to write a profile, or --check PROFILE to test one against a real run")
    check = load_profile(args.check) if args.check else None
    if args.tp > 1:
        if check is not None:
            raise ValueError("--check runs one process; check a TP profile's curves with --tp 1")
        from engine.profiling import profile_tp

        prof = profile_tp(args.model, args.tp, args.out, device=args.device, dtype=dtype, name=args.name,
                          batch_sizes=tuple(args.batch_sizes), rounds=args.rounds, progress=True,
                          prompt_lens=tuple(args.prompt_lens or [None]), max_tokens=args.max_tokens)
        print(f"wrote {args.out}: TP-{args.tp}, " + ", ".join(f"{k} {len(v)} points" for k, v in prof.curves.items()))
        return 0
    slots = args.slots if check else max(args.batch_sizes)
    engine = load_engine(args.model, device=args.device, dtype=dtype, max_slots=slots)
    if check is not None:
        res = check_profile(engine, check, requests=args.requests, slots=slots, seed=args.seed, progress=not args.json)
        print(json.dumps(res) if args.json else
              f"{res['rounds']} rounds of a real run ({res['requests']} requests, {res['model']} on {res['device']}): "
              f"measured {res['measured_s']} s, profile {res['profile']} predicts {res['predicted_s']} s "
              f"(error {res['total_error']:.1%}); per round: median error {res['median_round_error']:.1%}, "
              f"p90 {res['p90_round_error']:.1%}" + ("" if "steady" not in res else
              f"; without the {res['warming_rounds']} rounds that met a shape first or captured its CUDA "
              f"graph: error "
              f"{res['steady']['total_error']:.1%}, per round median {res['steady']['median_round_error']:.1%}"))
        return 0
    prof = profile_engine(engine, args.name or args.model.split(":")[0], args.batch_sizes, args.rounds, progress=True,
                          prompt_lens=tuple(args.prompt_lens or [None]), max_tokens=args.max_tokens)
    prof.save(args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {len(v)} points" for k, v in prof.curves.items())
          + f"; reference context {prof.ref_context:g} tokens, attention {prof.attn_ms_per_pair:.3g} ms per pair")
    for line in prof.meta.get("skipped", []):
        print(f"skipped {line}", file=sys.stderr)
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remask", description="Serve diffusion language models with SLOs.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train-default", help="train the embedded default models on the task suite")
    t.add_argument("--model", default="all", choices=["all", "tiny-bd", "tiny-mdm"])
    t.add_argument("--out", help="output directory (default: the shipped location)")
    t.add_argument("--steps", type=int, help="one phase of this many steps (default: the two-phase recipe)")
    t.add_argument("--minutes", type=float, help="wall-clock cap per phase; the schedule follows whichever ends first")
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int)
    t.add_argument("--init", help="start from this checkpoint directory instead of random weights")
    t.add_argument("--mix", type=_mix,
                   help="category weights, e.g. lookup=0.4,prose=0.2,arith=0.2; 'recall' is the training-only "
                        "associative-recall task (repeated needles with masked digits)")
    t.add_argument("--lookup-canvas", type=int,
                   help="cap tiny-mdm's canvas at this many tokens for lookup and recall examples (faster steps)")
    t.add_argument("--average", nargs="+", metavar="DIR",
                   help="write the weight average of these checkpoints to --out instead of training")
    t.set_defaults(func=cmd_train_default)

    e = sub.add_parser("eval", help="accuracy and rounds on the held-out task suite")
    e.add_argument("--model", default="tiny-bd")
    e.add_argument("--thresholds", type=_thresholds, default=[0.5, 0.7, 0.9])
    e.add_argument("--n", type=int, default=300)
    e.add_argument("--seed", type=int, default=2026)
    e.add_argument("--json", action="store_true")
    e.add_argument("--cache", default="dual", choices=["none", "prefix", "dual"])
    e.add_argument("--slots", type=int, default=64)
    e.add_argument("--device", default="cpu")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="generate an answer (interactive without --prompt)")
    g.add_argument("--model", default="tiny-bd")
    g.add_argument("--prompt")
    g.add_argument("--threshold", type=float)
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--system", help="a system message before the prompt (chat format)")
    g.add_argument("--raw", action="store_true", help="the prompt as raw text, without the chat template")
    g.add_argument("--temperature", type=float, help="0: greedy (default: the checkpoint's generation_config.json)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int, help="the same seed gives the same text")
    g.add_argument("--show-steps", action="store_true", help="print the canvas after each step")
    g.add_argument("--cache", default="dual", choices=["none", "prefix", "dual"])
    g.add_argument("--device", default="cpu")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("simulate", help="virtual-time simulation of one instance (or a cluster: dilaserve-*) "
                       "under several policies")
    s.add_argument("--scenario", default="dwise-burst-poisson")
    s.add_argument("--policies", help="comma-separated (default: fcfs-prefill-first,dwise,oracle; a cluster "
                   "scenario's own list for dilaserve-*)")
    s.add_argument("--requests", type=int, help="default 4096 (model in the loop: 512; cluster scenarios: 2000)")
    s.add_argument("--rate", type=float, help="cluster scenarios: arrival rate, requests per second")
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
                        "(auto: off for now, see sim.cluster_run.SHED_DEFAULT); refused requests count as "
                        "SLO misses")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_simulate)
    from planner.cli import add_parsers as planner_parsers

    planner_parsers(sub)  # remask plan

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
    b.add_argument("--out", help="round: also write the JSON result here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)
    from loadgen.cli import add_parsers as loadgen_parsers

    loadgen_parsers(sub)  # remask loadgen {synth,replay,plot,overhead}, remask chat

    f = sub.add_parser("profile", help="measure a latency profile (round time by step kind and batch)")
    f.add_argument("--model", default="tiny-bd", help="an embedded model, a local directory or a shape preset "
                                                      "(llada-8b-shape, dream-7b-shape, sdar-8b-shape[:overrides])")
    f.add_argument("--out", help="write the profile here (JSON)")
    f.add_argument("--check", metavar="PROFILE", help="instead: time a real run of mixed requests round by round "
                                                      "and compare with this profile's predictions")
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
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_profile)

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

    from predictors.cli import add_parsers as predictor_parsers

    predictor_parsers(sub)
    from sim.report.cli import add_parsers as report_parsers

    report_parsers(sub)  # remask report
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
