"""Prometheus metrics of the Remask ingress.

Each :class:`Metrics` owns a private ``CollectorRegistry``, so several app instances can live in one process
(tests, multiple ingresses) without name clashes. :meth:`Metrics.render` returns the text exposition for a
``/metrics`` route. Every metric name starts with ``remask_``.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ROUND_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
THRESHOLD_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class Metrics:
    """The ingress's counters, gauges and histograms, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._make_gauges()
        self._make_histograms()
        self._make_counters()

    def _make_gauges(self) -> None:
        r = self.registry
        self.in_flight = Gauge("remask_requests_in_flight", "Requests accepted by the ingress and not finished",
                               registry=r)
        self.running = Gauge("remask_requests_running", "Requests being decoded by the instances", registry=r)
        self.waiting = Gauge("remask_requests_waiting", "Requests queued, not yet admitted", registry=r)

    def _make_histograms(self) -> None:
        r = self.registry
        self.ttft = Histogram("remask_ttft_seconds", "Time to first token (first committed text)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("remask_e2e_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.rounds = Histogram("remask_rounds_per_request", "Denoising rounds a request took",
                                buckets=ROUND_BUCKETS, registry=r)
        self.filled_slots = Histogram("remask_filled_slots_per_round", "Tokens committed per denoising round",
                                      buckets=SLOT_BUCKETS, registry=r)
        self.control = Histogram("remask_control_event_seconds",
                                 "Delivery time of a progress event, round loop to ingress",
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=r)
        self.threshold = Histogram("remask_threshold", "Confidence threshold a request decoded with",
                                   buckets=THRESHOLD_BUCKETS, registry=r)

    def _make_counters(self) -> None:
        r = self.registry
        self.requests = Counter("remask_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.slo_met = Counter("remask_slo_met", "Requests with an SLO that met it", registry=r)
        self.slo_missed = Counter("remask_slo_missed", "Requests with an SLO that missed it", registry=r)
        self.migrations = Counter("remask_migrations", "Requests migrated between instances", registry=r)
        self.rejections = Counter("remask_rejected", "Requests rejected by the ingress, by reason", ["reason"],
                                  registry=r)

    def request_started(self) -> None:
        self.in_flight.inc()

    def request_finished(self, ttft_s: float | None, e2e_s: float, slo_met: bool | None, rounds: int,
                         threshold: float | None, ok: bool) -> None:
        """Record a finished request; ``None`` for ``ttft_s`` / ``slo_met`` / ``threshold`` means not applicable."""
        self.in_flight.dec()
        self.requests.labels(outcome="ok" if ok else "error").inc()
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if rounds > 0:
            self.rounds.observe(rounds)
        if threshold is not None:
            self.threshold.observe(threshold)
        if slo_met is not None:
            (self.slo_met if slo_met else self.slo_missed).inc()

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def round_observed(self, filled_slots: int) -> None:
        self.filled_slots.observe(filled_slots)

    def migration(self) -> None:
        self.migrations.inc()

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
