"""Predictor calibration for the report: the shipped predictors of an embedded model on its held-out set.

Uses the predictors package's own evaluation (``evaluate_predictors``, without the held-out-category
retraining, which takes about ten minutes) and keeps the per-request predictions for the calibration
plot. The held-out data are collected first when absent (``remask predictors collect``'s held-out half:
300 prompts x 5 thresholds, about a minute on two cores).
"""

from __future__ import annotations

import numpy as np


def heldout_data(model: str, data_dir: str | None = None, progress: bool = False) -> dict:
    from predictors.collect import collect, heldout_and_train, load_dataset
    from predictors.pipeline import data_paths

    path = data_paths(model, data_dir)[1]
    if not path.exists():
        from engine.loading import load_engine

        _, held = heldout_and_train(800, 300, seed=0)  # the CLI's defaults: the same held-out prompts
        engine = load_engine(model, device="cpu", max_slots=64)
        collect(engine, held, [0.5, 0.6, 0.7, 0.8, 0.9], model=model, progress=progress).save(path)
    return load_dataset(path)


def calibration(model: str = "tiny-bd", data_dir: str | None = None, progress: bool = False) -> dict:
    import torch

    from predictors.bundle import load_predictors
    from predictors.pipeline import HEADLINE_THRESHOLD, evaluate_predictors

    torch.set_num_threads(1)
    held = heldout_data(model, data_dir, progress)
    pred = load_predictors(model)
    report = evaluate_predictors(pred, held, None, progress=False)
    head = np.isclose(held["admission"][:, 3], HEADLINE_THRESHOLD)
    adm = pred.admission.predict(held["admission"])[head]
    ref = pred.refiner.predict(held["hidden"], held["prompt_tokens"], held["budget"], held["admission"][:, 3],
                               held["first_conf"])[head]
    rounds = held["rounds"][head].astype(float)
    report["admission"]["median_ratio"] = round(float(np.median(adm / rounds)), 3)
    report["points"] = {"rounds": rounds.tolist(), "admission": np.asarray(adm, float).tolist(),
                        "refined": np.asarray(ref, float).tolist()}
    return report
