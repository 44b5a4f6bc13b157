"""Real per-threshold behaviour of an embedded model on held-out prompts.

``build_table`` decodes held-out task-suite prompts with the embedded model
(``tiny-bd`` by default) once per candidate threshold and records, per
prompt and threshold, the denoising rounds it needed and whether its answer
was right. The table is cached as JSON (``$REMASK_CACHE_DIR`` or
``~/.cache/remask``), keyed by the model's weights, the prompt set and the
thresholds, so a run builds it once (400 prompts x 5 thresholds: ~30 s on
one CPU core).

``replay`` decodes prompts again with a threshold that changes from step to
step, as the router chose it (``step_thresholds`` maps a schedule over
progress to the model's own steps): that is how mixed-threshold requests of
the cluster simulator get real answers (see sim/cluster.py). Results are
memoised per process, so policies that made the same choices share them.

Tables are per decoding rule (``rule``, ``config``): a candidate threshold is the router's level, which
the rule turns into its own knob (``engine.decoding`` rules' ``knob_at``: the threshold rule's is the
threshold itself, ``entropy_bound``'s gamma = -ln(level), ...), so a rule's table holds its rounds and
answers at the knob of each level, and the simulator's steps follow (rule, knob). The ``threshold``
rule's table is today's (same key, same cache file).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

THRESHOLDS = (0.9, 0.8, 0.7, 0.6, 0.5)


@dataclass(frozen=True)
class ThresholdTable:
    model: str
    thresholds: tuple[float, ...]  # highest first
    prompts: tuple[str, ...]
    categories: tuple[str, ...]
    rounds: tuple[tuple[int, ...], ...]  # [prompt][threshold]
    correct: tuple[tuple[bool, ...], ...]  # [prompt][threshold]
    decoding: str = "threshold"  # the decoding rule the rounds were measured with (thresholds: its levels)
    config: tuple[tuple[str, object], ...] = ()  # the rule's other settings (sorted items)

    def __len__(self) -> int:
        return len(self.prompts)

    def accuracy(self, ti: int) -> float:
        return sum(c[ti] for c in self.correct) / len(self.correct)

    def knobs(self) -> tuple[float, ...]:
        """The rule's knob at each of the table's thresholds (levels)."""
        from engine.decoding import make_rule

        rule = make_rule(self.decoding, **dict(self.config))
        return tuple(rule.knob_at(t) for t in self.thresholds)

    def to_dict(self) -> dict:
        out = {"model": self.model, "thresholds": self.thresholds, "prompts": self.prompts,
               "categories": self.categories, "rounds": self.rounds, "correct": self.correct}
        if self.decoding != "threshold" or self.config:
            out.update(decoding=self.decoding, config=dict(self.config))
        return out

    @classmethod
    def from_dict(cls, d: dict) -> ThresholdTable:
        return cls(d["model"], tuple(d["thresholds"]), tuple(d["prompts"]), tuple(d["categories"]),
                   tuple(tuple(r) for r in d["rounds"]), tuple(tuple(bool(x) for x in c) for c in d["correct"]),
                   d.get("decoding", "threshold"), tuple(sorted((d.get("config") or {}).items())))


def cache_dir() -> Path:
    return Path(os.environ.get("REMASK_CACHE_DIR") or Path.home() / ".cache" / "remask")


def _key(model: str, n: int, seed: int, thresholds: tuple[float, ...], rule: str = "threshold",
         config: dict | None = None) -> str:
    from engine.loading import resolve_model

    path = resolve_model(model)
    text = f"{model}|{n}|{seed}|{thresholds}|v1"
    if rule != "threshold" or config:  # the threshold rule's key (and cache file) is today's
        text += f"|{rule}|{json.dumps(config or {}, sort_keys=True)}"
    h = hashlib.sha256(text.encode())
    for f in sorted(path.glob("*")):
        h.update(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}".encode())
    return h.hexdigest()[:16]


def load_table(model: str = "tiny-bd", n: int = 400, seed: int = 2026,
               thresholds: tuple[float, ...] = THRESHOLDS, progress: bool = False, rule: str = "threshold",
               config: dict | None = None) -> ThresholdTable:
    """The cached table of decoding rule ``rule`` (configured by ``config``), built on first use."""
    if rule != "threshold" or config:
        from engine.decoding import make_rule

        make_rule(rule, **(config or {}))  # a bad rule fails before anything is built
    path = cache_dir() / f"threshold-table-{model}-{_key(model, n, seed, thresholds, rule, config)}.json"
    if path.exists():
        try:
            return ThresholdTable.from_dict(json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError):
            pass  # rebuild a corrupt cache file
    table = build_table(model, n, seed, thresholds, progress, rule, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_dict()))
    tmp.replace(path)
    return table


def _engine(model: str, max_slots: int, rule: str, config: tuple | dict):
    from engine.loading import load_engine

    if rule == "threshold" and not config:
        return load_engine(model, max_slots=max_slots)
    from engine.decoding import make_rule

    return load_engine(model, max_slots=max_slots, rule=make_rule(rule, **dict(config)))


def build_table(model: str, n: int, seed: int, thresholds: tuple[float, ...], progress: bool = False,
                rule: str = "threshold", config: dict | None = None) -> ThresholdTable:
    """Each prompt decoded by ``rule`` at each threshold (the request's level: the rule decodes with its
    knob at it)."""
    import tasksuite as tasks
    from engine.sequence import SamplingParams

    engine = _engine(model, 64, rule, config or {})
    examples = tasks.heldout_set(n, seed)
    rounds, correct = [[] for _ in examples], [[] for _ in examples]
    for t in thresholds:
        outs = engine.generate([e.prompt for e in examples], SamplingParams(threshold=t), progress=progress)
        for i, (ex, out) in enumerate(zip(examples, outs)):
            rounds[i].append(out.rounds)
            correct[i].append(ex.check(out.text))
    return ThresholdTable(model, tuple(thresholds), tuple(e.prompt for e in examples),
                          tuple(e.category for e in examples), tuple(tuple(r) for r in rounds),
                          tuple(tuple(c) for c in correct), rule, tuple(sorted((config or {}).items())))


def threshold_at(schedule: list[tuple[float, float]], progress: float) -> float:
    """The threshold a schedule [(progress at which it starts, threshold), ...] uses at ``progress``."""
    t = schedule[0][1]
    for start, th in schedule:
        if start > progress + 1e-9:
            break
        t = th
    return t


def step_thresholds(table: ThresholdTable, p: int, schedule: list[tuple[float, float]]) -> tuple[float, ...]:
    """The threshold of each decoding step of prompt ``p`` under ``schedule`` (a schedule over progress,
    [(progress at which it starts, threshold), ...]): a step at threshold t advances progress by
    1 / (the prompt's rounds at t). After the last entry the last threshold repeats. Deterministic, so
    schedules that give the same step sequence give the same answer."""
    index = {t: i for i, t in enumerate(table.thresholds)}
    out, f = [], 0.0
    while f < 1.0 - 1e-9 and len(out) < 4 * max(table.rounds[p]) + 8:
        t = threshold_at(schedule, f)
        out.append(t)
        f += 1.0 / max(table.rounds[p][index[t]], 1)
    return tuple(out)


def replay(table: ThresholdTable, jobs: list[tuple[int, tuple[float, ...]]], model: str | None = None,
           max_slots: int = 128) -> list[bool]:
    """Decode prompt ``jobs[k][0]`` of the table with threshold ``jobs[k][1][i]`` at its i-th decoding
    step (the last one repeating); returns whether each answer is right."""
    import tasksuite as tasks
    from engine.sequence import SamplingParams

    if not jobs:
        return []
    engine = _engine(model or table.model, max_slots, table.decoding, table.config)
    live, done = [], {}
    for k, (p, steps) in enumerate(jobs):
        live.append((k, p, steps, engine.add_request(table.prompts[p], SamplingParams(threshold=steps[0]))))
    while live:
        batch = live[:max_slots]
        for _k, _p, steps, seq in batch:
            seq.threshold = steps[min(seq.rounds, len(steps) - 1)]
        engine.step([seq for *_, seq in batch])
        for k, p, _steps, seq in batch:
            if seq.finished:
                done[k] = tasks.check(table.categories[p], table.prompts[p], engine.output(seq).text)
                engine.sequences.pop(seq.seq_id, None)
        live = [x for x in live if not x[3].finished]
    return [done[k] for k in range(len(jobs))]
