"""``remask train-default`` and ``remask eval``: train the embedded default models on the task suite, and
measure accuracy and rounds on its held-out split."""

from __future__ import annotations

import argparse
import json

from engine.argtypes import category_mix as _mix
from engine.argtypes import thresholds as _thresholds
from tasksuite import CATEGORIES as CORE_CATEGORIES


def _knobs(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--knobs must be comma-separated numbers, got {text!r}") from None


def _categories(text: str) -> tuple[str, ...]:
    from tasksuite import ALL_CATEGORIES

    names = ALL_CATEGORIES if text.strip() == "all" else tuple(c.strip() for c in text.split(",") if c.strip())
    if not names or set(names) - set(ALL_CATEGORIES):
        raise argparse.ArgumentTypeError(f"--categories: unknown {sorted(set(names) - set(ALL_CATEGORIES))}; "
                                         f"known: {', '.join(ALL_CATEGORIES)} or 'all'")
    return names


def cmd_train_default(args) -> int:
    from engine.loading import DEFAULT_MODELS, DEFAULTS_DIR
    from tools.training import DG_BATCH, average_checkpoints, train, train_default, train_default_dg, train_dg

    if args.average:
        if not args.out:
            raise ValueError("--average needs --out")
        print(f"saved the average of {len(args.average)} checkpoints to {average_checkpoints(args.average, args.out)}")
        return 0
    names = DEFAULT_MODELS if args.model == "all" else (args.model,)
    for name in names:
        out = args.out or str(DEFAULTS_DIR / name)
        if len(names) > 1 and args.out:
            out = f"{args.out}/{name}"
        if name == "tiny-dg" and args.steps is None and args.init is None:  # the two phases of the shipped weights
            train_default_dg(out, minutes=args.minutes, threads=args.threads, seed=args.seed,
                             batch_size=args.batch_size or DG_BATCH, log_path=args.log, device=args.device)
        elif name == "tiny-dg":  # a DiffusionGemma: uniform-state diffusion (tools/training.py, train_dg)
            train_dg(out, steps=args.steps or 100_000, minutes=args.minutes, seed=args.seed,
                     batch_size=args.batch_size or DG_BATCH, lr=args.lr, threads=args.threads, init=args.init,
                     mix=args.mix, log_path=args.log, device=args.device, copies=args.copies)
        elif args.steps is None and args.init is None:  # the two-phase recipe of the shipped weights
            train_default(name, out, minutes=args.minutes, device=args.device, threads=args.threads, seed=args.seed,
                          batch_size=args.batch_size or 32)
        else:
            train(name, out, steps=args.steps or 20000, minutes=args.minutes, batch_size=args.batch_size or 32,
                  lr=args.lr, seed=args.seed, device=args.device, threads=args.threads, init=args.init, mix=args.mix,
                  lookup_canvas=args.lookup_canvas, new_ids_only=args.new_ids_only,
                  distill=tuple(args.distill.split(",")) if args.distill else ())
        print(f"saved {name} to {out}")
    return 0


def _decoding_config(text: str | None) -> dict:
    if not text:
        return {}
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--decoding-config must be a JSON object: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--decoding-config must be a JSON object, got {text!r}")
    return cfg


def _eval_decoding(args) -> int:
    from engine.decoding import make_rule
    from engine.loading import load_engine
    from tools.evaluate import matched_speedup, plot_frontiers, sweep_all, sweep_rule

    config = _decoding_config(args.decoding_config)
    if args.decoding != "all":
        make_rule(args.decoding, **config)  # an unknown rule or a bad value fails before the model loads
    elif config or args.knobs:
        raise ValueError("--decoding all sweeps each rule's default knobs: no --decoding-config or --knobs")
    engine = load_engine(args.model, device=args.device, cache=args.cache, max_slots=args.slots)
    progress = not args.quiet
    if args.decoding == "all":
        sweeps = sweep_all(engine, n=args.n, seed=args.seed, progress=progress, categories=args.categories)
    else:
        sweeps = {args.decoding: sweep_rule(engine, args.decoding, config, args.knobs, n=args.n, seed=args.seed,
                                            categories=args.categories,
                                            progress=progress)}
    if args.plot:
        plot_frontiers(sweeps, f"{args.model}: accuracy against forwards per token, per decoding rule", args.plot)
    if args.json:
        out = {"model": args.model, "n": args.n, "seed": args.seed, "sweeps": sweeps}
        if "threshold" in sweeps and len(sweeps) > 1:
            out["matched_speedup"] = matched_speedup(sweeps)
        print(json.dumps(out))
    else:
        for label, results in sweeps.items():
            for r in results:
                print(f"{label:26s} {r['knob']} {r['value']:<6g}: accuracy {r['accuracy']:.3f}  mean rounds "
                      f"{r['mean_rounds']:.2f}  forwards/token {r['forwards_per_token']:.3f}")
    return 0


def _eval_canvas(args, path) -> int:
    """A DiffusionGemma model (tiny-dg, a checkpoint): its held-out accuracy and denoising steps through the
    CanvasEngine, per entropy bound; with ``--transformers`` also transformers' own generate on the model exported
    as an HF checkpoint (tools/evaluate.py ``evaluate_transformers``)."""
    import tempfile

    import torch

    from engine.canvas import CanvasEngine
    from engine.models import diffusion_gemma as dg
    from tools.evaluate import evaluate_canvas, evaluate_transformers

    if args.decoding or args.decoding_config or args.knobs or args.plot:
        raise ValueError(f"{args.model} is a DiffusionGemma model: its rule is renoise, its knob --entropy-bounds")
    engine = CanvasEngine.from_pretrained(path, device=args.device)
    bounds = args.entropy_bounds or [None]
    for b in bounds:
        if b is not None:
            engine.rule.check_knob(b)
    results = evaluate_canvas(engine, bounds, n=args.n, seed=args.seed, progress=not args.quiet,
                              categories=args.categories)
    out = {"model": args.model, "n": args.n, "seed": args.seed, "categories": list(args.categories),
           "results": results}
    if args.transformers:
        with tempfile.TemporaryDirectory() as tmp:
            exported = dg.save_pretrained(dg.load(path, dtype=torch.float32), tmp, tokenizer_dir=path)
            out["transformers"] = [evaluate_transformers(exported, n=args.n, seed=args.seed, entropy_bound=b,
                                                         progress=not args.quiet, categories=args.categories)
                                   for b in bounds]
    if args.json:
        print(json.dumps(out))
        return 0
    for label, rows in (("remask", results), ("transformers", out.get("transformers", []))):
        for r in rows:
            cats = "  ".join(f"{c}={v['accuracy']:.2f}/{v['mean_rounds']:.1f}" for c, v in r["by_category"].items())
            print(f"{label:12s} entropy bound {r['entropy_bound']:g}: accuracy {r['accuracy']:.3f}  mean steps "
                  f"{r['mean_rounds']:.2f}  (max {r['rounds_max']})  [{cats}]")
    return 0


def cmd_eval(args) -> int:
    from engine.canvas import is_diffusion_gemma
    from engine.loading import load_engine, resolve_model
    from engine.models.presets import is_preset
    from tools.evaluate import evaluate

    if not is_preset(args.model) and is_diffusion_gemma(path := resolve_model(args.model)):
        return _eval_canvas(args, path)
    if getattr(args, "entropy_bounds", None) or getattr(args, "transformers", False):
        raise ValueError("--entropy-bounds and --transformers go with DiffusionGemma models (tiny-dg)")
    if args.decoding:
        return _eval_decoding(args)
    if args.decoding_config or args.knobs or args.plot:
        raise ValueError("--decoding-config, --knobs and --plot go with --decoding")
    engine = load_engine(args.model, device=args.device, cache=args.cache, max_slots=args.slots)
    results = evaluate(engine, args.thresholds, n=args.n, seed=args.seed, progress=not args.quiet,
                       categories=args.categories)
    if args.json:
        print(json.dumps({"model": args.model, "categories": list(args.categories), "results": results}))
    else:
        for r in results:
            cats = "  ".join(f"{c}={v['accuracy']:.2f}/{v['mean_rounds']:.1f}" for c, v in r["by_category"].items())
            print(f"threshold {r['threshold']:.2f}: accuracy {r['accuracy']:.3f}  mean rounds {r['mean_rounds']:.2f}"
                  f"  (p10 {r['rounds_p10']:.0f}, max {r['rounds_max']})  [{cats}]")
    return 0


def add_parsers(sub) -> None:
    """Add ``train-default`` and ``eval`` to the ``remask`` sub-parsers."""
    t = sub.add_parser("train-default", help="train the embedded default models on the task suite")
    t.add_argument("--model", default="all", choices=["all", "tiny-bd", "tiny-mdm", "tiny-dg"])
    t.add_argument("--out", help="output directory (default: the shipped location)")
    t.add_argument("--steps", type=int, help="one phase of this many steps (default: the two-phase recipe)")
    t.add_argument("--minutes", type=float, help="wall-clock cap per phase; the schedule follows whichever ends first")
    t.add_argument("--batch-size", type=int, help="examples per step (default: 32; tiny-dg 16)")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int)
    t.add_argument("--init", help="start from this checkpoint directory instead of random weights")
    t.add_argument("--mix", type=_mix,
                   help="category weights, e.g. lookup=0.4,prose=0.2,arith=0.2; training-only tasks: 'recall' "
                        "(tiny-bd, tiny-mdm: repeated needles with masked digits) and 'queries' (tiny-dg: a lookup "
                        "asked several keys)")
    t.add_argument("--lookup-canvas", type=int,
                   help="cap tiny-mdm's canvas at this many tokens for lookup and recall examples (faster steps)")
    t.add_argument("--new-ids-only", action="store_true",
                   help="tiny-bd/tiny-mdm with --init: train only the rows of the ids the checkpoint's tokenizer "
                        "lacks (every other weight stays as it is)")
    t.add_argument("--distill", help="with --init: these categories (comma-separated, e.g. "
                                     "choice,arith,reverse,prose,lookup) fit the checkpoint's own distributions (KL) "
                                     "instead of the answers, so their confidences stay where they were")
    t.add_argument("--copies", type=int, default=1,
                   help="tiny-dg: noised copies of each example's canvas decoded over its one encoder pass")
    t.add_argument("--log", help="append a JSON line of loss and per-category accuracy every 50 steps (tiny-dg)")
    t.add_argument("--average", nargs="+", metavar="DIR",
                   help="write the weight average of these checkpoints to --out instead of training")
    t.set_defaults(func=cmd_train_default)

    e = sub.add_parser("eval", help="accuracy and rounds on the held-out task suite")
    e.add_argument("--model", default="tiny-bd")
    e.add_argument("--thresholds", type=_thresholds, default=[0.5, 0.7, 0.9])
    e.add_argument("--n", type=int, default=300)
    e.add_argument("--seed", type=int, default=2026)
    e.add_argument("--json", action="store_true")
    e.add_argument("--categories", type=_categories, default=CORE_CATEGORIES,
                   help="held-out categories in turn, comma-separated, or 'all' (the core five and json; default: "
                        "the core five, which the published accuracy figures are over)")
    e.add_argument("--cache", default="dual", choices=["none", "prefix", "dual"])
    e.add_argument("--slots", type=int, default=64)
    e.add_argument("--device", default="cpu")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.add_argument("--decoding", help="sweep this decoding rule's knob instead of thresholds ('all': every rule)")
    e.add_argument("--decoding-config", help="the rule's other settings, a JSON object, e.g. "
                                             "'{\"edit_threshold\": 0.5}'")
    e.add_argument("--knobs", type=_knobs, help="the knob values to sweep (default: the rule's own sweep)")
    e.add_argument("--plot", help="write the rules' accuracy/forwards-per-token frontiers to this PNG")
    e.add_argument("--entropy-bounds", type=_knobs,
                   help="DiffusionGemma models (tiny-dg): the entropy bounds to evaluate (default: the checkpoint's)")
    e.add_argument("--transformers", action="store_true",
                   help="DiffusionGemma models: also transformers' own generate on the model exported as an HF "
                        "checkpoint, on the same held-out prompts")
    e.set_defaults(func=cmd_eval)
