"""The load generator's own overhead: replay a trace against the no-op server and compare clocks.

For every request the client measures TTFT (send to first text chunk) and the server logs when it
read the request line and when it wrote the first text chunk. The server's share is that gap; what
is left of the client's TTFT (``ttft_error_ms``) is the generator's own cost plus the loopback
transport: the error a TTFT measured by the replay carries. ``send_lag_ms`` is how late the replay
sent each request after its scheduled arrival.
"""

from __future__ import annotations

import httpx
import numpy as np

from loadgen.arrivals import ArrivalParams
from loadgen.noop_server import spawn
from loadgen.replay import ReplayConfig, replay
from loadgen.trace import SynthConfig, synth


def _dist(values: list[float]) -> dict:
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


def measure_overhead(n: int = 300, rate: float = 50.0, seed: int = 0, progress: bool = False,
                     limit_ms: float = 1.0, transport: str = "raw") -> dict:
    """Replay ``n`` Poisson requests at ``rate`` against a fresh no-op server; the measured errors."""
    proc, url = spawn("--reply", "ok", "--chunks", "2")
    try:
        trace = synth(SynthConfig(n=n, arrivals="poisson", arrival_params=ArrivalParams(rate=rate), seed=seed))
        doc = replay(trace, ReplayConfig(url=url, progress=progress, lead_s=0.2, transport=transport))
        log = httpx.get(url + "/noop/log", timeout=10).json()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    rows = [r for r in doc["requests"] if r["ok"] and r["request_id"] in log]
    if not rows:
        raise RuntimeError(f"no request succeeded against the no-op server: {doc['summary']['errors_by_kind']}")
    server = [(log[r["request_id"]][1] - log[r["request_id"]][0]) * 1000.0 for r in rows]
    err = [r["ttft_ms"] - s for r, s in zip(rows, server)]
    out = {"transport": transport, "requests": n, "rate": rate, "measured": len(rows),
           "errors": doc["summary"]["errors"],
           "client_ttft_ms": _dist([r["ttft_ms"] for r in rows]), "server_ttft_ms": _dist(server),
           "ttft_error_ms": _dist(err), "send_lag_ms": _dist([r["send_lag_ms"] for r in doc["requests"]]),
           "limit_ms": limit_ms}
    # The tail is the OS scheduler's on a busy machine (the no-op server's own p99 shows the same), so the
    # pass/fail is on the median; the full distribution is reported.
    out["median_within_limit"] = out["ttft_error_ms"]["median"] <= limit_ms
    return out
