"""Feature code shared by collection, training and serving.

- Admission (DWISE): three prompt features (words, newlines, tokens after the
  chat template) plus the request's threshold, which Remask varies per request
  (the paper serves one fixed threshold, so it needs no such feature).
- Step (DiLaServe): eleven scalars describing a request at a step boundary.
  The threshold is the first one, so one state row can be asked about every
  candidate threshold by overwriting that column.

numpy, and torch for the confidence statistics of a step's tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

ADMISSION_FEATURES = ("words", "newlines", "tokens", "threshold")
STEP_FEATURES = (
    "threshold", "output_len", "progress", "block_progress", "blocks_left", "step_in_block",
    "conf_min", "conf_q25", "conf_median", "conf_mean", "conf_q75",
)
DEFAULT_THRESHOLD = 0.9


def admission_row(prompt: str, n_tokens: int, threshold: float | None) -> list[float]:
    return [float(len(prompt.split())), float(prompt.count("\n")), float(n_tokens),
            DEFAULT_THRESHOLD if threshold is None else float(threshold)]


def confidence_stats(conf: torch.Tensor | None) -> torch.Tensor:
    """min, q25, median, mean, q75 of one step's confidences of masked positions (zeros when none).

    Computed on the tensor's own device, so the engine's refine hook adds no host synchronisation."""
    if conf is None or conf.numel() == 0:
        return torch.zeros(5)
    c = torch.sort(conf.detach().float().flatten()).values
    n = c.numel() - 1
    return torch.stack([c[0], c[round(0.25 * n)], c[round(0.5 * n)], c.mean(), c[round(0.75 * n)]])


def step_row(threshold: float, output_len: int, unmasked: int, block_unmasked: int, block_len: int,
             blocks_left: int, step_in_block: int, conf_stats: list[float]) -> list[float]:
    """One request's state after a step (``conf_stats`` from ``confidence_stats`` of that step)."""
    return [float(threshold), float(output_len), unmasked / max(output_len, 1), block_unmasked / max(block_len, 1),
            float(blocks_left), float(step_in_block), *conf_stats]


def state_row(seq, threshold: float | None) -> list[float]:
    """The step row of an engine ``Sequence`` right after its step at ``threshold``: collection
    records it for training, and a replica's round loop sends it to the router."""
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
