"""Step counts and step costs the Stage-1 ILP is built from.

Steps of a class at a threshold come from ``StepModel.steps_per_token``: denoising steps per
output token at each candidate threshold. The defaults are illustrative, shaped after DiLaServe
Fig. 3a (LLaDA-8B, GSM8K: 0.9 -> 0.7 cuts steps by 38%); the live planner replaces them with
the served traffic's (``planner.inputs``), or measure your model's with ``remask eval`` (mean
rounds / output tokens) and pass them in. Every output block needs at least
one step. With the approximate KV cache (``kv_cache="approx"``) each block starts with one
recompute step (the paper's s) and the rest are cached steps (s'); with ``kv_cache="none"`` every
step is a recompute step; with an exact cache (``kv_cache="exact"``: a block-causal model, or
DiffusionGemma's canvases) every step is a cached step of one block over the sequence (a profile
with denoise rounds only prices it by them), and the prompt's own pass is not priced.

DiffusionGemma: ``DG_STEPS_PER_CANVAS`` (denoising steps per 256-token canvas of the 26B-A4B by
entropy bound) and ``dg_steps_per_token`` (by the router's level, through ``renoise``'s ``knob_at``).

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


# The embedded tiny-dg's measured steps per canvas by entropy bound (its checkpoint's bound 0.1; 32-token
# canvases; 300 held-out prompts): `remask eval --model tiny-dg --n 300 --json --entropy-bounds
# 0.05,0.1,0.2,0.4,0.8` (steps_per_canvas per bound), weights of 2026-12-05; `python scripts/model_profile.py
# --steps-curve EVAL_JSON` prints the dicts below from such a file. Its shape (relative to bound 0.1) scales
# DiffusionGemma-26B-A4B's published count at its bound 0.1: about 15-20 tokens kept per pass (the model card,
# as reported), i.e. 256 / 17.5 = 14.6 steps per 256-token canvas. A measured 26B curve replaces both.
TINY_DG_STEPS_PER_CANVAS = {0.05: 20.482, 0.1: 16.818, 0.2: 14.439, 0.4: 14.056, 0.8: 14.0}
DG_PUBLISHED_STEPS = 256 / 17.5
DG_CANVAS_TOKENS = 256
DG_BOUND = 0.1  # the 26B-A4B checkpoint's entropy bound (generation_config.json)


def scaled_steps_curve(measured: dict[float, float], at: float = DG_BOUND, steps: float = DG_PUBLISHED_STEPS) \
        -> dict[float, float]:
    """``measured`` (bound -> steps per canvas) rescaled so its value at bound ``at`` is ``steps``."""
    if at not in measured:
        raise ValueError(f"the measured steps curve has no bound {at}: {sorted(measured)}")
    return {b: round(v * steps / measured[at], 3) for b, v in sorted(measured.items())}


DG_STEPS_PER_CANVAS = scaled_steps_curve(TINY_DG_STEPS_PER_CANVAS)


def steps_at_bound(curve: dict[float, float], bound: float) -> float:
    """Steps per canvas at ``bound``: linear in log(bound) between the curve's points, its end values beyond."""
    xs = sorted(curve)
    if bound <= xs[0]:
        return curve[xs[0]]
    if bound >= xs[-1]:
        return curve[xs[-1]]
    for a, b in zip(xs, xs[1:]):
        if a <= bound <= b:
            w = math.log(bound / a) / math.log(b / a)
            return curve[a] + w * (curve[b] - curve[a])
    return curve[xs[-1]]


def dg_bound(level: float, bound: float = DG_BOUND) -> float:
    """The entropy bound the router's ``level`` gives a DiffusionGemma request (``RenoiseRule.knob_at``)."""
    from engine.decoding.renoise import RenoiseRule

    return RenoiseRule(entropy_bound=bound).knob_at(level)


def dg_steps_per_token(levels=(0.5, 0.6, 0.7, 0.8, 0.9), curve: dict[float, float] | None = None,
                       canvas: int = DG_CANVAS_TOKENS) -> dict[float, float]:
    """Steps per output token by the router's level, for ``StepModel.steps_per_token``."""
    curve = DG_STEPS_PER_CANVAS if curve is None else curve
    return {float(lv): round(steps_at_bound(curve, dg_bound(lv)) / canvas, 6) for lv in levels}


@dataclass(frozen=True)
class StepModel:
    steps_per_token: dict[float, float] = field(default_factory=lambda: dict(DEFAULT_STEPS_PER_TOKEN))
    block_tokens: int = 32
    kv_cache: str = "approx"  # "approx": one recompute step per block, else cached; "none": all recompute;
    # "exact": all cached
    # a class's step distribution: (share of its requests, their steps per token / the class mean), e.g. the
    # short requests that unmask a block per step; the default, one group at the mean, is the mean request
    spread: tuple[tuple[float, float], ...] = ((1.0, 1.0),)

    def __post_init__(self) -> None:
        if self.kv_cache not in ("approx", "none", "exact"):
            raise ValueError(f"kv_cache must be 'approx', 'none' or 'exact', got {self.kv_cache!r}")
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
        if self.kv_cache == "exact":
            return 0, total
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
