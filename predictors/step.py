"""The step predictor (DiLaServe): a gradient-boosted model on the eleven
step features (``features.STEP_FEATURES``) predicting a request's remaining
denoising steps, asked once per candidate threshold. Trained on rows with the
two decoding-rule columns appended (``features.RULE_FEATURES``: the rule and
its knob), it learns steps as a function of (rule, knob); a model trained on
the eleven alone reads the first eleven columns of any wider row. Trained on
rows with the constraint's column after those (``features.CONSTRAINT_FEATURES``,
14 in all: the online learner's, when its traffic mixes constrained and free
requests), it learns a grammar's effect on the steps too.

Online use: re-predict every ``interval`` steps from the request's current
state and count down in between. ``choose_interval`` picks the coarsest
interval whose error stays within 5% of re-predicting at every step.
``predict`` is batched across requests and thresholds (one model call).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from predictors.features import with_constraint, with_decoding, with_thresholds

PARAMS = {"objective": "regression", "num_leaves": 31, "learning_rate": 0.08, "min_data_in_leaf": 20,
          "verbose": -1, "num_threads": 1, "deterministic": True, "seed": 0}
TREES = 200
INTERVALS = (1, 2, 4, 8, 16)


class StepPredictor:
    def __init__(self, booster, interval: int = 1) -> None:
        self.booster = booster
        self.interval = interval

    @classmethod
    def fit(cls, rows: np.ndarray, remaining: np.ndarray, seed: int = 0) -> StepPredictor:
        import lightgbm as lgb

        data = lgb.Dataset(np.asarray(rows, dtype=np.float64), np.log(np.asarray(remaining, dtype=np.float64)))
        return cls(lgb.train({**PARAMS, "seed": seed}, data, num_boost_round=TREES))

    @property
    def width(self) -> int:
        """The columns the model was trained on (11: the step features; 13: with the decoding rule's; 14: with
        the constraint's too)."""
        return int(self.booster.num_feature())

    def predict_rows(self, rows: np.ndarray) -> np.ndarray:
        """Remaining steps (>= 1) for state rows that carry their own threshold (and, for a decoding-aware
        model, their rule and knob; columns past the model's width are not read)."""
        rows = np.asarray(rows, dtype=np.float64)
        if not len(rows):
            return np.zeros(0)
        rows = np.atleast_2d(rows)
        if rows.shape[1] > self.width:
            rows = rows[:, : self.width]
        return np.maximum(np.exp(self.booster.predict(rows, num_threads=1)), 1.0)

    def predict(self, rows: np.ndarray, thresholds: Sequence[float], rule: str | None = None,
                constrained: float | None = None) -> np.ndarray:
        """[n, m]: remaining steps of each request under each candidate threshold (a level: with ``rule``,
        the rule's knob at it, ``features.with_decoding``; with ``constrained``, the constraint's column,
        ``features.with_constraint``, after the rule's, ``threshold``'s when no rule is given)."""
        rows = np.atleast_2d(np.asarray(rows, dtype=np.float64))
        asked = with_thresholds(rows, thresholds)
        if rule is not None or constrained is not None:
            asked = with_decoding(asked, "threshold" if rule is None else rule)
        if constrained is not None:
            asked = with_constraint(asked, constrained)
        return self.predict_rows(asked).reshape(len(rows), len(thresholds))

    def save(self, path: str | Path) -> None:
        self.booster.save_model(str(path))
        Path(str(path) + ".json").write_text(f'{{"interval": {self.interval}}}\n')

    @classmethod
    def load(cls, path: str | Path) -> StepPredictor:
        import json

        import lightgbm as lgb

        meta = Path(str(path) + ".json")
        interval = json.loads(meta.read_text())["interval"] if meta.exists() else 1
        return cls(lgb.Booster(model_file=str(path)), interval)


def online_errors(pred: StepPredictor, rows: np.ndarray, remaining: np.ndarray, done: np.ndarray, req: np.ndarray,
                  intervals: Sequence[int] = INTERVALS) -> dict[str, float]:
    """MAPE of remaining steps over every recorded step boundary.

    ``oneshot``: predicted once at the first boundary, counted down after it;
    ``every_k``: re-predicted at boundaries 1, 1+k, 1+2k, ... and counted down between.
    """
    fresh = pred.predict_rows(rows)
    order = np.lexsort((done, req))
    rows_req, rows_done, true, fresh = req[order], done[order], remaining[order].astype(float), fresh[order]
    first = np.r_[True, rows_req[1:] != rows_req[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    out = {}
    for k in (None, *intervals):
        offset = rows_done - rows_done[start]
        if k is None:
            anchor = start
        else:
            anchor = start + (offset // k) * k  # rows are consecutive steps of one request
        est = np.maximum(fresh[anchor] - (rows_done - rows_done[anchor]), 1.0)
        out["oneshot" if k is None else f"every_{k}"] = float(np.mean(np.abs(est - true) / true))
    return out


def choose_interval(errors: dict[str, float], tolerance: float = 0.05) -> int:
    best = errors["every_1"]
    ok = [int(k.split("_")[1]) for k, v in errors.items() if k.startswith("every_") and v <= best * (1 + tolerance)]
    return max(ok)
