"""Prometheus metrics of the Remask ingress, named as vLLM names its own.

Every metric is ``remask:<vLLM's name>`` (or a diffusion-specific one under the same prefix) and carries a
``model_name`` label (the served model name), so vLLM dashboards and alerts carry over with the prefix
changed. Each :class:`Metrics` owns a private ``CollectorRegistry``, so several app instances can live in one
process (tests, multiple ingresses) without name clashes; it depends on ``prometheus_client`` only.
:meth:`Metrics.render` returns the text exposition for a ``/metrics`` route.

Exposed names (counters are named with their ``_total`` suffix, as Prometheus exposes them):

========================================== ========= ===================================================
``remask:time_to_first_token_seconds``      histogram arrival at the ingress to the first committed text
``remask:inter_token_latency_seconds``      histogram gap between consecutive streamed deltas of a request
``remask:time_per_output_token_seconds``    histogram (e2e - ttft) / (completion_tokens - 1), > 1 token
``remask:e2e_request_latency_seconds``      histogram arrival to the last token, successful requests
``remask:request_queue_time_seconds``       histogram arrival to the request's first step on an instance
``remask:prompt_tokens_total``              counter   prompt tokens of the successful requests
``remask:generation_tokens_total``          counter   completion tokens of the successful requests
``remask:request_success_total``            counter   ``finished_reason``: stop | length
``remask:request_failure_total``            counter   ``reason``: see :data:`FAILURE_REASONS`
``remask:num_requests_running``             gauge     requests being decoded by the instances
``remask:num_requests_waiting``             gauge     requests queued on the instances, not yet admitted
``remask:kv_cache_usage_perc``              gauge     reserved KV tokens / KV capacity of all instances (0..1)
``remask:requests_in_flight``               gauge     requests accepted by the ingress and not ended
``remask:rounds_per_request``               histogram denoising rounds a request took
``remask:tokens_per_step``                  histogram completion tokens / rounds, per request
``remask:threshold``                        histogram mean confidence threshold a request decoded with
``remask:filled_slots_per_round``           histogram requests stepped per round of an instance
``remask:control_event_seconds``            histogram delivery of a progress batch, round loop to ingress
``remask:event_loop_lag_seconds``           histogram how late the ingress's event loop woke from a 10 ms sleep
``remask:gc_pause_seconds``                 histogram the ingress's cyclic collections, ``generation``: 0, 1, 2
``remask:migrations_total``                 counter   requests moved between instances by the router
``remask:resumes_total``                    counter   resumes (from committed tokens) of successful requests
``remask:slo_met_total``                    counter   successful requests with an SLO that met it
``remask:slo_missed_total``                 counter   successful requests with an SLO that missed it
``remask:requests_shed_total``              counter   requests shed on arrival (over capacity)
========================================== ========= ===================================================

A request that fails or whose client goes away is counted in ``remask:request_failure_total`` under its reason
and never observed in a latency histogram.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "remask:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 10.0, 20.0, 40.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
                   120.0, 240.0, 480.0, 960.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
CONTROL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1.0)
ROUND_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TOKENS_PER_STEP_BUCKETS = (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
THRESHOLD_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

FINISHED_REASONS = ("stop", "length")
#: ``reason`` label values of ``remask:request_failure_total`` (their series exist from the start, at 0)
FAILURE_REASONS = ("invalid", "unauthorized", "key_concurrency", "rate_limited", "overload", "unavailable", "error",
                   "cancelled")


def failure_reason(status: int | None) -> str:
    """The ``reason`` of a failed request from its HTTP status: 4xx client errors are ``invalid`` (401/403
    ``unauthorized``), 429 ``overload``, 503 ``unavailable``, anything else ``error``."""
    if status == 429:
        return "overload"
    if status in (401, 403):
        return "unauthorized"
    if status == 503:
        return "unavailable"
    if status is not None and 400 <= status < 500:
        return "invalid"
    return "error"


class Metrics:
    """The ingress's counters, gauges and histograms, in a registry of their own, for one served model."""

    def __init__(self, model_name: str = "remask", registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._shed_seen = 0
        self._make_gauges()
        self._make_histograms()
        self._make_counters()

    # ---- construction: every series of the model exists (at 0) from the start ------------------------------
    def _histogram(self, name: str, doc: str, buckets: tuple) -> Histogram:
        return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(model_name=self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:  # name without _total: prometheus_client appends it
        return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(model_name=self.model_name)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(model_name=self.model_name)

    def _make_gauges(self) -> None:
        self.in_flight = self._gauge("requests_in_flight", "Requests accepted by the ingress and not ended")
        self.running = self._gauge("num_requests_running", "Requests being decoded by the instances")
        self.waiting = self._gauge("num_requests_waiting", "Requests queued on the instances, not yet admitted")
        self.kv_usage = self._gauge("kv_cache_usage_perc",
                                    "KV cache usage: reserved KV tokens over the instances' KV capacity (1 = full)")
        self.graph_failures = self._gauge("cuda_graph_capture_failures",
                                          "CUDA-graph captures that failed, over the live instances (an instance "
                                          "runs its rounds eagerly after its first)")
        self.graphs_off = self._gauge("cuda_graphs_off_instances",
                                      "Live instances whose CUDA graphs were turned off by a failed capture")

    def _make_histograms(self) -> None:
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time to first token: arrival at the ingress to the first committed text",
                                    TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds",
                                   "Gap between consecutive streamed text deltas of a request", TOKEN_GAP_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "Time per output token after the first: (e2e - ttft) / (completion tokens - 1)",
                                    TOKEN_GAP_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds",
                                   "End-to-end latency of successful requests, arrival at the ingress to the end",
                                   REQUEST_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds",
                                     "Arrival at the ingress to the request's first step on an instance",
                                     QUEUE_BUCKETS)
        self.rounds = self._histogram("rounds_per_request", "Denoising rounds a request took", ROUND_BUCKETS)
        self.tokens_per_step = self._histogram("tokens_per_step",
                                               "Completion tokens per denoising round, per request",
                                               TOKENS_PER_STEP_BUCKETS)
        self.threshold = self._histogram("threshold", "Mean confidence threshold a request decoded with",
                                         THRESHOLD_BUCKETS)
        self.filled_slots = self._histogram("filled_slots_per_round",
                                            "Requests stepped per denoising round of an instance", SLOT_BUCKETS)
        self.control = self._histogram("control_event_seconds",
                                       "Delivery time of a progress batch, round loop to ingress", CONTROL_BUCKETS)
        self.lag = self._histogram("event_loop_lag_seconds",
                                   "How late the ingress's event loop woke from a 10 ms sleep", LAG_BUCKETS)
        self.gc_pause = Histogram(PREFIX + "gc_pause_seconds", "The ingress's cyclic garbage collections",
                                  ["model_name", "generation"], buckets=LAG_BUCKETS, registry=self.registry)
        for generation in range(3):
            self.gc_pause.labels(self.model_name, str(generation))

    def _make_counters(self) -> None:
        r, m = self.registry, self.model_name
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of successful requests")
        self.generation_tokens = self._counter("generation_tokens", "Completion tokens of successful requests")
        self.success = Counter(PREFIX + "request_success", "Successful requests by finished_reason",
                               ["model_name", "finished_reason"], registry=r)
        self.failure = Counter(PREFIX + "request_failure", "Failed, refused or cancelled requests by reason",
                               ["model_name", "reason"], registry=r)
        for reason in FINISHED_REASONS:
            self.success.labels(model_name=m, finished_reason=reason)
        for reason in FAILURE_REASONS:
            self.failure.labels(model_name=m, reason=reason)
        self.migrations = self._counter("migrations", "Requests migrated between instances")
        self.resumes = self._counter("resumes", "Resumes on another instance of requests that then succeeded")
        self.slo_met = self._counter("slo_met", "Successful requests with an SLO that met it")
        self.slo_missed = self._counter("slo_missed", "Successful requests with an SLO that missed it")
        self.shed = self._counter("requests_shed", "Requests shed on arrival: over capacity for their SLO")

    # ---- recording ------------------------------------------------------------------------------------
    def request_started(self) -> None:
        """A request (one choice) was handed to the dispatcher."""
        self.in_flight.inc()

    def request_finished(self, *, finish_reason: str, prompt_tokens: int, completion_tokens: int, e2e_s: float,
                         ttft_s: float | None = None, queue_s: float | None = None, rounds: int = 0,
                         threshold: float | None = None, slo_met: bool | None = None, resumes: int = 0) -> None:
        """A started request finished successfully; ``None`` means not measured / not applicable."""
        self.in_flight.dec()
        self.success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(max(prompt_tokens, 0))
        self.generation_tokens.inc(max(completion_tokens, 0))
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.observe(max(e2e_s - ttft_s, 0.0) / (completion_tokens - 1))
        if queue_s is not None:
            self.queue.observe(queue_s)
        if rounds > 0:
            self.rounds.observe(rounds)
            self.tokens_per_step.observe(completion_tokens / rounds)
        if threshold is not None:
            self.threshold.observe(threshold)
        if slo_met is not None:
            (self.slo_met if slo_met else self.slo_missed).inc()
        if resumes > 0:
            self.resumes.inc(resumes)

    def request_failed(self, reason: str, *, started: bool = True) -> None:
        """A request failed, was refused or its client went away: counted under ``reason``, no latency.
        ``started``: it had been counted by :meth:`request_started` (it leaves the in-flight gauge)."""
        if started:
            self.in_flight.dec()
        self.failure.labels(model_name=self.model_name, reason=reason).inc()

    def rejected(self, reason: str) -> None:
        """A request refused before it was handed to the dispatcher."""
        self.request_failed(reason, started=False)

    def request_dropped(self, n: int = 1) -> None:
        """``n`` started requests leave the in-flight gauge uncounted: their response's refusal counts once."""
        self.in_flight.dec(n)

    def token_gap(self, seconds: float) -> None:
        """One inter-token latency: the gap between two consecutive streamed deltas of a request."""
        self.itl.observe(seconds)

    def gap_timer(self, clock: Callable[[], float] = time.monotonic) -> Callable[..., None]:
        """A per-response timer: call it with a choice's key at each of its deltas; from the second delta of
        a key on, it records the gap since the previous one (:meth:`token_gap`)."""
        last: dict[Hashable, float] = {}

        def delta(key: Hashable = 0) -> None:
            now = clock()
            prev = last.get(key)
            last[key] = now
            if prev is not None:
                self.token_gap(now - prev)

        return delta

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def set_cluster(self, instance_stats: Iterable[Mapping], kv_capacity_tokens: int, shed: int | None = None) -> None:
        """The gauges from each instance's last reported stats (``running``, ``waiting``,
        ``kv_reserved_tokens``; KV capacity the instance's ``kv_capacity_tokens`` when it reports one, else
        ``kv_capacity_tokens``; ``cuda_graph_capture_failures``, ``cuda_graphs_off``), and the dispatcher's running
        count of shed requests mirrored into ``remask:requests_shed_total``."""
        views = list(instance_stats)
        self.set_queue(sum(v.get("running", 0) for v in views), sum(v.get("waiting", 0) for v in views))
        capacity = sum(v.get("kv_capacity_tokens") or kv_capacity_tokens for v in views)  # each instance's own
        used = sum(v.get("kv_reserved_tokens", 0) for v in views)
        self.kv_usage.set(min(used / capacity, 1.0) if capacity > 0 else 0.0)
        self.graph_failures.set(sum(v.get("cuda_graph_capture_failures", 0) for v in views))
        self.graphs_off.set(sum(bool(v.get("cuda_graphs_off")) for v in views))
        if shed is not None:
            self.sync_shed(shed)

    def sync_shed(self, total: int) -> None:
        """Mirror a running count of shed requests (the dispatcher's ``stats["shed"]``) into the counter."""
        if total > self._shed_seen:
            self.shed.inc(total - self._shed_seen)
            self._shed_seen = total

    def round_observed(self, filled_slots: int) -> None:
        """One round of an instance stepped ``filled_slots`` requests."""
        self.filled_slots.observe(filled_slots)

    def control_event(self, seconds: float) -> None:
        self.control.observe(seconds)

    def loop_lag(self, seconds: float) -> None:
        self.lag.observe(seconds)

    def collected(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(self.model_name, str(generation)).observe(seconds)

    def migration(self) -> None:
        self.migrations.inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
