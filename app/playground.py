"""The web playground (``GET /playground``) and its cluster view (``GET /debug/cluster``).

The page (``app/static/playground.{html,css,js}``: plain HTML, CSS and JavaScript, no build step, nothing
fetched from elsewhere) sends a streamed chat request with ``stream_options.include_canvas`` and draws the
canvas as the model fills it: each committed position coloured by the round that committed it, the
current block outlined; beside it the answer text and a cluster panel that polls ``/debug/cluster``.

Pure Python (no web framework here): the ingress wraps these in its routes.

- ``page()``: the HTML; ``static_file(name)``: ``(bytes, media type)`` of a file shipped in ``STATIC_DIR``
  (any other name, a path among them, raises ``KeyError``); ``HEADERS``: what to send with them.
- ``cluster_view(dispatcher, planner, now, outcomes)``: the JSON of ``/debug/cluster``.
- ``RecentOutcomes``: SLO outcomes of finished requests over a recent window, in bounded memory.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import Any

STATIC_DIR = Path(__file__).resolve().parent / "static"

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
}

# Headers for the page and its files: always revalidated (a redeploy's page is seen at once), and a
# content security policy that lets the page load and fetch only from this server.
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'",
}


def static_files() -> dict[str, Path]:
    """The files the playground may serve: the plain files directly in ``STATIC_DIR``, by name."""
    if not STATIC_DIR.is_dir():
        return {}
    return {p.name: p for p in STATIC_DIR.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix in MEDIA_TYPES}


def static_file(name: str) -> tuple[bytes, str]:
    """``(content, media type)`` of the shipped file ``name``; ``KeyError`` for any other name (a path,
    ``..``, a file not shipped, a hidden file)."""
    path = static_files().get(name) if isinstance(name, str) else None
    if path is None:
        raise KeyError(f"no static file {name!r}")
    return path.read_bytes(), MEDIA_TYPES[path.suffix]


def page() -> str:
    """The playground's HTML."""
    return static_file("playground.html")[0].decode("utf-8")


class RecentOutcomes:
    """SLO outcomes (met or missed) of finished requests over the last ``horizon_s`` seconds, counted in
    buckets of ``bucket_s`` seconds: memory is bounded by the number of buckets, however many requests
    finish. Times come from one clock (the ingress's ``time.monotonic()``)."""

    def __init__(self, horizon_s: float = 300.0, bucket_s: float = 1.0) -> None:
        if bucket_s <= 0 or horizon_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= horizon_s")
        self.horizon_s, self.bucket_s = float(horizon_s), float(bucket_s)
        self.max_buckets = math.ceil(horizon_s / bucket_s) + 1
        self._buckets: deque[list] = deque()  # [bucket index, met, total], oldest first

    def add(self, now: float, met: bool) -> None:
        k = math.floor(now / self.bucket_s)
        b = self._buckets
        if b and b[-1][0] >= k:  # the newest bucket (a time that went back lands there too: it is bounded)
            bucket = next((x for x in reversed(b) if x[0] == k), b[-1])
        else:
            bucket = [k, 0, 0]
            b.append(bucket)
        bucket[1] += bool(met)
        bucket[2] += 1
        self._expire(k)

    def _expire(self, k: int) -> None:
        b = self._buckets
        oldest = k - self.max_buckets + 1
        while b and (b[0][0] < oldest or len(b) > self.max_buckets):
            b.popleft()

    def counts(self, now: float, window_s: float = 60.0) -> tuple[int, int]:
        """``(met, finished)`` over the last ``window_s`` seconds (whole buckets; at most ``horizon_s``)."""
        first = math.floor((now - min(window_s, self.horizon_s)) / self.bucket_s) + 1
        last = math.floor(now / self.bucket_s)
        met = total = 0
        for k, m, n in self._buckets:
            if first <= k <= last:
                met += m
                total += n
        return met, total

    def attainment(self, now: float, window_s: float = 60.0) -> float | None:
        """The share of requests finished in the last ``window_s`` seconds that met their SLO; ``None``
        when none finished."""
        met, total = self.counts(now, window_s)
        return met / total if total else None

    def __len__(self) -> int:
        return len(self._buckets)


def _jsonable(value: Any) -> Any:
    """Dict keys as strings (JSON's), tuples and sets as lists, recursively."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _num(stats: dict, key: str) -> float | int:
    v = stats.get(key, 0)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def cluster_view(dispatcher, planner=None, now: float | None = None, outcomes: RecentOutcomes | None = None, *,
                 slots: int | None = None, window_s: float = 60.0) -> dict:
    """The JSON of ``/debug/cluster``, from the ingress's ``Dispatcher`` (its instances' last reported
    stats; through its cluster driver, the router's requests per instance; the live requests' thresholds), the
    planner service (``describe()``; ``None`` when the planner is off), and ``outcomes`` (SLO attainment over the last
    ``window_s`` seconds at ``now``). ``slots``: the batch slots of an instance (the app's config), to show
    how full each is."""
    driver = dispatcher.driver  # the one door into the cluster core (cluster/driver.py)
    instances, by_tp = [], {}
    for inst in sorted(dispatcher.instances.values(), key=lambda i: i.inst_id):
        st = inst.stats or {}
        rinst = driver.instance(inst.inst_id)
        rounds, filled = _num(st, "rounds"), _num(st, "filled_slots")
        row = {
            "id": inst.inst_id, "replica": inst.replica, "tp": inst.tp,
            "requests": rinst.n if rinst is not None else 0,
            "running": _num(st, "running"), "waiting": _num(st, "waiting"), "resident": _num(st, "resident"),
            "rounds": rounds, "slots_per_round": round(filled / rounds, 2) if rounds else None,
            "kv_reserved_tokens": _num(st, "kv_reserved_tokens"), "slots": slots,
            "draining": bool(getattr(inst, "draining", False)),
        }
        instances.append(row)
        tp = by_tp.setdefault(str(inst.tp), {"tp": inst.tp, "instances": 0, "requests": 0, "running": 0,
                                             "waiting": 0, "slots": 0 if slots else None})
        tp["instances"] += 1
        for key in ("requests", "running", "waiting"):
            tp[key] += row[key]
        if slots:
            tp["slots"] += slots

    # thresholds in use: each live request's latest (its last step's, else the one it was sent with)
    in_use: dict[str, int] = {}
    fixed = 0
    for live in list(dispatcher.live.values()):
        used = live.state.thresholds_used
        t = used[-1] if used else live.sent_threshold
        if live.state.fixed_threshold is not None:
            fixed += 1
        key = "none" if t is None else f"{t:.2f}"
        in_use[key] = in_use.get(key, 0) + 1

    slo: dict[str, Any] = {"window_s": window_s, "attainment": None, "met": 0, "finished": 0}
    if outcomes is not None and now is not None:
        met, total = outcomes.counts(now, window_s)
        slo.update(met=met, finished=total, attainment=met / total if total else None)

    plan = planner.describe() if planner is not None else None
    governor = driver.governor
    return _jsonable({
        "instances": instances,
        "by_tp": dict(sorted(by_tp.items(), key=lambda kv: kv[1]["tp"])),
        "live": len(dispatcher.live),
        "parked": len(dispatcher.parked),
        # requests that ever waited for an instance (arrivals and moves while none could take them)
        "parked_total": driver.stats["held"],
        "thresholds": {"in_use": dict(sorted(in_use.items(), reverse=True)), "fixed_by_client": fixed,
                       "candidates": list(driver.candidate_thresholds())},
        "slo": slo,
        "router": {**driver.counters(), "admission_util": round(governor.util, 3)},
        "dispatch": dict(dispatcher.stats),
        "planner": {"enabled": False} if plan is None else {"enabled": True, **plan},
    })
