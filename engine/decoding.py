"""Unmasking rules: which masked positions of the current block to commit.

A rule sees the confidences (top-1 probabilities) of the block's still-masked
positions and returns a selection. Rules are small strategy objects chosen by
name; the threshold may differ per request and per step (the router's
SLO-aware threshold choice passes it in), so it is an argument of select().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class UnmaskRule(Protocol):
    name: str

    def select(self, conf: torch.Tensor, step_in_block: int, masked_at_start: int,
               threshold: float | None = None) -> torch.Tensor:
        """Bool mask over ``conf`` (the masked positions): which to commit now.

        step_in_block: steps already taken on this block. masked_at_start: masked
        positions when the block began. threshold: per-request override.
        """
        ...


def _at_least_top(conf: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    k = min(max(k, 1), conf.numel())
    if int(chosen.sum()) >= k:
        return chosen
    chosen = chosen.clone()
    chosen[torch.topk(conf, k).indices] = True
    return chosen


def _check_threshold(t: float) -> float:
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {t}")
    return t


@dataclass(frozen=True)
class ThresholdRule:
    """Commit every position whose confidence exceeds the threshold, and at
    least the single most confident one (Fast-dLLM's parallel decoding)."""

    threshold: float = 0.9
    name: str = "threshold"

    def __post_init__(self) -> None:
        _check_threshold(self.threshold)

    def select(self, conf, step_in_block, masked_at_start, threshold=None):
        t = self.threshold if threshold is None else _check_threshold(threshold)
        return _at_least_top(conf, conf > t, 1)


@dataclass(frozen=True)
class DynamicRule:
    """Threshold rule with a per-step minimum: at least ``min_per_step``
    positions (or all that remain) are committed each step."""

    threshold: float = 0.9
    min_per_step: int = 2
    name: str = "dynamic"

    def __post_init__(self) -> None:
        _check_threshold(self.threshold)
        if self.min_per_step < 1:
            raise ValueError("min_per_step must be at least 1")

    def select(self, conf, step_in_block, masked_at_start, threshold=None):
        t = self.threshold if threshold is None else _check_threshold(threshold)
        return _at_least_top(conf, conf > t, self.min_per_step)


@dataclass(frozen=True)
class LowConfidenceRule:
    """LLaDA's schedule: a fixed number of steps per block, committing the most
    confident positions, the block's masks spread evenly over the steps."""

    steps_per_block: int = 8
    name: str = "low_confidence"

    def __post_init__(self) -> None:
        if self.steps_per_block < 1:
            raise ValueError("steps_per_block must be at least 1")

    def quota(self, step_in_block: int, masked_at_start: int) -> int:
        base, extra = divmod(masked_at_start, self.steps_per_block)
        return base + (1 if step_in_block < extra else 0)

    def select(self, conf, step_in_block, masked_at_start, threshold=None):
        if step_in_block >= self.steps_per_block - 1:
            return torch.ones_like(conf, dtype=torch.bool)
        k = self.quota(step_in_block, masked_at_start)
        return _at_least_top(conf, torch.zeros_like(conf, dtype=torch.bool), k)


RULES: dict[str, Callable[..., UnmaskRule]] = {
    "threshold": ThresholdRule,
    "dynamic": DynamicRule,
    "low_confidence": LowConfidenceRule,
}


def make_rule(name: str, **kwargs) -> UnmaskRule:
    try:
        factory = RULES[name]
    except KeyError:
        raise ValueError(f"unknown unmasking rule {name!r}; known: {', '.join(sorted(RULES))}") from None
    return factory(**kwargs)


def confidence(logits: torch.Tensor, mask_token_id: int | None = None,
               overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 probability, argmax token) of each row of logits [.., V], the softmax in float32.

    The mask token is never a prediction: committing it would leave the
    position masked forever. ``overwrite``: the caller's logits are scratch, so
    the mask token's column is masked in them in place (no copy of a
    vocabulary-wide tensor; the runner's LM head output).
    """
    if mask_token_id is not None and 0 <= mask_token_id < logits.shape[-1]:
        if not overwrite:
            logits = logits.clone()
        logits[..., mask_token_id] = float("-inf")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    conf, tokens = probs.max(dim=-1)
    return conf, tokens
