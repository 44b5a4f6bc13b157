"""Per-request KV caches.

Both keep one tensor of shape [layers, 2, kv_heads, capacity, head_dim] with
RoPE already applied to K, so context keys can be gathered in any order.
Contexts are views of it (one, or two for the dual cache's prefix and suffix);
their positions are small host tensors, so building a step never waits on the
device.

- ``ExactCache`` (block-causal models): holds the committed prefix only; it
  grows by whole blocks (a prefill block or the commit of a finished block)
  and is never stale.
- ``ApproxCache`` (full-sequence models, Fast-dLLM style): a recompute step
  refreshes every position; cached steps reuse it. ``prefix`` keeps only the
  positions before the current block, ``dual`` also the (masked) suffix.
"""

from __future__ import annotations

import torch


class _Cache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device) -> None:
        self.kv = torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def write(self, fresh: torch.Tensor, positions: torch.Tensor) -> None:
        """fresh: [layers, 2, kv_heads, len(positions), head_dim]."""
        self.kv[:, :, :, positions] = fresh


class ExactCache(_Cache):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.length = 0

    def context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K/V [layers, 2, kv_heads, C, head_dim], host positions [C]) of the committed prefix."""
        return self.kv[:, :, :, : self.length], torch.arange(self.length)

    def append(self, fresh: torch.Tensor, start: int) -> None:
        if start != self.length:
            raise RuntimeError(f"exact cache holds {self.length} positions; cannot append at {start}")
        end = start + fresh.shape[3]
        if end > self.capacity:
            raise RuntimeError(f"exact cache overflow: {end} > capacity {self.capacity}")
        self.kv[:, :, :, start:end] = fresh
        self.length = end


class ApproxCache(_Cache):
    def __init__(self, *args, variant: str = "dual", **kwargs) -> None:
        if variant not in ("prefix", "dual"):
            raise ValueError(f"approximate cache variant must be 'prefix' or 'dual', not {variant!r}")
        super().__init__(*args, **kwargs)
        self.variant = variant
        self.filled = 0  # positions [0, filled) hold KV from the last recompute

    def refresh(self, fresh: torch.Tensor) -> None:
        self.kv[:, :, :, : fresh.shape[3]] = fresh
        self.filled = fresh.shape[3]

    def context(self, q_start: int, q_end: int) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
        """Context (K/V, host positions) for a cached step whose queries cover [q_start, q_end). The dual
        variant's K/V is two views (prefix, suffix), in position order: the runner copies them into the
        round's buffer one after the other, so they are never concatenated first."""
        if self.variant == "prefix" or q_end >= self.filled:
            return self.kv[:, :, :, :q_start], torch.arange(q_start)
        kv = (self.kv[:, :, :, :q_start], self.kv[:, :, :, q_end : self.filled])
        return kv, torch.cat((torch.arange(q_start), torch.arange(q_end, self.filled)))
