"""Request length distributions (nominal prompt and output token counts), and what a task needs.

``azure-conv`` is the lognormal fit of the Azure LLM inference trace 2023 (conversation): input
mu 6.63 sigma 0.99, output mu 5.02 sigma 0.86 (medians about 758 and 151 tokens). ``sharegpt`` is
ShareGPT-like: lognormal with sigma 1.0 (input) and 0.9 (output), mu chosen so the means are 140 and
264 tokens (the usual ShareGPT means; the sigmas are our choice, not a fit). Samples are rounded and
clipped to [1, max_input] and [1, max_output].

The embedded models cannot read a 758-token prompt of prose, so prompts always come from the task
suite; the nominal lengths are kept in the trace and set ``max_tokens`` (see :func:`max_tokens_for`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

import tasksuite as tasks


@dataclass(frozen=True)
class LogNormal:
    mu: float
    sigma: float

    @classmethod
    def with_mean(cls, mean: float, sigma: float) -> LogNormal:
        return cls(math.log(mean) - sigma * sigma / 2.0, sigma)

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma * self.sigma / 2.0)


LENGTHS: dict[str, tuple[LogNormal, LogNormal]] = {
    "azure-conv": (LogNormal(6.63, 0.99), LogNormal(5.02, 0.86)),
    "sharegpt": (LogNormal.with_mean(140.0, 1.0), LogNormal.with_mean(264.0, 0.9)),
}


def sample_lengths(name: str, n: int, rng: np.random.Generator, max_input: int = 8192,
                   max_output: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (input, output) nominal token counts from distribution ``name``, rounded and clipped."""
    if name not in LENGTHS:
        raise ValueError(f"unknown length distribution {name!r}; known: {', '.join(LENGTHS)}")
    d_in, d_out = LENGTHS[name]
    x_in = rng.lognormal(d_in.mu, d_in.sigma, n)
    x_out = rng.lognormal(d_out.mu, d_out.sigma, n)
    return (np.clip(np.rint(x_in), 1, max_input).astype(int), np.clip(np.rint(x_out), 1, max_output).astype(int))


def _longest(options: list[tuple[str, float]]) -> int:
    return max(len(w) for w, _ in options)


def answer_need(example: tasks.Example) -> int:
    """Characters the longest valid answer to ``example`` can take (every answer, not just the reference one).

    The embedded models' tokenizer is one token per character, so this is also a token count; BPE
    tokenizers need fewer.
    """
    if example.category != "prose":
        return len(example.answer)
    m = re.fullmatch(r"story: (\w+) (\d+)", example.prompt)
    if not m:
        raise ValueError(f"not a prose prompt: {example.prompt!r}")
    noun, n = m.group(1), int(m.group(2))
    parts = []
    for template, slots in tasks.SENTENCES[:n]:
        parts.append(template.format(n=noun, **{k: "x" * _longest(v) for k, v in slots.items()}))
    parts += [f"code {tasks.CODES[0]}.", "the end."]
    return len(" ".join(parts))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def max_tokens_for(example: tasks.Example, output_len: int | None, cap: int, multiple: int = 8) -> int:
    """``max_tokens`` of a request: what the task needs (plus one for end-of-sequence), rounded up to ``multiple``;
    with a nominal ``output_len``, that length instead when it is larger, never above ``cap``.

    The task's need is a floor so every answer still fits: a request never fails for want of room.
    """
    need = round_up(answer_need(example) + 1, multiple)
    want = need if output_len is None else max(need, output_len)
    return max(need, min(want, cap))
