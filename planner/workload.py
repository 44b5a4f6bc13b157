"""Workload classes and the workload monitor (DiLaServe §3.3).

Requests are classified by input and output size into a grid of classes; the monitor keeps each
class's arrivals of the last ``window_s`` seconds and reports their rate times ``1 + buffer`` (the
safety buffer against short-term bursts). With ``slices`` > 1 the level is that of the window's
busiest slice (of ``window_s / slices`` seconds) when it is above the window's mean, the class mix
still the whole window's: the planner then sizes for the recent peak, so a load that is still
rising is not met with less capacity (as a Kubernetes autoscaler's stabilisation window keeps the
highest recommendation before it scales down). With ``lookahead_s`` > 0 as well, the level is at
least where the slices' linear trend reaches ``lookahead_s`` after now (a configuration chosen now
serves until the next re-plan: on a ramp, size it for the end of that time, not for its start).
Output size is the request's output budget
(``max_tokens``), known at arrival for a diffusion model's fixed-length canvas. Pure Python:
``record`` is O(1) amortised (a deque per class, evicted lazily).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class WorkloadClass:
    """One class of requests as the Stage-1 ILP sees it."""

    name: str
    rate: float  # requests per second (already buffered)
    input_tokens: float
    output_tokens: float
    slo_ms: float | None = None  # None: the planner's default (k x TP-1 isolated latency)

    def __post_init__(self) -> None:
        if self.rate < 0 or self.input_tokens < 0 or self.output_tokens <= 0:
            raise ValueError(f"class {self.name}: rate and input size must be >= 0, output size > 0")


@dataclass(frozen=True)
class ClassGrid:
    """Class boundaries: a request with ``input_edges[i-1] <= in < input_edges[i]`` is in input bin i."""

    input_edges: tuple[int, ...] = (256, 1024)
    output_edges: tuple[int, ...] = (128, 512)

    def classify(self, input_tokens: int, output_tokens: int) -> tuple[int, int]:
        return (bisect.bisect_right(self.input_edges, input_tokens),
                bisect.bisect_right(self.output_edges, output_tokens))

    def name(self, key: tuple[int, int]) -> str:
        return f"in{key[0]}-out{key[1]}"

    def keys(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(len(self.input_edges) + 1) for j in range(len(self.output_edges) + 1)]


class _ClassWindow:
    __slots__ = ("events", "sum_in", "sum_out")

    def __init__(self) -> None:
        self.events: deque[tuple[float, int, int]] = deque()
        self.sum_in = 0
        self.sum_out = 0

    def evict(self, horizon: float) -> None:
        ev = self.events
        while ev and ev[0][0] < horizon:
            _, i, o = ev.popleft()
            self.sum_in -= i
            self.sum_out -= o


class WorkloadMonitor:
    """Per-class arrival rates over a sliding window, with a safety buffer."""

    def __init__(self, grid: ClassGrid | None = None, window_s: float = 300.0, buffer: float = 0.2,
                 slices: int = 1, lookahead_s: float = 0.0) -> None:
        if window_s <= 0 or buffer < 0 or slices < 1 or lookahead_s < 0:
            raise ValueError("window_s must be > 0, buffer >= 0, slices >= 1 and lookahead_s >= 0")
        if lookahead_s > 0 and slices < 2:
            raise ValueError("a trend (lookahead_s > 0) needs slices >= 2")
        self.lookahead_s = lookahead_s
        self.grid = grid or ClassGrid()
        self.window_s = window_s
        self.buffer = buffer
        self.slices = slices
        self._windows: dict[tuple[int, int], _ClassWindow] = {}
        self._start: float | None = None

    def record(self, now: float, input_tokens: int, output_tokens: int) -> tuple[int, int]:
        """One arrival at time ``now`` (seconds, non-decreasing); returns its class key."""
        if self._start is None:
            self._start = now
        key = self.grid.classify(input_tokens, output_tokens)
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _ClassWindow()
        w.events.append((now, input_tokens, output_tokens))
        w.sum_in += input_tokens
        w.sum_out += output_tokens
        w.evict(now - self.window_s)
        return key

    def classes(self, now: float) -> list[WorkloadClass]:
        """Buffered rates of every class seen in the window (sizes: the window's means)."""
        return self._classes(now, peak=True)

    def _classes(self, now: float, peak: bool) -> list[WorkloadClass]:
        horizon = now - self.window_s
        # before a full window has passed, divide by the time observed (at least 1 s)
        span = self.window_s if self._start is None else min(self.window_s, max(now - self._start, 1.0))
        out = []
        for key in sorted(self._windows):
            w = self._windows[key]
            w.evict(horizon)
            n = len(w.events)
            if n == 0:
                continue
            out.append(WorkloadClass(self.grid.name(key), n / span * (1.0 + self.buffer),
                                     w.sum_in / n, max(w.sum_out / n, 1.0)))
        scale = self._peak_ratio(now, span) if peak and self.slices > 1 and out else 1.0
        return [replace(c, rate=c.rate * scale) for c in out] if scale > 1.0 else out

    def classes_mean(self, now: float) -> list[WorkloadClass]:
        """``classes`` at the window's mean rate (no busiest slice, no trend)."""
        return self._classes(now, peak=False)

    def _peak_ratio(self, now: float, span: float) -> float:
        """The busiest slice's arrival rate (or the trend's ``lookahead_s`` ahead, if higher) over the
        span's mean rate; at least 1."""
        S = self.slices
        width = span / S
        counts = [0] * S  # counts[0]: the newest slice
        for w in self._windows.values():
            for t, _, _ in w.events:
                counts[min(int((now - t) / width), S - 1)] += 1
        total = sum(counts)
        if not total:
            return 1.0
        ratio = max(counts) * S / total
        if self.lookahead_s > 0:  # least-squares line through (slice centre, count), centre of the span at 0
            xs = [span / 2 - (k + 0.5) * width for k in range(S)]
            mean = total / S
            slope = sum(x * (c - mean) for x, c in zip(xs, counts)) / sum(x * x for x in xs)  # per second
            ratio = max(ratio, (mean + slope * (span / 2 + self.lookahead_s)) / mean)
        return ratio

    def arrivals(self) -> int:
        """Arrivals held (those of the window as of the last ``classes`` call; a few older ones until evicted)."""
        return sum(len(w.events) for w in self._windows.values())

    def total_rate(self, now: float) -> float:
        return sum(c.rate for c in self.classes(now))
