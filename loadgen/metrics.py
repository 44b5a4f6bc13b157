"""The summary of a replay, in vLLM benchmark_serving's conventions (times in ms, rates per second).

- ``ttft``: send to first text chunk; ``tpot``: (e2el - ttft) / (output_tokens - 1) per request with
  more than one output token; ``itl``: every gap between text chunks, pooled over requests; ``e2el``:
  send to end of stream. Each gets ``mean_*_ms``, ``median_*_ms``, ``std_*_ms``, ``p99_*_ms``.
- ``duration``: start of the replay to the last finished request (s).
- ``request_throughput``: successful requests / duration; ``request_goodput``: successful requests that
  met their SLO (or had none) / duration; ``slo_attainment``: the share of requests with an SLO that
  finished successfully within it (failures count as misses); ``accuracy``: the share of successful
  requests whose answer passes the task check.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from loadgen.client import RequestResult


def _stats(name: str, values: list[float]) -> dict:
    arr = np.asarray(values, dtype=float)
    if not len(arr):
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p99")}
    return {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
            f"std_{name}_ms": float(arr.std()), f"p99_{name}_ms": float(np.percentile(arr, 99))}


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def tpot_ms(r: RequestResult) -> float | None:
    if r.ok and r.output_tokens and r.output_tokens > 1 and r.ttft_ms is not None:
        return (r.e2el_ms - r.ttft_ms) / (r.output_tokens - 1)
    return None


def summarize(results: list[RequestResult], duration_s: float, not_sent: int = 0) -> dict:
    sent = [r for r in results if not r.cancelled]
    ok = [r for r in sent if r.ok]
    with_slo = [r for r in sent if r.slo_ms is not None]
    met = [r for r in with_slo if r.ok and r.slo_met]
    good = [r for r in ok if r.slo_ms is None or r.slo_met]
    by_cat: dict[str, list[bool]] = defaultdict(list)
    for r in ok:
        by_cat[r.category].append(bool(r.correct))
    errors: dict[str, int] = defaultdict(int)
    for r in sent:
        if not r.ok:
            errors[str(r.status) if r.status and r.status >= 400 else "no response" if r.status is None else
                   "stream"] += 1
    lags = [r.send_lag_ms for r in results]
    out = {
        "duration": duration_s,
        "requests": len(results) + not_sent,
        "completed": len(ok),
        "errors": len(sent) - len(ok),
        "errors_by_kind": dict(errors),
        "cancelled": len(results) - len(sent),
        "not_sent": not_sent,
        "total_input_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "total_output_tokens": sum(r.output_tokens or 0 for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "request_goodput": len(good) / duration_s if duration_s > 0 else None,
        "output_throughput": sum(r.output_tokens or 0 for r in ok) / duration_s if duration_s > 0 else None,
        "slo_attainment": _ratio(len(met), len(with_slo)),
        "accuracy": _ratio(sum(bool(r.correct) for r in ok), len(ok)),
        "accuracy_by_category": {c: sum(v) / len(v) for c, v in sorted(by_cat.items())},
        "mean_send_lag_ms": float(np.mean(lags)) if lags else None,
        "max_send_lag_ms": float(np.max(lags)) if lags else None,
    }
    out.update(_stats("ttft", [r.ttft_ms for r in ok if r.ttft_ms is not None]))
    out.update(_stats("tpot", [t for r in ok if (t := tpot_ms(r)) is not None]))
    out.update(_stats("itl", [g for r in ok for g in r.itl_ms]))
    out.update(_stats("e2el", [r.e2el_ms for r in ok]))
    return out


def format_summary(s: dict) -> str:
    """A short human-readable block, like benchmark_serving's."""
    def f(v, spec=".2f"):
        return "n/a" if v is None else format(v, spec)

    lines = [f"{'Successful requests:':40s}{s['completed']}", f"{'Errors:':40s}{s['errors']} {s['errors_by_kind']}",
             f"{'Benchmark duration (s):':40s}{f(s['duration'])}",
             f"{'Request throughput (req/s):':40s}{f(s['request_throughput'])}",
             f"{'Request goodput (req/s):':40s}{f(s['request_goodput'])}",
             f"{'SLO attainment:':40s}{f(s['slo_attainment'], '.3f')}",
             f"{'Accuracy:':40s}{f(s['accuracy'], '.3f')}",
             f"{'Send lag mean / max (ms):':40s}{f(s['mean_send_lag_ms'], '.3f')} / {f(s['max_send_lag_ms'], '.3f')}"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        lines.append(f"{m.upper() + ' mean / median / p99 (ms):':40s}{f(s[f'mean_{m}_ms'])} / "
                     f"{f(s[f'median_{m}_ms'])} / {f(s[f'p99_{m}_ms'])}")
    if s["cancelled"] or s["not_sent"]:
        lines.append(f"{'Interrupted: cancelled / not sent:':40s}{s['cancelled']} / {s['not_sent']}")
    return "\n".join(lines)
