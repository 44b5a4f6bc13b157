"""Garbage-collector pauses of a serving process: start-up objects out of the collector's sight, each pause timed.

A process that imports Ray, Serve, FastAPI, torch and a tokenizer, and loads a model, holds some 350,000
objects before it serves its first request. Python's cyclic collector walks all of them in each full
(generation 2) collection: about 0.4 s on this project's CI machine, with the event loop or the round loop
stopped for all of it. None of those objects is ever garbage. ``settle`` collects once and freezes what is
left (``gc.freeze``), so a full collection walks only what serving allocates. ``PauseTimer`` times every
collection for the ingress's ``remask:gc_pause_seconds`` histogram.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("remask.gc_pauses")


def settle(who: str) -> int:
    """After start-up: collect the garbage start-up made, then freeze every surviving object (a collection
    never walks them again). Returns the number of objects frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of the collector's walks (%.0f ms)", who, frozen,
             (time.perf_counter() - t0) * 1e3)
    return frozen


class PauseTimer:
    """Times each cyclic collection of this process. The collector's callback only appends to a deque (it
    runs wherever an allocation triggers a collection, possibly inside a metrics lock); ``drain`` hands the
    (generation, seconds) pairs timed since the last drain to ``observe``. ``close`` unregisters it."""

    def __init__(self, observe: Callable[[int, float], None], keep: int = 10_000) -> None:
        self.observe = observe
        self._timed: deque[tuple[int, float]] = deque(maxlen=keep)
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0:
            self._timed.append((info["generation"], time.perf_counter() - self._t0))
            self._t0 = 0.0

    def drain(self) -> int:
        n = 0
        while self._timed:
            self.observe(*self._timed.popleft())
            n += 1
        return n

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
