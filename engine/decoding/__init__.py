"""Decoding: which masked positions of a request's current block to commit (and which committed ones an
editing rule rewrites) at each step, and the per-position proposals the rules choose from.

- ``engine.decoding.base``: the seam (``BlockStep``, ``Decision``, ``DecodingRule``, ``RULES``,
  ``make_rule``, ``apply_decision``).
- one module per rule, registered by name on import: ``threshold``, ``dynamic``, ``low_confidence``,
  ``joint_threshold``, ``entropy_bound``, ``hierarchical``, ``credit``.
- ``engine.decoding.sampling`` (torch; loaded on first use of its names): (confidence, token) per row,
  greedy or seeded sampling, and the per-position statistics some rules need (``entropy``, ``token_prob``).

Every name the engine imported from the old ``engine/decoding.py`` is exported here.
"""

from __future__ import annotations

from engine.decoding.base import (
    KNOWN_NEEDS,
    NEEDS_ALL_ROWS,
    NEEDS_CANVAS,
    NEEDS_CURRENT_PROB,
    NEEDS_ENTROPY,
    RULES,
    BlockStep,
    Decision,
    DecodingRule,
    Registry,
    RuleBase,
    apply_decision,
    make_rule,
    register,
)
from engine.decoding.credit import CreditRule
from engine.decoding.entropy_bound import EntropyBoundRule
from engine.decoding.hierarchical import HierarchicalRule
from engine.decoding.joint_threshold import JointThresholdRule
from engine.decoding.low_confidence import LowConfidenceRule
from engine.decoding.threshold import DynamicRule, ThresholdRule

UnmaskRule = DecodingRule  # the old name of the interface (its select() lives on in RuleBase)

# the torch side (sampling.py) loads on first use: the rules and their metadata stay importable without
# torch, so the router, the simulator and the predictors can read a rule's knob, range and direction
_SAMPLING = ("confidence", "entropy", "filter_logits", "gumbel_noise", "noise_seeds", "penalise_previous", "sample",
             "token_prob")


def __getattr__(name: str):
    if name in _SAMPLING:
        from engine.decoding import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module 'engine.decoding' has no attribute {name!r}")

__all__ = [
    "KNOWN_NEEDS", "NEEDS_ALL_ROWS", "NEEDS_CANVAS", "NEEDS_CURRENT_PROB", "NEEDS_ENTROPY", "RULES", "BlockStep",
    "CreditRule", "Decision", "DecodingRule", "DynamicRule", "EntropyBoundRule", "HierarchicalRule",
    "JointThresholdRule", "LowConfidenceRule", "Registry", "RuleBase", "ThresholdRule", "UnmaskRule",
    "apply_decision", "confidence", "entropy", "filter_logits", "gumbel_noise", "make_rule", "noise_seeds",
    "penalise_previous", "register", "sample", "token_prob",
]
