"""Latency profiles: round time as a function of batch composition.

A profile holds, per step kind, a piecewise-linear curve of forward time
against the tokens of that kind in the round (measured at a reference context
length), plus an attention term per query-token x context-token beyond the
reference. Steps of different kinds run as separate forwards (the runner
groups by length), so their times add up. Pure Python.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.scheduler.types import StepKind

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass
class LatencyProfile:
    name: str
    curves: dict[str, list[tuple[float, float]]]  # kind -> [(tokens, ms)], tokens ascending
    ref_context: float = 0.0  # context length the curves were measured at
    attn_ms_per_pair: float = 0.0  # extra ms per (query token x context token) beyond ref_context
    overhead_ms: float = 0.0  # per round (scheduling, sync)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind, pts in self.curves.items():
            if kind not in StepKind._value2member_map_:
                raise ValueError(f"profile {self.name}: unknown step kind {kind!r}")
            if not pts or any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
                raise ValueError(f"profile {self.name}: curve {kind!r} needs ascending token counts")
            self.curves[kind] = [(float(t), float(ms)) for t, ms in pts]

    def curve(self, kind: str) -> list[tuple[float, float]]:
        """The points that price ``kind``. Where the profile lacks that kind's curve, another stands in at
        the same query tokens, denoise first: the block kinds (prefill, denoise, cached: one block's query
        tokens over a cache) cost alike per token, a full-sequence model's profile has no prefill curve and
        a block-causal model's none for cached or recompute steps (which the planner's full-sequence cost
        model still prices: a recompute then costs its tokens as denoise tokens, without their attention
        to one another). A profile with no curve that can stand in (none of the block kinds) fails here,
        naming the kinds it has."""
        pts = self.curves.get(kind)
        if pts is not None:
            return pts
        if kind not in StepKind._value2member_map_:
            raise ValueError(f"profile {self.name}: unknown step kind {kind!r}")
        for stand_in in (StepKind.DENOISE, StepKind.CACHED, StepKind.PREFILL):
            if stand_in in self.curves:
                return self.curves[stand_in]
        raise ValueError(f"profile {self.name} has no {kind!r} curve and no block-step curve to stand in for it "
                         f"(it has {', '.join(sorted(self.curves)) or 'none'}): measure one with `remask profile`")

    def curve_ms(self, kind: str, tokens: float) -> float:
        pts = self.curve(kind)
        if tokens <= 0:
            return 0.0
        if len(pts) == 1:  # one measured shape (a short measurement on a busy machine): proportional to tokens
            x0, y0 = pts[0]
            return y0 * tokens / x0
        xs = [p[0] for p in pts]
        i = bisect.bisect_left(xs, tokens)
        if i == 0:  # below the first point: scale towards zero tokens linearly
            (x0, y0), (x1, y1) = pts[0], pts[1]
        elif i == len(pts):
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
        else:
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        y = y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        return max(y, 0.05 * y0)

    def round_ms(self, steps: list[tuple[str, int, int]]) -> float:
        """steps: (kind, query tokens, context tokens) of each slot in the round."""
        if not steps:
            return 0.0
        by_kind: dict[str, int] = {}
        extra_pairs = 0.0
        for kind, q, ctx in steps:
            by_kind[kind] = by_kind.get(kind, 0) + q
            extra_pairs += q * max(ctx - self.ref_context, 0.0)
        ms = sum(self.curve_ms(k, t) for k, t in by_kind.items())
        return ms + extra_pairs * self.attn_ms_per_pair + self.overhead_ms

    def scaled(self, factor: float, name: str | None = None) -> LatencyProfile:
        """The same profile with every time multiplied by ``factor`` (e.g. a TP degree's speed-up)."""
        curves = {k: [(t, ms * factor) for t, ms in pts] for k, pts in self.curves.items()}
        return LatencyProfile(name or f"{self.name}x{factor:g}", curves, self.ref_context,
                              self.attn_ms_per_pair * factor, self.overhead_ms * factor, dict(self.meta))

    def step_costs(self, block_tokens: int, sequence_tokens: int, batch: int = 32):
        """Relative step costs (a denoise block = 1) at a typical batch, for work weighting."""
        from engine.scheduler.types import StepCosts

        unit = self.curve_ms("denoise", block_tokens * batch) / batch
        return StepCosts(
            prefill=self.curve_ms("prefill", block_tokens * batch) / batch / unit,
            denoise=1.0,
            recompute=self.curve_ms("recompute", sequence_tokens * batch) / batch / unit,
            cached=self.curve_ms("cached", block_tokens * batch) / batch / unit,
        )

    def to_dict(self) -> dict:
        return {"name": self.name, "curves": self.curves, "ref_context": self.ref_context,
                "attn_ms_per_pair": self.attn_ms_per_pair, "overhead_ms": self.overhead_ms, "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict) -> LatencyProfile:
        return cls(data["name"], {k: [tuple(p) for p in v] for k, v in data["curves"].items()},
                   data.get("ref_context", 0.0), data.get("attn_ms_per_pair", 0.0), data.get("overhead_ms", 0.0),
                   data.get("meta", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def load_profile(name_or_path: str) -> LatencyProfile:
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.exists():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
        raise FileNotFoundError(f"latency profile {name_or_path!r} not found; known: {', '.join(known)}")
    try:
        return LatencyProfile.from_dict(json.loads(path.read_text()))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"corrupt latency profile {path}: {exc}") from exc


# Step-latency factor of a TP-d instance relative to TP-1 when no measured
# profile exists for d (DiLaServe: TP-2 cuts step latency 25%, TP-4 55%).
TP_SPEEDUP = {1: 1.0, 2: 0.75, 4: 0.45}


def load_tp_profiles(name: str, degrees: list[int] | tuple[int, ...] = (1, 2, 4)) -> dict[int, LatencyProfile]:
    """One profile per TP degree: ``{name}-tp{d}.json`` where measured, else ``name`` scaled by TP_SPEEDUP.
    ``name``: a profile in profiles/, or a JSON file's path (its ``-tp{d}`` siblings beside it)."""
    base = load_profile(name)
    path = Path(name)
    folder, stem = (path.parent, path.stem) if path.suffix else (PROFILES_DIR, name)
    name = stem
    out = {}
    for d in degrees:
        measured = folder / f"{name}-tp{d}.json"
        if d != 1 and measured.exists():
            out[d] = load_profile(str(measured))
        elif d in TP_SPEEDUP:
            out[d] = base.scaled(TP_SPEEDUP[d], name=f"{name}-tp{d}")
        else:
            raise ValueError(f"no profile for TP-{d} of {name!r}: measure one ({measured.name}) or use "
                             f"TP degrees {sorted(TP_SPEEDUP)}")
    return out
