"""``joint_threshold``: LLaDA2.1's decoding with token editing (SGLang's ``JointThreshold``).

Each step of a block does two things at once:

- mask-to-token (M2T): commit the masked positions whose confidence exceeds ``threshold`` (at least the
  most confident one, as ``threshold`` does);
- token-to-token (T2T): rewrite every committed output position of the block (not prompt positions, not
  positions committed by this same step) whose proposed token differs from the one on the canvas and whose
  probability exceeds ``edit_threshold``.

Once nothing is masked the block enters its post-edit phase: up to ``max_post_edit_steps`` more steps of
T2T only. The block is final (``done``) when a step changes nothing (a fixed point of greedy decoding), or
when the post-edit step count reaches the bound (after that step's edits), or, with a bound of 0, with the
step that commits the last mask. (SGLang spends one more forward to notice each of these; the canvas is
the same.) ``penalty_lambda``: LLaDA2.1's repetition penalty, subtracted from each position's logit of the
token on the canvas just before it before the proposals are made; it is applied where the logits are (the
runner, ``engine.decoding.sampling.penalise_previous``), the rule only carries and validates it.

Knob: ``threshold`` in [0, 1], lower is faster; the router's level is the threshold itself. The rule's
state (per block): ``post_edit_steps``, the post-edit steps taken, and ``edits``, the edits made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from engine.decoding.base import (
    NEEDS_ALL_ROWS,
    NEEDS_CANVAS,
    BlockStep,
    Decision,
    RuleBase,
    at_least_top,
    integer,
    real,
    register,
)

MAX_POST_EDIT_STEPS = 1024


@register
@dataclass(frozen=True)
class JointThresholdRule(RuleBase):
    threshold: float = 0.5
    edit_threshold: float = 0.0
    max_post_edit_steps: int = 16
    penalty_lambda: float = 0.0

    name: ClassVar[str] = "joint_threshold"
    knob: ClassVar[str] = "threshold"
    knob_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    speed_sign: ClassVar[int] = -1
    needs: ClassVar[frozenset[str]] = frozenset({NEEDS_ALL_ROWS, NEEDS_CANVAS})
    edits: ClassVar[bool] = True

    def __post_init__(self) -> None:
        real("threshold", self.threshold, 0.0, 1.0)
        real("edit_threshold", self.edit_threshold, 0.0, 1.0)
        integer("max_post_edit_steps", self.max_post_edit_steps, 0, MAX_POST_EDIT_STEPS)
        real("penalty_lambda", self.penalty_lambda, 0.0, 1e4)

    def decide(self, step: BlockStep) -> Decision:
        t = self.knob_value(step)
        state = step.state
        post = int(state.get("post_edit_steps", 0))
        masked = step.masked
        if masked.any():
            commit = at_least_top(step.conf, masked & (step.conf > t), 1, masked)
        else:
            commit = np.zeros(step.size, dtype=bool)
            post += 1
            state["post_edit_steps"] = post
            if post > self.max_post_edit_steps:  # entered past the bound (a bound of 0): final as it stands
                state["post_edit_steps"] = self.max_post_edit_steps
                return Decision(commit, commit.copy(), True)
        # T2T over the positions committed before this step whose proposal differs from the canvas
        if step.canvas is None and step.editable.any():
            raise ValueError("joint_threshold needs the block's canvas (BlockStep.canvas)")
        edit = step.editable & (step.conf > self.edit_threshold)
        if edit.any():
            edit &= step.tokens != step.canvas
        state["edits"] = int(state.get("edits", 0)) + int(edit.sum())
        left = masked & ~commit
        if left.any():
            return Decision(commit, edit, False)
        # nothing masked after this step: final when nothing changes, or when the post-edit bound is reached
        no_change = not commit.any() and not edit.any()
        done = no_change or post >= self.max_post_edit_steps
        return Decision(commit, edit, bool(done))
