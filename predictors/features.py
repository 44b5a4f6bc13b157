"""Feature code shared by collection, training and serving.

- Admission (DWISE): three prompt features (words, newlines, tokens after the
  chat template) plus the request's threshold, which Remask varies per request
  (the paper serves one fixed threshold, so it needs no such feature).
- Step (DiLaServe): eleven scalars describing a request at a step boundary
  (``StepFeatures``). The threshold is the first one, so one state row can be
  asked about every candidate threshold by overwriting that column. A replica
  builds them after each step (``state_row``), they travel to the ingress as
  they are (``app.protocol``), and the router's step estimators turn them back
  into model rows (``cluster.estimator.feature_row``).
- Decoding rule (``RULE_FEATURES``): a decoding-aware step model's rows carry
  two more columns after the eleven, the request's rule (``rule_code``) and
  its knob at the row's threshold (the router's candidate level, turned into
  the rule's knob by ``knob_at``), so it learns steps as a function of (rule,
  knob). ``with_decoding`` appends them; a model trained on the eleven alone
  reads the first eleven columns of a wider row (``predictors.step``), and for
  the threshold rule the extra columns say nothing new (its knob is the
  threshold).

numpy; torch only inside the functions on a step's tensors (``confidence_stats``,
``expected_blocks``), so the router, which never imports torch, shares
``StepFeatures``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

ADMISSION_FEATURES = ("words", "newlines", "tokens", "threshold")
DEFAULT_THRESHOLD = 0.9
RULE_FEATURES = ("rule", "knob")  # after STEP_FEATURES in a decoding-aware step model's rows
# each rule's code in the "rule" column: fixed, never reordered (trained models read them); a rule not listed
# gets a stable code of its own from its name (``rule_code``)
# after RULE_FEATURES: whether the request's text is held to a grammar (``constraint_value``)
CONSTRAINT_FEATURES = ("constrained",)
RULE_CODES = ("threshold", "dynamic", "low_confidence", "joint_threshold", "entropy_bound", "hierarchical",
              "credit")


class StepFeatures(NamedTuple):
    """A request's state right after one of its denoising steps: the step predictor's inputs, in the
    column order of its rows (the shipped models were trained on that order: never reorder)."""

    threshold: float  # the threshold of the step just taken (a row asked about another one overwrites it)
    output_len: float  # the output canvas, tokens
    progress: float  # fraction of the output committed
    block_progress: float  # fraction of the current block committed
    blocks_left: float  # output blocks not yet finished, the current one included
    step_in_block: float  # steps taken in the current block
    conf_min: float  # the step's confidences of the positions still masked: min, q25, median, mean, q75
    conf_q25: float
    conf_median: float
    conf_mean: float
    conf_q75: float

    def as_row(self, threshold: float | None = None) -> list[float]:
        """The model row (``STEP_FEATURES`` order); ``threshold`` replaces the first column."""
        row = list(self)
        if threshold is not None:
            row[0] = float(threshold)
        return row

    @property
    def conf_stats(self) -> tuple[float, float, float, float, float]:
        return self[6:11]


STEP_FEATURES = StepFeatures._fields


def admission_row(prompt: str, n_tokens: int, threshold: float | None) -> list[float]:
    return [float(len(prompt.split())), float(prompt.count("\n")), float(n_tokens),
            DEFAULT_THRESHOLD if threshold is None else float(threshold)]


def confidence_stats(conf: torch.Tensor | None) -> torch.Tensor:
    """min, q25, median, mean, q75 of one step's confidences of masked positions (zeros when none).

    Computed on the tensor's own device, so the engine's refine hook adds no host synchronisation."""
    import torch

    if conf is None or conf.numel() == 0:
        return torch.zeros(5)
    c = torch.sort(conf.detach().float().flatten()).values
    n = c.numel() - 1
    return torch.stack([c[0], c[round(0.25 * n)], c[round(0.5 * n)], c.mean(), c[round(0.75 * n)]])


def expected_blocks(p_eos: list[torch.Tensor | None], block_size: int, n_blocks: Sequence[int]) -> torch.Tensor:
    """Expected output blocks each request decodes, read off its first round's P(EOS) per output
    position seen (``seq.first_eos``; ``n_blocks``: blocks in each request's output budget).

    Answers are padded with EOS in training, so block k > 0 is decoded iff its first position is not
    EOS: P(reach k) = 1 - P(EOS at k * block_size), made non-increasing in k. Past the positions the
    round saw (a block-causal model sees its first block, and the engine's lookahead blocks after it)
    the answer runs on to the budget with the probability that the last position seen is not EOS.
    ``None`` (nothing seen) counts as one block. Batched on the tensors' device, no host
    synchronisation."""
    import torch

    seen = [torch.ones(1) if p is None or p.numel() == 0 else p.detach().float().flatten() for p in p_eos]
    dev = seen[0].device
    probs = torch.nn.utils.rnn.pad_sequence([p.to(dev) for p in seen], batch_first=True)  # [n, L]
    last = torch.tensor([len(p) - 1 for p in seen], device=dev)
    nb = torch.as_tensor(list(n_blocks), device=dev)
    k = torch.arange(1, max(int(max(n_blocks, default=1)), 2), device=dev)  # the blocks after the first
    idx = torch.minimum(k[None, :] * block_size, last[:, None])
    reach = torch.cummin(1.0 - probs.gather(1, idx), dim=1).values * (k[None, :] < nb[:, None])
    return 1.0 + reach.sum(1)


def step_row(threshold: float, output_len: int, unmasked: int, block_unmasked: int, block_len: int,
             blocks_left: int, step_in_block: int, conf_stats: Sequence[float]) -> StepFeatures:
    """One request's state after a step (``conf_stats`` from ``confidence_stats`` of that step)."""
    if len(conf_stats) != 5:
        raise ValueError(f"conf_stats holds min, q25, median, mean, q75: got {len(conf_stats)} values")
    return StepFeatures(float(threshold), float(output_len), unmasked / max(output_len, 1),
                        block_unmasked / max(block_len, 1), float(blocks_left), float(step_in_block), *conf_stats)


def state_row(seq, threshold: float | None) -> StepFeatures:
    """The step features of an engine ``Sequence`` right after its step at ``threshold``: collection
    records them for training, and a replica's round loop sends them to the router."""
    out = seq.tokens[seq.out_start : seq.out_end]
    unmasked = int((out != seq.cfg.mask_token_id).sum())
    if seq.block_idx < len(seq.blocks):
        bs, be = seq.blocks[seq.block_idx]
        block_len = be - bs
        block_unmasked = block_len - seq._masked((bs, be)).numel()
    else:
        block_len, block_unmasked = 1, 1
    return step_row(DEFAULT_THRESHOLD if threshold is None else threshold, seq.gen_len, unmasked, block_unmasked,
                    block_len, len(seq.blocks) - seq.block_idx, seq.step_in_block,
                    confidence_stats(seq.last_confidences).tolist())


def with_thresholds(rows: np.ndarray, thresholds: Sequence[float]) -> np.ndarray:
    """Every row once per candidate threshold: shape [n * m, 11], threshold-major within a row."""
    rows = np.asarray(rows, dtype=np.float64)
    m = len(thresholds)
    out = np.repeat(rows, m, axis=0)
    out[:, 0] = np.tile(np.asarray(thresholds, dtype=np.float64), len(rows))
    return out


def rule_code(rule: str) -> float:
    """The "rule" column's value for decoding rule ``rule``: its index in ``RULE_CODES``, or for a rule not
    listed there 100 + a stable hash of its name below 900 (never one of the listed codes)."""
    if rule in RULE_CODES:
        return float(RULE_CODES.index(rule))
    import zlib

    return float(100 + zlib.crc32(rule.encode()) % 900)


@functools.lru_cache(maxsize=64)
def _rule(name: str):
    from engine.decoding import make_rule

    return make_rule(name)


def rule_knob(rule: str, level: float) -> float:
    """Decoding rule ``rule``'s knob at the router's candidate ``level`` (a threshold; ``knob_at``)."""
    return float(_rule(rule).knob_at(level))


def decoding_columns(rule: str, level: float) -> list[float]:
    """The ``RULE_FEATURES`` columns of a row of a request decoded by ``rule`` at the router's candidate
    ``level`` (a threshold): the rule's code and its knob at that level."""
    return [rule_code(rule), rule_knob(rule, level)]


def with_decoding(rows: np.ndarray, rule: str) -> np.ndarray:
    """Rows of STEP_FEATURES (threshold first: the candidate level) with the ``RULE_FEATURES`` columns of
    ``rule`` appended: shape [n, 13] (``decoding_columns`` of each row's level, computed once per distinct
    level)."""
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    levels, inv = np.unique(rows[:, 0], return_inverse=True)
    cols = np.array([decoding_columns(rule, float(t)) for t in levels], dtype=np.float64).reshape(len(levels), 2)
    return np.concatenate([rows[:, : len(STEP_FEATURES)], cols[inv.reshape(-1)]], axis=1)


def constraint_value(constraint) -> float:
    """The "constrained" column of a request whose ``SamplingParams.constraint`` is ``constraint`` (its dict,
    a ``ConstraintSpec``, or None): 0.0 for free text, 1.0 for text held to a grammar (any kind: a JSON
    schema, a regular expression, choices, a grammar, tool calls)."""
    return 0.0 if constraint is None else 1.0


def with_constraint(rows: np.ndarray, constrained: float | Sequence[float] = 0.0) -> np.ndarray:
    """13-column rows (``STEP_FEATURES`` + ``RULE_FEATURES``) with the ``CONSTRAINT_FEATURES`` column appended:
    [n, 14]; ``constrained`` one value for every row, or one per row."""
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    col = np.broadcast_to(np.asarray(constrained, dtype=np.float64).reshape(-1, 1), (len(rows), 1))
    return np.concatenate([rows[:, : len(STEP_FEATURES) + len(RULE_FEATURES)], col], axis=1)


# the widths of step rows: the step features; with the rule's columns; with the constraint's too
STEP_WIDTHS = (len(STEP_FEATURES), len(STEP_FEATURES) + len(RULE_FEATURES),
               len(STEP_FEATURES) + len(RULE_FEATURES) + len(CONSTRAINT_FEATURES))


def decoding_rows(rows, rule: str | None = None, constrained: float = 0.0) -> np.ndarray:
    """Step rows as the online step learner keeps them, [n, 14]: rows of the 11 ``STEP_FEATURES`` (a
    replica's, or ``cluster.estimator.feature_row``'s) get ``rule``'s ``RULE_FEATURES`` columns
    (``with_decoding``; no rule: ``threshold``, whose knob is the level) and then the constraint's column
    (``constrained``: ``constraint_value``, 0 free); 13-column rows (carrying their rule's,
    ``cluster.thresholds.decoding_row``'s) get the constraint's; 14-column rows (carrying both,
    ``cluster.thresholds.request_row``'s) stay as they are. Any other width is a ValueError naming it."""
    width, wide = len(STEP_FEATURES), STEP_WIDTHS[-1]
    x = np.asarray(rows, dtype=np.float64)
    if x.size == 0:
        return np.zeros((0, wide))
    x = np.atleast_2d(x)
    if x.ndim != 2 or x.shape[1] not in STEP_WIDTHS:
        raise ValueError(f"step rows have {width} columns (STEP_FEATURES), {STEP_WIDTHS[1]} (with RULE_FEATURES) "
                         f"or {wide} (with CONSTRAINT_FEATURES too): got shape {x.shape}")
    if x.shape[1] == width:
        x = with_decoding(x, "threshold" if rule is None else rule)
    if x.shape[1] == STEP_WIDTHS[1]:
        x = with_constraint(x, constrained)
    return x


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation with average ranks for ties (nan when a side is constant)."""
    ra, rb = _ranks(np.asarray(a, dtype=np.float64)), _ranks(np.asarray(b, dtype=np.float64))
    sa, sb = ra.std(), rb.std()
    if sa == 0 or sb == 0 or math.isnan(sa * sb):
        return float("nan")
    return float(((ra - ra.mean()) * (rb - rb.mean())).mean() / (sa * sb))


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    # average ranks over ties
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return sums[inv] / counts[inv]
