"""Issue 24's live check: one app served with a predictors mode, a replayed trace, what the predictors
learnt and the SLO attainment, printed as JSON.

    .venv/bin/python scripts/live_predictors.py --mode shipped --model tiny-mdm --n 600 --rate 16 \
        --slo-ms 1000 --slo-ms-per-token 8 --out /tmp/shipped.json
    .venv/bin/python scripts/live_predictors.py --mode online ... --out /tmp/online.json --compare /tmp/shipped.json

Starts Ray and a Serve app on this machine (127.0.0.1:PORT), replays a synthesized trace against it
with `remask loadgen`, reads `/debug/predictors` and `/metrics`, and shuts down. It prints the SLO
attainment, the thresholds requests decoded with (the mean, and the share of requests by their mean
threshold: thresholds drop only under load), each predictor's source, version and recent Spearman,
the event loop's lag (p99 over the run, and over the seconds in which a refit ran: /metrics is read
every ``--poll-s`` during the replay), the ingress's garbage-collection pauses, and the load average at
start and end (the lag suffers when other work shares the CPUs: Ray runs the service at niceness 15, so
anything at a lower niceness preempts it; the replay runs at ``--client-nice``, 15 by default).
``--compare`` takes the shipped run's output and adds issue 24's checks:
an online version of each predictor, step Spearman >= 0.8 x the shipped one's, attainment within 5
points, lag p99 <= 5 ms while refitting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

LAG = "remask:event_loop_lag_seconds"


def buckets(text: str, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts (upper bound -> count, summed over label sets) from a
    Prometheus exposition."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            key = float("inf") if le == "+Inf" else float(le)
            out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


def quantile(cum: dict[float, float], q: float) -> float | None:
    """The q-quantile's bucket upper bound from cumulative bucket counts (None: no observation)."""
    if not cum or max(cum.values()) <= 0:
        return None
    total = cum[max(cum)]
    for le in sorted(cum):
        if cum[le] >= q * total:
            return le
    return None


def lag_quantile(text: str, q: float) -> float | None:
    """The q-quantile upper bound of remask:event_loop_lag_seconds from a Prometheus exposition."""
    return quantile(buckets(text, LAG), q)


def lag_while(samples: list[tuple[float, dict]], windows: list[list[float]], inside: bool = True) -> dict:
    """The lag histogram over the polling intervals that overlap a refit window (``inside``; else over the
    others): ``samples`` are (wall time, cumulative lag buckets) read during the run; the difference of
    consecutive ones is what the loop observed in between."""
    cum: dict[float, float] = {}
    seconds = 0.0
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        if any(s < t1 and e > t0 for s, e in windows) == inside:
            seconds += t1 - t0
            for le, n in b.items():
                cum[le] = cum.get(le, 0.0) + n - a.get(le, 0.0)
    return {"p99_s": quantile(cum, 0.99), "p50_s": quantile(cum, 0.5), "share_over_5ms": share_over(cum),
            "seconds": round(seconds, 1), "observations": int(cum.get(float("inf"), 0))}


def lag_timeline(samples: list[tuple[float, dict]], windows: list[list[float]], over: float = 0.005) -> list:
    """Per polling interval: seconds since the first poll, lag observations, those above ``over`` (by bucket
    bound), and whether a refit ran in it."""
    out = []
    bound = min((le for le in samples[0][1] if le >= over), default=over) if samples else over
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        n = b.get(float("inf"), 0.0) - a.get(float("inf"), 0.0)
        slow = n - (b.get(bound, 0.0) - a.get(bound, 0.0))
        out.append([round(t1 - samples[0][0], 1), int(n), int(slow), any(s < t1 and e > t0 for s, e in windows)])
    return out


def gc_pauses(text: str) -> dict[str, dict]:
    """The ingress's garbage-collection pauses per generation (remask:gc_pause_seconds): how many, their
    mean, and how many took over 5 ms."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        if not line.startswith("remask:gc_pause_seconds"):
            continue
        gen = line.split('generation="', 1)[1][0]
        g = out.setdefault(gen, {"count": 0, "sum_s": 0.0, "le_5ms": 0})
        value = float(line.split()[-1])
        if line.startswith("remask:gc_pause_seconds_count{"):
            g["count"] = int(value)
        elif line.startswith("remask:gc_pause_seconds_sum{"):
            g["sum_s"] = value
        elif line.startswith("remask:gc_pause_seconds_bucket{") and 'le="0.005"' in line:
            g["le_5ms"] = int(value)
    return {gen: {"count": g["count"], "mean_ms": round(1e3 * g["sum_s"] / g["count"], 3) if g["count"] else None,
                  "over_5ms": g["count"] - g["le_5ms"]} for gen, g in sorted(out.items())}


def share_over(cum: dict[float, float], bound: float = 0.005) -> float | None:
    """Share of the observations above ``bound`` (a bucket bound) in cumulative bucket counts."""
    total = cum.get(float("inf"), 0.0)
    return round(1 - cum.get(bound, 0.0) / total, 5) if total else None


def threshold_shares(text: str) -> dict[str, float]:
    """Share of the requests whose mean threshold was at most each bucket bound (remask:threshold)."""
    cum = buckets(text, "remask:threshold")
    total = cum.get(float("inf"), 0.0)
    return {f"<={le:g}": round(n / total, 3) for le, n in sorted(cum.items()) if total and 0.5 <= le < 1.0}


def checks(out: dict, shipped: dict) -> dict:
    """Issue 24's done-when figures of an online run against the shipped run on the same trace."""
    p = out["predictors"]
    ratio = None
    if shipped["predictors"]["step"].get("spearman_recent") and p["step"].get("spearman_recent") is not None:
        ratio = round(p["step"]["spearman_recent"] / shipped["predictors"]["step"]["spearman_recent"], 3)
    gap = round(shipped["slo_attainment"] - out["slo_attainment"], 4)
    lag = out["loop_lag_while_refitting"]["p99_s"]
    return {"online_versions": {k: (p[k]["source"], p[k]["version"]) for k in ("step", "admission")},
            "online_version_of_each": all(p[k]["source"] == "online" and p[k]["version"] >= 1
                                          for k in ("step", "admission")),
            "step_spearman_ratio": ratio, "step_spearman_ok": ratio is not None and ratio >= 0.8,
            "attainment_shipped": shipped["slo_attainment"], "attainment_gap": gap, "attainment_ok": gap <= 0.05,
            "lag_p99_while_refitting_s": lag, "lag_ok": lag is not None and lag <= 0.005}


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
    p.add_argument("--poll-s", type=float, default=2.0, help="how often /metrics is read during the replay")
    p.add_argument("--client-nice", type=int, default=15, help="niceness of the replay and the metrics poller "
                   "(Ray runs its workers, the ingress and the replicas, at 15: a load generator at 0 on the same "
                   "cores preempts the service it measures; 0 keeps it)")
    p.add_argument("--compare", help="the shipped run's output (--out of a --mode shipped run on the same trace)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    shipped = json.loads(Path(args.compare).read_text()) if args.compare else None
    load_start = os.getloadavg()

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
        samples: list[tuple[float, dict]] = []
        done = threading.Event()

        def poll() -> None:  # the lag histogram through the run, to tell the seconds with a refit apart
            while True:
                try:
                    samples.append((time.time(), buckets(httpx.get(url + "/metrics", timeout=10).text, LAG)))
                except httpx.HTTPError:
                    pass
                if done.wait(args.poll_s):
                    return

        if args.client_nice:  # from here on this thread and the ones it starts (Linux: nice is per thread)
            os.setpriority(os.PRIO_PROCESS, 0, args.client_nice)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        t0 = time.monotonic()
        results = tmp / "results.json"
        remask(["loadgen", "replay", "--url", url, "--trace", str(trace), "--out", str(results), "--quiet"])
        summary = json.loads(results.read_text())["summary"]
        time.sleep(5)  # the last refits
        done.set()
        poller.join()
        metrics = httpx.get(url + "/metrics", timeout=10).text
        samples.append((time.time(), buckets(metrics, LAG)))
        predictors = httpx.get(url + "/debug/predictors", timeout=60).json()
        windows = predictors.pop("refit_windows", [])
        out = {"mode": args.mode, "model": args.model, "n": args.n, "rate": args.rate, "slo_ms": args.slo_ms,
               "slo_ms_per_token": args.slo_ms_per_token, "wall_s": round(time.monotonic() - t0, 1),
               "slo_attainment": summary.get("slo_attainment"), "completed": summary.get("completed"),
               "errors": summary.get("errors_by_kind"), "mean_threshold": metric_mean(metrics, "remask:threshold"),
               "requests_by_mean_threshold": threshold_shares(metrics),
               "loop_lag_p99_s": lag_quantile(metrics, 0.99), "loop_lag_p50_s": lag_quantile(metrics, 0.5),
               "loop_lag_share_over_5ms": share_over(buckets(metrics, LAG)), "gc_pauses": gc_pauses(metrics),
               "loop_lag_while_refitting": {**lag_while(samples, windows), "refits": len(windows),
                                            "refit_seconds": round(sum(e - s for s, e in windows), 1)},
               "loop_lag_otherwise": lag_while(samples, windows, inside=False),
               "lag_timeline": lag_timeline(samples, windows), "predictors": predictors, "summary": summary}
    finally:
        serve.shutdown()
        ray.shutdown()
    out["loadavg_start"], out["loadavg_end"] = [round(x, 2) for x in load_start], [round(x, 2) for x in os.getloadavg()]
    if shipped is not None:
        out["checks"] = checks(out, shipped)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("summary", "lag_timeline")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
