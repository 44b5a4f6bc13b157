"""Reference decoding loops, one request at a time, for ``remask bench engine``.

Two well-known ways to decode a full-sequence (bidirectional) masked diffusion
model, written here in plain torch over a :class:`DLMTransformer` so that
Remask's engine can be measured against them on the same model and prompts:

- :func:`llada_generate`: LLaDA's ``generate`` with low-confidence remasking.
  The output canvas is split into blocks; each block gets a fixed number of
  steps; every step runs one forward over the whole sequence (prompt and
  canvas, no cache) and commits the ``k`` most confident masked positions of
  the block, the block's masks spread evenly over its steps (the remainder to
  the first steps). Greedy (argmax).
- :func:`fastdllm_generate`: Fast-dLLM's threshold parallel decoding with a
  prefix KV cache. The first step of each block is one forward over the whole
  sequence that both decodes and refreshes the cached K/V of the positions
  before the block; every further step of the block runs only the block's
  tokens, attending to that cached prefix (the masked suffix is dropped). A
  step commits every masked position of the block whose confidence exceeds
  the threshold, and at least the most confident one.

Both use the same conventions as Remask's engine (``engine/sequence.py``) so
that the comparison is fair:

- confidence is the engine's own ``engine.decoding.confidence``: the top-1
  probability of a softmax that excludes the mask token (never a prediction);
- the canvas is ``gen_length`` rounded up to whole blocks, and decoding stops
  as soon as the answer is complete: an EOS with no mask before it in the
  output, or no mask left within the first ``gen_length`` output positions.
  (LLaDA's and Fast-dLLM's published loops run every block to the end of the
  canvas; stopping early saves the reference loops the same work the engine
  saves, so they are not handicapped by forwards over a finished answer.)
- ``logits_shift`` models (Dream) predict the token at position p from the
  logits row p - 1.

Block-causal models (SDAR, LLaDA2) decode with an exact per-block cache, not
with these loops; they are refused with a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decoding import confidence
from engine.models.flops import forward_flops
from engine.models.transformer import DLMTransformer


@dataclass
class RefResult:
    token_ids: list[int]  # output tokens, up to (not including) the EOS, at most gen_length
    finish_reason: str  # 'stop' (an EOS ended the answer) | 'length'
    forwards: int  # model forwards, one per decoding step
    flops: int  # counted FLOPs of those forwards (engine/models/flops.py)
    canvas: list[int]  # the whole output canvas at the end (masks left where decoding stopped early)


def _check_model(model: DLMTransformer) -> None:
    cfg = model.config
    if cfg.attention != "bidirectional":
        raise ValueError(f"the reference loops decode bidirectional (full-sequence) models only, like LLaDA and "
                         f"Dream; this model's attention is {cfg.attention!r} (block-causal models such as SDAR "
                         f"decode block by block with an exact cache)")


def _setup(model: DLMTransformer, prompt_ids: list[int], gen_length: int, block_length: int | None):
    cfg = model.config
    _check_model(model)
    block = block_length or cfg.block_size
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if gen_length < 1 or block < 1:
        raise ValueError(f"gen_length and block_length must be positive, got {gen_length} and {block}")
    if cfg.mask_token_id in prompt_ids:
        raise ValueError("the prompt must not contain the mask token")
    canvas = -(-gen_length // block) * block
    start = len(prompt_ids)
    if start + canvas > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({start} tokens) + canvas ({canvas}) exceeds the model's context of "
                         f"{cfg.max_position_embeddings} tokens")
    dev = next(model.parameters()).device
    x = torch.tensor([list(prompt_ids) + [cfg.mask_token_id] * canvas], dtype=torch.long, device=dev)
    pos = torch.arange(start + canvas, device=dev)[None]
    blocks = [(s, s + block) for s in range(start, start + canvas, block)]
    return cfg, x, pos, blocks, start


def _masked(x: torch.Tensor, span: tuple[int, int], mask_token_id: int) -> torch.Tensor:
    s, e = span
    return torch.nonzero(x[0, s:e] == mask_token_id).flatten() + s


def _done(x: torch.Tensor, start: int, gen_length: int, cfg) -> tuple[str, int] | None:
    """('stop' | 'length', output length) once the answer is complete, else None (one small host read)."""
    out = x[0, start:]
    is_mask = out == cfg.mask_token_id
    is_eos = out == cfg.eos_token_id
    n = out.numel()
    idx = torch.arange(n, device=out.device)
    first_eos = torch.where(is_eos, idx, n).min()
    masks_before_eos = (is_mask & (idx < first_eos)).sum()
    masks_in_budget = is_mask[:gen_length].sum()
    first, before, budget = torch.stack([first_eos, masks_before_eos, masks_in_budget]).tolist()
    if first < n and before == 0:
        return "stop", min(first, gen_length)
    if budget == 0:
        return "length", gen_length
    return None


def _result(x: torch.Tensor, start: int, done: tuple[str, int], forwards: int, flops: int) -> RefResult:
    canvas = x[0, start:].tolist()
    return RefResult(canvas[: done[1]], done[0], forwards, flops, canvas)


@torch.inference_mode()
def llada_generate(model: DLMTransformer, prompt_ids: list[int], gen_length: int, block_length: int | None = None,
                   steps_per_block: int = 8) -> RefResult:
    """LLaDA's low-confidence remasking loop (greedy), stopping once the answer is complete.

    Every step is one forward over prompt + canvas (no cache). In each block of
    ``block_length`` positions (default: the model's block size), step j of the
    block's ``steps_per_block`` commits the k_j most confident masked positions,
    k_j = masked // steps (+1 for the first masked % steps steps), at least one;
    the block's last step commits whatever is left. Stopping as soon as an EOS
    has no mask before it (or the first ``gen_length`` positions are filled) is
    the stopping rule of Remask's engine; the published loop runs on to the end
    of the canvas, which would only add forwards over a finished answer.
    """
    if steps_per_block < 1:
        raise ValueError(f"steps_per_block must be at least 1, got {steps_per_block}")
    cfg, x, pos, blocks, start = _setup(model, prompt_ids, gen_length, block_length)
    shift, mask_id = cfg.logits_shift, cfg.mask_token_id
    forwards = flops = 0
    done = None
    for span in blocks:
        masked_at_start = span[1] - span[0]  # blocks start fully masked
        base, extra = divmod(masked_at_start, steps_per_block)
        for step in range(steps_per_block):
            masked = _masked(x, span, mask_id)
            logits = model(x, pos, None)[0][0]
            forwards += 1
            flops += forward_flops(cfg, 1, x.shape[1])
            conf, tok = confidence(logits[masked - shift], mask_id)
            n = masked.numel()
            k = n if step == steps_per_block - 1 else min(max(base + (step < extra), 1), n)
            chosen = torch.topk(conf, k).indices
            x[0, masked[chosen]] = tok[chosen]
            done = _done(x, start, gen_length, cfg)
            if done or k == n:
                break
        if done:
            break
    assert done is not None  # the last block fills the canvas
    return _result(x, start, done, forwards, flops)


@torch.inference_mode()
def fastdllm_generate(model: DLMTransformer, prompt_ids: list[int], gen_length: int, block_length: int | None = None,
                      threshold: float = 0.9) -> RefResult:
    """Fast-dLLM's threshold parallel decoding with a prefix KV cache, stopping once the answer is complete.

    Per block: one forward over prompt + canvas decodes the block's first step
    and refreshes the prefix cache (K/V of every position before the block;
    with shifted logits the block's queries start one position earlier, so
    the cache ends there). Each further step is a forward over the block's
    tokens only, with the cached prefix K/V as ``past``. A step commits every
    masked position of the block whose confidence exceeds ``threshold`` and at
    least the most confident one. Same stopping rule as Remask's engine (see
    :func:`llada_generate`).
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    cfg, x, pos, blocks, start = _setup(model, prompt_ids, gen_length, block_length)
    shift, mask_id = cfg.logits_shift, cfg.mask_token_id
    forwards = flops = 0
    done = None
    for bs, be in blocks:
        q0 = bs - shift  # first query row of a cached step
        logits, _, fresh = model(x, pos, None)
        forwards += 1
        flops += forward_flops(cfg, 1, x.shape[1])
        prefix = [(k[:, :, :q0], v[:, :, :q0]) for k, v in fresh]
        rows, offset = logits[0], 0
        while True:
            masked = _masked(x, (bs, be), mask_id)
            conf, tok = confidence(rows[masked - shift - offset], mask_id)
            chosen = conf > threshold
            if not bool(chosen.any()):
                chosen[torch.topk(conf, 1).indices] = True
            x[0, masked[chosen]] = tok[chosen]
            done = _done(x, start, gen_length, cfg)
            if done or bool(chosen.all()):
                break
            rows = model(x[:, q0:be], pos[:, q0:be], None, prefix)[0][0]
            offset = q0
            forwards += 1
            flops += forward_flops(cfg, 1, be - q0, q0)
        if done:
            break
    assert done is not None
    return _result(x, start, done, forwards, flops)
