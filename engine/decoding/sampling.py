"""The (confidence, token) of each position a decoding rule chooses from, and the per-position
statistics some rules need beyond them (``entropy``, ``token_prob``).

A greedy request's token is the argmax (``confidence``); a sampling request's
(temperature > 0) is drawn by ``sample``: Gumbel-max over the tempered,
top-k/top-p filtered logits, with noise that depends only on the request's seed
and the token's absolute position (``noise_seeds``), so a seeded request
decodes the same text in any batch, on any tensor-parallel rank and after a
resume elsewhere (on the same kind of device: CPU and CUDA generators differ).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


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


def _masked_probs(logits: torch.Tensor, mask_token_id: int | None) -> torch.Tensor:
    """softmax(logits) in float32 with the mask token's column excluded (as ``confidence`` does)."""
    if mask_token_id is not None and 0 <= mask_token_id < logits.shape[-1]:
        logits = logits.clone()
        logits[..., mask_token_id] = float("-inf")
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def entropy(logits: torch.Tensor, mask_token_id: int | None = None) -> torch.Tensor:
    """Entropy in nats of each row's distribution (the one ``confidence`` takes its top-1 from: softmax in
    float32, the mask token excluded) [..]. A decoding rule that names "entropy" in its ``needs`` gets this
    per position (the entropy-bounded sampler's budget is spent in these units)."""
    probs = _masked_probs(logits, mask_token_id)
    return -torch.special.xlogy(probs, probs).sum(dim=-1)


def token_prob(logits: torch.Tensor, tokens: torch.Tensor, mask_token_id: int | None = None) -> torch.Tensor:
    """The probability of ``tokens`` [..] under each row's distribution (softmax in float32, the mask token
    excluded: a position that still holds the mask token gets 0). A rule that names "current_prob" in its
    ``needs`` gets this for the token now on the canvas (an editing rule's penalty for rewriting it)."""
    probs = _masked_probs(logits, mask_token_id)
    return probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def penalise_previous(logits: torch.Tensor, prev_tokens: torch.Tensor, penalty: float) -> torch.Tensor:
    """LLaDA2.1's repetition penalty (``joint_threshold``'s ``penalty_lambda``): ``penalty`` subtracted from
    row i's logit of ``prev_tokens[i]``, the token on the canvas just before row i's position (negative ids:
    no token there, untouched). Returns a new tensor; the proposals (``confidence``/``sample``) are made
    from it."""
    out = logits.clone()
    if penalty <= 0.0:
        return out
    rows = torch.nonzero(prev_tokens >= 0).flatten()
    out[rows, prev_tokens[rows].long()] -= penalty
    return out
