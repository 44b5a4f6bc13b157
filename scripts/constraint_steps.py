"""Does the step predictor need to know that a request is constrained? Measured on an embedded model (tiny-bd
by default): held-out task-suite prompts decoded at each threshold without and with the constraint of their
category (``scripts.structured_bench.constraint_for``: a regular expression or the choices), the replica's step
rows recorded after every denoising step (``predictors.features.state_row``, as a replica sends them), and then
the online step learner (``predictors.online.OnlineStepLearner``, its refit as served) trained on a mix of
constrained and free requests twice: once with the constraint column (``features.CONSTRAINT_FEATURES``: 1 for
a constrained request's rows) and once blind to it (every row 0, as before the column). Both are scored on
requests of prompts neither saw: MAPE of the remaining steps over every step row, overall, per threshold and
on the constrained and the prose rows, and the mean signed error on constrained rows (negative: too few steps
predicted). Several splits (``--splits``: which prompts train, which are constrained), mean and spread.

    OMP_NUM_THREADS=1 python -m scripts.constraint_steps [--model tiny-bd] [--n 60] [--thresholds 0.5 0.9]
        [--mix 0.5] [--splits 5]

Why it differs (reports/structured.md): at 0.5 a constrained story takes more rounds per token (the grammar
remasks the provisional tokens it refuses), at 0.9 fewer (jump-forward writes forced tokens without the
model), so the column matters with the threshold, not as a constant factor.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.commands import SamplingParams
from predictors.features import constraint_value, state_row
from scripts.structured_bench import constraint_for
from tasksuite import CATEGORIES, heldout_set


def decode(engine, examples, threshold: float, constrained: bool, max_tokens: int) -> list[dict]:
    """Every example in one batch: per request its step rows (11 features after each denoising step but the
    last), the steps done at each, its total steps, and its constraint column."""
    seqs, rows = [], {}
    for ex in examples:
        spec = constraint_for(ex.category, ex.prompt).to_dict() if constrained else None
        seq = engine.add_request(ex.prompt, SamplingParams(max_tokens=max_tokens, threshold=threshold,
                                                           constraint=spec))
        seqs.append((ex, seq, spec))
        rows[seq.seq_id] = []
    while not all(s.finished for _, s, _ in seqs):
        result = engine.step()
        for rep in result.reports:
            if rep.kind.value == "prefill" or rep.finished:
                continue
            seq = engine.sequences[rep.seq_id]
            rows[seq.seq_id].append((list(state_row(seq, threshold)), seq.rounds))
    out = []
    for ex, seq, spec in seqs:
        r = rows[seq.seq_id]
        out.append({"category": ex.category, "threshold": threshold, "constrained": constraint_value(spec),
                    "rows": np.array([x for x, _ in r], dtype=np.float64).reshape(-1, 11),
                    "done": np.array([d for _, d in r], dtype=np.float64), "total": seq.rounds,
                    "tokens": len(engine.output(seq).token_ids)})
        engine.sequences.pop(seq.seq_id, None)
    return out


def learner_for(train: list[dict], aware: bool, seed: int):
    """The online step learner after recording ``train`` (finished requests) and one refit; ``aware``: the rows
    carry the request's constraint column, else 0 on every row (blind to it)."""
    from predictors.online import OnlineStepLearner

    learner = OnlineStepLearner(window=len(train) + 1, min_requests=2, refit_every=10**9, seed=seed)
    for r in train:
        learner.record(r["rows"], r["done"], r["total"], last_threshold=r["threshold"],
                       constrained=r["constrained"] if aware else 0.0)
    learner.refit()
    return learner


def scores(learner, test: list[dict]) -> dict[str, float]:
    """MAPE of remaining steps over the test requests' rows (each row with its own constraint column), per
    group, and the mean signed relative error on constrained rows."""
    from predictors.features import decoding_rows

    xs, ys, groups = [], [], []
    for r in test:
        if not len(r["rows"]):
            continue
        keep = r["done"] < r["total"]
        xs.append(decoding_rows(r["rows"][keep], "threshold", r["constrained"]))
        ys.append(r["total"] - r["done"][keep])
        groups += [(r["threshold"], r["constrained"], r["category"])] * int(keep.sum())
    x, y = np.concatenate(xs), np.concatenate(ys)
    pred = learner.predict_rows(x)
    rel = (pred - y) / y
    th = np.array([g[0] for g in groups])
    con = np.array([g[1] for g in groups])
    prose = np.array([g[2] == "prose" for g in groups])
    out = {"all": float(np.abs(rel).mean())}
    for t in sorted(set(th.tolist())):
        out[f"t={t:g}"] = float(np.abs(rel[th == t]).mean())
        sel = (th == t) & (con == 1.0)
        out[f"t={t:g} constrained"] = float(np.abs(rel[sel]).mean())
        out[f"t={t:g} constrained prose"] = float(np.abs(rel[sel & prose]).mean())
        out[f"t={t:g} constrained bias"] = float(rel[sel].mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-bd")
    ap.add_argument("--n", type=int, default=60, help="held-out prompts per category")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.9])
    ap.add_argument("--mix", type=float, default=0.5, help="share of the prompts served constrained")
    ap.add_argument("--train", type=float, default=0.7, help="share of the prompts the learner trains on")
    ap.add_argument("--splits", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=168)
    args = ap.parse_args()
    from engine.loading import load_engine

    examples = heldout_set(len(CATEGORIES) * args.n)
    engine = load_engine(args.model, max_slots=len(examples))
    t0 = time.perf_counter()
    # decoded[(threshold, constrained)][i]: prompt i's request
    decoded = {(t, c): decode(engine, examples, t, c, args.max_tokens) for t in args.thresholds for c in (False, True)}
    print(f"model {args.model}: {len(examples)} held-out prompts ({args.n} per category), thresholds "
          f"{' '.join(f'{t:g}' for t in args.thresholds)}, each free and constrained, decoded in "
          f"{time.perf_counter() - t0:.1f} s")
    for t in args.thresholds:
        for cat in ("prose", "all"):
            fpt = {}
            for c in (False, True):
                reqs = [r for r in decoded[(t, c)] if cat == "all" or r["category"] == cat]
                fpt[c] = sum(r["total"] for r in reqs) / sum(r["tokens"] + 1 for r in reqs)
            print(f"  threshold {t:g}, {cat}: forwards per token free {fpt[False]:.3f}, constrained {fpt[True]:.3f} "
                  f"({fpt[True] / fpt[False]:.2f}x)")
    results: dict[str, list[dict]] = {"with the column": [], "blind (column 0)": []}
    for split in range(args.splits):
        rng = np.random.default_rng(split)
        order = rng.permutation(len(examples))
        served_constrained = rng.random(len(examples)) < args.mix
        n_train = round(args.train * len(examples))

        train, test = ([decoded[(t, bool(served_constrained[i]))][i] for i in idx for t in args.thresholds]
                       for idx in (order[:n_train], order[n_train:]))
        train = [train[i] for i in rng.permutation(len(train))]  # finished in some order
        for name, aware in (("with the column", True), ("blind (column 0)", False)):
            learner = learner_for(train, aware, seed=split)
            results[name].append({**scores(learner, test), "width": learner._served.model.width
                                  if learner._served.model is not None else 0, "source": learner.source})
    print(f"online step learner, {args.splits} splits ({args.train:.0%} of the prompts train, {args.mix:.0%} of "
          f"them served constrained; a request per prompt and threshold): MAPE of remaining steps on the other "
          f"prompts' requests, mean (sd) over splits; bias: mean signed relative error")
    keys = [k for k in results["with the column"][0] if k not in ("width", "source")]
    print("| rows | " + " | ".join(keys) + " | model width |")
    print("|---|" + "---|" * (len(keys) + 1))
    for name, runs in results.items():
        cells = [f"{np.mean([r[k] for r in runs]):+.3f} ({np.std([r[k] for r in runs]):.3f})" if "bias" in k
                 else f"{np.mean([r[k] for r in runs]):.3f} ({np.std([r[k] for r in runs]):.3f})" for k in keys]
        widths = sorted({r["width"] for r in runs})
        print(f"| {name} | " + " | ".join(cells) + f" | {'/'.join(map(str, widths))} |")
    gain = [b["all"] - w["all"] for w, b in zip(results["with the column"], results["blind (column 0)"])]
    print(f"MAPE blind - with the column, all rows, per split: {' '.join(f'{g:+.4f}' for g in gain)} "
          f"(mean {np.mean(gain):+.4f}; {len(train)} training requests a split)")


if __name__ == "__main__":
    main()
