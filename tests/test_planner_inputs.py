"""The planner's inputs measured from served traffic (planner.inputs): steps per token per threshold, the
SLO scale, profiles per TP degree, each with its source; the live service's API for the ingress."""

from __future__ import annotations

import json
import random
import threading

import pytest

from engine.latency_profile import TP_SPEEDUP, load_tp_profiles
from planner.costs import DEFAULT_STEPS_PER_TOKEN, StepModel, cost_tables, default_steps_per_token, isolated_ms
from planner.inputs import FinishedRequest, InputsConfig, MeasuredInputs, fit_steps_per_token, nearest, pav
from planner.planner import Planner, PlannerConfig
from planner.report import default_classes
from planner.stage1 import Stage1Config, default_slos
from planner.stage2 import Cluster
from planner.workload import ClassGrid, WorkloadClass

PROFILES = load_tp_profiles("h200-llada8b-measured")
HIGHS = Stage1Config(solver="highs")
TRUTH = {0.5: 0.30, 0.6: 0.36, 0.7: 0.45, 0.8: 0.60, 0.9: 0.85}  # steps per output token of "the model"


def planner(**inputs) -> Planner:
    return Planner(Cluster.uniform(2, 8), PROFILES, PlannerConfig(stage1=HIGHS, inputs=InputsConfig(**inputs)),
                   profile_sources={1: "configured", 2: "scaled", 4: "scaled"})


def stream(n: int, truth=TRUTH, seed: int = 0, slo=None, thresholds=None):
    """``n`` finished requests: a threshold near a candidate (jitter 0.03), steps = truth x output tokens."""
    rng = random.Random(seed)
    ths = thresholds or sorted(truth)
    for i in range(n):
        th = ths[i % len(ths)]
        prompt, out = rng.randint(20, 600), rng.choice([32, 64, 128, 256, 512])
        slo_s = None if slo is None else slo(prompt, out)
        yield FinishedRequest(prompt, out, round(truth[th] * out), th + rng.uniform(-0.03, 0.03), slo_s,
                              1.0, 1)


def test_pav_and_nearest():
    assert pav([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]) == [1.0, 2.5, 2.5, 4.0]
    assert pav([3.0, 1.0], [1, 3]) == [1.5, 1.5]
    assert nearest([0.7, 0.8, 0.9], 0.84) == 0.8 and nearest([0.7, 0.8, 0.9], 0.85) == 0.9  # a tie: the higher
    assert nearest([0.7, 0.8, 0.9], 0.99) == 0.9


def test_default_steps_per_token_at_the_routers_thresholds():
    assert default_steps_per_token([0.9, 0.8, 0.7]) == {t: DEFAULT_STEPS_PER_TOKEN[t] for t in (0.9, 0.8, 0.7)}
    more = default_steps_per_token([0.95, 0.85, 0.3])
    assert more[0.85] == pytest.approx(0.355) and more[0.95] > 0.40 and more[0.3] == 0.1


def test_the_step_model_converges_to_the_measured_steps_and_the_source_flips_at_the_minimum():
    p = planner(min_requests=50, min_bucket=10)
    reqs = list(stream(400))
    for r in reqs[:49]:
        p.observe_finished(r)
    inp = p.inputs.snapshot()
    assert inp.steps.steps_per_token == DEFAULT_STEPS_PER_TOKEN
    assert inp.sources["steps_per_token"]["source"] == "default"
    p.observe_finished(reqs[49])  # the 50th: 10 at each of the 5 thresholds
    inp = p.inputs.snapshot()
    src = inp.sources["steps_per_token"]
    assert src["source"] == "measured" and src["requests"] == 50
    assert all(e["source"] == "measured" and e["requests"] == 10 for e in src["thresholds"].values())
    for r in reqs[50:]:
        p.observe_finished(r)
    spt = p.inputs.snapshot().steps.steps_per_token
    assert spt == pytest.approx(TRUTH, rel=0.01)


def test_unseen_thresholds_follow_the_measured_ones_monotonically():
    # only 0.9 and 0.7 in the traffic (the router's usual two): 0.8 between them, 0.5 and 0.6 along the default shape
    p = planner(min_requests=20, min_bucket=5)
    for r in stream(200, thresholds=[0.9, 0.7]):
        p.observe_finished(r)
    inp = p.inputs.snapshot()
    spt, per = inp.steps.steps_per_token, inp.sources["steps_per_token"]["thresholds"]
    assert {t: e["source"] for t, e in per.items()} == {0.5: "scaled", 0.6: "scaled", 0.7: "measured",
                                                        0.8: "scaled", 0.9: "measured"}
    assert spt[0.9] == pytest.approx(TRUTH[0.9], rel=0.01) and spt[0.7] == pytest.approx(TRUTH[0.7], rel=0.01)
    assert spt[0.7] <= spt[0.8] <= spt[0.9]
    ratio = spt[0.7] / DEFAULT_STEPS_PER_TOKEN[0.7]  # below the lowest measured: the default's shape at its ratio
    assert spt[0.5] == pytest.approx(DEFAULT_STEPS_PER_TOKEN[0.5] * ratio)
    assert list(spt.values()) == sorted(spt.values())


def test_measured_steps_that_violate_monotonicity_are_pooled():
    default = {0.7: 0.25, 0.8: 0.31, 0.9: 0.40}
    sums = {0.7: (60.0, 100.0, 10), 0.8: (50.0, 100.0, 10), 0.9: (80.0, 100.0, 10)}  # 0.7 above 0.8: noise
    spt, src = fit_steps_per_token(default, sums, min_bucket=10)
    assert spt == {0.7: 0.55, 0.8: 0.55, 0.9: 0.8}
    assert set(src.values()) == {"measured"}
    spt, src = fit_steps_per_token(default, {0.9: (80.0, 100.0, 9)}, min_bucket=10)  # too few: defaults
    assert spt == default and set(src.values()) == {"default"}


def test_isolated_latency_is_default_slos_per_request():
    classes = default_classes(8)
    model = StepModel()
    tab = cost_tables(classes, PROFILES, model)
    slo = default_slos(classes, tab, 1.0)
    for c, s in zip(classes, slo):
        assert isolated_ms(c.input_tokens, c.output_tokens, PROFILES[1], model) == pytest.approx(s)


def test_slo_scale_measured_overall_and_per_class():
    grid = ClassGrid()
    p = planner(min_requests=50)

    def slo(prompt, out):  # short outputs get 10x their isolated latency, long ones 3x (with the true steps)
        k = 10.0 if out < 128 else 3.0
        return k * isolated_ms(prompt, out, PROFILES[1], StepModel(steps_per_token=TRUTH)) / 1e3

    reqs = list(stream(2000, slo=slo))
    for r in reqs[:49]:
        p.observe_finished(r)
    assert p.inputs.snapshot().sources["slo_scale"]["source"] == "default"
    assert p.inputs.snapshot().slo_scale == 5.0
    for r in reqs[49:]:
        p.observe_finished(r)
    inp = p.inputs.snapshot()
    s = inp.sources["slo_scale"]
    assert s["source"] == "measured" and s["requests"] == 2000
    assert inp.slo_scale in (pytest.approx(3.0, rel=0.02), pytest.approx(10.0, rel=0.02))  # the median's side
    short = grid.name(grid.classify(100, 64))
    long_ = grid.name(grid.classify(100, 256))
    assert inp.class_slo_scale[short] == pytest.approx(10.0, rel=0.02)
    assert inp.class_slo_scale[long_] == pytest.approx(3.0, rel=0.02)
    assert s["classes"][short]["per_class"] and s["classes"][short]["source"] == "measured"
    # a class's SLO in the plan is its own k x its isolated latency
    cls = [WorkloadClass(short, 2.0, 100, 64), WorkloadClass(long_, 2.0, 100, 256)]
    plan = p.decide(cls).proposal
    iso = {c.name: isolated_ms(c.input_tokens, c.output_tokens, PROFILES[1], inp.steps) for c in cls}
    assert plan.slo_ms[short] == pytest.approx(10.0 * iso[short], rel=0.02)
    assert plan.slo_ms[long_] == pytest.approx(3.0 * iso[long_], rel=0.02)


def test_more_steps_per_token_measured_plans_more_instances_at_the_same_load():
    classes = default_classes(16)
    default = planner()
    measured = planner(min_requests=50)
    for r in stream(300, truth={t: 3 * v for t, v in DEFAULT_STEPS_PER_TOKEN.items()}):
        measured.observe_finished(r)  # no SLOs: the SLO scale stays the default
    a, b = default.decide(classes).proposal, measured.decide(classes).proposal
    assert a.feasible and b.feasible
    assert a.counts == {1: 0, 2: 0, 4: 4}  # four TP-4 instances hold the default steps
    assert sum(b.counts.values()) > sum(a.counts.values())  # three times the steps: more, smaller instances
    assert b.counts[1] > 0


def test_measured_profiles_replace_configured_and_scaled_ones():
    p = planner()
    src = p.inputs.snapshot().sources["profiles"]
    assert {d: e["source"] for d, e in src.items()} == {1: "configured", 2: "scaled", 4: "scaled"}
    assert src[2]["value"]["from"] == "TP-1 configured" and src[2]["value"]["factor"] == TP_SPEEDUP[2]
    step_ms = src[1]["value"]["cached_step_ms"]
    slow = PROFILES[1].scaled(2.0, name="measured-tp1")
    p.set_profile(1, slow)
    inp = p.inputs.snapshot()
    assert inp.sources["profiles"][1] == {"value": {"name": "measured-tp1", "cached_step_ms": pytest.approx(
        2 * step_ms, abs=1e-3)}, "source": "measured", "requests": 1}
    assert inp.sources["profiles"][4]["source"] == "scaled"  # re-derived from the measured TP-1
    assert inp.sources["profiles"][4]["value"]["from"] == "TP-1 measured"
    assert inp.profiles[4].curve_ms("cached", 32) == pytest.approx(slow.curve_ms("cached", 32) * TP_SPEEDUP[4])
    own = PROFILES[1].scaled(0.5, name="measured-tp4")
    p.set_profile(4, own)
    inp = p.inputs.snapshot()
    assert inp.profiles[4] is own and inp.sources["profiles"][4]["source"] == "measured"
    assert p.profiles[4] is own
    with pytest.raises(ValueError, match="TP-8"):
        p.set_profile(8, own)


def test_slower_measured_profiles_plan_more_instances():
    classes = default_classes(16)
    slow = planner()
    for d in (1, 2, 4):
        slow.set_profile(d, PROFILES[d].scaled(3.0))
    a, b = planner().decide(classes).proposal, slow.decide(classes).proposal
    assert sum(b.counts.values()) > sum(a.counts.values())


def test_memory_is_bounded():
    p = planner(window=100)
    for r in stream(5000, slo=lambda p, o: 30.0):
        p.observe_finished(r)
    inp = p.inputs
    assert len(inp.records) == 100 and inp.seen == 5000
    snap = inp.snapshot()
    assert snap.sources["steps_per_token"]["requests"] == 100 and snap.sources["slo_scale"]["requests"] == 100
    assert snap.sources["finished"]["kept"] == 100 and snap.sources["finished"]["seen"] == 5000


def test_snapshot_is_cached_until_something_changes():
    p = planner()
    a = p.inputs.snapshot()
    assert p.inputs.snapshot() is a
    p.observe_finished(FinishedRequest(10, 32, 8, 0.9, 5.0, 1.0, 1))
    assert p.inputs.snapshot() is not a


def test_records_without_threshold_or_slo_count_only_where_they_can():
    m = MeasuredInputs(StepModel(), PROFILES, 5.0, lambda i, o: "c", InputsConfig(min_requests=1, min_bucket=1))
    m.record(FinishedRequest(10, 32, 8, None, 5.0, 1.0, 1))
    m.record(FinishedRequest(10, 32, 8, 0.9, None, 1.0, 2))
    s = m.snapshot().sources
    assert s["steps_per_token"]["requests"] == 1 and s["slo_scale"]["requests"] == 1
    assert s["finished"]["slo_attainment"] == 1.0 and set(s["finished"]["e2e_s_median"]) == {1, 2}


# ---- the live service (app.planner_service.PlannerService) ---------------------------------------------------
def _service():
    from app.config import AppConfig
    from app.planner_service import build_service

    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    cfg = AppConfig(engine={"model": "tiny-bd"}, resources={"tp_degrees": [1, 2]}, planner={
        "nodes": 1, "gpus_per_node": 2, "period_s": 10, "window_s": 10, "profile": "cpu-tiny-bd",
        "min_requests": 20, "min_bucket": 5, "finished_window": 500})
    clock = Clock()
    return build_service(cfg, clock=clock), clock


def test_service_describes_every_input_with_its_source():
    svc, clock = _service()
    inputs = svc.describe()["inputs"]
    assert set(inputs) >= {"steps_per_token", "slo_scale", "classes", "profiles"}
    assert inputs["steps_per_token"]["source"] == "default"
    assert sorted(inputs["steps_per_token"]["value"]) == [0.7, 0.8, 0.9]  # the router's candidate thresholds
    assert inputs["slo_scale"] == {"value": 5.0, "source": "default", "requests": 0, "classes": {}}
    assert {d: e["source"] for d, e in inputs["profiles"].items()} == {1: "configured", 2: "scaled"}
    assert inputs["classes"]["value"] == [] and inputs["classes"]["requests"] == 0
    truth = {0.7: 0.3, 0.8: 0.4, 0.9: 0.6}
    for i in range(40):
        clock.t = i * 0.1
        svc.observe(24, 32)
        th = (0.7, 0.8, 0.9)[i % 3]
        svc.observe_finished(24, 32, round(truth[th] * 32), th, 2.0, 0.5, 1 + i % 2)
    svc.set_profile(2, load_tp_profiles("cpu-tiny-bd", [1])[1].scaled(0.5, name="tiny-tp2-measured"))
    d = svc.describe()
    json.dumps(d)  # served as JSON
    inputs = d["inputs"]
    assert inputs["steps_per_token"]["source"] == "measured" and inputs["steps_per_token"]["requests"] == 40
    assert inputs["steps_per_token"]["value"] == pytest.approx({0.7: 0.3125, 0.8: 0.40625, 0.9: 0.59375}, abs=1e-4)
    assert inputs["slo_scale"]["source"] == "measured" and inputs["slo_scale"]["requests"] == 40
    assert inputs["profiles"][2]["source"] == "measured" and inputs["profiles"][2]["value"]["name"] == \
        "tiny-tp2-measured"
    assert inputs["classes"]["source"] == "measured" and inputs["classes"]["requests"] == 40
    assert inputs["classes"]["value"][0]["input_tokens"] == 24
    assert inputs["finished"]["slo_attainment"] == 1.0


def test_service_queues_events_without_waiting_for_a_solve():
    svc, clock = _service()
    with svc._lock:  # a solve in progress holds the lock
        done = threading.Event()

        def ingress():
            for _ in range(100):
                svc.observe(24, 32)
                svc.observe_finished(24, 32, 10, 0.9, 2.0, 0.5, 1)
            done.set()

        t = threading.Thread(target=ingress)
        t.start()
        assert done.wait(5.0)
        t.join()
    assert len(svc._arrivals) == 100 and len(svc._finished) == 100
    svc.tick()  # the thread's next look hands them to the planner
    assert not svc._arrivals and not svc._finished
    assert svc.planner.inputs.seen == 100 and svc.planner.monitor.arrivals() == 100
