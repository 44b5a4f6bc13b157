"""The predictors of one model, as shipped: load, check, attach to an instance.

Artifacts live in ``predictors/artifacts/<model>/``: ``admission.txt`` and
``step.txt`` (LightGBM), ``step.txt.json`` (online interval), ``refine.safetensors``
(survival MLPs and isotonic map) and ``meta.json`` (what they were trained on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from predictors.admission import AdmissionPredictor
from predictors.features import admission_row
from predictors.refine import Refiner
from predictors.step import StepPredictor

ARTIFACTS_DIR = Path(__file__).resolve().parent / "artifacts"
LOOKAHEAD_BLOCKS = 8  # masked blocks a block-causal request's lookahead round appends (Engine.lookahead)
FILES = ("admission.txt", "refine.safetensors", "step.txt", "meta.json")


class PredictorError(ValueError):
    """Missing or unreadable predictor artifacts."""


def artifact_dir(model: str) -> Path:
    """The shipped directory of an embedded model, or ``<checkpoint>/predictors`` for a path."""
    path = Path(model)
    if path.is_dir():
        return path / "predictors"
    return ARTIFACTS_DIR / model


@dataclass
class Predictors:
    admission: AdmissionPredictor
    refiner: Refiner
    step: StepPredictor
    meta: dict

    def admission_estimate(self, seq) -> float:
        """Instance estimator: total rounds of a newly added sequence."""
        row = admission_row(seq.prompt_text, len(seq.prompt_ids), seq.threshold)
        return self.admission.predict_one(row)

    def attach(self, instance, lookahead: int = LOOKAHEAD_BLOCKS) -> None:
        """Admission estimates for new requests; refinement inside the engine's rounds."""
        want = instance.engine.cfg.hidden_size + 8
        if self.refiner.mean.numel() != want:
            raise PredictorError(f"these predictors take {self.refiner.mean.numel()} inputs, the model gives {want}: "
                                 f"retrain them (`remask predictors train --model {self.meta.get('model')}`)")
        instance.estimator = self.admission_estimate
        self.hook_into(instance.engine, lookahead)

    def hook_into(self, engine, lookahead: int = LOOKAHEAD_BLOCKS) -> None:
        """Refinement inside ``engine``'s rounds, with the engine's lookahead on (``lookahead`` blocks):
        a block-causal request whose first block does not end its answer is refined after its
        second round, with P(EOS) over the blocks after it (the refiner's structural term), as
        when these predictors were collected."""
        engine.refine_hook = self.refiner.hook
        engine.lookahead = lookahead

    def save(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.admission.save(out / "admission.txt")
        self.refiner.save(out / "refine.safetensors")
        self.step.save(out / "step.txt")
        (out / "meta.json").write_text(json.dumps(self.meta, indent=1) + "\n")
        return out


def load_predictors(model: str, directory: str | Path | None = None) -> Predictors:
    d = Path(directory) if directory else artifact_dir(model)
    missing = [f for f in FILES if not (d / f).exists()]
    if missing:
        raise PredictorError(f"predictors for {model!r} not found in {d} (missing {', '.join(missing)}); "
                             f"train them with `remask predictors collect --model {model}` and "
                             f"`remask predictors train --model {model}`")
    try:
        return Predictors(AdmissionPredictor.load(d / "admission.txt"), Refiner.load(d / "refine.safetensors"),
                          StepPredictor.load(d / "step.txt"), json.loads((d / "meta.json").read_text()))
    except Exception as exc:  # lightgbm, safetensors and json each raise their own types
        raise PredictorError(f"predictors for {model!r} in {d} are corrupt: {exc}") from exc
