"""The planner's model-dependent inputs, measured from served traffic, each with its source.

Stage 1 is built from inputs that depend on the model and the machine. Each starts from a default or
a configured value and is replaced by a measurement once enough traffic was seen:

- **steps per output token** at each candidate threshold (``StepModel.steps_per_token``), from
  finished requests: a request's denoising steps over its output size, bucketed by the mean
  threshold it decoded with (to the nearest candidate; a tie goes to the higher one). A bucket's
  value is the ratio of sums (its steps over its output tokens, so the class-level step count the
  ILP uses is right on average). Buckets with ``min_bucket`` requests are measured once
  ``min_requests`` requests with a threshold were seen; the measured values are made
  non-decreasing in the threshold (pool-adjacent-violators, weighted by tokens: a lower threshold
  never needs more steps). A candidate with too few requests keeps the default curve's shape,
  scaled by the measured/default ratio (interpolated linearly between the measured thresholds
  around it, the nearest one's beyond them) and clipped between its measured neighbours (source
  "scaled").
- **SLO scale** ``k`` (the default SLO of a class is k x its isolated latency: TP-1 (the smallest
  degree), the ILP's smallest batch, the highest threshold; ``stage1.default_slos``): the median
  over finished requests of ``slo_s`` / that isolated latency for the request's own sizes,
  computed with the current step model and profile (so a class's default SLO reproduces the SLOs
  its requests carried). Overall once ``min_requests`` requests carried an SLO; per workload class
  (the monitor's grid) once the class has ``min_requests`` of its own, which then sets the
  class's ``slo_ms``.
- **latency profile per TP degree**: the configured one (``profiles/<name>[-tp<d>].json``) until a
  replica of that degree sends its measured profile; a degree without a profile file of its own
  is TP-1's scaled by ``engine.latency_profile.TP_SPEEDUP`` (source "scaled"), re-derived from TP-1's
  measured profile once that arrives.

The workload classes themselves (sizes and rates) come from arrivals (``workload.WorkloadMonitor``).
Memory is bounded: the newest ``window`` finished requests are kept. Pure Python and numpy.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.latency_profile import TP_SPEEDUP, LatencyProfile
from planner.costs import StepModel, isolated_ms
from planner.workload import WorkloadClass

DEFAULT, CONFIGURED, MEASURED, SCALED = "default", "configured", "measured", "scaled"


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request as the planner sees it."""

    prompt_tokens: int
    output_tokens: int  # the output size the arrival was observed with (its budget, max_tokens)
    steps: int  # denoising steps it took (prompt prefill steps excluded)
    threshold: float | None  # the mean threshold of its steps; None: unknown
    slo_s: float | None  # its SLO (deadline - arrival); None: unknown
    e2e_s: float  # arrival to last token
    tp: int  # TP degree of the instance that finished it


@dataclass(frozen=True)
class InputsConfig:
    min_requests: int = 50  # requests before a measured value replaces its default
    min_bucket: int = 10  # requests at a threshold before that threshold's steps per token count as measured
    window: int = 2000  # finished requests kept (the newest)

    def __post_init__(self) -> None:
        if self.min_requests < 1 or self.min_bucket < 1 or self.window < 1:
            raise ValueError("min_requests, min_bucket and window must be >= 1")


@dataclass(frozen=True)
class Inputs:
    """What one plan is made with (``MeasuredInputs.snapshot``)."""

    steps: StepModel
    slo_scale: float
    class_slo_scale: dict[str, float]  # measured per class (name -> k); the others use slo_scale
    profiles: dict[int, LatencyProfile]
    batch: int  # the batch of the isolated latency (the ILP's smallest)
    sources: dict  # describe(): name -> {"value", "source", "requests", ...}

    def with_slos(self, classes: list[WorkloadClass]) -> list[WorkloadClass]:
        """Classes without an SLO of their own get k x their isolated latency where k was measured for them."""
        if not self.class_slo_scale:
            return classes
        prof = self.profiles[min(self.profiles)]
        return [replace(c, slo_ms=self.class_slo_scale[c.name] * isolated_ms(
            c.input_tokens, c.output_tokens, prof, self.steps, self.batch))
            if c.slo_ms is None and c.name in self.class_slo_scale else c for c in classes]


def nearest(thresholds: list[float], t: float) -> float:
    """The candidate threshold nearest ``t`` (a tie: the higher one)."""
    return min(thresholds, key=lambda c: (round(abs(c - t), 9), -c))


def pav(values: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [b[0] for b in blocks for _ in range(b[2])]


def fit_steps_per_token(default: dict[float, float], sums: dict[float, tuple[float, float, int]],
                        min_bucket: int) -> tuple[dict[float, float], dict[float, str]]:
    """Steps per output token at every threshold of ``default`` and each one's source, from
    ``sums[t] = (steps, output tokens, requests)`` of the requests bucketed at t (see the module doc)."""
    ths = sorted(default)
    seen = [t for t in ths if t in sums and sums[t][2] >= min_bucket and sums[t][1] > 0]
    if not seen:
        return dict(default), {t: DEFAULT for t in ths}
    fit = dict(zip(seen, pav([sums[t][0] / sums[t][1] for t in seen], [sums[t][1] for t in seen])))
    out, src = {}, {}
    for t in ths:
        if t in fit:
            out[t], src[t] = fit[t], MEASURED
            continue
        lo = max((s for s in seen if s < t), default=None)
        hi = min((s for s in seen if s > t), default=None)
        r_lo = None if lo is None else fit[lo] / default[lo]
        r_hi = None if hi is None else fit[hi] / default[hi]
        if lo is None or hi is None:
            r = r_hi if lo is None else r_lo
        else:
            r = r_lo + (r_hi - r_lo) * (t - lo) / (hi - lo)
        v = default[t] * r
        if lo is not None:
            v = max(v, fit[lo])
        if hi is not None:
            v = min(v, fit[hi])
        out[t], src[t] = v, SCALED
    run = 0.0
    for t in ths:  # non-decreasing in the threshold (measured values are already, and bound the rest)
        run = out[t] = max(out[t], run)
    return out, src


class MeasuredInputs:
    """Finished requests and replicas' profiles in; the inputs of the next plan out (see the module doc)."""

    def __init__(self, steps: StepModel, profiles: dict[int, LatencyProfile], slo_scale: float,
                 classify: Callable[[int, int], str], config: InputsConfig | None = None,
                 profile_sources: dict[int, str] | None = None, batch: int = 1) -> None:
        self.default_steps, self.default_slo_scale = steps, slo_scale
        self.classify, self.batch = classify, batch
        self.config = config or InputsConfig()
        self.records: deque[FinishedRequest] = deque(maxlen=self.config.window)
        self.seen = 0  # finished requests recorded, ever
        self.configured = dict(profiles)
        self.profile_sources = {d: (profile_sources or {}).get(d, CONFIGURED) for d in profiles}
        self.measured: dict[int, LatencyProfile] = {}
        self.profile_reports = {d: 0 for d in profiles}
        self._cache: tuple[tuple[int, int], Inputs] | None = None
        self._version = 0

    # -- inputs -----------------------------------------------------------------------------------
    def record(self, req: FinishedRequest) -> None:
        self.records.append(req)
        self.seen += 1

    def set_profile(self, tp: int, profile: LatencyProfile) -> None:
        """A replica's measured profile for its TP degree (the newest replaces an earlier one)."""
        if tp not in self.configured:
            raise ValueError(f"no TP-{tp} in the planner's degrees {sorted(self.configured)}")
        self.measured[tp] = profile
        self.profile_reports[tp] += 1
        self._version += 1

    # -- outputs ------------------------------------------------------------------------------------
    def profiles(self) -> tuple[dict[int, LatencyProfile], dict[int, dict]]:
        """The profile per degree, and per degree its source entry."""
        base = self.measured.get(1)
        out, info = {}, {}
        for d, conf in self.configured.items():
            if d in self.measured:
                prof, src, extra = self.measured[d], MEASURED, {}
            elif self.profile_sources[d] == SCALED and base is not None and d in TP_SPEEDUP:
                prof = base.scaled(TP_SPEEDUP[d], name=f"{base.name}-tp{d}")
                src, extra = SCALED, {"from": "TP-1 measured", "factor": TP_SPEEDUP[d]}
            else:
                prof, src = conf, self.profile_sources[d]
                extra = {"from": "TP-1 configured", "factor": TP_SPEEDUP.get(d)} if src == SCALED else {}
            out[d] = prof
            info[d] = {"value": {"name": prof.name, "cached_step_ms": round(isolated_step_ms(
                prof, self.default_steps.block_tokens), 3), **extra},
                "source": src, "requests": self.profile_reports[d]}
        return out, info

    def snapshot(self) -> Inputs:
        key = (self.seen, self._version)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        cfg, default = self.config, self.default_steps
        profiles, prof_info = self.profiles()
        ths = default.thresholds
        # steps per output token
        sums: dict[float, list[float]] = {}
        with_th = 0
        for r in self.records:
            if r.threshold is None or r.steps <= 0 or r.output_tokens <= 0 or not math.isfinite(r.threshold):
                continue
            with_th += 1
            s = sums.setdefault(nearest(ths, r.threshold), [0.0, 0.0, 0])
            s[0] += r.steps
            s[1] += r.output_tokens
            s[2] += 1
        if with_th >= cfg.min_requests:
            spt, src = fit_steps_per_token(default.steps_per_token, {t: tuple(v) for t, v in sums.items()},
                                           cfg.min_bucket)
        else:
            spt, src = dict(default.steps_per_token), {t: DEFAULT for t in ths}
        steps = replace(default, steps_per_token=spt) if spt != default.steps_per_token else default
        steps_src = MEASURED if MEASURED in src.values() else DEFAULT
        # SLO scale: slo / isolated latency at the smallest degree, with the step model just fitted
        prof = profiles[min(profiles)]
        ratios: list[float] = []
        by_class: dict[str, list[float]] = {}
        iso: dict[tuple[int, int], float] = {}
        for r in self.records:
            if r.slo_s is None or r.slo_s <= 0 or r.output_tokens <= 0:
                continue
            k = (r.prompt_tokens, r.output_tokens)
            if k not in iso:
                iso[k] = isolated_ms(r.prompt_tokens, r.output_tokens, prof, steps, self.batch)
            ratio = r.slo_s * 1e3 / iso[k]
            ratios.append(ratio)
            by_class.setdefault(self.classify(r.prompt_tokens, r.output_tokens), []).append(ratio)
        measured_k = len(ratios) >= cfg.min_requests
        scale = statistics.median(ratios) if measured_k else self.default_slo_scale
        per_class = {c: statistics.median(v) for c, v in by_class.items() if len(v) >= cfg.min_requests}
        sources = {
            "steps_per_token": {
                "value": {t: round(spt[t], 4) for t in ths}, "source": steps_src, "requests": with_th,
                "thresholds": {t: {"value": round(spt[t], 4), "source": src[t],
                                   "requests": int(sums[t][2]) if t in sums else 0} for t in ths}},
            "slo_scale": {"value": round(scale, 4), "source": MEASURED if measured_k else DEFAULT,
                          "requests": len(ratios), "classes": {
                              c: {"value": round(per_class.get(c, scale), 4), "per_class": c in per_class,
                                  "source": MEASURED if c in per_class or measured_k else DEFAULT, "requests": len(v)}
                              for c, v in sorted(by_class.items())}},
            "profiles": prof_info,
            "finished": self.observed(),
        }
        out = Inputs(steps, scale, per_class, profiles, self.batch, sources)
        self._cache = (key, out)
        return out

    def observed(self) -> dict:
        """Outcomes of the kept finished requests: count, SLO attainment, median latency per TP degree."""
        met = [r.e2e_s <= r.slo_s for r in self.records if r.slo_s is not None and r.slo_s > 0]
        by_tp: dict[int, list[float]] = {}
        for r in self.records:
            by_tp.setdefault(r.tp, []).append(r.e2e_s)
        return {"seen": self.seen, "kept": len(self.records), "window": self.config.window,
                "slo_attainment": round(sum(met) / len(met), 4) if met else None,
                "e2e_s_median": {d: round(statistics.median(v), 4) for d, v in sorted(by_tp.items())}}


def isolated_step_ms(profile: LatencyProfile, block_tokens: int) -> float:
    """One cached step of one block, alone, at the profile's reference context (a profile's headline number)."""
    return profile.curve_ms("cached", block_tokens) + profile.overhead_ms
