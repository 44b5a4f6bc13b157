"""``credit``: dInfer's credit decoding (``CreditThresholdParallelDecoder``).

A position's predictions over the steps of a block earn credit: at each step every masked position's
top-1 token gains ``conf ** boost`` of credit, and all credit decays by ``decay`` per step before it. The
decision is the threshold rule's, made on the credit-fused distribution softmax(logits + alpha *
log(1 + credit)): a token the model has kept proposing is committed sooner than its probability in this
step alone would allow.

The rule sees only this step's top-1 (token, probability) per position, not the whole distribution, so
it keeps credit per (position, token) for the tokens that were top-1 (the only ones dInfer credits) and
fuses as if the rest of the distribution carried none:

    fused = p * (1 + C) ** alpha / (p * (1 + C) ** alpha + 1 - p)

for this step's top-1 token with probability p and credit C. That is dInfer's fused probability exactly
when no other token of the position holds credit (its top-1 has not changed in the block), and an upper
bound otherwise; the committed token is this step's top-1 (dInfer's is the fused argmax, which differs
only when another, credited token overtakes it).

Knob: ``threshold`` on the fused probability, in [0, 1], lower is faster; the router's level is the
threshold itself. State (per block): ``credit``, for each block position a list of [token, credit].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from engine.decoding.base import BlockStep, Decision, RuleBase, at_least_top, commit_only, real, register

CREDIT_FLOOR = 1e-6  # credit below this is forgotten (keeps the state small)


@register
@dataclass(frozen=True)
class CreditRule(RuleBase):
    threshold: float = 0.9
    alpha: float = 0.7  # weight of log(1 + credit) in the fused logits (dInfer's credit_alpha)
    decay: float = 0.8  # credit kept per step (dInfer's decay_beta)
    boost: float = 0.2  # a step adds conf ** boost (dInfer's boost_gamma)

    name: ClassVar[str] = "credit"
    knob: ClassVar[str] = "threshold"
    knob_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    speed_sign: ClassVar[int] = -1

    def __post_init__(self) -> None:
        real("threshold", self.threshold, 0.0, 1.0)
        real("alpha", self.alpha, 0.0, 10.0)
        real("decay", self.decay, 0.0, 1.0)
        real("boost", self.boost, 0.0, 10.0)

    def update(self, step: BlockStep) -> np.ndarray:
        """Decay the block's credit, add this step's, and return the credit of each position's top-1 token."""
        n = step.size
        credit = step.state.get("credit")
        if credit is None or len(credit) != n:
            credit = [[] for _ in range(n)]
        now = np.zeros(n, dtype=np.float64)
        for i in range(n):
            kept = [[tok, c * self.decay] for tok, c in credit[i] if c * self.decay >= CREDIT_FLOOR]
            if step.masked[i]:
                tok, gain = int(step.tokens[i]), float(step.conf[i]) ** self.boost
                for entry in kept:
                    if entry[0] == tok:
                        entry[1] += gain
                        break
                else:
                    kept.append([tok, gain])
                now[i] = next(c for t, c in kept if t == tok)
            credit[i] = kept
        step.state["credit"] = credit
        return now

    def fused(self, conf: np.ndarray, credit: np.ndarray) -> np.ndarray:
        p = conf.astype(np.float64)
        w = p * (1.0 + credit) ** self.alpha
        return w / np.maximum(w + (1.0 - p), 1e-300)

    def decide(self, step: BlockStep) -> Decision:
        t = self.knob_value(step)
        fused = self.fused(step.conf, self.update(step))
        masked = step.masked
        return commit_only(step, at_least_top(fused, masked & (fused > t), 1, masked))
