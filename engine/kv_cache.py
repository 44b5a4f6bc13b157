"""Per-request KV caches.

Both keep one tensor of shape [layers, 2, kv_heads, capacity, head_dim] with
RoPE already applied to K, so context keys can be gathered in any order; index
p holds position p. Contexts are views of it (one, or two for the dual cache's
prefix and suffix); their positions are small host tensors, so building a step
never waits on the device.

That tensor is a slot of the runner's ``KVPool`` when one is free (preallocated
once, so no request allocates device memory, and a round whose requests hold
consecutive slots attends to the pool in place: see engine/runner.py). A cache
longer than a slot takes several slots, any free ones: its positions are the
slots' positions one slot after the other (never a slot's scratch position),
its contexts the slots' views in position order (which the runner copies into
the round's buffer), so it too stays within the pool's memory. Only a cache the
pool cannot hold (no pool, another dtype, not enough free slots: the instance
scheduler's reservations rule that out) gets a tensor of its own, counted in
``KVPool.beyond``. Slots return to the pool when their cache is dropped.

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
        self.beyond = 0  # caches that could not take slots and got a tensor of their own (memory past the pool)

    @property
    def slots(self) -> int:
        return self.kv.shape[2]

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes of one slot, its scratch position included."""
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def slots_for(self, positions: int) -> int:
        """Slots a cache of ``positions`` takes."""
        return max(-(-positions // self.capacity), 1)

    def acquire(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def acquire_many(self, n: int) -> list[int] | None:
        """``n`` slots (the lowest free ones), or None when fewer are free."""
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        heapq.heappush(self._free, slot)

    def release_many(self, slots: list[int]) -> None:
        for slot in slots:
            self.release(slot)


class _Cache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device,
                 pool: KVPool | None = None) -> None:
        self.slot: int | None = None  # the one slot holding the cache (forwards may attend to it in place)
        self.slots: list[int] = []  # every pool slot it holds, in position order
        if pool is not None:
            if pool.kv.dtype == dtype:
                self.slots = pool.acquire_many(pool.slots_for(capacity)) or []
            pool.beyond += not self.slots
        if not self.slots:  # no pool, another dtype, or not enough free slots: a tensor of its own
            self.segments = [torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)]
        else:
            c = pool.capacity
            self.segments = [pool.kv[:, :, s, :, : min(c, capacity - i * c)] for i, s in enumerate(self.slots)]
            if len(self.slots) == 1:
                self.slot = self.slots[0]
            weakref.finalize(self, pool.release_many, self.slots)  # back to the pool however it is dropped
        self._starts = [0]
        for seg in self.segments:
            self._starts.append(self._starts[-1] + seg.shape[3])

    @property
    def kv(self) -> torch.Tensor:
        """The cache's one tensor [layers, 2, kv_heads, capacity, head_dim] (a cache in one slot or its own
        tensor; a cache over several slots has ``segments`` instead)."""
        if len(self.segments) != 1:
            raise AttributeError("a cache over several pool slots has no single tensor: use its segments")
        return self.segments[0]

    @property
    def capacity(self) -> int:
        return self._starts[-1]

    def nbytes(self) -> int:
        return sum(seg.numel() * seg.element_size() for seg in self.segments)

    def _span(self, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        """Views of positions [lo, hi), one per segment they cross, in position order."""
        if len(self.segments) == 1:
            return (self.segments[0][:, :, :, lo:hi],)
        out = []
        for seg, s0, s1 in zip(self.segments, self._starts, self._starts[1:]):
            if s0 < hi and lo < s1:
                out.append(seg[:, :, :, max(lo, s0) - s0 : min(hi, s1) - s0])
        return tuple(out) or (self.segments[0][:, :, :, :0],)

    def _view(self, lo: int, hi: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Positions [lo, hi) as one view, or (across slots) a tuple of views in position order."""
        views = self._span(lo, hi)
        return views[0] if len(views) == 1 else views

    def _put(self, fresh: torch.Tensor, start: int) -> None:
        """Store ``fresh`` at positions [start, start + T); a no-op when a forward over the pool already
        wrote it there."""
        off = 0
        for dst in self._span(start, start + fresh.shape[3]):
            src = fresh[:, :, :, off : off + dst.shape[3]]
            off += dst.shape[3]
            if dst.data_ptr() != src.data_ptr() or dst.stride() != src.stride():
                dst.copy_(src)


class ExactCache(_Cache):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.length = 0

    def context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K/V [layers, 2, kv_heads, C, head_dim], host positions [C]) of the committed prefix."""
        return self._view(0, self.length), torch.arange(self.length)

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
            return self._view(0, q_start), torch.arange(q_start)
        kv = self._span(0, q_start) + self._span(q_end, self.filled)
        return kv, torch.cat((torch.arange(q_start), torch.arange(q_end, self.filled)))
