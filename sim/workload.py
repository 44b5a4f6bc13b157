"""Workload models for the simulator.

``dwise_workload`` is distribution-driven, calibrated to the DWISE paper's
LLaDA2.1-mini workload: its eight request categories and their shares
(Table 1), denoising rounds per request with p25 14, p50 46, p90 149 and a
maximum of 279, 32-token blocks, ~10K-token long-context prompts and a
256-token output budget.

``dg_workload`` is DiffusionGemma-26B-A4B's canvases: prompts and output budgets of a chat mix, each
256-token canvas taking the steps ``planner.costs.DG_STEPS_PER_CANVAS`` gives at the request's entropy
bound (the router's level through ``renoise``'s ``knob_at``), times a log-normal spread.

Predictions are a stated stand-in: admission and refined estimates are the
true rounds times log-normal noise whose spread is calibrated so their
Spearman correlation with the truth matches the paper's measured predictors
(admission 0.74, refined after the first round 0.87).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from engine.scheduler.types import SchedRequest


@dataclass
class SimRequestSpec:
    req_id: str
    category: str
    arrival: float
    prompt_tokens: int
    block_rounds: list[int]  # denoising rounds of each output block
    admission_est: float
    refined_est: float
    predicted_output_tokens: float
    output_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def true_rounds(self) -> int:
        return sum(self.block_rounds)


# category: (serving share, prompt tokens median, sigma, rounds median, sigma, output blocks lo, hi)
DWISE_CATEGORIES = {
    "chat": (1085, 220, 0.8, 105, 0.55, 8, 8),
    "instruction": (296, 160, 0.5, 100, 0.5, 6, 8),
    "code": (592, 180, 0.5, 44, 0.6, 6, 8),
    "math": (766, 120, 0.5, 40, 0.6, 6, 8),
    "multilingual_math": (258, 140, 0.4, 34, 0.5, 6, 8),
    "mcq": (637, 320, 0.4, 7, 0.6, 1, 2),
    "hard_mcq": (312, 160, 0.4, 3, 0.4, 1, 1),
    "long_context": (150, 10000, 0.05, 24, 0.4, 1, 2),
}
MAX_ROUNDS = 279
BLOCK = 32
BUDGET_TOKENS = 256


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else 0.0


def noisy_estimates(true: list[int], target_rho: float, rng: random.Random, tol: float = 0.01) -> list[float]:
    """true x exp(sigma * z), with sigma bisected until Spearman(estimate, true) ~ target_rho."""
    z = [rng.gauss(0, 1) for _ in true]
    lo, hi = 0.0, 5.0
    est = [float(t) for t in true]
    for _ in range(30):
        sigma = (lo + hi) / 2
        est = [t * math.exp(sigma * e) for t, e in zip(true, z)]
        rho = spearman(est, [float(t) for t in true])
        if abs(rho - target_rho) < tol:
            break
        lo, hi = (sigma, hi) if rho > target_rho else (lo, sigma)
    return est


def _split_rounds(total: int, blocks: int, rng: random.Random) -> list[int]:
    blocks = max(1, min(blocks, total))
    weights = [rng.expovariate(1.0) for _ in range(blocks)]
    s = sum(weights)
    extra = total - blocks
    parts = [1 + int(extra * w / s) for w in weights]
    parts[rng.randrange(blocks)] += total - sum(parts)
    return parts


def dwise_workload(n: int, seed: int = 0, admission_rho: float = 0.74,
                   refined_rho: float = 0.87) -> list[SimRequestSpec]:
    """n requests in the DWISE mix; arrival times are left at 0 (see arrivals)."""
    rng = random.Random(seed)
    names = list(DWISE_CATEGORIES)
    shares = [DWISE_CATEGORIES[c][0] for c in names]
    specs = []
    for i in range(n):
        cat = rng.choices(names, weights=shares)[0]
        _, p_med, p_sig, r_med, r_sig, b_lo, b_hi = DWISE_CATEGORIES[cat]
        prompt = max(8, int(p_med * math.exp(p_sig * rng.gauss(0, 1))))
        rounds = min(MAX_ROUNDS, max(1, round(r_med * math.exp(r_sig * rng.gauss(0, 1)))))
        blocks = rng.randint(b_lo, b_hi)
        out_tokens = min(BUDGET_TOKENS, blocks * BLOCK - rng.randrange(BLOCK) if blocks < 8 else BUDGET_TOKENS)
        specs.append(SimRequestSpec(f"r{i}", cat, 0.0, prompt, _split_rounds(rounds, blocks, rng), 0.0, 0.0,
                                    out_tokens * math.exp(0.4 * rng.gauss(0, 1)), out_tokens))
    true = [s.true_rounds for s in specs]
    for s, a, r in zip(specs, noisy_estimates(true, admission_rho, rng), noisy_estimates(true, refined_rho, rng)):
        s.admission_est, s.refined_est = a, r
    return specs


# DiffusionGemma requests: prompt tokens (median, sigma), output tokens (median, sigma, cap), and the spread
# (sigma) of a canvas's steps around the curve's mean; a canvas never takes more than the rule's step cap
DG_PROMPT = (160, 0.7)
DG_OUTPUT = (300, 0.6, 1024)
DG_STEP_SIGMA = 0.3
DG_MAX_STEPS = 48  # max_denoising_steps


def dg_workload(n: int, seed: int = 0, level: float = 0.9, canvas: int = 256,
                curve: dict[float, float] | None = None) -> list[SimRequestSpec]:
    """n DiffusionGemma requests at the router's ``level`` (module doc); arrival times left at 0. Each request
    is estimated as the live instance does: its canvases times the step cap at admission, its first canvas's
    steps times its canvases once that canvas stops (``refined_est``, given then by the canvas runner)."""
    from planner.costs import DG_STEPS_PER_CANVAS, dg_bound, steps_at_bound

    mean = steps_at_bound(DG_STEPS_PER_CANVAS if curve is None else curve, dg_bound(level))
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        prompt = max(8, int(DG_PROMPT[0] * math.exp(DG_PROMPT[1] * rng.gauss(0, 1))))
        out = min(DG_OUTPUT[2], max(16, int(DG_OUTPUT[0] * math.exp(DG_OUTPUT[1] * rng.gauss(0, 1)))))
        canvases = -(-out // canvas)
        steps = [min(DG_MAX_STEPS, max(1, round(mean * math.exp(DG_STEP_SIGMA * rng.gauss(0, 1)
                                                                 - DG_STEP_SIGMA ** 2 / 2))))
                 for _ in range(canvases)]
        specs.append(SimRequestSpec(f"r{i}", "chat", 0.0, prompt, steps, float(canvases * DG_MAX_STEPS),
                                    float(steps[0] * canvases), float(out), out, extra={"level": level}))
    return specs


def set_arrivals(specs: list[SimRequestSpec], pattern: str, rate: float = 16.0, seed: int = 0) -> None:
    """burst: all at t = 0; burst-poisson: half at t = 0, the rest Poisson at ``rate`` req/s; poisson: all
    Poisson at ``rate`` req/s from t = 0."""
    rng = random.Random(seed + 7919)
    if pattern == "burst":
        for s in specs:
            s.arrival = 0.0
    elif pattern == "burst-poisson":
        half = len(specs) // 2
        t = 0.0
        for i, s in enumerate(specs):
            if i >= half:
                t += rng.expovariate(rate)
            s.arrival = 0.0 if i < half else t
    elif pattern == "poisson":
        t = 0.0
        for s in specs:
            s.arrival = t
            t += rng.expovariate(rate)
    else:
        raise ValueError(f"unknown arrival pattern {pattern!r}; known: burst, burst-poisson, poisson")


def sched_request(spec: SimRequestSpec, block: int = BLOCK, full_sequence: bool = False) -> SchedRequest:
    return SchedRequest(
        req_id=spec.req_id,
        prompt_blocks=math.ceil(spec.prompt_tokens / block),
        output_blocks=len(spec.block_rounds),
        est_rounds=spec.admission_est,
        arrival=spec.arrival,
        predicted_output_tokens=spec.predicted_output_tokens,
        true_rounds=spec.true_rounds,
        full_sequence=full_sequence,
    )
