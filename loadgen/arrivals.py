"""Arrival processes: offsets in seconds from the start of a trace, one per request, sorted.

- ``poisson``: exponential gaps at ``rate`` requests/s.
- ``gamma``: gamma gaps with shape ``burstiness`` and mean ``1/rate``, so the gaps' CV^2 is ``1/burstiness``
  (the convention of vLLM's benchmark_serving: 1 is Poisson, below 1 burstier, above 1 more regular).
- ``diurnal``: a BurstGPT-like non-homogeneous Poisson process: a sinusoidal day of ``period_s`` seconds
  (peak-to-mean ``amplitude``) with short bursts (``burst_factor`` x the rate for ``burst_s`` seconds,
  ``bursts_per_period`` of them on average), scaled so the long-run mean rate is ``rate``.
- ``burst``: every request at t = 0.
- ``burst-poisson``: ``burst_frac`` of the requests at t = 0, the rest Poisson at ``rate`` (DWISE's mixed load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARRIVALS = ("poisson", "gamma", "diurnal", "burst", "burst-poisson")


@dataclass(frozen=True)
class ArrivalParams:
    rate: float = 1.0
    burstiness: float = 1.0
    period_s: float = 600.0
    amplitude: float = 0.5
    bursts_per_period: float = 4.0
    burst_s: float = 10.0
    burst_factor: float = 4.0
    burst_frac: float = 0.5


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    # The first request goes at t = 0; each later one after its gap (as vLLM's benchmark does).
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if len(gaps) else gaps


def _diurnal(rng: np.random.Generator, n: int, p: ArrivalParams) -> np.ndarray:
    if not (0.0 <= p.amplitude <= 1.0 and p.period_s > 0 and p.burst_factor >= 1.0 and p.burst_s >= 0):
        raise ValueError("diurnal needs 0 <= amplitude <= 1, period_s > 0, burst_factor >= 1, burst_s >= 0")
    burst_rate = p.bursts_per_period / p.period_s
    busy_frac = 1.0 - math.exp(-burst_rate * p.burst_s)  # P(t lies in at least one burst window)
    base = p.rate / (1.0 + busy_frac * (p.burst_factor - 1.0))
    lam_max = base * (1.0 + p.amplitude) * p.burst_factor
    out: list[float] = []
    windows: list[float] = []  # burst start times, generated lazily ahead of t
    next_burst = rng.exponential(1.0 / burst_rate) if burst_rate > 0 else math.inf
    t = 0.0
    while len(out) < n:  # Lewis-Shedler thinning
        t += rng.exponential(1.0 / lam_max)
        while next_burst <= t:
            windows.append(next_burst)
            next_burst += rng.exponential(1.0 / burst_rate)
        windows = [s for s in windows if s + p.burst_s > t]
        in_burst = bool(windows)
        lam = base * (1.0 + p.amplitude * math.sin(2.0 * math.pi * t / p.period_s)) * (
            p.burst_factor if in_burst else 1.0)
        if rng.random() * lam_max <= lam:
            out.append(t)
    arr = np.asarray(out)
    return arr - arr[0] if n else arr


def arrivals(kind: str, n: int, params: ArrivalParams, rng: np.random.Generator) -> np.ndarray:
    """``n`` sorted arrival offsets (seconds) of process ``kind``."""
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; known: {', '.join(ARRIVALS)}")
    if n < 0:
        raise ValueError("n must be >= 0")
    if kind != "burst" and not params.rate > 0:
        raise ValueError(f"rate must be > 0 for {kind} arrivals")
    if kind == "poisson":
        return _from_gaps(rng.exponential(1.0 / params.rate, n))
    if kind == "gamma":
        if not params.burstiness > 0:
            raise ValueError("burstiness must be > 0")
        k = params.burstiness
        return _from_gaps(rng.gamma(k, 1.0 / (params.rate * k), n))
    if kind == "diurnal":
        return _diurnal(rng, n, params)
    if kind == "burst":
        return np.zeros(n)
    if not 0.0 <= params.burst_frac <= 1.0:
        raise ValueError("burst_frac must lie in [0, 1]")
    n_burst = int(round(n * params.burst_frac))
    rest = rng.exponential(1.0 / params.rate, n - n_burst)
    return np.concatenate([np.zeros(n_burst), np.cumsum(rest)])
