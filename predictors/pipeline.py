"""Training and evaluation of a model's three predictors from collected data."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from predictors.admission import AdmissionPredictor
from predictors.bundle import Predictors
from predictors.features import expected_blocks, spearman
from predictors.refine import Refiner
from predictors.step import StepPredictor, choose_interval, online_errors

DATA_DIR = Path(".remask") / "predictors"
HEADLINE_THRESHOLD = 0.9


def data_paths(model: str, data_dir: str | Path | None = None) -> tuple[Path, Path]:
    d = Path(data_dir) if data_dir else DATA_DIR
    name = Path(model).name
    return d / f"{name}-train.npz", d / f"{name}-heldout.npz"


def refine_inputs(data: dict) -> np.ndarray:
    import torch

    x = Refiner.inputs(torch.as_tensor(data["hidden"]), data["prompt_tokens"], data["budget"],
                       data["admission"][:, 3], data["first_conf"])
    return x.numpy()


def decoded_blocks(data: dict) -> np.ndarray:
    """Output blocks each request decoded."""
    return (data["block_rounds"] > 0).sum(1)


def first_round_blocks(data: dict) -> np.ndarray:
    """Expected blocks per request from its first round's P(EOS) (``features.expected_blocks``)."""
    import torch

    b = int(data["block_size"])
    rows = [torch.as_tensor(r[~np.isnan(r)]) for r in data["first_eos"]]
    return expected_blocks(rows, b, [-(-int(t) // b) for t in data["budget"]]).numpy()


def _subset(data: dict, keep: np.ndarray) -> dict:
    """Rows of the per-request arrays in ``keep`` (step rows follow their requests)."""
    n = len(data["rounds"])
    out = {k: v[keep] for k, v in data.items() if v.ndim and len(v) == n}
    out.update({k: v for k, v in data.items() if not v.ndim})
    new_index = np.full(n, -1)
    new_index[np.flatnonzero(keep)] = np.arange(int(keep.sum()))
    step_keep = keep[data["step_req"]]
    for k in ("step_rows", "step_remaining", "step_done"):
        out[k] = data[k][step_keep]
    out["step_req"] = new_index[data["step_req"][step_keep]]
    return out


def train_predictors(train: dict, model: str, seed: int = 0, epochs: int = 300, progress: bool = True) -> Predictors:
    from tqdm import tqdm

    bar = tqdm(total=4, desc=f"train predictors {model}", disable=not progress)
    admission = AdmissionPredictor.fit(train["admission"], train["rounds"], seed=seed)
    bar.update()
    refiner = Refiner.fit(refine_inputs(train), train["rounds"], epochs=epochs, blocks=decoded_blocks(train))
    bar.update()
    # the online interval is chosen on a validation fifth of the training prompts
    val = (train["prompt_id"] % 5) == 0
    fit_part, val_part = _subset(train, ~val), _subset(train, val)
    probe = StepPredictor.fit(fit_part["step_rows"], fit_part["step_remaining"], seed=seed)
    interval = choose_interval(online_errors(probe, val_part["step_rows"], val_part["step_remaining"],
                                             val_part["step_done"], val_part["step_req"]))
    bar.update()
    step = StepPredictor.fit(train["step_rows"], train["step_remaining"], seed=seed)
    step.interval = interval
    bar.update()
    bar.close()
    meta = {"model": model, "requests": int(len(train["rounds"])), "step_rows": int(len(train["step_rows"])),
            "thresholds": sorted({round(float(t), 3) for t in train["admission"][:, 3]}),
            "max_rounds": int(train["rounds"].max()), "max_blocks": int(decoded_blocks(train).max()),
            "step_interval": interval}
    return Predictors(admission, refiner, step, meta)


def evaluate_predictors(pred: Predictors, held: dict, train: dict | None = None, epochs: int = 300,
                        progress: bool = True) -> dict:
    """The issue's figures on held-out requests (headline at threshold 0.9)."""
    head = np.isclose(held["admission"][:, 3], HEADLINE_THRESHOLD)
    rounds = held["rounds"]
    adm = pred.admission.predict(held["admission"])
    ref = pred.refiner.predict(held["hidden"], held["prompt_tokens"], held["budget"], held["admission"][:, 3],
                               held["first_conf"], first_round_blocks(held))
    out = {
        "model": pred.meta.get("model"),
        "requests": int(head.sum()),
        "admission": {"spearman": round(spearman(adm[head], rounds[head]), 4),
                      "spearman_all_thresholds": round(spearman(adm, rounds), 4)},
        "refined": {"spearman": round(spearman(ref[head], rounds[head]), 4),
                    "spearman_all_thresholds": round(spearman(ref, rounds), 4),
                    "median_ratio": round(float(np.median(ref[head] / rounds[head])), 3)},
    }
    errs = online_errors(pred.step, held["step_rows"], held["step_remaining"], held["step_done"], held["step_req"])
    k = pred.step.interval
    out["step"] = {"oneshot_mape": round(errs["oneshot"], 4), "online_mape": round(errs[f"every_{k}"], 4),
                   "interval": k, "by_interval": {key: round(v, 4) for key, v in errs.items()}}
    if train is not None:
        out["heldout_category"] = heldout_categories(train, held, epochs=epochs, progress=progress)
    out["admission_us"] = round(_time_admission(pred, held), 2)
    out["refine_ms_per_round"] = round(_time_refine(pred, held), 3)
    return out


def heldout_categories(train: dict, held: dict, epochs: int = 300, progress: bool = True) -> dict:
    """Per category c: predictors trained without c, Spearman on held-out requests (threshold 0.9)
    of every category (``spearman``) and of c alone (``within``, null when c's rounds are constant)."""
    from tqdm import tqdm

    cats = sorted(set(train["category"].tolist()))
    head = np.isclose(held["admission"][:, 3], HEADLINE_THRESHOLD)
    out = {}
    for c in tqdm(cats, desc="held-out categories", disable=not progress):
        part = _subset(train, train["category"] != c)
        adm = AdmissionPredictor.fit(part["admission"], part["rounds"])
        ref = Refiner.fit(refine_inputs(part), part["rounds"], epochs=epochs, blocks=decoded_blocks(part))
        x = held["admission"][head]
        r = held["rounds"][head]
        pa = adm.predict(x)
        pr = ref.predict(held["hidden"][head], held["prompt_tokens"][head], held["budget"][head], x[:, 3],
                         held["first_conf"][head], first_round_blocks(held)[head])
        mine = held["category"][head] == c
        within = spearman(pr[mine], r[mine])
        out[c] = {"admission": round(spearman(pa, r), 4), "refined": round(spearman(pr, r), 4),
                  "refined_within": None if np.isnan(within) else round(within, 4)}
    return out


def _time_admission(pred: Predictors, held: dict, reps: int = 3) -> float:
    rows = held["admission"].tolist()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for row in rows:
            pred.admission.predict_one(row)
        best = min(best, (time.perf_counter() - t0) / len(rows))
    return best * 1e6


def _time_refine(pred: Predictors, held: dict, batch: int = 32, reps: int = 20) -> float:
    import torch

    class _Cfg:
        block_size = int(held["block_size"])

    class _Seq:  # what the engine hands the hook
        def __init__(self, i: int) -> None:
            self.cfg = _Cfg()
            self.first_hidden = torch.as_tensor(held["hidden"][i])
            self.first_confidences = torch.as_tensor(held["first_conf"][i])  # stand-in rows of the right size
            eos = held["first_eos"][i]
            self.first_eos = torch.as_tensor(eos[~np.isnan(eos)])
            self.prompt_ids = [0] * int(held["prompt_tokens"][i])
            self.max_tokens = int(held["budget"][i])
            self.threshold = float(held["admission"][i, 3])
            self.rounds = 1

    seqs = [_Seq(i % len(held["rounds"])) for i in range(batch)]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pred.refiner.hook(seqs)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3
