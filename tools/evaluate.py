"""Accuracy and denoising rounds of a model on the held-out task suite, per threshold (``evaluate``) or per
knob value of any decoding rule (``sweep_rule``), and the rules' accuracy/speed frontiers (``frontier``,
``matched_speedup``, ``plot_frontiers``) that ``reports/decoding.md`` shows.

Speed is counted in forwards per generated token: the request's denoising rounds (each one forward of the
model over its current block or sequence; prefill forwards, the same for every rule, are left out) over
the output tokens it returned (up to its EOS). A rule that commits more tokens per forward at the same
accuracy is faster on any device.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import tasksuite as tasks
from engine.decoding import RULES, make_rule
from engine.engine import Engine
from engine.sequence import SamplingParams

# each rule's default knob sweep (the knob's own units), slowest first
KNOB_SWEEPS: dict[str, tuple[float, ...]] = {
    "threshold": (0.95, 0.9, 0.7, 0.5, 0.3),
    "dynamic": (0.95, 0.9, 0.7, 0.5, 0.3),
    "low_confidence": (1, 2, 3, 4, 8),
    "joint_threshold": (0.95, 0.9, 0.7, 0.5, 0.3),
    "entropy_bound": (0.01, 0.05, 0.15, 0.5, 1.5),
    "hierarchical": (0.95, 0.9, 0.7, 0.5, 0.3),
    "credit": (0.95, 0.9, 0.7, 0.5, 0.3),
}
ROUTER_LEVELS = (0.9, 0.8, 0.7, 0.6, 0.5)  # a rule without a sweep of its own: its knob at the router's levels
# what ``--decoding all`` sweeps: (label, rule, config). joint_threshold twice: at SGLang's defaults (edit any
# disagreement, 16 post-edit steps) and conservatively; hierarchical with sub-blocks of 4 (the embedded
# models' blocks are 8 tokens: with its default of 8 it would be the threshold rule)
REPORT_SWEEPS: tuple[tuple[str, str, dict], ...] = (
    ("threshold", "threshold", {}),
    ("dynamic", "dynamic", {}),
    ("low_confidence", "low_confidence", {}),
    ("joint_threshold", "joint_threshold", {}),
    ("joint_threshold edit>0.9", "joint_threshold", {"edit_threshold": 0.9, "max_post_edit_steps": 2}),
    ("entropy_bound", "entropy_bound", {}),
    ("hierarchical sub-block 4", "hierarchical", {"sub_block_size": 4}),
    ("credit", "credit", {}),
)


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _summary(examples, outs) -> dict:
    per: dict[str, list[tuple[bool, int]]] = defaultdict(list)
    for ex, out in zip(examples, outs):
        per[ex.category].append((ex.check(out.text), out.rounds))
    flat = [x for rows in per.values() for x in rows]
    rounds = [r for _, r in flat]
    tokens = sum(max(len(o.token_ids), 1) for o in outs)  # an empty answer still cost its forwards
    return {
        "accuracy": round(sum(ok for ok, _ in flat) / len(flat), 4),
        "mean_rounds": round(statistics.mean(rounds), 3),
        "rounds_p10": _percentile(rounds, 0.1),
        "rounds_max": max(rounds),
        "requests": len(flat),
        "forwards_per_token": round(sum(rounds) / tokens, 4),
        "mean_tokens": round(tokens / len(outs), 3),
        "by_category": {
            c: {"accuracy": round(sum(ok for ok, _ in rows) / len(rows), 4),
                "mean_rounds": round(statistics.mean(r for _, r in rows), 3), "requests": len(rows)}
            for c, rows in sorted(per.items())
        },
    }


def evaluate(engine: Engine, thresholds: list[float], n: int = 300, seed: int = 2026,
             progress: bool = False, categories: Sequence[str] = tasks.CATEGORIES) -> list[dict]:
    """One result per threshold (the engine's rule at that per-request threshold): accuracy, mean rounds,
    forwards per generated token and a per-category split (held-out prompts of ``categories`` in turn)."""
    examples = tasks.heldout_set(n, seed, tuple(categories))
    results = []
    for t in thresholds:
        outs = engine.generate([e.prompt for e in examples], SamplingParams(threshold=t), progress=progress)
        results.append({"threshold": t, **_summary(examples, outs)})
    return results


def knob_sweep(rule: str) -> tuple[float, ...]:
    """The default knob values ``sweep_rule`` tries for ``rule``."""
    if rule in KNOB_SWEEPS:
        return KNOB_SWEEPS[rule]
    r = make_rule(rule)
    return tuple(dict.fromkeys(r.knob_at(t) for t in ROUTER_LEVELS))


def sweep_rule(engine: Engine, rule: str, config: dict | None = None, knobs: Sequence[float] | None = None,
               n: int = 300, seed: int = 2026, progress: bool = False,
               categories: Sequence[str] = tasks.CATEGORIES) -> list[dict]:
    """One result per knob value of decoding rule ``rule`` (configured by ``config``, whose own knob value,
    if any, the sweep replaces): the engine decodes the held-out set with the rule at that knob. The
    ``threshold`` rule with no other config goes through ``evaluate`` (today's per-request thresholds: its
    results are the threshold evaluation's, unchanged)."""
    base = make_rule(rule, **(config or {}))  # a bad name or value fails here, before any decoding
    knobs = tuple(knobs) if knobs else knob_sweep(rule)
    for v in knobs:
        base.check_knob(v)
    rest = {k: v for k, v in base.config().items() if k != base.knob}
    if rule == "threshold" and not rest:
        return [{"decoding": rule, "config": {}, "knob": base.knob, "value": r["threshold"], **r}
                for r in evaluate(engine, list(knobs), n, seed, progress, categories)]
    examples = tasks.heldout_set(n, seed, tuple(categories))
    saved = engine.rule
    results = []
    try:
        for v in knobs:
            engine.rule = make_rule(rule, **{**rest, base.knob: v})
            outs = engine.generate([e.prompt for e in examples], SamplingParams(), progress=progress)
            results.append({"decoding": rule, "config": rest, "knob": base.knob, "value": v,
                            **_summary(examples, outs)})
    finally:
        engine.rule = saved
    return results


def sweep_all(engine: Engine, n: int = 300, seed: int = 2026, progress: bool = False,
              sweeps: Sequence[tuple[str, str, dict]] = REPORT_SWEEPS,
              categories: Sequence[str] = tasks.CATEGORIES) -> dict[str, list[dict]]:
    """``sweep_rule`` of each (label, rule, config) of ``sweeps`` at the rule's default knob sweep, by label;
    with every registered rule not in ``sweeps`` after them (but the whole-canvas rules, ``canvas_rule``, which
    decode DiffusionGemma canvases, not a masked model's blocks)."""
    todo = list(sweeps) + [(r, r, {}) for r in sorted(RULES) if r not in {rule for _, rule, _ in sweeps}
                           and not getattr(RULES[r], "canvas_rule", False)]
    return {label: sweep_rule(engine, rule, config, n=n, seed=seed, progress=progress, categories=categories)
            for label, rule, config in todo}


# ---- frontiers -------------------------------------------------------------------------------------

def frontier(points: Sequence[dict]) -> list[dict]:
    """The accuracy/speed frontier of a rule's sweep: its points no other point beats on both (fewer or as
    many forwards per token and at least the accuracy, one of them strictly), fastest first."""
    pts = sorted(points, key=lambda p: (p["forwards_per_token"], -p["accuracy"]))
    out: list[dict] = []
    for p in pts:
        if not out or p["accuracy"] > out[-1]["accuracy"]:
            out.append(p)
    return out


def forwards_at(points: Sequence[dict], accuracy: float) -> float | None:
    """The fewest forwards per token at which a rule's frontier reaches ``accuracy`` (linear between its
    points; None when no point reaches it)."""
    f = frontier(points)
    if not f or f[-1]["accuracy"] < accuracy:
        return None
    prev = None
    for p in f:
        if p["accuracy"] >= accuracy:
            if prev is None or p["accuracy"] == prev["accuracy"]:
                return p["forwards_per_token"]
            w = (accuracy - prev["accuracy"]) / (p["accuracy"] - prev["accuracy"])
            return prev["forwards_per_token"] + w * (p["forwards_per_token"] - prev["forwards_per_token"])
        prev = p
    return None


def matched_speedup(sweeps: dict[str, list[dict]], base: str = "threshold",
                    levels: Sequence[float] | None = None) -> dict[str, list[dict]]:
    """For each rule, at each accuracy level (default: those the ``base`` rule's frontier reached): the
    forwards per token the base and the rule need to reach it (``forwards_at``) and the base's over the
    rule's (> 1: the rule is faster there; None: the rule never reaches that accuracy)."""
    out = {}
    ref = sweeps[base]
    levels = sorted(levels if levels is not None else {p["accuracy"] for p in frontier(ref)})
    for rule, pts in sweeps.items():
        if rule == base:
            continue
        rows = []
        for acc in levels:
            theirs, mine = forwards_at(pts, acc), forwards_at(ref, acc)
            rows.append({"accuracy": acc, "base_forwards_per_token": mine, "forwards_per_token": theirs,
                         "speedup": None if theirs is None or not mine else round(mine / theirs, 3)})
        out[rule] = rows
    return out


def _span(pts: Sequence[dict]) -> str:
    vals = [p["value"] for p in pts]
    return f"{min(vals):g}-{max(vals):g}"


def plot_frontiers(sweeps: dict[str, list[dict]], title: str, path: str) -> str:
    """Accuracy against forwards per generated token: every rule's sweep (points) and its frontier (line), one
    colour per rule; left the whole range (log scale), right the region around the ``threshold`` rule's
    sweep. Written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13.0, 5.2), gridspec_kw={"width_ratios": [1, 1.25]})
    markers = "os^vDP*Xh"
    ref = sweeps.get("threshold") or next(iter(sweeps.values()))
    x_hi = 1.35 * max(p["forwards_per_token"] for p in ref)
    x_lo = 0.85 * min(p["forwards_per_token"] for p in ref)
    y_lo = min(p["accuracy"] for p in ref) - 0.04
    for ax, zoom in zip(axes, (False, True)):
        for i, (rule, pts) in enumerate(sweeps.items()):
            colour, main = f"C{i}", rule == "threshold"
            ax.scatter([p["forwards_per_token"] for p in pts], [p["accuracy"] for p in pts], color=colour,
                       marker=markers[i % len(markers)], s=30, alpha=0.6, zorder=3)
            f = frontier(pts)
            ax.plot([p["forwards_per_token"] for p in f], [p["accuracy"] for p in f], color=colour,
                    lw=2.8 if main else 1.5, ls="-" if main else ("--", "-.", ":")[i % 3], zorder=4 if main else 2,
                    label=f"{rule} ({pts[0]['knob']} {_span(pts)})")
        ax.set_xlabel("forwards per generated token (lower is faster)")
        ax.grid(alpha=0.3, which="both")
        if zoom:
            ax.set_xlim(x_lo, x_hi)
            ax.set_ylim(y_lo, max(p["accuracy"] for pts in sweeps.values() for p in pts) + 0.01)
            ax.set_title("around the threshold rule's sweep")
            ax.legend(fontsize=7.5, loc="lower right")
        else:
            from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

            ax.set_xscale("log")
            xs = [p["forwards_per_token"] for pts in sweeps.values() for p in pts]
            ticks = [t for t in (0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0) if min(xs) * 0.8 <= t <= max(xs) * 1.25]
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylabel("accuracy (held-out task suite, 300 requests)")
            ax.set_title("every point (log scale)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_rows(model: str, sweeps: dict[str, list[dict]]) -> list[str]:
    """The report's table rows of one model's sweeps: label, knob value, accuracy, mean rounds, forwards
    per generated token (and its inverse, tokens per forward)."""
    rows = []
    for label, pts in sweeps.items():
        for p in pts:
            rows.append(f"| {model} | {label} | {p['knob']} = {p['value']:g} | {p['accuracy']:.3f} | "
                        f"{p['mean_rounds']:.2f} | {p['forwards_per_token']:.3f} | "
                        f"{1.0 / p['forwards_per_token']:.2f} |")
    return rows


# ---- canvas models (DiffusionGemma: engine/canvas.py) ------------------------------------------------

@dataclass(frozen=True)
class _CanvasResult:
    """A canvas request's outcome in ``_summary``'s terms: ``rounds`` its denoising steps (one decoder forward
    each, all canvases; the encoder passes, the prefill, left out as for the masked models)."""

    text: str
    token_ids: list[int]
    rounds: int


def canvas_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A held-out prompt as a canvas model reads it: the character tokenizer's <bos> prompt <sep> (unpadded), or a
    checkpoint tokenizer's chat template."""
    return tokenizer.prompt_ids(prompt, 1)


def evaluate_canvas(engine, bounds: Sequence[float | None] = (None,), n: int = 300, seed: int = 2026,
                    progress: bool = False, categories: Sequence[str] = tasks.CATEGORIES) -> list[dict]:
    """``evaluate`` for a DiffusionGemma model: the held-out prompts as canvas requests through ``engine`` (a
    ``CanvasEngine``, all requests stepped together), one result per entropy bound (None: the checkpoint's);
    request i draws from seed ``seed + i``. ``mean_rounds`` is denoising steps per request; ``steps_per_canvas``
    the mean over canvases."""
    from engine.canvas import CanvasParams

    examples = tasks.heldout_set(n, seed, tuple(categories))
    prompts = [canvas_prompt_ids(engine.tokenizer, e.prompt) for e in examples]
    results = []
    for bound in bounds:
        seqs = [engine.add_request(ids, CanvasParams(seed=seed + i, entropy_bound=bound))
                for i, ids in enumerate(prompts)]
        bar = _bar(len(seqs), f"eval bound {bound if bound is not None else engine.rule.entropy_bound:g}", progress)
        done = 0
        while any(not s.finished for s in seqs):
            engine.step(seqs)
            now = sum(s.finished for s in seqs)
            bar.update(now - done)
            done = now
        bar.close()
        outs = [engine.output(s) for s in seqs]
        for s in seqs:
            engine.sequences.pop(s.seq_id, None)
        canvases = [k for o in outs for k in o.steps_per_canvas]
        summary = _summary(examples, [_CanvasResult(o.text, o.token_ids, sum(o.steps_per_canvas)) for o in outs])
        results.append({"entropy_bound": bound if bound is not None else engine.rule.entropy_bound, **summary,
                        "steps_per_canvas": round(statistics.mean(canvases), 3),
                        "canvases_per_request": round(len(canvases) / len(outs), 3)})
    return results


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, mininterval=2.0)


def evaluate_transformers(path, n: int = 300, seed: int = 2026, entropy_bound: float | None = None,
                          progress: bool = False, categories: Sequence[str] = tasks.CATEGORIES) -> dict:
    """The same held-out prompts through transformers' own ``DiffusionGemmaForBlockDiffusion.generate`` on the
    checkpoint at ``path`` (a DiffusionGemma directory, e.g. ``remask export``'s): prompts of equal length batched
    together (no padding, so positions are those of a single prompt), its draws from torch's generator seeded by
    ``seed``; the answer cut at the first EOS. The accuracy and mean decoder forwards per request, in
    ``evaluate_canvas``'s terms (the draws differ from Remask's: the figures agree statistically)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32).eval()
    stops = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                else [model.generation_config.eos_token_id])
    examples = tasks.heldout_set(n, seed, tuple(categories))
    prompts = [canvas_prompt_ids(tok, e.prompt) for e in examples]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(prompts):
        groups[len(ids)].append(i)
    kwargs = {}
    if entropy_bound is not None:
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=float(entropy_bound))
    torch.manual_seed(seed)
    results: list[_CanvasResult | None] = [None] * n
    bar = _bar(n, "transformers generate", progress)
    with torch.no_grad():
        for length, rows in sorted(groups.items()):
            out = model.generate(torch.tensor([prompts[i] for i in rows]), **kwargs)
            for row, i in enumerate(rows):
                new = out.sequences[row, length:].tolist()
                cut = next((j for j, t in enumerate(new) if t in stops), len(new))
                # transformers reports tokens per forward: its non-pad tokens over the row's decoder forwards
                valid = sum(t != model.generation_config.pad_token_id for t in new)
                forwards = int(round(valid / float(out.tokens_per_forward[row]))) if valid else 0
                results[i] = _CanvasResult(tok.decode(new[:cut]), new[:cut], forwards)
            bar.update(len(rows))
    bar.close()
    return {"entropy_bound": model.generation_config.sampler_config.entropy_bound if entropy_bound is None
            else entropy_bound, **_summary(examples, results)}
