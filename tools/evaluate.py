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
             progress: bool = False) -> list[dict]:
    """One result per threshold (the engine's rule at that per-request threshold): accuracy, mean rounds,
    forwards per generated token and a per-category split."""
    examples = tasks.heldout_set(n, seed)
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
               n: int = 300, seed: int = 2026, progress: bool = False) -> list[dict]:
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
                for r in evaluate(engine, list(knobs), n, seed, progress)]
    examples = tasks.heldout_set(n, seed)
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
              sweeps: Sequence[tuple[str, str, dict]] = REPORT_SWEEPS) -> dict[str, list[dict]]:
    """``sweep_rule`` of each (label, rule, config) of ``sweeps`` at the rule's default knob sweep, by label;
    with every registered rule not in ``sweeps`` after them."""
    todo = list(sweeps) + [(r, r, {}) for r in sorted(RULES) if r not in {rule for _, rule, _ in sweeps}]
    return {label: sweep_rule(engine, rule, config, n=n, seed=seed, progress=progress)
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


def matched_speedup(sweeps: dict[str, list[dict]], base: str = "threshold") -> dict[str, list[dict]]:
    """For each rule, at each accuracy the ``base`` rule's sweep reached: forwards per token of the base and
    of the rule at that accuracy, and the base's over the rule's (> 1: the rule is faster there)."""
    out = {}
    ref = sweeps[base]
    for rule, pts in sweeps.items():
        if rule == base:
            continue
        rows = []
        for p in sorted(ref, key=lambda p: p["accuracy"]):
            theirs = forwards_at(pts, p["accuracy"])
            mine = forwards_at(ref, p["accuracy"])
            rows.append({"accuracy": p["accuracy"], "base_forwards_per_token": mine,
                         "forwards_per_token": theirs,
                         "speedup": None if theirs is None or not mine else round(mine / theirs, 3)})
        out[rule] = rows
    return out


def _span(pts: Sequence[dict]) -> str:
    vals = [p["value"] for p in pts]
    return f"{min(vals):g}-{max(vals):g}"


def plot_frontiers(sweeps: dict[str, list[dict]], title: str, path: str) -> str:
    """Accuracy against forwards per generated token: every rule's sweep (points, in knob order) and its
    frontier (line), one colour per rule; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    markers = "os^vDP*Xh"
    for i, (rule, pts) in enumerate(sweeps.items()):
        colour = f"C{i}"
        ax.scatter([p["forwards_per_token"] for p in pts], [p["accuracy"] for p in pts], color=colour,
                   marker=markers[i % len(markers)], s=28, alpha=0.55)
        f = frontier(pts)
        ax.plot([p["forwards_per_token"] for p in f], [p["accuracy"] for p in f], color=colour,
                lw=2.6 if rule == "threshold" else 1.4, ls="-" if rule == "threshold" else ("--", "-.", ":")[i % 3],
                label=f"{rule} ({pts[0]['knob']} {_span(pts)})")
    ax.set_xlabel("forwards per generated token (lower is faster)")
    ax.set_ylabel("accuracy (held-out task suite)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
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
