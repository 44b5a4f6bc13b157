"""Per-request KV caches.

Both keep one tensor of shape [layers, 2, kv_heads, capacity, head_dim] with
RoPE already applied to K, so context keys can be gathered in any order; index
p holds position p. Contexts are views of it (one, or two for the dual cache's
prefix and suffix); their positions are small host tensors, so building a step
never waits on the device.

That tensor is a slot of the runner's ``KVPool`` when one is free (preallocated
once, so no request allocates device memory, and a round whose requests hold
consecutive slots attends to the pool in place: see engine/runner.py), else a
tensor of its own. A slot returns to the pool when its cache is dropped.

- ``ExactCache`` (block-causal models): holds the committed prefix only; it
  grows by whole blocks (a prefill block or the commit of a finished block)
  and is never stale.
- ``ApproxCache`` (full-sequence models, Fast-dLLM style): a recompute step
  refreshes every position; cached steps reuse it. ``prefix`` keeps only the
  positions before the current block, ``dual`` also the (masked) suffix.
"""

from __future__ import annotations

import heapq
import weakref

import torch


class KVPool:
    """Preallocated K/V slots: one tensor [layers, 2, slots, kv_heads, capacity + 1, head_dim]. A cache
    takes a slot's first ``capacity`` positions; the last one is scratch, where a batched forward over
    the pool writes the K/V of its padding rows. Zeroed once: positions a round attends past a
    request's own are masked, and stay finite (a masked NaN would still poison the softmax product)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, capacity: int, dtype, device) -> None:
        if slots < 1 or capacity < 1:
            raise ValueError(f"a KV pool needs at least one slot and one position, got {slots} x {capacity}")
        self.kv = torch.zeros(layers, 2, slots, kv_heads, capacity + 1, head_dim, dtype=dtype, device=device)
        self.capacity = capacity
        self._free = list(range(slots))  # a heap: the lowest free slot first, so live slots stay packed

    @property
    def slots(self) -> int:
        return self.kv.shape[2]

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        heapq.heappush(self._free, slot)


class _Cache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device,
                 pool: KVPool | None = None) -> None:
        self.slot: int | None = None
        if pool is not None and capacity <= pool.capacity and pool.kv.dtype == dtype:
            self.slot = pool.acquire()
        if self.slot is None:  # no pool, no free slot, or too long for one: a tensor of its own
            self.kv = torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        else:
            self.kv = pool.kv[:, :, self.slot, :, :capacity]
            weakref.finalize(self, pool.release, self.slot)  # back to the pool however the cache is dropped

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def _put(self, fresh: torch.Tensor, start: int) -> None:
        """Store ``fresh`` at positions [start, start + T); a no-op when a forward over the pool already
        wrote it there."""
        dst = self.kv[:, :, :, start : start + fresh.shape[3]]
        if dst.data_ptr() != fresh.data_ptr() or dst.stride() != fresh.stride():
            dst.copy_(fresh)


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
        self._put(fresh, start)
        self.length = end


class ApproxCache(_Cache):
    def __init__(self, *args, variant: str = "dual", **kwargs) -> None:
        if variant not in ("prefix", "dual"):
            raise ValueError(f"approximate cache variant must be 'prefix' or 'dual', not {variant!r}")
        super().__init__(*args, **kwargs)
        self.variant = variant
        self.filled = 0  # positions [0, filled) hold KV from the last recompute

    def refresh(self, fresh: torch.Tensor) -> None:
        self._put(fresh, 0)
        self.filled = fresh.shape[3]

    def context(self, q_start: int, q_end: int) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
        """Context (K/V, host positions) for a cached step whose queries cover [q_start, q_end). The dual
        variant's K/V is two views (prefix, suffix), in position order: the runner copies them into the
        round's buffer one after the other, so they are never concatenated first."""
        if self.variant == "prefix" or q_end >= self.filled:
            return self.kv[:, :, :, :q_start], torch.arange(q_start)
        kv = (self.kv[:, :, :, :q_start], self.kv[:, :, :, q_end : self.filled])
        return kv, torch.cat((torch.arange(q_start), torch.arange(q_end, self.filled)))
