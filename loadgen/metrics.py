"""The summary of a replay, in vLLM benchmark_serving's conventions (times in ms, rates per second).

- ``ttft``: send to first text chunk; ``tpot``: (e2el - ttft) / (output_tokens - 1) per request with
  more than one output token (``output_tokens`` from the stream's usage chunk; without one, the number of
  text chunks); ``itl``: every gap between text chunks, pooled over requests; ``e2el``: send to end of
  stream. All from the chunks' arrival times as :mod:`loadgen.client` records them. Each gets
  ``mean_*_ms``, ``median_*_ms``, ``std_*_ms`` and ``p<P>_*_ms`` for every P of ``percentiles``
  (``--percentiles``, default 50,90,99; ``p99.9_ttft_ms`` for 99.9).
- ``duration``: start of the replay to the last finished request (s).
- ``request_throughput``: successful requests / duration; ``request_goodput``: successful requests that
  met every ``--goodput`` bound (``ttft``, ``tpot``, ``e2el`` in ms, each ``<=``; a request's TPOT is 0
  with one output token, as in vLLM) and their own SLO (or had none) / duration; ``goodput_share``:
  those requests over the requests sent (failures count as not good); ``goodput_bounds``: the bounds;
  ``slo_attainment``: the share of requests with an SLO that finished successfully within it (failures
  count as misses); ``accuracy``: the share of successful requests with a reference answer whose answer
  passes the task check.
- ``mean_queue_ms``/``max_queue_ms``: the wait for a slot under ``--max-concurrency`` (as in vLLM, it is
  not part of TTFT, TPOT, ITL or E2EL, which start when the request goes out; it is part of ``duration``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from loadgen.client import RequestResult

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def pct_name(p: float) -> str:
    """``p99``, ``p99.9``: how a percentile is named in summary keys."""
    return f"p{p:g}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> (50.0, 90.0, 99.0); each in [0, 100]."""
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"percentiles are numbers separated by commas, e.g. 50,90,99; got {text!r}") from None
    if not out or any(not 0.0 <= p <= 100.0 for p in out):
        raise ValueError(f"percentiles must lie in [0, 100]; got {text!r}")
    return tuple(dict.fromkeys(out))


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """``["ttft:500", "e2el:3000"]`` -> {"ttft": 500.0, "e2el": 3000.0} (vLLM's ``--goodput``; ms)."""
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes {', '.join(m + ':MS' for m in GOODPUT_METRICS)}; got {item!r}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}: {value!r} is not a number of milliseconds") from None
        if out[key] < 0:
            raise ValueError(f"--goodput {key}: must not be negative, got {value}")
    return out


def _stats(name: str, values: list[float], percentiles=DEFAULT_PERCENTILES) -> dict:
    arr = np.asarray(values, dtype=float)
    keys = ["mean", "median", "std", *(pct_name(p) for p in percentiles)]
    if not len(arr):
        return {f"{k}_{name}_ms": None for k in keys}
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    out.update({f"{pct_name(p)}_{name}_ms": float(np.percentile(arr, p)) for p in percentiles})
    return out


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def tpot_ms(r: RequestResult) -> float | None:
    n = r.output_tokens if r.output_tokens is not None else len(r.chunk_offsets_ms)
    if r.ok and n > 1 and r.ttft_ms is not None and r.e2el_ms is not None:
        return (r.e2el_ms - r.ttft_ms) / (n - 1)
    return None


def is_good(r: RequestResult, bounds: dict[str, float] | None) -> bool:
    """Did ``r`` succeed within its own SLO (if any) and every goodput bound (vLLM's ``--goodput``)?"""
    if not r.ok or (r.slo_ms is not None and not r.slo_met):
        return False
    values = {"ttft": r.ttft_ms if r.ttft_ms is not None else r.e2el_ms, "tpot": tpot_ms(r) or 0.0,
              "e2el": r.e2el_ms}
    return all(values[k] is not None and values[k] <= v for k, v in (bounds or {}).items())


def summarize(results: list[RequestResult], duration_s: float, not_sent: int = 0,
              percentiles=DEFAULT_PERCENTILES, goodput: dict[str, float] | None = None) -> dict:
    sent = [r for r in results if not r.cancelled]
    ok = [r for r in sent if r.ok]
    with_slo = [r for r in sent if r.slo_ms is not None]
    met = [r for r in with_slo if r.ok and r.slo_met]
    good = [r for r in ok if is_good(r, goodput)]
    checked = [r for r in ok if r.correct is not None]
    by_cat: dict[str, list[bool]] = defaultdict(list)
    for r in checked:
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
        "goodput_share": _ratio(len(good), len(sent)),
        "goodput_bounds": dict(goodput) if goodput else None,
        "output_throughput": sum(r.output_tokens or 0 for r in ok) / duration_s if duration_s > 0 else None,
        "slo_attainment": _ratio(len(met), len(with_slo)),
        "accuracy": _ratio(sum(bool(r.correct) for r in checked), len(checked)),
        "accuracy_by_category": {c: sum(v) / len(v) for c, v in sorted(by_cat.items())},
        "mean_send_lag_ms": float(np.mean(lags)) if lags else None,
        "max_send_lag_ms": float(np.max(lags)) if lags else None,
        "mean_queue_ms": float(np.mean([r.queued_ms for r in results])) if results else None,
        "max_queue_ms": float(np.max([r.queued_ms for r in results])) if results else None,
        "percentiles": list(percentiles),
    }
    out.update(_stats("ttft", [r.ttft_ms for r in ok if r.ttft_ms is not None], percentiles))
    out.update(_stats("tpot", [t for r in ok if (t := tpot_ms(r)) is not None], percentiles))
    out.update(_stats("itl", [g for r in ok for g in r.itl_ms], percentiles))
    out.update(_stats("e2el", [r.e2el_ms for r in ok], percentiles))
    return out


def format_summary(s: dict) -> str:
    """A short human-readable block, like benchmark_serving's."""
    def f(v, spec=".2f"):
        return "n/a" if v is None else format(v, spec)

    bounds = s.get("goodput_bounds")
    good = "Request goodput (req/s):" if not bounds else \
        f"Goodput {' '.join(f'{k}<={v:g}' for k, v in bounds.items())} ms (req/s):"
    lines = [f"{'Successful requests:':40s}{s['completed']}", f"{'Errors:':40s}{s['errors']} {s['errors_by_kind']}",
             f"{'Benchmark duration (s):':40s}{f(s['duration'])}",
             f"{'Request throughput (req/s):':40s}{f(s['request_throughput'])}",
             f"{good:40s}{f(s['request_goodput'])} ({f(s.get('goodput_share'), '.3f')} of requests)",
             f"{'SLO attainment:':40s}{f(s['slo_attainment'], '.3f')}",
             f"{'Accuracy:':40s}{f(s['accuracy'], '.3f')}",
             f"{'Send lag mean / max (ms):':40s}{f(s['mean_send_lag_ms'], '.3f')} / {f(s['max_send_lag_ms'], '.3f')}"]
    if s.get("max_concurrency"):
        lines.append(f"{'Maximum request concurrency:':40s}{s['max_concurrency']}")
    if s.get("max_queue_ms"):
        lines.append(f"{'Slot wait mean / max (ms):':40s}{f(s['mean_queue_ms'], '.3f')} / "
                     f"{f(s['max_queue_ms'], '.3f')}")
    names = [pct_name(p) for p in s.get("percentiles", (99,))]
    labels = {m: f"{m.upper()} mean / median / {' / '.join(names)} (ms):" for m in ("ttft", "tpot", "itl", "e2el")}
    width = max(40, *(len(v) + 1 for v in labels.values()))
    for m, label in labels.items():
        lines.append(label.ljust(width) + " / ".join(f(s.get(f"{k}_{m}_ms")) for k in ("mean", "median", *names)))
    if s["cancelled"] or s["not_sent"]:
        lines.append(f"{'Interrupted: cancelled / not sent:':40s}{s['cancelled']} / {s['not_sent']}")
    return "\n".join(lines)
