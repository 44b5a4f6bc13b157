"""Structured outputs on the canvas, measured on an embedded model (tiny-bd by default): for each task-suite
category, held-out prompts decoded without and with a constraint that describes the category's answers (a
regular expression, or the choices), in one batch each. Per category and mode: validity (the answer is a
sentence of the constraint), accuracy (``tasksuite.check``), forwards per generated token (denoising rounds
over output tokens, EOS included), tokens remasked by the grammar per request, and the grammar's time per
denoising step. Prints a Markdown table (reports/structured.md quotes it). On a DiffusionGemma model (``--model
tiny-dg``) a round is a denoising step of a canvas, "remasked" counts the tokens the grammar renoised, and the
canvases finished under the grammar's mask at the step cap are counted.

    OMP_NUM_THREADS=1 python -m scripts.structured_bench [--model tiny-bd] [--n 40] [--threshold 0.9]

The constraints are the regular languages of the core categories' answers and, for the ``json`` category
(``tasksuite.JSON``: answers as small objects), the JSON schema of the prompt's form (``json_schema_for``:
enums, a bounded integer, a bounded array), as a ``response_format`` of type ``json_schema`` makes it. A model
whose vocabulary cannot write JSON (tiny-mdm's 51 characters) is measured on the core categories only.
"""

from __future__ import annotations

import argparse
import re
import time

from engine.commands import SamplingParams
from engine.constraints.spec import ConstraintSpec
from tasksuite import ALL_CATEGORIES, CATEGORIES, JSON, _prose_pattern, heldout_set, json_schema_for, json_valid


def constraint_for(category: str, prompt: str) -> ConstraintSpec:
    """The language of ``category``'s answers (for prose, the prompt's own story template)."""
    if category == "choice":
        return ConstraintSpec.choice(["a", "b", "c", "d"], "guided_choice")
    if category == "arith":
        return ConstraintSpec("regex", r"[0-9]{1,3}", "guided_regex")
    if category == "reverse":
        return ConstraintSpec("regex", r"[a-z]{3,6}", "guided_regex")
    if category == "lookup":
        return ConstraintSpec("regex", r"[0-9]{2}", "guided_regex")
    if category == JSON:
        return ConstraintSpec.json_schema(json_schema_for(prompt), "response_format")
    noun, n = prompt.split()[1], int(prompt.split()[2])
    return ConstraintSpec("regex", _prose_pattern(noun, n).pattern, "guided_regex")


def valid(spec: ConstraintSpec, text: str, prompt: str) -> bool:
    if spec.kind == "choice":
        return text in spec.choices
    if spec.kind == "json_schema":
        return json_valid(prompt, text)
    return re.fullmatch(spec.value, text) is not None


def run(engine, examples, constrained: bool, threshold: float | None, max_tokens: int) -> dict:
    seqs = []
    for i, ex in enumerate(examples):
        spec = constraint_for(ex.category, ex.prompt)
        params = SamplingParams(max_tokens=max_tokens, threshold=threshold, seed=i,  # the same draws both ways
                                constraint=spec.to_dict() if constrained else None)
        seqs.append((ex, spec, engine.add_request(ex.prompt, params)))
    t0 = time.perf_counter()
    steps = 0
    while not all(s.finished for _, _, s in seqs):
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    rows = []
    for ex, spec, seq in seqs:
        out = engine.output(seq)
        tokens = len(out.token_ids) + (seq.finish_reason == "stop")  # the EOS is decoded too
        inner = getattr(seq, "inner", None)  # a DiffusionGemma request (engine/canvas_serving.py): its canvas's
        guard = getattr(inner if inner is not None else seq, "guard", None)
        rows.append({"valid": valid(spec, out.text, ex.prompt), "ok": ex.check(out.text), "rounds": seq.rounds,
                     "tokens": max(tokens, 1), "remasked": guard.remasked if guard else 0,
                     "grammar_s": guard.seconds if guard else 0.0, "finish": seq.finish_reason,
                     "fallbacks": getattr(inner, "fallbacks", 0),
                     "canvases": len(getattr(inner, "steps_per_canvas", ()))})
        engine.sequences.pop(seq.seq_id, None)
    return {"rows": rows, "wall_s": wall, "steps": steps}


def summary(rows: list[dict]) -> dict:
    n = len(rows)
    rounds = sum(r["rounds"] for r in rows)
    stopped = [r for r in rows if r["finish"] == "stop"]
    return {"n": n, "valid": sum(r["valid"] for r in rows) / n, "acc": sum(r["ok"] for r in rows) / n,
            "valid_stop": sum(r["valid"] for r in stopped) / max(len(stopped), 1), "stopped": len(stopped),
            "fpt": rounds / sum(r["tokens"] for r in rows), "remasked": sum(r["remasked"] for r in rows) / n,
            "grammar_us_per_round": 1e6 * sum(r["grammar_s"] for r in rows) / max(rounds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-bd")
    ap.add_argument("--n", type=int, default=40, help="held-out examples per category")
    ap.add_argument("--threshold", type=float, default=None, help="the unmasking threshold (default: the rule's)")
    ap.add_argument("--max-tokens", type=int, default=168)
    ap.add_argument("--no-jump", action="store_true", help="no jump-forward (forced tokens wait for the model)")
    ap.add_argument("--backend", choices=["llguidance", "xgrammar"], default=None, help="the grammar engine")
    args = ap.parse_args()
    if args.backend:
        import engine.constraints.grammar as grammar

        grammar.DEFAULT_BACKEND = args.backend
    if args.no_jump:
        import engine.constraints.canvas as canvas

        canvas.JUMP = False
    from engine.loading import load_engine

    engine = load_engine(args.model, max_slots=len(ALL_CATEGORIES) * args.n)
    writes_json = all(c in engine.tokenizer.vocab for c in '{}[]"')
    categories = ALL_CATEGORIES if writes_json else CATEGORIES
    # the core categories' prompts are those of the core held-out set (the tables before json was added), the
    # json prompts drawn apart
    examples = heldout_set(len(CATEGORIES) * args.n)
    if writes_json:
        examples += heldout_set(args.n, categories=(JSON,))
    results = {mode: run(engine, examples, mode == "constrained", args.threshold, args.max_tokens)
               for mode in ("free", "constrained")}
    print(f"model {args.model}, {len(examples)} held-out prompts, threshold {args.threshold or 'default'}, "
          f"max_tokens {args.max_tokens}, jump-forward {'off' if args.no_jump else 'on'}, "
          f"backend {args.backend or 'default'}")
    print("| category | n | valid free | valid constrained (of those ending by stop) | accuracy free | "
          "accuracy constrained | forwards/token free | forwards/token constrained | ratio | remasked/request | "
          "grammar us/round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cat in [*categories, "all"]:
        pick = [i for i, ex in enumerate(examples) if cat == "all" or ex.category == cat]
        f = summary([results["free"]["rows"][i] for i in pick])
        c = summary([results["constrained"]["rows"][i] for i in pick])
        print(f"| {cat} | {f['n']} | {f['valid']:.0%} | {c['valid']:.0%} ({c['valid_stop']:.0%} of {c['stopped']}) | "
              f"{f['acc']:.0%} | {c['acc']:.0%} | "
              f"{f['fpt']:.3f} | {c['fpt']:.3f} | {c['fpt'] / f['fpt']:.2f} | {c['remasked']:.1f} | "
              f"{c['grammar_us_per_round']:.0f} |")
    for mode, r in results.items():
        print(f"{mode}: {r['steps']} engine rounds, {r['wall_s']:.2f} s wall")
    canvases = sum(r["canvases"] for r in results["constrained"]["rows"])
    if canvases:  # DiffusionGemma: canvases the grammar still rejected at the step cap, finished under its mask
        fallbacks = sum(r["fallbacks"] for r in results["constrained"]["rows"])
        print(f"constrained canvases finished under the grammar's mask at the step cap: {fallbacks} of {canvases}")


if __name__ == "__main__":
    main()
