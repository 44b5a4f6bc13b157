"""Unmasking rules: which masked positions of the current block to commit,
and the (confidence, token) of each masked position they choose from.

A rule sees the confidences (top-1 probabilities) of the block's still-masked
positions and returns a selection. Rules are small strategy objects chosen by
name; the threshold may differ per request and per step (the router's
SLO-aware threshold choice passes it in), so it is an argument of select().

A greedy request's token is the argmax (``confidence``); a sampling request's
(temperature > 0) is drawn by ``sample``: Gumbel-max over the tempered,
top-k/top-p filtered logits, with noise that depends only on the request's seed
and the token's absolute position (``noise_seeds``), so a seeded request
decodes the same text in any batch, on any tensor-parallel rank and after a
resume elsewhere (on the same kind of device: CPU and CUDA generators differ).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class UnmaskRule(Protocol):
    name: str

    def select(self, conf: torch.Tensor, step_in_block: int, masked_at_start: int,
               threshold: float | None = None) -> torch.Tensor:
        """Bool mask over ``conf`` (the masked positions): which to commit now.

        step_in_block: steps already taken on this block. masked_at_start: masked
        positions when the block began. threshold: per-request override.
        """
        ...


def _at_least_top(conf: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    k = min(max(k, 1), conf.numel())
    if int(chosen.sum()) >= k:
        return chosen
    chosen = chosen.clone()
    chosen[torch.topk(conf, k).indices] = True
    return chosen


def _check_threshold(t: float) -> float:
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {t}")
    return t


@dataclass(frozen=True)
class ThresholdRule:
    """Commit every position whose confidence exceeds the threshold, and at
    least the single most confident one (Fast-dLLM's parallel decoding)."""

    threshold: float = 0.9
    name: str = "threshold"

    def __post_init__(self) -> None:
        _check_threshold(self.threshold)

    def select(self, conf, step_in_block, masked_at_start, threshold=None):
        t = self.threshold if threshold is None else _check_threshold(threshold)
        return _at_least_top(conf, conf > t, 1)


@dataclass(frozen=True)
class DynamicRule:
    """Threshold rule with a per-step minimum: at least ``min_per_step``
    positions (or all that remain) are committed each step."""

    threshold: float = 0.9
    min_per_step: int = 2
    name: str = "dynamic"

    def __post_init__(self) -> None:
        _check_threshold(self.threshold)
        if self.min_per_step < 1:
            raise ValueError("min_per_step must be at least 1")

    def select(self, conf, step_in_block, masked_at_start, threshold=None):
        t = self.threshold if threshold is None else _check_threshold(threshold)
        return _at_least_top(conf, conf > t, self.min_per_step)


@dataclass(frozen=True)
class LowConfidenceRule:
    """LLaDA's schedule: a fixed number of steps per block, committing the most
    confident positions, the block's masks spread evenly over the steps."""

    steps_per_block: int = 8
    name: str = "low_confidence"

    def __post_init__(self) -> None:
        if self.steps_per_block < 1:
            raise ValueError("steps_per_block must be at least 1")

    def quota(self, step_in_block: int, masked_at_start: int) -> int:
        base, extra = divmod(masked_at_start, self.steps_per_block)
        return base + (1 if step_in_block < extra else 0)

    def select(self, conf, step_in_block, masked_at_start, threshold=None):
        if step_in_block >= self.steps_per_block - 1:
            return torch.ones_like(conf, dtype=torch.bool)
        k = self.quota(step_in_block, masked_at_start)
        return _at_least_top(conf, torch.zeros_like(conf, dtype=torch.bool), k)


RULES: dict[str, Callable[..., UnmaskRule]] = {
    "threshold": ThresholdRule,
    "dynamic": DynamicRule,
    "low_confidence": LowConfidenceRule,
}


def make_rule(name: str, **kwargs) -> UnmaskRule:
    try:
        factory = RULES[name]
    except KeyError:
        raise ValueError(f"unknown unmasking rule {name!r}; known: {', '.join(sorted(RULES))}") from None
    return factory(**kwargs)


def confidence(logits: torch.Tensor, mask_token_id: int | None = None,
               overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 probability, argmax token) of each row of logits [.., V], the softmax in float32.

    The mask token is never a prediction: committing it would leave the
    position masked forever. ``overwrite``: the caller's logits are scratch, so
    the mask token's column is masked in them in place (no copy of a
    vocabulary-wide tensor; the runner's LM head output).
    """
    if mask_token_id is not None and 0 <= mask_token_id < logits.shape[-1]:
        if not overwrite:
            logits = logits.clone()
        logits[..., mask_token_id] = float("-inf")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    conf, tokens = probs.max(dim=-1)
    return conf, tokens


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 values (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def noise_seeds(seed: int, positions: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    """The generator seed of each position's Gumbel noise: a 64-bit mix of (``seed``, absolute position),
    so the noise a token sees depends on nothing else (not the round, batch, step or instance)."""
    pos = np.asarray(positions.numpy() if isinstance(positions, torch.Tensor) else positions, dtype=np.uint64)
    key = _splitmix64(np.array([int(seed) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return _splitmix64(key ^ pos).tolist()


def gumbel_noise(seeds: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise [len(seeds), vocab] (float32, on ``device``): row i from a generator seeded
    with ``seeds[i]``. CPU and CUDA generators give different streams; one kind of device always the same."""
    device = torch.device(device)
    u = torch.empty((len(seeds), vocab), dtype=torch.float32, device=device)
    gen = torch.Generator(device=device)
    for row, s in zip(u, seeds):
        gen.manual_seed(s)
        row.uniform_(generator=gen)  # [0, 1): a 0 gives -inf noise (that token never wins), never NaN
    return u.log_().neg_().log_().neg_()


def _per_row(values, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar, a sequence or a host tensor of per-row values as a [n] tensor on ``device`` (copied
    asynchronously from pinned memory on a GPU: nothing here waits for the device)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    t = t.to(dtype).expand(n) if t.dim() == 0 else t.to(dtype)
    if t.device == device:
        return t
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def filter_logits(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scores`` [n, V] with the tokens outside each row's top-k (``top_k`` [n], <= 0: off; ties with
    the k-th kept) and then outside its nucleus (``top_p`` [n]: the fewest most likely tokens whose
    probability under softmax(scores) reaches top_p; 1: off) set to -inf. The most likely token always
    stays."""
    n, vocab = scores.shape
    ordered, order = scores.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    drop = ordered < ordered.gather(-1, (k - 1)[:, None])
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    above = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    drop |= (above >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return scores.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))


def sample(logits: torch.Tensor, temperature, top_k, top_p, seeds: Sequence[int],
           mask_token_id: int | None = None, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence, token) of each row of logits [n, V], the token sampled (LLaDA's Gumbel-max choice):
    the mask token excluded (as in ``confidence``), the logits divided by the row's ``temperature``
    (> 0), filtered to its ``top_k`` (<= 0: off) and then its nucleus ``top_p`` (1: off; Dream's and
    Hugging Face's order), and the token is argmax(scores + Gumbel noise) with row i's noise drawn from
    ``seeds[i]`` (``gumbel_noise``): a sample from softmax of the filtered, tempered scores. Its
    confidence is the model's probability of it: softmax(logits) in float32, untempered and unfiltered
    (LLaDA's low-confidence remasking), so an unmasking threshold means what it means for greedy
    requests, and top_k=1 (or a very low temperature) decodes exactly as greedy does. Per-row arguments
    are scalars, sequences or tensors of n values. ``overwrite``: the logits are scratch (masked in
    place)."""
    n, vocab = logits.shape
    if mask_token_id is not None and 0 <= mask_token_id < vocab:
        if not overwrite:
            logits = logits.clone()
        logits[..., mask_token_id] = float("-inf")
    dev = logits.device
    scores = logits.float() / _per_row(temperature, n, torch.float32, dev)[:, None]
    k, p = torch.as_tensor(top_k), torch.as_tensor(top_p)
    if bool((k > 0).any()) or bool((p < 1).any()):  # host values: no wait
        scores = filter_logits(scores, _per_row(k, n, torch.long, dev), _per_row(p, n, torch.float32, dev))
    tokens = (scores + gumbel_noise(seeds, vocab, dev)).argmax(dim=-1)
    conf = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, tokens[:, None])[:, 0]
    return conf, tokens
