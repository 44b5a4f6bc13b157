"""The ingress metrics (app.metrics): vLLM-style ``remask:*`` names with a ``model_name`` label, failures counted
and never timed, the ingress's call sites (deployments.ingress, no Ray), and the Grafana dashboard
(ops/grafana/remask-dashboard.json) querying only metrics the ingress exposes (tests/dashboard.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.config import AppConfig
from app.metrics import FAILURE_REASONS, Metrics, failure_reason
from app.playground import RecentOutcomes
from tests.dashboard import dashboard_metric_names, exposed_metric_names, promql_metric_names, template_metric_names

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "ops" / "grafana" / "remask-dashboard.json"
MODEL = "tiny-bd"

HISTOGRAMS = {"remask:time_to_first_token_seconds", "remask:inter_token_latency_seconds",
              "remask:time_per_output_token_seconds", "remask:e2e_request_latency_seconds",
              "remask:request_queue_time_seconds", "remask:rounds_per_request", "remask:tokens_per_step",
              "remask:threshold", "remask:filled_slots_per_round", "remask:control_event_seconds",
              "remask:event_loop_lag_seconds"}
LABELLED_HISTOGRAMS = {"remask:gc_pause_seconds"}  # by another label than model_name too (generation)
COUNTERS = {"remask:prompt_tokens_total", "remask:generation_tokens_total", "remask:request_success_total",
            "remask:request_failure_total", "remask:migrations_total", "remask:resumes_total",
            "remask:slo_met_total", "remask:slo_missed_total", "remask:requests_shed_total"}
GAUGES = {"remask:num_requests_running", "remask:num_requests_waiting", "remask:kv_cache_usage_perc",
          "remask:requests_in_flight", "remask:cuda_graph_capture_failures", "remask:cuda_graphs_off_instances"}


def samples(m: Metrics) -> dict[tuple, float]:
    """{(sample name, (label, value), ...): value} of every sample ``m`` exposes."""
    out = {}
    for family in text_string_to_metric_families(m.render()[0].decode()):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def value(m: Metrics, name: str, **labels) -> float:
    return samples(m)[(name, *sorted({"model_name": m.model_name, **labels}.items()))]


def count(m: Metrics, histogram: str) -> float:
    return value(m, histogram + "_count")


def total(m: Metrics, histogram: str) -> float:
    return value(m, histogram + "_sum")


def finish(m: Metrics, **kw) -> None:
    args = dict(finish_reason="stop", prompt_tokens=10, completion_tokens=21, e2e_s=2.5, ttft_s=0.5, queue_s=0.1,
                rounds=7, threshold=0.85, slo_met=True, resumes=0)
    args.update(kw)
    m.request_finished(**args)


def one_of_each(m: Metrics) -> None:
    """A successful request, a failed one, a cancelled one, a refusal; a round, a control event, a migration."""
    for _ in range(3):
        m.request_started()
    finish(m)
    m.request_failed("error")
    m.request_failed("cancelled")
    m.rejected("overload")
    m.token_gap(0.02)
    m.round_observed(3)
    m.control_event(0.002)
    m.migration()
    m.set_cluster([{"running": 1, "waiting": 0, "kv_reserved_tokens": 10}], 100, shed=1)


# ---- names, types, labels ----------------------------------------------------------------------------------
def test_names_types_and_model_label():
    m = Metrics(model_name=MODEL)
    text = m.render()[0].decode()
    # every series exists from the start
    assert exposed_metric_names(text) == HISTOGRAMS | LABELLED_HISTOGRAMS | COUNTERS | GAUGES
    types = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        types[family.name] = family.type
        for s in family.samples:
            assert s.name.startswith("remask:"), s.name
            assert s.labels["model_name"] == MODEL, s
    assert {n for n, t in types.items() if t == "histogram"} == HISTOGRAMS | LABELLED_HISTOGRAMS
    assert {n + "_total" for n, t in types.items() if t == "counter"} == COUNTERS
    assert {n for n, t in types.items() if t == "gauge"} == GAUGES
    # the labelled counters' series are there at 0: rates and ratios work before the first failure
    for reason in ("stop", "length"):
        assert value(m, "remask:request_success_total", finished_reason=reason) == 0
    for reason in FAILURE_REASONS:
        assert value(m, "remask:request_failure_total", reason=reason) == 0
    assert m.render()[1].startswith("text/plain")


def test_instances_do_not_clash_and_keep_their_model():
    a, b = Metrics(model_name="a"), Metrics(model_name="b")
    a.request_started()
    finish(a)
    assert count(a, "remask:e2e_request_latency_seconds") == 1
    assert count(b, "remask:e2e_request_latency_seconds") == 0
    assert all(dict(k[1:])["model_name"] == "b" for k in samples(b))


# ---- requests ------------------------------------------------------------------------------------------
def test_successful_request():
    m = Metrics(model_name=MODEL)
    m.request_started()
    assert value(m, "remask:requests_in_flight") == 1
    finish(m, finish_reason="length", prompt_tokens=10, completion_tokens=21, e2e_s=2.5, ttft_s=0.5, queue_s=0.1,
           rounds=7, threshold=0.85, slo_met=True, resumes=2)
    assert value(m, "remask:requests_in_flight") == 0
    assert value(m, "remask:request_success_total", finished_reason="length") == 1
    assert value(m, "remask:request_success_total", finished_reason="stop") == 0
    assert value(m, "remask:prompt_tokens_total") == 10
    assert value(m, "remask:generation_tokens_total") == 21
    for name, expect in [("remask:e2e_request_latency_seconds", 2.5), ("remask:time_to_first_token_seconds", 0.5),
                         ("remask:request_queue_time_seconds", 0.1), ("remask:rounds_per_request", 7),
                         ("remask:threshold", 0.85), ("remask:tokens_per_step", 3.0),
                         ("remask:time_per_output_token_seconds", (2.5 - 0.5) / 20)]:
        assert count(m, name) == 1, name
        assert total(m, name) == pytest.approx(expect), name
    assert value(m, "remask:slo_met_total") == 1 and value(m, "remask:slo_missed_total") == 0
    assert value(m, "remask:resumes_total") == 2
    assert sum(value(m, "remask:request_failure_total", reason=r) for r in FAILURE_REASONS) == 0


def test_tpot_needs_two_tokens_and_a_ttft_and_optional_fields_stay_out():
    m = Metrics(model_name=MODEL)
    for _ in range(3):
        m.request_started()
    finish(m, completion_tokens=1, ttft_s=0.3, e2e_s=0.3)  # one token: no time per output token
    finish(m, completion_tokens=5, ttft_s=None, queue_s=None, rounds=0, threshold=None, slo_met=None)
    finish(m, completion_tokens=0, ttft_s=None, e2e_s=0.2, slo_met=False)  # e.g. a stop string at once
    assert count(m, "remask:time_per_output_token_seconds") == 0
    assert count(m, "remask:time_to_first_token_seconds") == 1
    assert count(m, "remask:request_queue_time_seconds") == 2
    assert count(m, "remask:rounds_per_request") == 2 and count(m, "remask:tokens_per_step") == 2
    assert total(m, "remask:tokens_per_step") == pytest.approx(1 / 7 + 0 / 7)
    assert count(m, "remask:threshold") == 2
    assert count(m, "remask:e2e_request_latency_seconds") == 3
    assert value(m, "remask:slo_met_total") == 1 and value(m, "remask:slo_missed_total") == 1
    assert value(m, "remask:generation_tokens_total") == 6


def test_failures_and_cancellations_are_counted_not_timed():
    m = Metrics(model_name=MODEL)
    for _ in range(4):
        m.request_started()
    m.request_failed("error")
    m.request_failed("unavailable")
    m.request_failed("cancelled")
    m.request_dropped()  # its response's refusal counts it, once
    m.rejected("overload")
    m.rejected("invalid")
    m.rejected("invalid")
    assert value(m, "remask:requests_in_flight") == 0
    for reason, n in {"error": 1, "unavailable": 1, "cancelled": 1, "overload": 1, "invalid": 2,
                      "unauthorized": 0, "key_concurrency": 0}.items():
        assert value(m, "remask:request_failure_total", reason=reason) == n, reason
    for name in HISTOGRAMS:
        assert count(m, name) == 0, name  # no latency 0 for a failure
    for name in ("remask:prompt_tokens_total", "remask:generation_tokens_total", "remask:slo_met_total",
                 "remask:slo_missed_total"):
        assert value(m, name) == 0, name
    assert all(value(m, "remask:request_success_total", finished_reason=r) == 0 for r in ("stop", "length"))


@pytest.mark.parametrize("status,reason", [(400, "invalid"), (404, "invalid"), (413, "invalid"), (422, "invalid"),
                                           (401, "unauthorized"), (403, "unauthorized"), (429, "overload"),
                                           (503, "unavailable"), (500, "error"), (502, "error"), (None, "error")])
def test_failure_reason(status, reason):
    assert failure_reason(status) == reason
    assert reason in FAILURE_REASONS


# ---- gauges, rounds, shed, token gaps -----------------------------------------------------------------------
def test_cluster_gauges_kv_usage_and_shed_mirror():
    m = Metrics(model_name=MODEL)
    views = [{"running": 3, "waiting": 1, "kv_reserved_tokens": 300, "resident": 2},
             {"running": 2, "waiting": 4, "kv_reserved_tokens": 100}]
    m.set_cluster(views, kv_capacity_tokens=1000, shed=2)
    assert value(m, "remask:num_requests_running") == 5
    assert value(m, "remask:num_requests_waiting") == 5
    assert value(m, "remask:kv_cache_usage_perc") == pytest.approx(400 / 2000)
    assert value(m, "remask:requests_shed_total") == 2
    m.set_cluster(views, 1000, shed=2)  # a mirror: the same running count adds nothing
    m.set_cluster(views[:1], 1000, shed=5)
    assert value(m, "remask:requests_shed_total") == 5
    assert value(m, "remask:kv_cache_usage_perc") == pytest.approx(0.3)
    m.set_cluster([{}], 1000)  # an instance that has not reported yet
    assert value(m, "remask:kv_cache_usage_perc") == 0 and value(m, "remask:num_requests_running") == 0
    m.set_cluster([], 1000)  # no instance
    assert value(m, "remask:kv_cache_usage_perc") == 0
    m.set_cluster([{"kv_reserved_tokens": 5000}], 1000)
    assert value(m, "remask:kv_cache_usage_perc") == 1.0
    m.set_queue(running=4, waiting=7)
    assert value(m, "remask:num_requests_running") == 4 and value(m, "remask:num_requests_waiting") == 7


def test_rounds_control_and_migrations():
    m = Metrics(model_name=MODEL)
    m.round_observed(3)
    m.round_observed(5)
    m.control_event(0.004)
    m.migration()
    m.migration()
    assert count(m, "remask:filled_slots_per_round") == 2 and total(m, "remask:filled_slots_per_round") == 8
    assert count(m, "remask:control_event_seconds") == 1
    assert value(m, "remask:migrations_total") == 2


def test_gap_timer_measures_each_choice_from_its_previous_delta():
    m = Metrics(model_name=MODEL)
    now = [0.0]
    gap = m.gap_timer(clock=lambda: now[0])
    for t, key in [(1.0, 0), (1.5, 1), (1.25, 0), (2.0, 0), (2.5, 1)]:
        now[0] = t
        gap(key)
    # choice 0: 1.0 -> 1.25 -> 2.0 (two gaps), choice 1: 1.5 -> 2.5 (one gap); a first delta has none
    assert count(m, "remask:inter_token_latency_seconds") == 3
    assert total(m, "remask:inter_token_latency_seconds") == pytest.approx(0.25 + 0.75 + 1.0)
    m.token_gap(0.5)
    assert count(m, "remask:inter_token_latency_seconds") == 4


# ---- the dashboard -----------------------------------------------------------------------------------------
def test_dashboard_queries_only_exposed_metrics():
    m = Metrics(model_name=MODEL)
    one_of_each(m)
    queried = dashboard_metric_names(DASHBOARD)
    exposed = exposed_metric_names(m.render()[0].decode())
    assert queried, "the dashboard queries nothing"
    assert not queried - exposed, sorted(queried - exposed)
    assert queried == HISTOGRAMS | LABELLED_HISTOGRAMS | COUNTERS | GAUGES  # and it shows every one of them


def test_dashboard_shape():
    doc = json.loads(DASHBOARD.read_text())
    assert 36 <= doc["schemaVersion"] <= 41
    assert [i["name"] for i in doc["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    query = variables["model_name"]["query"]
    query = query["query"] if isinstance(query, dict) else query
    assert query == "label_values(remask:e2e_request_latency_seconds_count, model_name)"
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        for t in p["targets"]:
            assert 'model_name=~"$model_name"' in t["expr"], (p["title"], t["expr"])
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(remask:time_to_first_token_seconds_bucket" in exprs


def test_promql_metric_names():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, model_name) (rate(remask:e2e_request_latency_seconds_bucket'
        '{model_name=~"$model_name", job="a,b{c}"}[$__rate_interval])))') == {"remask:e2e_request_latency_seconds"}
    assert promql_metric_names(
        'sum(rate(x_total{a="1"}[5m] offset 1h)) / ignoring(reason) group_left sum without (reason) '
        '(y_count) > bool 0 or vector(0) and on(model_name) up') == {"x_total", "y", "up"}
    assert promql_metric_names("max_over_time(g[1m:10s]) * 1e3 + ${var:raw} - 0x1f") == {"g"}
    assert promql_metric_names("count(foo_sum) + sum(bar_bucket)") == {"foo", "bar"}
    assert template_metric_names("label_values(remask:e2e_request_latency_seconds_count, model_name)") == {
        "remask:e2e_request_latency_seconds"}
    assert template_metric_names('label_values(a_total{b="c,d"},  model_name)') == {"a_total"}
    assert template_metric_names("label_values(model_name)") == set()
    assert template_metric_names("query_result(topk(3, q_total))") == {"q_total"}
    assert template_metric_names("metrics(remask:.*)") == set()


def test_exposed_metric_names_normal_form():
    text = "\n".join([
        "# HELP c_total a counter", "# TYPE c_total counter", 'c_total{x="1"} 3.0',
        "# HELP c_created a counter", "# TYPE c_created gauge", 'c_created{x="1"} 1.7e9',
        "# HELP h a histogram", "# TYPE h histogram", 'h_bucket{le="1.0"} 1.0', 'h_bucket{le="+Inf"} 1.0',
        "h_count 1.0", "h_sum 0.5",
        "# HELP h_created a histogram", "# TYPE h_created gauge", "h_created 1.7e9",
        "# HELP g a gauge", "# TYPE g gauge", "g 1.0",
        "# HELP job_created a gauge of its own", "# TYPE job_created gauge", "job_created 1.0",
        "# HELP s a summary", "# TYPE s summary", "s_count 2.0", "s_sum 1.0",
        "u_bucket 1", "v 2", ""])
    assert exposed_metric_names(text) == {"c_total", "h", "g", "job_created", "s", "u", "v"}
    names = exposed_metric_names(Metrics(model_name=MODEL).render()[0].decode())
    assert not any(n.endswith(("_created", "_bucket", "_count", "_sum")) for n in names)


# ---- the ingress's call sites (no Ray, no model) -------------------------------------------------------------
class FakeStream:
    def __init__(self, events, hang: bool = False) -> None:
        self.events, self.hang, self.ended, self.cancelled = list(events), hang, False, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.ended:
            raise StopAsyncIteration
        if not self.events:
            if self.hang:
                await asyncio.sleep(3600)
            raise StopAsyncIteration
        event = self.events.pop(0)
        await asyncio.sleep(0)
        if event["type"] in ("done", "error"):
            self.ended = True
        return event

    def cancel(self) -> None:
        self.ended = self.cancelled = True


def _done(text="ab", completion_tokens=3, **kw) -> dict:
    return {"type": "done", "finish_reason": "stop", "text": text, "prompt_tokens": 4,
            "completion_tokens": completion_tokens, "rounds": 3, "ttft_s": 0.1, "e2e_s": 0.4, "threshold": 0.9,
            "migrations": 0, "resumes": 1, "queue_s": 0.01, **kw}


def _events(done: dict | None = None, error: dict | None = None, deltas=("a", "b")) -> list[dict]:
    out = [{"type": "accepted", "add_ms": 1.0}] + [{"type": "delta", "text": t} for t in deltas]
    return out + [error if error is not None else (done or _done())]


def _ingress():
    """The ingress's completion service (app.completions) with only what its metrics need."""
    from app.completions import CompletionService

    ing = CompletionService.__new__(CompletionService)
    ing.metrics = Metrics(model_name=MODEL)
    ing.cfg = AppConfig(http={"served_model_name": MODEL}, engine={"kv_capacity_tokens": 1000})
    ing.outcomes, ing.planner = RecentOutcomes(), None
    return ing


def _req(n: int = 1, stream: bool = True, slo_ms: float | None = None):
    from app.api import GenRequest

    return GenRequest(request_id="cmpl-1", kind="completion", model=MODEL, prompts=["p"] * n, messages=[],
                      max_tokens=8, stream=stream, slo_ms=slo_ms)


async def _drain(gen, idle_s: float = 0.2) -> list[str]:
    """Read the chunks until none comes for ``idle_s``, then go away (as Starlette cancels a stream whose client
    disconnected)."""
    out = []
    try:
        while True:
            out.append(await asyncio.wait_for(gen.__anext__(), idle_s))
    except (StopAsyncIteration, TimeoutError):
        pass
    await gen.aclose()
    return out


def test_ingress_sse_records_success_gaps_errors_and_cancellations():
    ing = _ingress()
    m = ing.metrics
    streams = [FakeStream(_events(deltas="abc")),
               FakeStream(_events(error={"type": "error", "status": 503, "message": "gone"})),
               FakeStream(_events(deltas="x")[:-1], hang=True)]  # no end: still decoding
    for _ in streams:
        m.request_started()
    out = asyncio.run(_drain(ing.sse(_req(3, slo_ms=100.0), streams, [])))
    # the client read every chunk so far and went away while the third choice was still decoding
    assert len(out) == 3 + 2 + 1 + 2  # the deltas, the first choice's end, the second's error
    assert not any("[DONE]" in c for c in out)
    assert value(m, "remask:request_success_total", finished_reason="stop") == 1
    assert value(m, "remask:request_failure_total", reason="unavailable") == 1
    assert value(m, "remask:request_failure_total", reason="cancelled") == 1
    assert value(m, "remask:requests_in_flight") == 0
    assert count(m, "remask:e2e_request_latency_seconds") == 1  # the success only
    assert count(m, "remask:inter_token_latency_seconds") == 2 + 1  # "abc": 2 gaps; "ab" of the failed one: 1
    assert value(m, "remask:slo_met_total") == 0 and value(m, "remask:slo_missed_total") == 1  # 400 ms > 100 ms
    assert value(m, "remask:resumes_total") == 1
    assert count(m, "remask:request_queue_time_seconds") == 1
    assert all(s.ended for s in streams)


def test_ingress_finished_and_on_batch():
    from app.frontend import Frontend

    ing = _ingress()
    m = ing.metrics
    from app.control_timer import ControlTimer

    front = Frontend.__new__(Frontend)  # the front's progress-batch gauges, on the same metrics
    front.metrics, front.cfg, front.control = m, ing.cfg, ControlTimer()
    front.dispatcher = SimpleNamespace(
        stats={"shed": 3}, instances={0: SimpleNamespace(stats={"running": 2, "waiting": 1, "kv_reserved_tokens": 250}),
                                      1: SimpleNamespace(stats={"running": 1, "waiting": 0, "kv_reserved_tokens": 0})})
    from app.protocol import AcceptedItem, ProgressBatch, StepItem

    front.on_batch(ProgressBatch(time.time(), 7, 5.0, items=[StepItem("a", [], 1, False), StepItem("b", [], 2, False),
                                                            AcceptedItem("c", 1.0, 3)]), 0.0)
    assert front.control.events == 1 and list(front.control.add_ms) == [1.0]
    assert count(m, "remask:filled_slots_per_round") == 1 and total(m, "remask:filled_slots_per_round") == 2
    assert value(m, "remask:num_requests_running") == 3 and value(m, "remask:num_requests_waiting") == 1
    assert value(m, "remask:kv_cache_usage_perc") == pytest.approx(250 / 2000)
    assert value(m, "remask:requests_shed_total") == 3
    m.request_started()
    ing.finished(_req(slo_ms=1000.0), _done(completion_tokens=5))
    assert value(m, "remask:slo_met_total") == 1
    assert total(m, "remask:time_per_output_token_seconds") == pytest.approx((0.4 - 0.1) / 4)
    assert value(m, "remask:prompt_tokens_total") == 4 and value(m, "remask:generation_tokens_total") == 5


def test_ingress_sse_complete_stream_counts_no_cancellation():
    ing = _ingress()
    m = ing.metrics
    streams = [FakeStream(_events(deltas="abcd")), FakeStream(_events(deltas="xy"))]
    for _ in streams:
        m.request_started()
    out = asyncio.run(_drain(ing.sse(_req(2), streams, [])))
    assert out[-1].strip() == "data: [DONE]"
    assert value(m, "remask:request_success_total", finished_reason="stop") == 2
    assert sum(value(m, "remask:request_failure_total", reason=r) for r in FAILURE_REASONS) == 0
    assert value(m, "remask:requests_in_flight") == 0
    assert count(m, "remask:inter_token_latency_seconds") == 3 + 1
    assert count(m, "remask:e2e_request_latency_seconds") == 2
    assert value(m, "remask:slo_met_total") + value(m, "remask:slo_missed_total") == 0  # no SLO asked


def _generating(per_submit):
    """An ingress whose request parsing is stubbed and whose dispatcher hands out ``per_submit()``'s streams
    (or raises what it returns)."""
    ing = _ingress()

    async def body(request):
        return b"{}"

    def submit(*a, **kw):
        out = per_submit()
        if isinstance(out, Exception):
            raise out
        return out

    ing.gate, ing.parse = SimpleNamespace(body=body), lambda kind, raw, key, rid=None: _req(1, stream=False)
    ing.prompt_ids, ing.check_prompt = lambda req: [[1, 2]], lambda *a: None
    ing.sampling = lambda req: {"temperature": 0.0, "seed": None}
    ing.charge = lambda *a: None  # no rate limits
    ing.dispatcher = SimpleNamespace(submit=submit, stats={"shed": 0}, instances={})
    return ing


def test_ingress_generate_success_and_refusals():
    from app.dispatch import DispatchError

    ing = _generating(lambda: FakeStream(_events(deltas="abc")))
    response = asyncio.run(ing.generate("completion", None, None))
    assert response["choices"][0]["text"] == "ab"
    m = ing.metrics
    assert value(m, "remask:request_success_total", finished_reason="stop") == 1
    assert count(m, "remask:inter_token_latency_seconds") == 2
    assert value(m, "remask:requests_in_flight") == 0
    cases = [(lambda: DispatchError(429, "over capacity"), 429, "overload"),  # refused at submit
             (lambda: FakeStream([{"type": "error", "status": 503, "message": "none"}]), 503, "unavailable"),
             (lambda: FakeStream(_events(error={"type": "error", "status": 500, "message": "x"})), 500, "error")]
    for per_submit, status, reason in cases:
        ing = _generating(per_submit)
        m = ing.metrics
        response = asyncio.run(ing.generate("completion", None, None))
        assert response.status_code == status
        assert value(m, "remask:request_failure_total", reason=reason) == 1, reason  # once, by _refused
        assert sum(value(m, "remask:request_failure_total", reason=r) for r in FAILURE_REASONS) == 1
        assert value(m, "remask:requests_in_flight") == 0
        assert all(count(m, h) == 0 for h in HISTOGRAMS if h != "remask:inter_token_latency_seconds")


def test_ingress_generate_cancelled_handler_counts_cancelled():
    ing = _generating(lambda: FakeStream(_events(deltas="ab")[:-1], hang=True))
    m = ing.metrics

    async def go():
        task = asyncio.ensure_future(ing.generate("completion", None, None))
        await asyncio.sleep(0.05)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert value(m, "remask:request_failure_total", reason="cancelled") == 1
    assert value(m, "remask:requests_in_flight") == 0
    assert count(m, "remask:e2e_request_latency_seconds") == 0
