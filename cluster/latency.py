"""Per-TP step-latency model used by the router (pure Python).

Built from one ``LatencyProfile`` per TP degree (``engine.latency_profile.load_tp_profiles``).
A round of an instance runs all of its batched steps together, so every
request in the round waits the whole round: a request's step latency is the
instance's round latency. A round with ``n_rec`` recompute steps and
``n_cached`` cached steps (or prefill/denoise steps for exact-cache models)
costs the sum of the two kinds' curves. Round times are tabulated per batch
size up to the instance's slot count, so a lookup is O(1); above the slot
count requests time-share the rounds, so the effective step latency grows
by ``n / slots``.
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


class TpLatencyModel:
    """Predicted round (= step) latency of an instance of TP degree d at a load."""

    def __init__(self, profiles: dict[int, LatencyProfile], slots: int, shape: StepShape | None = None) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self.profiles, self.slots = profiles, slots
        self.shape = shape or StepShape()
        self.scale = 1.0  # measured / profiled round time (``calibrate``): the profile under this deployment's load
        self.calibrations = 0  # rounds folded into ``scale``
        self._heavy: dict[int, list[float]] = {}
        self._light: dict[int, list[float]] = {}
        for tp, prof in profiles.items():
            self._tabulate(tp, prof)

    def _tabulate(self, tp: int, prof: LatencyProfile) -> None:
        s, slots = self.shape, self.slots
        heavy, light = ("recompute", "cached") if s.full_sequence else ("prefill", "denoise")
        ctx = s.sequence_tokens
        pairs = max(ctx - prof.ref_context, 0.0) * prof.attn_ms_per_pair
        self._heavy[tp] = [0.0] + [prof.curve_ms(heavy, k * (ctx if s.full_sequence else s.block_tokens))
                                   for k in range(1, slots + 1)]
        self._light[tp] = [0.0] + [prof.curve_ms(light, k * s.block_tokens) + k * s.block_tokens * pairs
                                   for k in range(1, slots + 1)]
        if prof.overhead_ms:
            self._light[tp] = [v + prof.overhead_ms for v in self._light[tp]]

    def set_profile(self, tp: int, prof: LatencyProfile) -> None:
        """A profile measured by an instance of degree ``tp`` replaces the configured one; the calibration
        (measured / profiled round time) starts over, since it was relative to the old profile."""
        self.profiles[tp] = prof
        self._tabulate(tp, prof)
        self.scale, self.calibrations = 1.0, 0

    @property
    def degrees(self) -> list[int]:
        return sorted(self.profiles)

    def round_ms(self, tp: int, n_heavy: int, n_light: int) -> float:
        """Round latency with ``n_heavy`` recompute (or prefill) and ``n_light`` cached (or denoise)
        steps queued; above the slot count the requests share rounds (latency x n / slots)."""
        n = n_heavy + n_light
        if n <= self.slots:
            return (self._heavy[tp][n_heavy] + self._light[tp][n_light]) * self.scale
        h = round(n_heavy * self.slots / n)
        return (self._heavy[tp][h] + self._light[tp][self.slots - h]) * n / self.slots * self.scale

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
        return (heavy_steps * self._heavy[tp][1] + light_steps * self._light[tp][1]) * self.scale

    def calibrate(self, tp: int, n_heavy: int, n_light: int, measured_ms: float, weight: float = 0.1,
                  bounds: tuple[float, float] = (0.25, 8.0)) -> float:
        """Fold one measured round into ``scale``: the mean of measured / profiled time over the first
        rounds, an exponential average (``weight``) after them, so the scale is right from the first few
        rounds (admission trusts it from the first arrivals on) and follows changes within ~1/weight rounds.

        A profile is measured on an idle machine; a live deployment's rounds also pay for whatever shares
        it (on a small machine the HTTP proxy and the ingress, on any machine a slower or faster GPU than
        the profile's), and the router's latencies and load control's capacity follow that ratio."""
        n = n_heavy + n_light
        if n <= 0 or measured_ms <= 0.0:
            return self.scale
        profiled = self.round_ms(tp, n_heavy, n_light) / self.scale
        if profiled > 0.0:
            ratio = min(max(measured_ms / profiled, bounds[0]), bounds[1])
            self.calibrations += 1
            self.scale += max(weight, 1.0 / self.calibrations) * (ratio - self.scale)
        return self.scale
