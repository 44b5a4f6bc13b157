"""``low_confidence``: LLaDA's low-confidence remasking as a per-step count. Each step commits the ``k``
most confident masked positions of the block (all of them when fewer remain) and keeps the rest masked;
with ``steps_per_block`` set instead, ``k`` follows LLaDA's schedule (the block's masks spread evenly over
that many steps, the last step committing whatever is left).

Knob: ``k``, tokens per step, an integer >= 1; higher is faster. The router's level t (a threshold, higher
is slower) maps to k = max(1, round(8 * (1 - t))): 0.9 -> 1, 0.8 -> 2, 0.7 -> 2, 0.6 -> 3, 0.5 -> 4 (the
number of tokens a threshold-t step would commit on a block whose confidences were spread evenly over
[0, 1], at Remask's usual 8-token sub-block granularity)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from engine.decoding.base import BlockStep, Decision, RuleBase, at_least_top, commit_only, integer, real, register

K_MAX = 4096  # no block is longer


@register
@dataclass(frozen=True)
class LowConfidenceRule(RuleBase):
    k: int = 2
    steps_per_block: int | None = None

    name: ClassVar[str] = "low_confidence"
    knob: ClassVar[str] = "k"
    knob_range: ClassVar[tuple[float, float]] = (1, K_MAX)
    speed_sign: ClassVar[int] = +1
    knob_integral: ClassVar[bool] = True

    def __post_init__(self) -> None:
        integer("k", self.k, 1, K_MAX)
        if self.steps_per_block is not None:
            integer("steps_per_block", self.steps_per_block, 1, K_MAX)

    def knob_at(self, level: float) -> float:
        t = real("threshold", level, 0.0, 1.0)
        return max(1, int(math.floor(8.0 * (1.0 - t) + 0.5)))

    def quota(self, step_in_block: int, masked_at_start: int) -> int:
        """LLaDA's schedule: positions to commit at ``step_in_block`` of a block that began with
        ``masked_at_start`` masks, over ``steps_per_block`` steps."""
        steps = self.steps_per_block or 1
        base, extra = divmod(masked_at_start, steps)
        return base + (1 if step_in_block < extra else 0)

    def decide(self, step: BlockStep) -> Decision:
        none = np.zeros(step.size, dtype=bool)
        if step.knob is None and self.steps_per_block is not None:
            if step.step_in_block >= self.steps_per_block - 1:
                return commit_only(step, step.masked.copy())
            k = self.quota(step.step_in_block, step.masked_at_start)
        else:
            k = int(self.knob_value(step))
        return commit_only(step, at_least_top(step.conf, none, k, step.masked))
