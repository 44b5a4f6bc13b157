"""``entropy_bound``: the entropy-bounded (EB) sampler for masked diffusion models (Ben-Hamu et al.,
"Accelerated Sampling from Masked Diffusion Models via Entropy Bounded Unmasking", arXiv 2505.24857;
SGLang's ``EBSampling``).

Each step orders the block's masked positions by the entropy of their distributions, lowest first, and
commits the longest prefix U of that order whose entropies, less the largest of them, sum to at most
``gamma``: sum(H(U)) - max(H(U)) <= gamma (the paper's bound on the dependence error the parallel commit
adds). The lowest-entropy position always commits; ties in entropy go to the lower position.

Knob: ``gamma`` (nats) in [0, 1000], higher is faster. The router's level t (a threshold) maps to
gamma = -ln(t) (t = 0: the top of the range): a single position's entropy is at least its min-entropy
-ln(max p), so a position whose entropy fits a budget of -ln(t) has top-1 probability at least t: the
budget is the entropy counterpart of threshold t (0.9 -> 0.105, 0.7 -> 0.357, 0.5 -> 0.693).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from engine.decoding.base import NEEDS_ENTROPY, BlockStep, Decision, RuleBase, commit_only, real, register

GAMMA_MAX = 1000.0


@register
@dataclass(frozen=True)
class EntropyBoundRule(RuleBase):
    gamma: float = 0.15

    name: ClassVar[str] = "entropy_bound"
    knob: ClassVar[str] = "gamma"
    knob_range: ClassVar[tuple[float, float]] = (0.0, GAMMA_MAX)
    speed_sign: ClassVar[int] = +1
    needs: ClassVar[frozenset[str]] = frozenset({NEEDS_ENTROPY})

    def __post_init__(self) -> None:
        real("gamma", self.gamma, 0.0, GAMMA_MAX)

    def knob_at(self, level: float) -> float:
        t = real("threshold", level, 0.0, 1.0)
        return GAMMA_MAX if t <= 0.0 else min(GAMMA_MAX, max(0.0, -math.log(t)))

    def decide(self, step: BlockStep) -> Decision:
        if step.entropy is None:
            raise ValueError("entropy_bound needs per-position entropies (BlockStep.entropy)")
        gamma = self.knob_value(step)
        pos = np.flatnonzero(step.masked)
        commit = np.zeros(step.size, dtype=bool)
        if pos.size == 0:
            return commit_only(step, commit)
        h = step.entropy[pos].astype(np.float64)
        order = np.argsort(h, kind="stable")
        sorted_h = h[order]
        # position j of the order joins when the entropies before it (the set less its largest) fit gamma
        before = np.concatenate(([0.0], np.cumsum(sorted_h)[:-1]))
        n = max(1, int((before <= gamma).sum()))  # entropies are >= 0: the fitting ones are a prefix
        commit[pos[order[:n]]] = True
        return commit_only(step, commit)
