"""The admission predictor (DWISE): LightGBM, 100 trees of at most 15 leaves,
on the prompt features (``features.ADMISSION_FEATURES``), regressing total
denoising rounds in log space.

Serving predicts one request at a time, where LightGBM's own ``predict`` takes
about 60 us per call, mostly overhead. ``FlatForest`` compiles the same trees
into one Python function (about 6 us); a test checks it agrees with LightGBM.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

PARAMS = {"objective": "regression", "num_leaves": 15, "learning_rate": 0.1, "min_data_in_leaf": 10,
          "verbose": -1, "num_threads": 1, "deterministic": True, "seed": 0}
TREES = 100


class FlatForest:
    """A LightGBM model's trees compiled into one Python function of the feature row.

    Each tree becomes a nested conditional expression (numerical ``<=`` splits
    only), so a prediction is a few hundred comparisons of straight-line
    bytecode: no per-call array set-up. The source is generated from the
    model's own dump (numbers only) and compiled once.
    """

    def __init__(self, dump: dict) -> None:
        n = int(dump.get("max_feature_idx", 0)) + 1
        terms = [self._expr(tree["tree_structure"]) for tree in dump["tree_info"]]
        args = ", ".join(f"x{i}" for i in range(n))
        src = f"def forest({args}):\n    return (" + "\n        + ".join(terms or ["0.0"]) + ")\n"
        scope: dict = {}
        exec(compile(src, "<lightgbm-forest>", "exec"), scope)  # noqa: S102 - our own generated source
        self._fn = scope["forest"]
        self.n_features = n

    def _expr(self, node: dict) -> str:
        if "split_feature" not in node:
            return repr(float(node.get("leaf_value", 0.0)))
        if node.get("decision_type", "<=") != "<=":
            raise ValueError(f"unsupported split {node.get('decision_type')!r}")
        f, thr = int(node["split_feature"]), float(node["threshold"])
        return f"({self._expr(node['left_child'])} if x{f} <= {thr!r} else {self._expr(node['right_child'])})"

    def predict_one(self, x: list[float]) -> float:
        return self._fn(*x[: self.n_features])


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
