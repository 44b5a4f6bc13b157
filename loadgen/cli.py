"""``remask loadgen {synth,replay,bench,plot,overhead}`` and ``remask chat``."""

from __future__ import annotations

import argparse
import json
import sys

from engine.argtypes import category_mix as _mix
from loadgen.arrivals import ARRIVALS
from loadgen.bench import add_parser as _bench_parser
from loadgen.lengths import LENGTHS


def cmd_synth(args) -> int:
    from loadgen.arrivals import ArrivalParams
    from loadgen.trace import SynthConfig, read_prompts, synth, write_trace

    params = ArrivalParams(rate=args.rate, burstiness=args.burstiness, period_s=args.period_s,
                           amplitude=args.amplitude, bursts_per_period=args.bursts_per_period, burst_s=args.burst_s,
                           burst_factor=args.burst_factor, burst_frac=args.burst_frac)
    if args.prompts_file and args.prompts == "eval":
        raise ValueError("--prompts eval and --prompts-file exclude each other")
    n = args.n if args.n is not None else len(read_prompts(args.prompts_file)) if args.prompts_file else 200
    cfg = SynthConfig(n=n, arrivals=args.arrivals, arrival_params=params, seed=args.seed, mix=args.mix,
                      endpoint=args.endpoint, lengths=args.lengths, max_tokens_cap=args.max_tokens_cap,
                      threshold=args.threshold, slo_ms=args.slo_ms, slo_ms_per_token=args.slo_ms_per_token,
                      priorities=tuple(args.priorities), prompts=args.prompts, eval_seed=args.eval_seed,
                      prompts_file=args.prompts_file)
    trace = synth(cfg)
    write_trace(trace, args.out)
    span = trace[-1].arrival_s if trace else 0.0
    print(f"wrote {len(trace)} requests to {args.out}: {args.arrivals} arrivals over {span:.1f} s "
          f"({(len(trace) - 1) / span if span else float('inf'):.2f} req/s)")
    return 0


def cmd_replay(args) -> int:
    from loadgen.client import resolve_api_key, unauthorized_hint
    from loadgen.metrics import format_summary, parse_goodput, parse_percentiles
    from loadgen.replay import ReplayConfig, replay, write_results
    from loadgen.trace import read_trace

    trace = read_trace(args.trace)
    if args.limit:
        trace = trace[: args.limit]
    key = resolve_api_key(args.api_key)
    cfg = ReplayConfig(url=args.url, model=args.model, timeout_s=args.timeout, progress=not args.quiet,
                       time_scale=args.time_scale, transport=args.transport, spin_s=args.spin_ms / 1000.0,
                       api_key=key, max_concurrency=args.max_concurrency,
                       percentiles=parse_percentiles(args.percentiles), goodput=parse_goodput(args.goodput))
    doc = replay(trace, cfg)
    if "401" in doc["summary"]["errors_by_kind"]:
        print(f"remask loadgen replay: {doc['summary']['errors_by_kind']['401']} requests got HTTP 401 "
              f"Unauthorized: {unauthorized_hint(key)}", file=sys.stderr)
    doc["config"]["trace"] = args.trace
    write_results(doc, args.out)
    if args.json:
        print(json.dumps(doc["summary"]))
    else:
        print(format_summary(doc["summary"]))
        print(f"wrote {args.out}" + (" (interrupted: partial results)" if doc["interrupted"] else ""))
    return 130 if doc["interrupted"] else 0


def cmd_plot(args) -> int:
    from loadgen.plot import plot_results

    for path in plot_results(args.results, args.out):
        print(f"wrote {path}")
    return 0


def cmd_overhead(args) -> int:
    from loadgen.overhead import measure_overhead

    reports = [measure_overhead(args.n, args.rate, args.seed, progress=False, transport=t) for t in args.transport]
    if args.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0]))
        return 0
    for r in reports:
        e, lag = r["ttft_error_ms"], r["send_lag_ms"]
        print(f"{r['transport']:6s} {r['measured']} requests at {r['rate']:g} req/s: TTFT error mean {e['mean']:.3f} "
              f"median {e['median']:.3f} p99 {e['p99']:.3f} ms (server's own share subtracted); send lag mean "
              f"{lag['mean']:.3f} p99 {lag['p99']:.3f} ms; median <= {r['limit_ms']:g} ms: {r['median_within_limit']}")
    return 0


def cmd_chat(args) -> int:
    from loadgen.chat import chat
    from loadgen.client import resolve_api_key

    extra = {k: v for k, v in (("threshold", args.threshold), ("max_tokens", args.max_tokens),
                                ("slo_ms", args.slo_ms)) if v is not None}
    return chat(args.url, args.model, show_steps=args.show_steps, history=not args.single_turn, system=args.system,
                extra=extra, api_key=resolve_api_key(args.api_key))


API_KEY_HELP = "sent as 'Authorization: Bearer KEY' with every request (default: $OPENAI_API_KEY)"


def _synth_parser(sub) -> None:
    s = sub.add_parser("synth", help="synthesize a trace (JSONL) of task-suite requests with fixed seeds")
    s.add_argument("--n", type=int, help="requests (default 200; with --prompts-file, one per line of the file)")
    s.add_argument("--rate", type=float, default=1.0, help="mean arrival rate (req/s)")
    s.add_argument("--arrivals", default="poisson", choices=ARRIVALS)
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape = 1/CV^2 of the gaps (1: Poisson)")
    s.add_argument("--period-s", type=float, default=600.0, help="diurnal: length of one 'day'")
    s.add_argument("--amplitude", type=float, default=0.5, help="diurnal: relative swing of the rate")
    s.add_argument("--bursts-per-period", type=float, default=4.0)
    s.add_argument("--burst-s", type=float, default=10.0)
    s.add_argument("--burst-factor", type=float, default=4.0)
    s.add_argument("--burst-frac", type=float, default=0.5, help="burst-poisson: share of requests at t=0")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--mix", type=_mix, help="category weights, e.g. lookup=0.4,prose=0.2 (default: uniform)")
    s.add_argument("--prompts", default="sample", choices=["sample", "eval"],
                   help="eval: the held-out set `remask eval --n N` scores, in order (ignores --mix)")
    s.add_argument("--eval-seed", type=int, default=2026, help="with --prompts eval: remask eval's --seed")
    s.add_argument("--prompts-file", metavar="FILE.jsonl",
                   help="own prompts instead of the task suite: one JSON object a line, {\"prompt\": ...} or "
                        "{\"messages\": [...]}, optional \"max_tokens\"; used in order, wrapping around")
    s.add_argument("--endpoint", default="completion", choices=["completion", "chat", "mixed"])
    s.add_argument("--lengths", choices=sorted(LENGTHS),
                   help="nominal length distribution; its output length raises max_tokens above the task's need")
    s.add_argument("--max-tokens-cap", type=int, default=256)
    s.add_argument("--threshold", type=float, help="per-request confidence threshold (default: the server's)")
    s.add_argument("--slo-ms", type=float, help="per-request SLO: this many ms ...")
    s.add_argument("--slo-ms-per-token", type=float, default=0.0, help="... plus this many per max_tokens")
    s.add_argument("--priorities", type=lambda t: [int(x) for x in t.split(",")], default=[0],
                   help="priorities drawn uniformly, e.g. 0,1")
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_synth)


def add_parsers(sub) -> None:
    """Add ``loadgen`` and ``chat`` to the ``remask`` sub-parsers."""
    lg = sub.add_parser("loadgen", help="traces, open-loop replay, vLLM-style benchmark, plots, overhead")
    lsub = lg.add_subparsers(dest="loadgen_command", required=True)
    _synth_parser(lsub)

    r = lsub.add_parser("replay", help="open-loop replay of a trace against a server; results JSON")
    r.add_argument("--url", default="http://127.0.0.1:8000")
    r.add_argument("--trace", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--model", help="model name sent with each request (default: the server's)")
    r.add_argument("--transport", default="raw", choices=["raw", "httpx"])
    r.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    r.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival offsets (0.5: twice the rate)")
    r.add_argument("--spin-ms", type=float, default=0.0, help="yield-spin before each send for sub-ms timing")
    r.add_argument("--limit", type=int, help="only the first N requests")
    r.add_argument("--api-key", help=API_KEY_HELP)
    r.add_argument("--max-concurrency", type=int, metavar="N",
                   help="at most N requests in flight; later arrivals wait for a slot (the wait is reported apart "
                        "from TTFT/E2EL, as in vLLM's benchmark_serving)")
    r.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                   help="goodput bounds, any of ttft:MS tpot:MS e2el:MS: a request is good when it meets every one "
                        "(and its own SLO, if the trace gives one)")
    r.add_argument("--percentiles", default="50,90,99",
                   help="percentiles of TTFT, TPOT, ITL and E2EL to report (default 50,90,99)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_replay)

    _bench_parser(lsub)

    p = lsub.add_parser("plot", help="PNG plots of a results JSON")
    p.add_argument("results")
    p.add_argument("--out", default="plots")
    p.set_defaults(func=cmd_plot)

    o = lsub.add_parser("overhead", help="measure the replay's own TTFT error against a no-op server")
    o.add_argument("--n", type=int, default=300)
    o.add_argument("--rate", type=float, default=50.0)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--transport", type=lambda t: t.split(","), default=["raw"], help="raw, httpx or raw,httpx")
    o.add_argument("--json", action="store_true")
    o.set_defaults(func=cmd_overhead)

    c = sub.add_parser("chat", help="streaming chat with a server (stdin lines are user turns)",
                       description="Streaming chat client. --show-steps asks the server for its denoising canvas "
                                   "(stream_options.include_canvas) and prints one line per round: the round, "
                                   "the threshold and the canvas (committed text, _ for masked positions, the "
                                   "current block in [ ]); besides, each streamed text chunk with its time.")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--model")
    c.add_argument("--show-steps", action="store_true",
                   help="one line per denoising round (the canvas) and per streamed chunk (time, text so far)")
    c.add_argument("--single-turn", action="store_true", help="send each line alone, without the conversation")
    c.add_argument("--system", help="a system message before the conversation")
    c.add_argument("--threshold", type=float)
    c.add_argument("--max-tokens", type=int)
    c.add_argument("--slo-ms", type=float)
    c.add_argument("--api-key", help=API_KEY_HELP)
    c.set_defaults(func=cmd_chat)


if __name__ == "__main__":  # python -m loadgen.cli ... (the same commands without `remask`)
    parser = argparse.ArgumentParser(prog="remask")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args()
    sys.exit(a.func(a))
