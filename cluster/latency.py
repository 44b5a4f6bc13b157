"""Per-TP step-latency model used by the router (pure Python).

Built from one ``LatencyProfile`` per TP degree (``engine.latency_profile.load_tp_profiles``), each
pricing a round by its fitted round-time model. A round of an instance runs all of its batched steps
together, so every request in the round waits the whole round: a request's step latency is the
instance's round latency. A round with ``n_rec`` recompute steps and ``n_cached`` cached steps (or
prefill/denoise steps for exact-cache models) costs the sum of the two kinds' forwards. Round times are
tabulated per batch size up to the instance's slot count, so a lookup is O(1); above the slot count
requests time-share the rounds, so the effective step latency grows by ``n / slots``.

Live rounds correct the profile per kind (``calibrate``): a deployment's rounds also pay for whatever
shares its machine (one scale for every kind), and a profile file can be wrong for one kind only (a
recompute curve 5x off while the cached one is right). The heavy and light parts of each measured round
are fitted to it (least squares in relative error over the recent rounds, per TP degree), with the
overall scale as the prior where the rounds cannot tell the kinds apart (every round of the same mix).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.latency_profile import LatencyProfile


@dataclass(frozen=True)
class StepShape:
    """Typical token counts of one step, for the routing tables."""

    block_tokens: int = 32  # query tokens of a cached / denoise step
    sequence_tokens: int = 396  # query tokens of a recompute step (prompt + output canvas)
    full_sequence: bool = True  # recompute/cached steps (approximate cache) vs denoise steps (exact cache)


class _KindFit:
    """Per-kind scales of one TP degree: (heavy, light) minimising the recent rounds' relative error
    ((s_h H + s_l L) / measured - 1), rounds weighted as ``calibrate``'s scale weighs them, plus a weak
    prior (``PRIOR`` of one round's weight) toward the overall scale."""

    PRIOR = 0.02

    def __init__(self) -> None:
        self.a = [[0.0, 0.0], [0.0, 0.0]]
        self.b = [0.0, 0.0]
        self.rounds = 0

    def add(self, heavy: float, light: float, measured: float, alpha: float) -> None:
        x = (heavy / measured, light / measured)
        for i in range(2):
            self.b[i] += alpha * (x[i] - self.b[i])
            for j in range(2):
                self.a[i][j] += alpha * (x[i] * x[j] - self.a[i][j])
        self.rounds += 1

    def scales(self, prior: float, bounds: tuple[float, float]) -> tuple[float, float]:
        lam = self.PRIOR
        a11, a12, a22 = self.a[0][0] + lam, self.a[0][1], self.a[1][1] + lam
        b1, b2 = self.b[0] + lam * prior, self.b[1] + lam * prior
        det = a11 * a22 - a12 * a12
        if det <= 0.0:
            return prior, prior
        s_h, s_l = (a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det
        return tuple(min(max(s, bounds[0]), bounds[1]) for s in (s_h, s_l))  # type: ignore[return-value]


class TpLatencyModel:
    """Predicted round (= step) latency of an instance of TP degree d at a load."""

    KIND_BOUNDS = (0.05, 20.0)  # a per-kind scale's range: a file 20x off is beyond correcting

    def __init__(self, profiles: dict[int, LatencyProfile], slots: int, shape: StepShape | None = None) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self.profiles, self.slots = profiles, slots
        self.shape = shape or StepShape()
        self.scale = 1.0  # measured / profiled round time (``calibrate``): the profile under this deployment's load
        self.calibrations = 0  # rounds folded into ``scale``
        self._kinds: dict[int, _KindFit] = {}  # per TP degree: the per-kind correction (``calibrate``)
        self._kind_scale: dict[int, tuple[float, float]] = {}
        self._heavy: dict[int, list[float]] = {}
        self._light: dict[int, list[float]] = {}
        for tp, prof in profiles.items():
            self._tabulate(tp, prof)

    def _tabulate(self, tp: int, prof: LatencyProfile) -> None:
        s, slots = self.shape, self.slots
        heavy, light = ("recompute", "cached") if s.full_sequence else ("prefill", "denoise")
        seq, blk = s.sequence_tokens, s.block_tokens
        if s.full_sequence:  # a recompute step: the whole sequence, no context
            self._heavy[tp] = [0.0] + [prof.forward_ms(heavy, k, seq, 0.0) for k in range(1, slots + 1)]
        else:  # a prefill step: one block at the profile's reference context
            self._heavy[tp] = [0.0] + [prof.forward_ms(heavy, k, blk) for k in range(1, slots + 1)]
        # a block step attends to its sequence (``round_ms``'s (kind, block, sequence) steps)
        self._light[tp] = [prof.overhead_ms] + [prof.forward_ms(light, k, blk, seq) + prof.overhead_ms
                                                for k in range(1, slots + 1)]

    def set_profile(self, tp: int, prof: LatencyProfile) -> None:
        """A profile measured by an instance of degree ``tp`` replaces the configured one; the calibration
        (measured / profiled round time) starts over, since it was relative to the old profile."""
        self.profiles[tp] = prof
        self._tabulate(tp, prof)
        self.scale, self.calibrations = 1.0, 0
        self._kinds.clear()
        self._kind_scale.clear()

    @property
    def degrees(self) -> list[int]:
        return sorted(self.profiles)

    def kind_scales(self, tp: int) -> tuple[float, float]:
        """(heavy, light): measured / profiled time of each kind's part of a round on TP-``tp`` (the overall
        scale until that degree's rounds have been measured)."""
        return self._kind_scale.get(tp, (self.scale, self.scale))

    def _parts(self, tp: int, n_heavy: int, n_light: int) -> tuple[float, float, float]:
        """(heavy ms, light ms, time-sharing factor) of a round as the profile prices it."""
        n = n_heavy + n_light
        if n <= self.slots:
            return self._heavy[tp][n_heavy], self._light[tp][n_light], 1.0
        h = round(n_heavy * self.slots / n)
        return self._heavy[tp][h], self._light[tp][self.slots - h], n / self.slots

    def round_ms(self, tp: int, n_heavy: int, n_light: int) -> float:
        """Round latency with ``n_heavy`` recompute (or prefill) and ``n_light`` cached (or denoise)
        steps queued; above the slot count the requests share rounds (latency x n / slots)."""
        heavy, light, share = self._parts(tp, n_heavy, n_light)
        s_h, s_l = self._kind_scale.get(tp, (self.scale, self.scale))
        return (heavy * s_h + light * s_l) * share

    def step_ms(self, tp: int, batch: int, kind: str = "cached") -> float:
        """Latency of a round of ``batch`` steps all of ``kind`` ('recompute'/'prefill' or 'cached'/'denoise')."""
        heavy = kind in ("recompute", "prefill")
        return self.round_ms(tp, batch if heavy else 0, 0 if heavy else batch)

    def cost_per_step(self, tp: int, kind: str, batch: int | None = None) -> float:
        """Instance milliseconds one step of ``kind`` costs at ``batch`` (default: the slot count);
        the load unit of load control (Alg. 2)."""
        b = batch or self.slots
        return self.step_ms(tp, b, kind) / b

    def isolated_ms(self, tp: int, heavy_steps: int, light_steps: int) -> float:
        """End-to-end latency of one request alone on a TP-``tp`` instance."""
        s_h, s_l = self._kind_scale.get(tp, (self.scale, self.scale))
        return heavy_steps * self._heavy[tp][1] * s_h + light_steps * self._light[tp][1] * s_l

    def calibrate(self, tp: int, n_heavy: int, n_light: int, measured_ms: float, weight: float = 0.1,
                  bounds: tuple[float, float] = (0.25, 8.0)) -> float:
        """Fold one measured round into ``scale`` and into TP-``tp``'s per-kind scales. ``scale``: the mean
        of measured / profiled time over the first rounds, an exponential average (``weight``) after them,
        so it is right from the first few rounds (admission trusts it from the first arrivals on) and
        follows changes within ~1/weight rounds. The per-kind scales weigh rounds alike and fit the heavy
        and light parts of the rounds to their measured times (``_KindFit``): rounds of different mixes
        (some with recompute steps, some without) tell the kinds apart, so a profile whose recompute is
        off by a factor while its cached steps are right is corrected where it is wrong.

        A profile is measured on an idle machine; a live deployment's rounds also pay for whatever shares
        it (on a small machine the HTTP proxy and the ingress, on any machine a slower or faster GPU than
        the profile's), and the router's latencies and load control's capacity follow those ratios."""
        n = n_heavy + n_light
        if n <= 0 or measured_ms <= 0.0:
            return self.scale
        heavy, light, share = self._parts(tp, n_heavy, n_light)
        heavy, light = heavy * share, light * share
        profiled = heavy + light
        if profiled > 0.0:
            ratio = min(max(measured_ms / profiled, bounds[0]), bounds[1])
            self.calibrations += 1
            alpha = max(weight, 1.0 / self.calibrations)
            self.scale += alpha * (ratio - self.scale)
            fit = self._kinds.setdefault(tp, _KindFit())
            fit.add(heavy, light, measured_ms, max(weight, 1.0 / (fit.rounds + 1)))
            lo, hi = self.KIND_BOUNDS
            self._kind_scale[tp] = fit.scales(self.scale, (max(lo, bounds[0] / 8), min(hi, bounds[1] * 8)))
        return self.scale
