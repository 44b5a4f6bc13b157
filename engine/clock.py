"""Clocks injected into policy code: scheduling never reads the wall itself."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Simulated time, advanced by the simulator."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time cannot go backwards")
        self.t += dt

    def set(self, t: float) -> None:
        self.t = max(self.t, t)
