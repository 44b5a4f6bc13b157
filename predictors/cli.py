"""``remask predictors collect | train | eval``."""

from __future__ import annotations

import json
from pathlib import Path

from engine.argtypes import thresholds as _thresholds


def add_parsers(sub) -> None:
    p = sub.add_parser("predictors", help="collect data for, train and evaluate the work predictors")
    psub = p.add_subparsers(dest="predictors_command", required=True)
    c = psub.add_parser("collect", help="run the task suite through the engine and record predictor data")
    c.add_argument("--n", type=int, default=800, help="training requests (each decoded at every threshold)")
    c.add_argument("--n-heldout", type=int, default=300)
    c.add_argument("--thresholds", type=_thresholds, default=[0.5, 0.6, 0.7, 0.8, 0.9])
    t = psub.add_parser("train", help="train the admission, refinement and step predictors")
    t.add_argument("--out", help="artifact directory (default: the shipped location)")
    t.add_argument("--epochs", type=int, default=300)
    e = psub.add_parser("eval", help="rank correlation and step error on held-out requests")
    e.add_argument("--json", action="store_true")
    e.add_argument("--no-categories", action="store_true", help="skip the held-out-category retraining")
    e.add_argument("--epochs", type=int, default=300)
    e.add_argument("--artifacts", help="artifact directory (default: the shipped location)")
    for q in (c, t, e):
        q.add_argument("--model", default="tiny-bd")
        q.add_argument("--data-dir", help="where collected data lives (default: .remask/predictors)")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--device", default="cpu")
        q.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def _collect(args, which: str) -> Path:
    from engine.loading import load_engine
    from predictors.collect import collect, heldout_and_train
    from predictors.pipeline import data_paths

    train_path, held_path = data_paths(args.model, args.data_dir)
    n = getattr(args, "n", 800)
    train, held = heldout_and_train(n, getattr(args, "n_heldout", 300), seed=args.seed)
    engine = load_engine(args.model, device=args.device, max_slots=64)
    thresholds = getattr(args, "thresholds", [0.5, 0.6, 0.7, 0.8, 0.9])
    path, examples = (train_path, train) if which == "train" else (held_path, held)
    collect(engine, examples, thresholds, model=args.model, progress=not args.quiet).save(path)
    return path


def _data(args, which: str) -> dict:
    """Collected data, collecting it first when absent (with a progress bar)."""
    from predictors.collect import load_dataset
    from predictors.pipeline import data_paths

    path = data_paths(args.model, args.data_dir)[0 if which == "train" else 1]
    if not path.exists():
        _collect(args, which)
    return load_dataset(path)


def run(args) -> int:
    import torch

    from predictors.bundle import artifact_dir, load_predictors
    from predictors.pipeline import evaluate_predictors, train_predictors

    if args.device == "cpu":
        torch.set_num_threads(1)  # small models: a second thread only spins on a shared machine

    if args.predictors_command == "collect":
        for which in ("heldout", "train"):
            print(f"wrote {_collect(args, which)}")
        return 0
    if args.predictors_command == "train":
        pred = train_predictors(_data(args, "train"), args.model, seed=args.seed, epochs=args.epochs,
                                progress=not args.quiet)
        print(f"wrote {pred.save(args.out or artifact_dir(args.model))}")
        return 0
    pred = load_predictors(args.model, args.artifacts)
    train = None if args.no_categories else _data(args, "train")
    report = evaluate_predictors(pred, _data(args, "heldout"), train, epochs=args.epochs, progress=not args.quiet)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=1))
    return 0
