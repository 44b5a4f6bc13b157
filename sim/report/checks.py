"""Simulator fidelity checks. Each returns a ``Check`` that can fail; the report prints PASS/FAIL.

- ``littles_law``: the time-average number of requests in the system, measured from the simulator's
  own state (the instance scheduler's held requests, or the cluster simulator's event counter), equals
  throughput x mean latency (from the requests' own timestamps) within ``tol``.
- ``fcfs_fingerprint``: SGLang's FCFS prefill-first former reproduces DWISE Table 3's signature
  (almost every round prefill-only and nearly empty) and DWISE fills its rounds.
- ``same_traces``: every policy of one experiment saw the identical arrival trace and finished
  exactly the requests of that trace.
- ``seed_spread``: across seeds every policy keeps its place, each policy's spread is small, and the gap
  between policies exceeds the seed-to-seed spread; ``deterministic``: a rerun of one seed is identical.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"


def trace_hash(pairs: Iterable[tuple[str, float]]) -> str:
    """A digest of (request id, arrival) pairs, order-free; arrivals to the nanosecond."""
    h = hashlib.sha1()
    for rid, t in sorted((str(r), round(float(a), 9)) for r, a in pairs):
        h.update(f"{rid}@{t!r};".encode())
    return h.hexdigest()[:16]


def littles_law(name: str, mean_in_system: float, throughput: float, mean_latency: float,
                tol: float = 0.05) -> Check:
    """L = X W: ``mean_in_system`` against ``throughput x mean_latency``, relative error within ``tol``."""
    xw = throughput * mean_latency
    if not all(math.isfinite(v) for v in (mean_in_system, throughput, mean_latency)) or xw <= 0:
        return Check(name, False, f"L={mean_in_system}, X={throughput}, W={mean_latency}: not comparable")
    err = abs(mean_in_system - xw) / xw
    return Check(name, err <= tol, f"L={mean_in_system:.3f}, XW={xw:.3f} (X={throughput:.3f}/s, "
                                   f"W={mean_latency:.3f}s), error {100 * err:.2f}% (limit {100 * tol:g}%)")


# bands around DWISE Table 3 (SGLang: 94.6% prefill-only rounds, 5.0 of 128 slots, 78.2% of time; DWISE 113.2)
FINGERPRINT = {"fcfs_prefill_only_rounds_min": 0.85, "fcfs_filled_max_frac": 10 / 128,
               "fcfs_prefill_only_time_min": 0.50, "dwise_filled_min_frac": 0.75, "round_ratio_min": 10.0}


def fcfs_fingerprint(name: str, fcfs: Mapping[str, float], dwise: Mapping[str, float], slots: int) -> Check:
    """``fcfs``/``dwise``: round composition dicts (``rounds``, ``prefill_only_rounds_frac``,
    ``prefill_only_time_frac``, ``filled_slots_per_round``)."""
    f = FINGERPRINT
    conds = {
        f"FCFS prefill-only rounds {100 * fcfs['prefill_only_rounds_frac']:.1f}% >= "
        f"{100 * f['fcfs_prefill_only_rounds_min']:.0f}%":
            fcfs["prefill_only_rounds_frac"] >= f["fcfs_prefill_only_rounds_min"],
        f"FCFS filled slots {fcfs['filled_slots_per_round']:.1f} <= {f['fcfs_filled_max_frac'] * slots:.1f}":
            fcfs["filled_slots_per_round"] <= f["fcfs_filled_max_frac"] * slots,
        f"FCFS prefill-only time {100 * fcfs['prefill_only_time_frac']:.1f}% >= "
        f"{100 * f['fcfs_prefill_only_time_min']:.0f}%":
            fcfs["prefill_only_time_frac"] >= f["fcfs_prefill_only_time_min"],
        f"DWISE filled slots {dwise['filled_slots_per_round']:.1f} >= {f['dwise_filled_min_frac'] * slots:.0f}":
            dwise["filled_slots_per_round"] >= f["dwise_filled_min_frac"] * slots,
        f"rounds FCFS/DWISE {fcfs['rounds'] / max(dwise['rounds'], 1):.1f} >= {f['round_ratio_min']:g}":
            fcfs["rounds"] >= f["round_ratio_min"] * dwise["rounds"],
    }
    failed = [k for k, ok in conds.items() if not ok]
    return Check(name, not failed, "; ".join(conds) + (f" -- failed: {'; '.join(failed)}" if failed else ""))


def same_traces(name: str, offered: Mapping[str, str], finished: Mapping[str, str]) -> Check:
    """``offered``/``finished``: policy -> trace hash of the requests given / finished."""
    given = set(offered.values())
    bad = [p for p in offered if finished.get(p) != offered[p]]
    ok = len(given) == 1 and not bad
    detail = f"{len(offered)} policies, trace {next(iter(given)) if len(given) == 1 else sorted(given)}"
    if bad:
        detail += f"; finished set differs for {', '.join(bad)}"
    return Check(name, ok, detail)


def seed_spread(name: str, values: Mapping[str, Sequence[float]], higher_is_better: bool = False,
                max_cv: float = 0.10) -> Check:
    """``values``: policy -> metric per seed (same seeds in the same order). Passes when every seed ranks
    the policies alike, no policy's coefficient of variation exceeds ``max_cv``, and each adjacent pair's
    gap in means exceeds twice the larger of their standard deviations."""
    pols = list(values)
    n = len(next(iter(values.values())))
    if n < 2 or any(len(v) != n for v in values.values()):
        return Check(name, False, "needs at least two seeds per policy, the same for every policy")
    sign = -1.0 if higher_is_better else 1.0
    orders = {tuple(sorted(pols, key=lambda p, i=i: sign * values[p][i])) for i in range(n)}
    mean = {p: statistics.fmean(values[p]) for p in pols}
    sd = {p: statistics.stdev(values[p]) for p in pols}
    cv = {p: sd[p] / abs(mean[p]) if mean[p] else math.inf for p in pols}
    ranked = sorted(pols, key=lambda p: sign * mean[p])
    gaps_ok = all(abs(mean[a] - mean[b]) > 2 * max(sd[a], sd[b]) for a, b in zip(ranked, ranked[1:]))
    cv_ok = all(c <= max_cv for c in cv.values())
    ok = len(orders) == 1 and cv_ok and gaps_ok
    parts = [f"{p}: {mean[p]:.3f} +- {sd[p]:.3f} (CV {100 * cv[p]:.1f}%)" for p in ranked]
    detail = f"{n} seeds; " + ", ".join(parts) + f"; same order in every seed: {len(orders) == 1}; " \
             f"CV <= {100 * max_cv:g}%: {cv_ok}; gaps > 2 sd: {gaps_ok}"
    return Check(name, ok, detail)


def deterministic(name: str, first: Mapping, second: Mapping) -> Check:
    """Two runs of one seed give identical summaries."""
    diff = sorted(k for k in set(first) | set(second) if first.get(k) != second.get(k))
    return Check(name, not diff, "identical" if not diff else f"differ in {', '.join(diff)}")
