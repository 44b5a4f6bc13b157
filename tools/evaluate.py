"""Accuracy and denoising rounds of a model on the held-out task suite."""

from __future__ import annotations

import statistics
from collections import defaultdict

import tasksuite as tasks
from engine.engine import Engine
from engine.sequence import SamplingParams


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def evaluate(engine: Engine, thresholds: list[float], n: int = 300, seed: int = 2026,
             progress: bool = False) -> list[dict]:
    """One result per threshold: accuracy, mean rounds and a per-category split."""
    examples = tasks.heldout_set(n, seed)
    results = []
    for t in thresholds:
        outs = engine.generate([e.prompt for e in examples], SamplingParams(threshold=t), progress=progress)
        per: dict[str, list[tuple[bool, int]]] = defaultdict(list)
        for ex, out in zip(examples, outs):
            per[ex.category].append((ex.check(out.text), out.rounds))
        flat = [x for rows in per.values() for x in rows]
        rounds = [r for _, r in flat]
        results.append({
            "threshold": t,
            "accuracy": round(sum(ok for ok, _ in flat) / len(flat), 4),
            "mean_rounds": round(statistics.mean(rounds), 3),
            "rounds_p10": _percentile(rounds, 0.1),
            "rounds_max": max(rounds),
            "requests": len(flat),
            "by_category": {
                c: {"accuracy": round(sum(ok for ok, _ in rows) / len(rows), 4),
                    "mean_rounds": round(statistics.mean(r for _, r in rows), 3), "requests": len(rows)}
                for c, rows in sorted(per.items())
            },
        })
    return results
