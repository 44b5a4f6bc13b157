"""Structured outputs under load, measured the way vLLM measures serving: ``remask loadgen bench`` with a
structured-output dataset against the HTTP front (``app.frontend``, uvicorn in a thread) and one in-process
replica of an embedded model (no Ray), once with every request constrained and once with none.

    OMP_NUM_THREADS=1 python -m scripts.structured_load [--dataset-name regex] [--num-prompts 100]
        [--request-rate 20] [--threshold 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import threading
import time


def serve(model: str, slots: int):
    """(base URL, stop) of the front of ``model`` with one replica, served by uvicorn on a free port."""
    import uvicorn

    from app.config import AppConfig
    from app.frontend import Frontend
    from app.replica import ReplicaServer
    from app.routes import build_web
    from engine.instance import Instance
    from engine.loading import load_engine

    rep = ReplicaServer(Instance(load_engine(model, max_slots=slots), slots=slots), tick_s=0.2)
    fe = Frontend(AppConfig(engine={"model": model, "slots": slots}, router={"predictors": "off"}))
    server = uvicorn.Server(uvicorn.Config(build_web(lambda: fe), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    sock = server.servers[0]
    asyncio.run_coroutine_threadsafe(fe.dispatcher.connect("r0", 1, **rep.info()), sock.get_loop()).result(30)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)
        rep.close()

    return f"http://127.0.0.1:{sock.sockets[0].getsockname()[1]}", stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-bd")
    ap.add_argument("--dataset-name", default="regex", choices=["regex", "choice", "json"])
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--request-rate", default="20")
    ap.add_argument("--threshold", default=None)
    ap.add_argument("--slots", type=int, default=16)
    args = ap.parse_args()
    from tools.cli import build_parser

    url, stop = serve(args.model, args.slots)
    try:
        rows = []
        for ratio in ("0", "1"):
            argv = ["loadgen", "bench", "--base-url", url, "--dataset-name", args.dataset_name, "--num-prompts",
                    str(args.num_prompts), "--request-rate", args.request_rate, "--structured-output-ratio", ratio,
                    "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
                    "--seed", "1", *(["--threshold", args.threshold] if args.threshold else [])]
            bench_args = build_parser().parse_args(argv)
            from loadgen.bench import run

            res, _ = run(bench_args, out=io.StringIO())
            x = res["remask"]
            rows.append((ratio, res["completed"], res["request_throughput"], res["output_throughput"],
                         res["median_ttft_ms"], res["median_tpot_ms"], res["median_e2el_ms"], res["p99_e2el_ms"],
                         x["accuracy"], x["structured_valid_all"]))
    finally:
        stop()
    print(f"model {args.model}, --dataset-name {args.dataset_name}, {args.num_prompts} prompts at "
          f"{args.request_rate} req/s, threshold {args.threshold or 'the router'}")
    print("| constrained | completed | req/s | output tok/s | median TTFT ms | median TPOT ms | median E2EL ms | "
          "P99 E2EL ms | accuracy | valid |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r[8] is None else f"{r[8]:.2f}"
        valid = "-" if r[9] is None else f"{r[9]:.2f}"
        print(f"| {'all' if r[0] == '1' else 'none'} | {r[1]} | {r[2]:.2f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.2f} | "
              f"{r[6]:.1f} | {r[7]:.1f} | {acc} | {valid} |")


if __name__ == "__main__":
    main()
