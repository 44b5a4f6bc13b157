"""Issue 24's live check: one app served with a predictors mode, a replayed trace, what the predictors
learnt and the SLO attainment, printed as JSON.

    .venv/bin/python scripts/live_predictors.py --mode online --model tiny-mdm --n 600 --rate 6 \
        --slo-ms 1500 --slo-ms-per-token 10 --out /tmp/online.json

Starts Ray and a Serve app on this machine (127.0.0.1:PORT), replays a synthesized trace against it
with `remask loadgen`, reads `/debug/predictors` and `/metrics` (event-loop lag), and shuts down. Run it
once with `--mode shipped` and once with `--mode online` to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def lag_quantile(text: str, q: float) -> float | None:
    """The q-quantile upper bound of remask:event_loop_lag_seconds from a Prometheus exposition."""
    buckets = []
    for line in text.splitlines():
        if line.startswith("remask:event_loop_lag_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    for le, count in sorted(buckets):
        if count >= q * total:
            return le
    return None


def metric_mean(text: str, name: str) -> float | None:
    """sum / count of a histogram in a Prometheus exposition (e.g. the mean threshold requests used)."""
    total = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"{name}_{part}{{") or line.startswith(f"{name}_{part} "):
                total[part] = total.get(part, 0.0) + float(line.split()[-1])
    return total["sum"] / total["count"] if total.get("count") else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", required=True, choices=["auto", "shipped", "online", "off"])
    p.add_argument("--model", default="tiny-mdm")
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--rate", type=float, default=6.0)
    p.add_argument("--slo-ms", type=float, default=1500.0)
    p.add_argument("--slo-ms-per-token", type=float, default=10.0)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--port", type=int, default=8799)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import httpx
    import ray
    from ray import serve

    from deployments.builder import build_app
    from tools.cli import main as remask

    def wait_until(cond, limit_s: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            try:
                if cond():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the app did not come up within {limit_s:.0f} s")

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    url = f"http://127.0.0.1:{args.port}"
    tmp = Path(tempfile.mkdtemp(prefix="remask-live-"))
    trace = tmp / "trace.jsonl"
    assert remask(["loadgen", "synth", "--n", str(args.n), "--rate", str(args.rate), "--seed", str(args.seed),
                   "--slo-ms", str(args.slo_ms), "--slo-ms-per-token", str(args.slo_ms_per_token),
                   "--out", str(trace)]) == 0
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app({"engine": {"model": args.model, "slots": args.slots}, "router": {"predictors": args.mode},
                             "http": {"max_tokens_limit": 512}}), name="live", route_prefix="/", blocking=False)
        wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, limit_s=300)
        t0 = time.monotonic()
        results = tmp / "results.json"
        remask(["loadgen", "replay", "--url", url, "--trace", str(trace), "--out", str(results), "--quiet"])
        summary = json.loads(results.read_text())["summary"]
        time.sleep(5)  # the last refits
        predictors = httpx.get(url + "/debug/predictors", timeout=60).json()
        metrics = httpx.get(url + "/metrics", timeout=10).text
        out = {"mode": args.mode, "model": args.model, "n": args.n, "rate": args.rate, "slo_ms": args.slo_ms,
               "slo_ms_per_token": args.slo_ms_per_token, "wall_s": round(time.monotonic() - t0, 1),
               "slo_attainment": summary.get("slo_attainment"), "completed": summary.get("completed"),
               "errors": summary.get("errors_by_kind"), "mean_threshold": metric_mean(metrics, "remask:threshold"),
               "loop_lag_p99_s": lag_quantile(metrics, 0.99), "loop_lag_p50_s": lag_quantile(metrics, 0.5),
               "predictors": predictors, "summary": summary}
    finally:
        serve.shutdown()
        ray.shutdown()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("summary",)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
