"""Profiling collection: run the task suite through the engine and record what
the predictors learn from.

Per request and threshold: the admission features, the output budget, total
rounds and rounds per block, whether the answer was correct, the pooled
final-layer hidden rows of the first denoising round and its P(EOS) at the
output positions it saw (with the engine's lookahead, as served), and one step-feature
row after every denoising step with the steps that remained after it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from predictors.bundle import LOOKAHEAD_BLOCKS
from predictors.features import STEP_FEATURES, admission_row, confidence_stats, decoding_columns, state_row

DEFAULT_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class Dataset:
    """One row per (request, threshold); step rows index back into it with ``step_req``."""

    model: str
    block_size: int = 0
    category: list[str] = field(default_factory=list)
    prompt_id: list[int] = field(default_factory=list)  # the same prompt under several thresholds
    admission: list[list[float]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    budget: list[int] = field(default_factory=list)  # output budget (max tokens)
    rounds: list[int] = field(default_factory=list)
    block_rounds: list[list[int]] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    hidden: list[np.ndarray] = field(default_factory=list)
    first_conf: list[list[float]] = field(default_factory=list)  # confidence stats of the first round
    first_eos: list[np.ndarray] = field(default_factory=list)  # the first round's P(EOS) per output position seen
    step_rows: list[list[float]] = field(default_factory=list)
    step_remaining: list[int] = field(default_factory=list)
    step_done: list[int] = field(default_factory=list)  # steps taken when the row was recorded
    step_req: list[int] = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        width = max((len(b) for b in self.block_rounds), default=0)
        blocks = np.zeros((len(self.block_rounds), width), dtype=np.int32)
        for i, b in enumerate(self.block_rounds):
            blocks[i, : len(b)] = b
        eos = np.full((len(self.first_eos), max((len(e) for e in self.first_eos), default=0)), np.nan, np.float32)
        for i, e in enumerate(self.first_eos):
            eos[i, : len(e)] = e
        return {
            "first_eos": eos,  # NaN past the positions the first round saw
            "block_size": np.array(self.block_size),
            "category": np.array(self.category), "prompt_id": np.array(self.prompt_id, dtype=np.int32),
            "admission": np.array(self.admission, dtype=np.float64).reshape(-1, 4),
            "prompt_tokens": np.array(self.prompt_tokens, dtype=np.int32),
            "budget": np.array(self.budget, dtype=np.int32), "rounds": np.array(self.rounds, dtype=np.int32),
            "block_rounds": blocks, "correct": np.array(self.correct, dtype=bool),
            "hidden": np.stack(self.hidden).astype(np.float32) if self.hidden else np.zeros((0, 0), np.float32),
            "first_conf": np.array(self.first_conf, dtype=np.float64).reshape(-1, 5),
            # the 11 step features, and the decoding rule's 2 after them when collected with ``rule_features``
            "step_rows": np.array(self.step_rows, dtype=np.float64).reshape(
                -1, len(self.step_rows[0]) if self.step_rows else len(STEP_FEATURES)),
            "step_remaining": np.array(self.step_remaining, dtype=np.int32),
            "step_done": np.array(self.step_done, dtype=np.int32),
            "step_req": np.array(self.step_req, dtype=np.int32),
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, model=np.array(self.model), **self.arrays())
        return path


def load_dataset(path: str | Path) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no collected data at {path}; run `remask predictors collect` first")
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def collect(engine, examples, thresholds=DEFAULT_THRESHOLDS, model: str = "", progress: bool = True,
            rule_features: bool = False) -> Dataset:
    """Decode every example at every threshold (batched, the engine's own rounds; the engine's decoding rule
    decodes at its knob for each threshold, a level: ``knob_at``). ``rule_features``: each step row also
    carries the rule's code and knob (``features.RULE_FEATURES``), for a step model of (rule, knob)."""
    from tqdm import tqdm

    from engine.sequence import SamplingParams

    ds = Dataset(model, block_size=engine.cfg.block_size)
    engine.lookahead = LOOKAHEAD_BLOCKS  # P(EOS) past the first block for longer answers, as served
    bar = tqdm(total=len(examples) * len(thresholds), desc=f"collect {model}", unit="req", disable=not progress)
    for t in thresholds:
        extra = decoding_columns(engine.rule.name, t) if rule_features else []
        seqs = [engine.add_request(ex.prompt, SamplingParams(threshold=t)) for ex in examples]
        steps: dict[int, list[tuple[list[float], int]]] = {s.seq_id: [] for s in seqs}
        blocks: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        in_block = dict.fromkeys(steps, 0)
        live = list(seqs)
        while live:
            result = engine.step(live[: engine.max_slots])
            for rep in result.reports:
                if rep.kind.value == "prefill":
                    continue
                seq = engine.sequences[rep.seq_id]
                in_block[seq.seq_id] += 1
                if rep.block_done or rep.finished:
                    blocks[seq.seq_id].append(in_block[seq.seq_id])
                    in_block[seq.seq_id] = 0
                if not rep.finished:
                    steps[seq.seq_id].append((list(state_row(seq, t)) + extra, seq.rounds))
            finished = sum(s.finished for s in live)
            live = [s for s in live if not s.finished]
            bar.update(finished)
        for i, (ex, seq) in enumerate(zip(examples, seqs)):
            req = len(ds.rounds)
            ds.category.append(ex.category)
            ds.prompt_id.append(i)
            ds.admission.append(admission_row(ex.prompt, len(seq.prompt_ids), t))
            ds.prompt_tokens.append(len(seq.prompt_ids))
            ds.budget.append(seq.max_tokens)
            ds.rounds.append(seq.rounds)
            ds.block_rounds.append(blocks[seq.seq_id])
            ds.correct.append(ex.check(engine.output(seq).text))
            ds.hidden.append(seq.first_hidden.float().cpu().numpy())
            ds.first_conf.append(confidence_stats(seq.first_confidences).tolist())
            ds.first_eos.append(seq.first_eos.float().cpu().numpy())
            for row, done_steps in steps[seq.seq_id]:
                ds.step_rows.append(row)
                ds.step_remaining.append(seq.rounds - done_steps)
                ds.step_done.append(done_steps)
                ds.step_req.append(req)
            engine.sequences.pop(seq.seq_id, None)
    bar.close()
    return ds


def heldout_and_train(n_train: int, n_heldout: int, seed: int = 0):
    import tasksuite as tasks

    rng = random.Random(seed)
    train = [tasks.sample(rng, split="train") for _ in range(n_train)]
    held = [tasks.sample(rng, split="heldout") for _ in range(n_heldout)]
    return train, held
