"""Step counts and step costs the Stage-1 ILP is built from.

Steps of a class at a threshold come from ``StepModel.steps_per_token``: denoising steps per
output token at each candidate threshold. The defaults are illustrative, shaped after DiLaServe
Fig. 3a (LLaDA-8B, GSM8K: 0.9 -> 0.7 cuts steps by 38%); the live planner replaces them with
the served traffic's (``planner.inputs``), or measure your model's with ``remask eval`` (mean
rounds / output tokens) and pass them in. Every output block needs at least
one step. With the approximate KV cache (``kv_cache="approx"``) each block starts with one
recompute step (the paper's s) and the rest are cached steps (s'); with ``kv_cache="none"`` every
step is a recompute step.

Costs come from ``engine.latency_profile.LatencyProfile`` per TP degree d and batch b, for a class with
sequence length L = input + output:

- ``t_rec[c, d, b]``, ``t_cac[c, d, b]``: round time (ms) of a round of b recompute (cached) steps,
  i.e. the step latency a request sees at that batch;
- ``alpha = t_rec / b`` and ``beta = t_cac / b``: instance time (ms) one recompute (cached) step
  costs at that batch, the paper's alpha_d and beta_d, used by the stability constraint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.latency_profile import LatencyProfile

DEFAULT_STEPS_PER_TOKEN = {0.5: 0.18, 0.6: 0.22, 0.7: 0.25, 0.8: 0.31, 0.9: 0.40}
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def default_steps_per_token(thresholds) -> dict[float, float]:
    """``DEFAULT_STEPS_PER_TOKEN`` at other candidate thresholds: linear between its points, its end
    segments' slopes beyond them (at least 0.01 steps per token)."""
    xs = sorted(DEFAULT_STEPS_PER_TOKEN)
    ys = [DEFAULT_STEPS_PER_TOKEN[x] for x in xs]
    out = {}
    for t in thresholds:
        t = float(t)
        i = min(max(sum(x <= t for x in xs) - 1, 0), len(xs) - 2)  # the segment [xs[i], xs[i + 1]] (or an end one)
        v = ys[i] + (ys[i + 1] - ys[i]) * (t - xs[i]) / (xs[i + 1] - xs[i])
        out[t] = round(max(v, 0.01), 6)
    return out


@dataclass(frozen=True)
class StepModel:
    steps_per_token: dict[float, float] = field(default_factory=lambda: dict(DEFAULT_STEPS_PER_TOKEN))
    block_tokens: int = 32
    kv_cache: str = "approx"  # "approx": one recompute step per block, else cached; "none": all recompute
    # a class's step distribution: (share of its requests, their steps per token / the class mean), e.g. the
    # short requests that unmask a block per step; the default, one group at the mean, is the mean request
    spread: tuple[tuple[float, float], ...] = ((1.0, 1.0),)

    def __post_init__(self) -> None:
        if self.kv_cache not in ("approx", "none"):
            raise ValueError(f"kv_cache must be 'approx' or 'none', got {self.kv_cache!r}")
        if not self.steps_per_token or any(v <= 0 or not 0 <= t <= 1 for t, v in self.steps_per_token.items()):
            raise ValueError("steps_per_token needs thresholds in [0, 1] with positive steps per token")
        if (not self.spread or any(s <= 0 or f <= 0 for s, f in self.spread)
                or abs(sum(s for s, _ in self.spread) - 1.0) > 1e-6):
            raise ValueError(f"spread needs positive (share, factor) groups whose shares sum to 1, got {self.spread}")

    @property
    def thresholds(self) -> list[float]:
        return sorted(self.steps_per_token)

    def steps(self, output_tokens: float, threshold: float, factor: float = 1.0) -> tuple[int, int]:
        """(recompute steps, cached steps) of one request of this output size at this threshold
        (``factor``: a ``spread`` group's steps per token relative to the mean)."""
        blocks = max(math.ceil(output_tokens / self.block_tokens), 1)
        total = max(math.ceil(output_tokens * self.steps_per_token[threshold] * factor), blocks)
        if self.kv_cache == "none":
            return total, 0
        return blocks, total - blocks


def isolated_ms(input_tokens: float, output_tokens: float, profile: LatencyProfile, model: StepModel,
                batch: int = 1) -> float:
    """A request's latency alone at the highest threshold, its steps at this profile's step times at
    ``batch`` (the quantity ``stage1.default_slos`` scales by k, for one request's sizes)."""
    seq = input_tokens + output_tokens
    rec, cac = model.steps(output_tokens, model.thresholds[-1])
    return (rec * _round_ms(profile, "recompute", seq, seq, batch)
            + cac * _round_ms(profile, "cached", model.block_tokens, seq, batch))


@dataclass(frozen=True)
class CostTables:
    """Arrays indexed [class, threshold] (steps) and [class, degree, batch] (ms)."""

    degrees: tuple[int, ...]
    batches: tuple[int, ...]
    thresholds: tuple[float, ...]
    s_rec: np.ndarray  # (C, T)
    s_cac: np.ndarray  # (C, T)
    t_rec: np.ndarray  # (C, D, B)
    t_cac: np.ndarray  # (C, D, B)

    @property
    def alpha(self) -> np.ndarray:
        return self.t_rec / np.asarray(self.batches, dtype=float)

    @property
    def beta(self) -> np.ndarray:
        return self.t_cac / np.asarray(self.batches, dtype=float)


def _round_ms(prof: LatencyProfile, kind: str, query: float, context: float, batch: int) -> float:
    # LatencyProfile.round_ms for b identical steps of ``query`` tokens whose keys span ``context`` tokens
    # (their own query among them), without building the list
    return prof.forward_ms(kind, batch, query, max(context - query, 0.0)) + prof.overhead_ms


def cost_tables(classes, profiles: dict[int, LatencyProfile], model: StepModel,
                batches: tuple[int, ...] = DEFAULT_BATCHES) -> CostTables:
    degrees = tuple(sorted(profiles))
    thresholds = tuple(model.thresholds)
    C, D, B = len(classes), len(degrees), len(batches)
    s_rec, s_cac = np.zeros((C, len(thresholds))), np.zeros((C, len(thresholds)))
    t_rec, t_cac = np.zeros((C, D, B)), np.zeros((C, D, B))
    for i, cls in enumerate(classes):
        seq = cls.input_tokens + cls.output_tokens
        for j, th in enumerate(thresholds):
            s_rec[i, j], s_cac[i, j] = model.steps(cls.output_tokens, th)
        for k, d in enumerate(degrees):
            for m, b in enumerate(batches):
                t_rec[i, k, m] = _round_ms(profiles[d], "recompute", seq, seq, b)
                t_cac[i, k, m] = _round_ms(profiles[d], "cached", model.block_tokens, seq, b)
    return CostTables(degrees, tuple(batches), thresholds, s_rec, s_cac, t_rec, t_cac)
