"""``hierarchical``: Fast-dLLM v2's hierarchical (sub-block) decoding (SGLang's ``HierarchyBlock``).

The block is cut into sub-blocks of ``sub_block_size`` positions, counted from the block's first position.
Each step works on the first sub-block that still has masked positions only: it commits that sub-block's
masked positions whose confidence exceeds the threshold, and at least the most confident one of them. The
positions of later sub-blocks stay masked (the model still sees them and predicts them: they are context,
not output, until their sub-block's turn), so decoding proceeds left to right across sub-blocks and in
parallel within one. With ``sub_block_size`` at least the block's length it is ``threshold``.

Knob: ``threshold`` in [0, 1], lower is faster; the router's level is the threshold itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from engine.decoding.base import BlockStep, Decision, RuleBase, at_least_top, commit_only, integer, real, register


@register
@dataclass(frozen=True)
class HierarchicalRule(RuleBase):
    threshold: float = 0.9
    sub_block_size: int = 8

    name: ClassVar[str] = "hierarchical"
    knob: ClassVar[str] = "threshold"
    knob_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    speed_sign: ClassVar[int] = -1

    def __post_init__(self) -> None:
        real("threshold", self.threshold, 0.0, 1.0)
        integer("sub_block_size", self.sub_block_size, 1, 4096)

    def decide(self, step: BlockStep) -> Decision:
        t = self.knob_value(step)
        pos = np.flatnonzero(step.masked)
        commit = np.zeros(step.size, dtype=bool)
        if pos.size == 0:
            return commit_only(step, commit)
        s = (int(pos[0]) // self.sub_block_size) * self.sub_block_size
        sub = np.zeros(step.size, dtype=bool)
        sub[s : s + self.sub_block_size] = True
        sub &= step.masked
        return commit_only(step, at_least_top(step.conf, sub & (step.conf > t), 1, sub))
