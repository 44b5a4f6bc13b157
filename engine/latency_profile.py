"""Latency profiles: round time as a function of batch composition.

A profile holds a round's measured points (each a round of one step kind: its steps, query tokens and
context per step, and the median wall time) and prices any round by one model fitted to all of them
(``RoundModel``): per forward, a fixed cost (launches, synchronisation), the matrix products (reading
the weights below the ``ridge`` token count, their FLOPs above it), a cost per token (norms, rotary
embedding, activations, copies), per step (its slot's gathers, its decoded rows) and per attention pair
(query token x key), plus per-kind extras where a kind's points show more than those shared terms
(a recompute's K/V writes, a path without CUDA graphs). Every coefficient is non-negative, fitted by
least squares in relative error. Steps of different kinds run as separate forwards (the runner groups
by length), so their times add up.

Each kind's measured token range is stated (``measured``); outside it a round is priced by the model,
never by a line through two points. ``curves`` (kind -> [(tokens, ms)]) are the measured points as
the profile run wrote them; a file with no explicit point records (older files, hand tables) has its
records derived from the curves and its ``meta`` (``derive_points``). A profile with points at fewer
than three token counts cannot fit the shared terms (the fallback): it prices a kind linearly between
its measured points and in proportion to the tokens beyond them, from the nearest one (a single
measured shape scales with its tokens; never a line through two points outside the measured range).

Pure Python for pricing; fitting imports NumPy and SciPy when a profile is built.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from engine.scheduler.types import StepKind

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
KINDS = tuple(k.value for k in StepKind)
STAND_INS = ("denoise", "cached", "prefill")  # who prices a kind a profile never measured, in this order
DEFAULT_BLOCK = 32  # query tokens of a block step when a file does not say (every shipped model but SDAR's)
MIN_TOKEN_COUNTS = 3  # distinct token counts a fit needs; fewer: the proportional fallback


@dataclass(frozen=True)
class ProfilePoint:
    """One measured round: ``steps`` steps of ``kind``, each ``query`` tokens over ``context`` keys
    (beyond its own query), that took ``ms``."""

    kind: str
    steps: float
    query: float
    context: float
    ms: float

    @property
    def tokens(self) -> float:
        return self.steps * self.query

    @property
    def pairs(self) -> float:
        """Attention pairs (query token x key: its context and its own query)."""
        return self.steps * self.query * (self.context + self.query)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "steps": self.steps, "query": self.query, "context": self.context,
                "ms": self.ms}

    @classmethod
    def from_dict(cls, d: dict) -> ProfilePoint:
        for key in ("kind", "steps", "query", "context", "ms"):
            if key not in d:
                raise ValueError(f"point {d!r} lacks {key!r}")
        p = cls(str(d["kind"]), float(d["steps"]), float(d["query"]), float(d["context"]), float(d["ms"]))
        if p.kind not in KINDS:
            raise ValueError(f"point {d!r}: unknown step kind {p.kind!r}")
        if p.steps <= 0 or p.query <= 0 or p.context < 0 or p.ms <= 0:
            raise ValueError(f"point {d!r}: steps, query and ms must be positive, context non-negative")
        return p


# the model's coefficients, their units and what they stand for (``remask profile --fit`` prints these)
COEFFICIENTS = {
    "forward_ms": ("ms per forward", "launches, synchronisation, the host's part of a forward"),
    "product_ms": ("ms per token", "the matrix products' FLOPs, above the ridge"),
    "ridge_tokens": ("tokens", "below this, a forward's products cost the weights' read: product_ms x ridge"),
    "token_ms": ("ms per token", "norms, rotary embedding, activations, residual adds, copies"),
    "step_ms": ("ms per step", "a step's slot: its gathers, the host's bookkeeping"),
    "decode_ms": ("ms per step", "a decoding step's rows (every kind but prefill): the LM head, the pick"),
    "pair_ms": ("ms per pair", "attention: query token x key (context and own query)"),
    "eager_ms": ("ms per forward", "a forward above the CUDA-graph limit, launched op by op"),
    "graph_tokens": ("tokens", "the largest forward a CUDA graph replays (0: no graphs)"),
}


@dataclass(frozen=True)
class RoundModel:
    """Round time of one forward of ``steps`` steps of a kind: the fitted terms (see the module doc).

    ``kind_token_ms[k]``: extra ms per token of kind k; ``kind_excess_ms[k]``: extra ms a forward of kind
    k shows over the shared terms from ``kind_excess_tokens[k]`` tokens (its smallest measured round)
    up, below which it is taken in proportion to the tokens (no fixed cost is assumed where nothing was
    measured). ``proportional``: the fallback's points by kind, (tokens, ms without attention): then the
    shared terms are unused (``_interpolate``)."""

    forward_ms: float = 0.0
    product_ms: float = 0.0
    ridge_tokens: float = 0.0
    token_ms: float = 0.0
    step_ms: float = 0.0
    decode_ms: float = 0.0
    pair_ms: float = 0.0
    eager_ms: float = 0.0
    graph_tokens: float = 0.0
    kind_token_ms: dict = field(default_factory=dict)
    kind_excess_ms: dict = field(default_factory=dict)
    kind_excess_tokens: dict = field(default_factory=dict)
    proportional: dict | None = None
    stand_in: dict = field(default_factory=dict)  # kind -> the measured kind whose extras price it

    @property
    def mode(self) -> str:
        return "proportional" if self.proportional is not None else "fit"

    def terms(self, kind: str, steps: float, query: float, context: float) -> dict[str, float]:
        """The ms of each term for one forward (``forward_ms`` sums them)."""
        tokens = steps * query
        if tokens <= 0:
            return {}
        pairs = steps * query * (max(context, 0.0) + query)
        k = self.stand_in.get(kind, kind)
        if self.proportional is not None:
            return {"tokens": _interpolate(self.proportional[k], tokens), "attention": self.pair_ms * pairs}
        out = {"forward": self.forward_ms, "products": self.product_ms * max(tokens, self.ridge_tokens),
               "tokens": self.token_ms * tokens, "steps": self.step_ms * steps, "attention": self.pair_ms * pairs}
        if self.decode_ms and kind != "prefill":
            out["decoding"] = self.decode_ms * steps
        if self.eager_ms and tokens > self.graph_tokens:
            out["eager"] = self.eager_ms
        if self.kind_token_ms.get(k):
            out[f"{k} tokens"] = self.kind_token_ms[k] * tokens
        if self.kind_excess_ms.get(k):
            s = self.kind_excess_tokens[k]
            out[f"{k} excess"] = self.kind_excess_ms[k] * min(tokens, s) / s
        return out

    def forward_ms_of(self, kind: str, steps: float, query: float, context: float) -> float:
        """The sum of ``terms`` (written out: the simulator prices every round through it)."""
        tokens = steps * query
        if tokens <= 0:
            return 0.0
        pairs = tokens * ((context if context > 0.0 else 0.0) + query)
        k = self.stand_in.get(kind, kind)
        if self.proportional is not None:
            return _interpolate(self.proportional[k], tokens) + self.pair_ms * pairs
        ms = (self.forward_ms + self.product_ms * (tokens if tokens > self.ridge_tokens else self.ridge_tokens)
              + self.token_ms * tokens + self.step_ms * steps + self.pair_ms * pairs)
        if kind != "prefill":
            ms += self.decode_ms * steps
        if self.eager_ms and tokens > self.graph_tokens:
            ms += self.eager_ms
        extra = self.kind_token_ms.get(k)
        if extra:
            ms += extra * tokens
        excess = self.kind_excess_ms.get(k)
        if excess:
            s = self.kind_excess_tokens[k]
            ms += excess * (tokens if tokens < s else s) / s
        return ms

    def forward_ms_array(self, kind: str, steps, query, context):
        """``forward_ms_of`` over NumPy arrays (broadcast); 0 where there are no tokens."""
        import numpy as np

        n = np.asarray(steps, dtype=float)
        q = np.asarray(query, dtype=float)
        tokens = n * q
        pairs = tokens * (np.maximum(np.asarray(context, dtype=float), 0.0) + q)
        k = self.stand_in.get(kind, kind)
        if self.proportional is not None:
            pts = self.proportional[k]
            ms = np.interp(tokens, [t for t, _ in pts], [v for _, v in pts])
            lo, hi = pts[0], pts[-1]
            ms = np.where(tokens < lo[0], lo[1] * tokens / lo[0], np.where(tokens > hi[0], hi[1] * tokens / hi[0], ms))
            ms = ms + self.pair_ms * pairs
        else:
            ms = (self.forward_ms + self.product_ms * np.maximum(tokens, self.ridge_tokens) + self.token_ms * tokens
                  + self.step_ms * n + self.pair_ms * pairs)
            if kind != "prefill":
                ms = ms + self.decode_ms * n
            if self.eager_ms:
                ms = ms + self.eager_ms * (tokens > self.graph_tokens)
            ms = ms + self.kind_token_ms.get(k, 0.0) * tokens
            if self.kind_excess_ms.get(k):
                s = self.kind_excess_tokens[k]
                ms = ms + self.kind_excess_ms[k] * np.minimum(tokens, s) / s
        return np.where(tokens > 0, ms, 0.0)

    def scaled(self, factor: float) -> RoundModel:
        """Every time multiplied by ``factor`` (the ridge stays)."""
        return replace(self, forward_ms=self.forward_ms * factor, product_ms=self.product_ms * factor,
                       token_ms=self.token_ms * factor, step_ms=self.step_ms * factor,
                       decode_ms=self.decode_ms * factor,
                       pair_ms=self.pair_ms * factor, eager_ms=self.eager_ms * factor,
                       kind_token_ms={k: v * factor for k, v in self.kind_token_ms.items()},
                       kind_excess_ms={k: v * factor for k, v in self.kind_excess_ms.items()},
                       proportional=None if self.proportional is None else
                       {k: [(t, v * factor) for t, v in pts] for k, pts in self.proportional.items()})

    def to_dict(self) -> dict:
        out = {"mode": self.mode, **{k: getattr(self, k) for k in COEFFICIENTS}}
        out.update(kind_token_ms=dict(self.kind_token_ms), kind_excess_ms=dict(self.kind_excess_ms),
                   kind_excess_tokens=dict(self.kind_excess_tokens), stand_in=dict(self.stand_in))
        if self.proportional is not None:
            out["fallback_points"] = {k: [list(p) for p in v] for k, v in self.proportional.items()}
        return out


def _interpolate(pts: list[tuple[float, float]], tokens: float) -> float:
    """The fallback: linear between measured points, in proportion to the tokens beyond them (from the
    nearest end point: never a line through two points outside the measured range)."""
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    if tokens <= x0:
        return y0 * tokens / x0
    if tokens >= x1:
        return y1 * tokens / x1
    for (a, ya), (b, yb) in zip(pts, pts[1:]):
        if a <= tokens <= b:
            return ya + (yb - ya) * (tokens - a) / (b - a)
    return y1 * tokens / x1


def _stand_ins(measured: set[str]) -> dict[str, str]:
    """kind -> the kind that prices it: itself when measured, else the first measured of ``STAND_INS``
    (a full-sequence model's profile has no prefill round, a block-causal model's no cached or recompute
    round: the block kinds cost alike per token)."""
    out = {}
    for kind in KINDS:
        if kind in measured:
            out[kind] = kind
        else:
            out[kind] = next((s for s in STAND_INS if s in measured), kind)
    return out


def _ridge_candidates(points: list[ProfilePoint]) -> list[float]:
    ts = sorted({p.tokens for p in points})
    grid = {0.0, *ts}
    grid |= {math.sqrt(a * b) for a, b in zip(ts, ts[1:])}
    grid |= {float(2 ** k) for k in range(3, 16) if 2 ** k < ts[-1]}
    return sorted(grid)


def fit_model(points: list[ProfilePoint], pair_ms: float | None = None, graph_tokens: float = 0.0) -> RoundModel:
    """The model fitted to ``points`` (least squares in relative error, every coefficient non-negative).
    ``pair_ms``: the attention cost per pair when known (a profile's longer-prompt rounds measured it);
    None: fitted too. ``graph_tokens``: the largest forward the profiled engine replayed from a CUDA
    graph (0: none did), above which a forward pays ``eager_ms``. Fewer than ``MIN_TOKEN_COUNTS``
    distinct token counts: the proportional fallback."""
    return _fit(tuple(points), pair_ms, float(graph_tokens))


@lru_cache(maxsize=256)
def _fit(points: tuple[ProfilePoint, ...], pair_ms: float | None, graph_tokens: float) -> RoundModel:
    import numpy as np

    if not points:
        raise ValueError("a latency model needs one measured point at least")
    measured = {p.kind for p in points}
    stand = _stand_ins(measured)
    fixed = pair_ms if pair_ms is not None else 0.0
    ms = np.array([p.ms for p in points])
    if len({p.tokens for p in points}) < MIN_TOKEN_COUNTS:
        prop: dict[str, list[tuple[float, float]]] = {}
        for kind in measured:
            by_tokens: dict[float, list[float]] = {}
            for p in points:
                if p.kind == kind:  # the attention at the point's own shape comes off; pricing adds it back
                    by_tokens.setdefault(p.tokens, []).append(max(p.ms - fixed * p.pairs, 0.0))
            prop[kind] = [(t, sum(v) / len(v)) for t, v in sorted(by_tokens.items())]
        return RoundModel(pair_ms=fixed, proportional=prop, stand_in=stand)
    # the base kind (most points) has no extras: its points fix the shared terms
    order = {k: i for i, k in enumerate(("denoise", "cached", "prefill", "recompute"))}
    base = max(measured, key=lambda k: (sum(p.kind == k for p in points), -order[k]))
    extras = sorted((k for k in measured if k != base and sum(p.kind == k for p in points) >= 2), key=order.get)
    excess_at = {k: min(p.tokens for p in points if p.kind == k) for k in extras}
    y = np.array([p.ms - fixed * p.pairs for p in points]) / ms
    best = None
    for ridge in _ridge_candidates(list(points)):
        cols = [[1.0 for _ in points], [max(p.tokens, ridge) for p in points], [p.tokens for p in points],
                [p.steps for p in points], [p.steps * (p.kind != "prefill") for p in points]]
        if pair_ms is None:
            cols.append([p.pairs for p in points])
        if graph_tokens:
            cols.append([float(p.tokens > graph_tokens) for p in points])
        for k in extras:
            cols.append([p.tokens * (p.kind == k) for p in points])
            cols.append([min(p.tokens, excess_at[k]) / excess_at[k] * (p.kind == k) for p in points])
        a = np.array(cols, dtype=float).T / ms[:, None]
        scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # columns of like size for the solver
        x = _nnls(a / scale, y) / scale
        sse = float(((a @ x - y) ** 2).sum())
        if best is None or sse < best[0] - 1e-12:
            best = (sse, ridge, x)
    _, ridge, x = best
    vals = [float(v) for v in x]
    fwd, prod, tok, step, dec = vals[:5]
    rest = vals[5:]
    pair = fixed if pair_ms is not None else rest.pop(0)
    eager = rest.pop(0) if graph_tokens else 0.0
    kt, ke = {}, {}
    for k in extras:
        kt[k], ke[k] = rest.pop(0), rest.pop(0)
    if prod == 0.0:
        ridge = 0.0
    return RoundModel(fwd, prod, ridge, tok, step, dec, pair, eager, graph_tokens if eager else 0.0, kt, ke,
                      {k: excess_at[k] for k in extras if ke[k] > 0}, None, stand)


def _nnls(a, b, tol: float = 1e-12):
    """min |a x - b| with x >= 0: Lawson and Hanson's active-set method (NumPy; SciPy's import alone costs
    more than every fit of a profile)."""
    import numpy as np

    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            neg = passive & (z <= tol)
            alpha = np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
    return x


GRAPH_TOKENS = 512  # the engine's CUDA-graph limit (engine/graphs.py), for a profile that names none


def graph_tokens(meta: dict) -> float:
    """The largest forward (rows x query tokens) a profile's engine replayed from a CUDA graph: 0 without
    graphs (``meta['cuda_graphs']`` false or absent)."""
    if not meta.get("cuda_graphs"):
        return 0.0
    return float(meta.get("graph_tokens") or GRAPH_TOKENS)


def derive_points(curves: dict[str, list[tuple[float, float]]], meta: dict, ref_context: float) -> list[ProfilePoint]:
    """Point records of a file that has none: each curve point as a round of identical steps. A block
    kind's step is one block (``meta['block_size']``, else 32 tokens when every count divides by it); a
    recompute step's query is the largest length that makes every point's step count one of the run's
    batch sizes (``meta['batch_sizes']``), else the smallest point's tokens (one request). Block steps
    attend to the profile's reference context, a recompute step to its own query only. A curve that is
    a copy of another kind's (a full-sequence model's denoise curve is its cached one) is left out: that
    kind is priced by its stand-in."""
    sizes = [float(b) for b in meta.get("batch_sizes") or []]
    block = float(meta.get("block_size") or DEFAULT_BLOCK)
    out: list[ProfilePoint] = []
    seen: list[list] = []
    for kind in ("cached", "denoise", "prefill", "recompute"):  # a copied curve is the later kind's
        pts = curves.get(kind)
        if not pts or any(pts == s for s in seen):
            continue
        seen.append(pts)
        tokens = [t for t, _ in pts]
        q = _query(tokens, sizes, None if kind == "recompute" else block)
        ctx = 0.0 if kind == "recompute" else float(ref_context)
        out += [ProfilePoint(kind, t / q, q, ctx, ms) for t, ms in pts]
    return out


def _query(tokens: list[float], sizes: list[float], block: float | None) -> float:
    def fits(q: float) -> bool:
        return all(abs(t / q - round(t / q)) < 1e-9 and (not sizes or round(t / q) in sizes) for t in tokens)

    if block is not None and fits(block):
        return block
    for b in sorted(sizes):
        q = tokens[0] / b
        if q >= 1 and fits(q):
            return q
    return block if block is not None and tokens[0] >= block else tokens[0]


@dataclass
class LatencyProfile:
    name: str
    curves: dict[str, list[tuple[float, float]]]  # kind -> [(tokens, ms)], tokens ascending: as measured
    ref_context: float = 0.0  # context length the curves were measured at
    attn_ms_per_pair: float = 0.0  # ms per (query token x key) pair, measured by longer prompts (0: fitted)
    overhead_ms: float = 0.0  # per round (scheduling, sync)
    meta: dict = field(default_factory=dict)
    points: list[ProfilePoint] | None = None  # the measured rounds; None: derived from curves and meta
    model: RoundModel | None = None  # given: used as is (a scaled profile), else fitted to ``points``

    def __post_init__(self) -> None:
        for kind, pts in self.curves.items():
            if kind not in StepKind._value2member_map_:
                raise ValueError(f"profile {self.name}: unknown step kind {kind!r}")
            if not pts or any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
                raise ValueError(f"profile {self.name}: curve {kind!r} needs ascending token counts")
            self.curves[kind] = [(float(t), float(ms)) for t, ms in pts]
        self.points_derived = self.points is None
        if self.points is None:
            self.points = derive_points(self.curves, self.meta, self.ref_context)
        if not self.points:
            raise ValueError(f"profile {self.name} has no measured rounds: measure one with `remask profile`")
        if self.model is None:
            self.model = fit_model(self.points, self.attn_ms_per_pair if self.attn_ms_per_pair > 0 else None,
                                   graph_tokens(self.meta))
        if self.attn_ms_per_pair <= 0:
            self.attn_ms_per_pair = self.model.pair_ms
        self._measured: dict[str, tuple[float, float]] = {}
        for p in self.points:
            lo, hi = self._measured.get(p.kind, (p.tokens, p.tokens))
            self._measured[p.kind] = (min(lo, p.tokens), max(hi, p.tokens))

    # ---- what is measured --------------------------------------------------------------------------
    @property
    def measured(self) -> dict[str, tuple[float, float]]:
        """kind -> (fewest, most) tokens of its measured rounds; a kind absent here is modelled only."""
        return dict(self._measured)

    @property
    def modelled(self) -> bool:
        """No device measured this profile (``meta['modelled']``: engine/profile_model.py): its points are a
        model's, sampled at the shapes a profile run measures."""
        return bool(self.meta.get("modelled"))

    def region(self, kind: str, tokens: float) -> str:
        """'measured' when a forward of ``tokens`` tokens of ``kind`` lies within that kind's measured
        range (of a profile a device measured), else 'modelled'."""
        if self.modelled:
            return "modelled"
        lo_hi = self.measured.get(kind)
        return "measured" if lo_hi and lo_hi[0] <= tokens <= lo_hi[1] else "modelled"

    def query_ref(self, kind: str) -> float:
        """The query tokens of one step of ``kind`` at the profile's reference shape (its measured rounds'
        median, or its stand-in's; a block otherwise)."""
        k = self.model.stand_in.get(kind, kind)
        qs = sorted(p.query for p in self.points if p.kind == k)
        return qs[len(qs) // 2] if qs else float(self.meta.get("block_size") or DEFAULT_BLOCK)

    # ---- pricing -----------------------------------------------------------------------------------
    def curve(self, kind: str) -> list[tuple[float, float]]:
        """The measured points of ``kind`` (or of the kind that stands in for it); see ``measured``."""
        self._check(kind)
        k = self.model.stand_in.get(kind, kind)
        return sorted((p.tokens, p.ms) for p in self.points if p.kind == k)

    def forward_ms(self, kind: str, steps: float, query: float, context: float | None = None) -> float:
        """One forward of ``steps`` steps of ``kind``, each ``query`` tokens over ``context`` keys beyond
        its own query (None: the reference shape's, none for a recompute)."""
        self._check(kind)
        if context is None:
            context = 0.0 if kind == "recompute" else self.ref_context
        return self.model.forward_ms_of(kind, steps, query, context)

    def _check(self, kind: str) -> None:
        if kind not in StepKind._value2member_map_:
            raise ValueError(f"profile {self.name}: unknown step kind {kind!r}")
        if self.model.stand_in.get(kind, kind) not in self._measured:
            raise ValueError(f"profile {self.name} has no {kind!r} curve and no block-step curve to stand in for it "
                             f"(it has {', '.join(sorted(self.measured)) or 'none'}): measure one with "
                             "`remask profile`")

    def curve_ms(self, kind: str, tokens: float, steps: float | None = None) -> float:
        """A forward of ``tokens`` tokens of ``kind`` at the reference shape: steps of ``query_ref`` tokens
        (or ``steps`` steps sharing the tokens), over the reference context."""
        if tokens <= 0:
            return 0.0
        n = tokens / self.query_ref(kind) if steps is None else max(steps, 1e-9)
        return self.forward_ms(kind, n, tokens / n)

    def curve_ms_array(self, kind: str, tokens, steps):
        """``curve_ms`` over NumPy arrays of tokens and steps (0 where there are no tokens)."""
        import numpy as np

        self._check(kind)
        t = np.asarray(tokens, dtype=float)
        n = np.maximum(np.asarray(steps, dtype=float), 1e-9)
        ctx = 0.0 if kind == "recompute" else self.ref_context
        return self.model.forward_ms_array(kind, np.where(t > 0, n, 0.0), t / n, ctx)

    def round_ms(self, steps: list[tuple[str, int, int]]) -> float:
        """steps: (kind, query tokens, context tokens) of each slot in the round. One forward per kind."""
        if not steps:
            return 0.0
        by_kind: dict[str, list[float]] = {}
        for kind, q, ctx in steps:
            acc = by_kind.setdefault(kind, [0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += q
            acc[2] += q * (ctx + q)
        ms = 0.0
        for kind, (n, tokens, pairs) in by_kind.items():
            if tokens <= 0:
                continue
            q = tokens / n
            ms += self.forward_ms(kind, n, q, pairs / tokens - q)  # the same pairs as the steps' own
        return ms + self.overhead_ms

    def scaled(self, factor: float, name: str | None = None) -> LatencyProfile:
        """The same profile with every time multiplied by ``factor`` (e.g. a TP degree's speed-up)."""
        curves = {k: [(t, ms * factor) for t, ms in pts] for k, pts in self.curves.items()}
        points = [replace(p, ms=p.ms * factor) for p in self.points]
        return LatencyProfile(name or f"{self.name}x{factor:g}", curves, self.ref_context,
                              self.attn_ms_per_pair * factor, self.overhead_ms * factor, dict(self.meta),
                              points, self.model.scaled(factor))

    def step_costs(self, block_tokens: int, sequence_tokens: int, batch: int = 32):
        """Relative step costs (a denoise block = 1) at a typical batch, for work weighting."""
        from engine.scheduler.types import StepCosts

        unit = self.forward_ms("denoise", batch, block_tokens) / batch
        return StepCosts(
            prefill=self.forward_ms("prefill", batch, block_tokens) / batch / unit,
            denoise=1.0,
            recompute=self.forward_ms("recompute", batch, sequence_tokens) / batch / unit,
            cached=self.forward_ms("cached", batch, block_tokens) / batch / unit,
        )

    # ---- the fit, per point ------------------------------------------------------------------------
    def fit_report(self) -> dict:
        """Each measured point's ms against the model's, the relative error, the coefficients with their
        units, and each kind's measured range."""
        rows = []
        for p in self.points:
            model = self.forward_ms(p.kind, p.steps, p.query, p.context)
            rows.append({**p.to_dict(), "tokens": p.tokens, "model_ms": round(model, 3),
                         "error": round((model - p.ms) / p.ms, 4)})
        m = self.model
        coef = {k: {"value": getattr(m, k), "unit": u, "what": w} for k, (u, w) in COEFFICIENTS.items()}
        coef["weights_ms"] = {"value": m.product_ms * m.ridge_tokens, "unit": "ms per forward",
                              "what": "the products' floor below the ridge: reading the weights"}
        for k, v in m.kind_token_ms.items():
            coef[f"{k}_token_ms"] = {"value": v, "unit": "ms per token", "what": f"extra per {k} token"}
        for k, v in m.kind_excess_ms.items():
            coef[f"{k}_excess_ms"] = {"value": v, "unit": f"ms per forward from {m.kind_excess_tokens.get(k, 0):g} "
                                      "tokens", "what": f"extra a {k} forward shows over the shared terms "
                                                        "(in proportion to tokens below)"}
        if m.proportional is not None:
            for k, v in m.proportional.items():
                coef[f"{k}_ms_per_token"] = {"value": v, "unit": "ms per token", "what": "the fallback"}
        errors = [abs(r["error"]) for r in rows]
        return {"profile": self.name, "mode": m.mode, "points": rows, "max_error": max(errors),
                "coefficients": coef, "measured": {k: list(v) for k, v in self.measured.items()},
                "modelled": self.modelled,
                "points_derived": self.points_derived, "overhead_ms": self.overhead_ms}

    # ---- files -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"name": self.name, "curves": self.curves, "ref_context": self.ref_context,
                "attn_ms_per_pair": self.attn_ms_per_pair, "overhead_ms": self.overhead_ms, "meta": self.meta,
                "points": [p.to_dict() for p in self.points],
                "measured": {k: list(v) for k, v in self.measured.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> LatencyProfile:
        pts = data.get("points")
        if pts is not None and not isinstance(pts, list):
            raise ValueError("'points' must be a list of point records")
        points = None if pts is None else [ProfilePoint.from_dict(p) for p in pts]
        return cls(data["name"], {k: [tuple(p) for p in v] for k, v in data["curves"].items()},
                   data.get("ref_context", 0.0), data.get("attn_ms_per_pair", 0.0), data.get("overhead_ms", 0.0),
                   data.get("meta", {}), points)

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
