"""``threshold`` (Fast-dLLM's parallel decoding, Remask's default) and ``dynamic`` (the same with a per-step
minimum): commit every masked position whose confidence exceeds the threshold, and at least the most
confident one (``min_per_step`` of them for ``dynamic``) so every step makes progress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine.decoding.base import BlockStep, Decision, RuleBase, at_least_top, commit_only, integer, real, register


@register
@dataclass(frozen=True)
class ThresholdRule(RuleBase):
    """Commit every masked position whose confidence exceeds the threshold, and at least the single most
    confident one. Knob: ``threshold`` in [0, 1]; lower is faster (more positions pass)."""

    threshold: float = 0.9

    name: ClassVar[str] = "threshold"
    knob: ClassVar[str] = "threshold"
    knob_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    speed_sign: ClassVar[int] = -1

    def __post_init__(self) -> None:
        real("threshold", self.threshold, 0.0, 1.0)

    def decide(self, step: BlockStep) -> Decision:
        t = self.knob_value(step)
        return commit_only(step, at_least_top(step.conf, step.masked & (step.conf > t), 1, step.masked))


@register
@dataclass(frozen=True)
class DynamicRule(RuleBase):
    """The threshold rule with a per-step minimum: at least ``min_per_step`` positions (or all that remain)
    are committed each step. Knob: ``threshold``."""

    threshold: float = 0.9
    min_per_step: int = 2

    name: ClassVar[str] = "dynamic"
    knob: ClassVar[str] = "threshold"
    knob_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    speed_sign: ClassVar[int] = -1

    def __post_init__(self) -> None:
        real("threshold", self.threshold, 0.0, 1.0)
        integer("min_per_step", self.min_per_step, 1)

    def decide(self, step: BlockStep) -> Decision:
        t = self.knob_value(step)
        return commit_only(step, at_least_top(step.conf, step.masked & (step.conf > t), self.min_per_step,
                                              step.masked))
