"""Control-path timing at the ingress: how long progress events take from a
replica's round loop to the ingress, and requests from the ingress to a round
boundary. ``remask bench control`` reads these through ``GET /debug/control``."""

from __future__ import annotations

import statistics
import time
from collections import deque

from app.protocol import AcceptedItem, ProgressBatch


class ControlTimer:
    def __init__(self, keep: int = 20_000) -> None:
        self.event_ms: deque[float] = deque(maxlen=keep)
        self.add_ms: deque[float] = deque(maxlen=keep)
        self.events = 0  # total observed, so a client can take only the samples after a mark

    def batch(self, batch: ProgressBatch, now: float | None = None) -> float:
        """One round's progress batch: its delivery time (ms), and the dispatch-to-round-boundary time of
        every request it reports accepted."""
        for item in batch.items:
            if type(item) is AcceptedItem and item.add_ms is not None:
                self.add_ms.append(item.add_ms)
        ms = ((now or time.time()) - batch.t) * 1e3
        self.event_ms.append(ms)
        self.events += 1
        return ms

    def summary(self, since: int = 0) -> dict:
        new = max(0, min(self.events - since, len(self.event_ms)))
        ev = list(self.event_ms)[len(self.event_ms) - new:] if new else []
        return {"events": self.events, "samples": len(ev), "median_ms": _pct(ev, 0.5), "p99_ms": _pct(ev, 0.99),
                "add_median_ms": _pct(list(self.add_ms), 0.5)}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if q == 0.5:
        return round(statistics.median(values), 3)
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)
