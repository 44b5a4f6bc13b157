"""The admission predictor (DWISE): LightGBM, 100 trees of at most 15 leaves,
on the prompt features (``features.ADMISSION_FEATURES``), regressing total
denoising rounds in log space.

Serving predicts one request at a time, where LightGBM's own ``predict`` costs
hundreds of microseconds of call overhead. ``FlatForest`` walks the same
trees from flat Python lists instead (tens of microseconds); a test checks it
agrees with LightGBM.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

PARAMS = {"objective": "regression", "num_leaves": 15, "learning_rate": 0.1, "min_data_in_leaf": 10,
          "verbose": -1, "num_threads": 1, "deterministic": True, "seed": 0}
TREES = 100


class FlatForest:
    """A LightGBM model's trees as flat arrays: numerical splits (``<=``) only."""

    def __init__(self, dump: dict) -> None:
        self.trees = []
        for tree in dump["tree_info"]:
            feat, thr, left, right, value = [], [], [], [], []
            self._flatten(tree["tree_structure"], feat, thr, left, right, value)
            self.trees.append((feat, thr, left, right, value))

    def _flatten(self, node: dict, feat, thr, left, right, value) -> int:
        i = len(feat)
        for lst in (feat, thr, left, right, value):
            lst.append(0)
        if "leaf_value" in node or "split_feature" not in node:
            feat[i], value[i] = -1, float(node.get("leaf_value", 0.0))
            return i
        if node.get("decision_type", "<=") != "<=":
            raise ValueError(f"unsupported split {node.get('decision_type')!r}")
        feat[i], thr[i] = int(node["split_feature"]), float(node["threshold"])
        left[i] = self._flatten(node["left_child"], feat, thr, left, right, value)
        right[i] = self._flatten(node["right_child"], feat, thr, left, right, value)
        return i

    def predict_one(self, x: list[float]) -> float:
        total = 0.0
        for feat, thr, left, right, value in self.trees:
            i = 0
            f = feat[0]
            while f >= 0:
                i = left[i] if x[f] <= thr[i] else right[i]
                f = feat[i]
            total += value[i]
        return total


class AdmissionPredictor:
    def __init__(self, booster) -> None:
        self.booster = booster
        self.flat = FlatForest(booster.dump_model())

    @classmethod
    def fit(cls, x: np.ndarray, rounds: np.ndarray, seed: int = 0) -> AdmissionPredictor:
        import lightgbm as lgb

        data = lgb.Dataset(np.asarray(x, dtype=np.float64), np.log(np.asarray(rounds, dtype=np.float64)))
        return cls(lgb.train({**PARAMS, "seed": seed}, data, num_boost_round=TREES))

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Total rounds for each row (batched)."""
        return np.exp(self.booster.predict(np.asarray(x, dtype=np.float64), num_threads=1))

    def predict_one(self, row: list[float]) -> float:
        return math.exp(self.flat.predict_one(row))

    def save(self, path: str | Path) -> None:
        self.booster.save_model(str(path))

    @classmethod
    def load(cls, path: str | Path) -> AdmissionPredictor:
        import lightgbm as lgb

        return cls(lgb.Booster(model_file=str(path)))
