"""The report machinery (sim/report): fidelity checks that can fail, workload variants, small runs."""

from __future__ import annotations

import math

import pytest

from engine.latency_profile import load_profile, load_tp_profiles
from sim.report import checks as ck
from sim.report.instance import PROFILE, extend_budget, poisson_arrivals, rescale_blocks, run_instance
from sim.report.tables import fmt, md_table
from sim.workload import dwise_workload, set_arrivals


# ---- checks -------------------------------------------------------------------------------------------------
def test_littles_law_passes_consistent_and_fails_inconsistent():
    assert ck.littles_law("ok", 50.0, 10.0, 5.0).passed
    assert ck.littles_law("edge", 52.4, 10.0, 5.0).passed  # 4.8% off
    bad = ck.littles_law("bad", 60.0, 10.0, 5.0)  # 20% off
    assert not bad.passed and "20.00%" in bad.detail
    assert not ck.littles_law("nan", math.nan, 10.0, 5.0).passed
    assert not ck.littles_law("empty", 0.0, 0.0, 0.0).passed


T3_SGLANG = {"rounds": 63926, "prefill_only_rounds_frac": 0.946, "prefill_only_time_frac": 0.782,
             "filled_slots_per_round": 5.0}
T3_DWISE = {"rounds": 2819, "prefill_only_rounds_frac": 0.03, "prefill_only_time_frac": 0.112,
            "filled_slots_per_round": 113.2}


def test_fingerprint_accepts_the_papers_table3_and_rejects_a_full_fcfs():
    assert ck.fcfs_fingerprint("paper", T3_SGLANG, T3_DWISE, 128).passed
    full = {**T3_SGLANG, "filled_slots_per_round": 60.0, "prefill_only_rounds_frac": 0.2}
    c = ck.fcfs_fingerprint("mixed fcfs", full, T3_DWISE, 128)
    assert not c.passed and "failed" in c.detail
    assert not ck.fcfs_fingerprint("close rounds", T3_SGLANG, {**T3_DWISE, "rounds": 20000}, 128).passed


def test_same_traces_and_trace_hash():
    a = ck.trace_hash([("r0", 0.0), ("r1", 1.5)])
    assert a == ck.trace_hash([("r1", 1.5), ("r0", 0.0)])  # order-free
    assert a != ck.trace_hash([("r0", 0.0), ("r1", 1.5000001)])
    assert ck.same_traces("ok", {"p": a, "q": a}, {"p": a, "q": a}).passed
    assert not ck.same_traces("different trace", {"p": a, "q": "x"}, {"p": a, "q": "x"}).passed
    assert not ck.same_traces("lost one", {"p": a, "q": a}, {"p": a, "q": ck.trace_hash([("r0", 0.0)])}).passed


def test_seed_spread_and_determinism():
    assert ck.seed_spread("ok", {"slow": [100, 102, 98], "fast": [10, 10.5, 9.5]}).passed
    assert not ck.seed_spread("flip", {"a": [10, 12, 10], "b": [11, 11, 11.5]}).passed
    assert not ck.seed_spread("noisy", {"a": [100, 150, 60], "b": [10, 10, 10]}).passed
    assert not ck.seed_spread("one seed", {"a": [1.0], "b": [2.0]}).passed
    assert ck.seed_spread("higher", {"good": [0.9, 0.91, 0.9], "bad": [0.4, 0.42, 0.41]}, higher_is_better=True).passed
    assert ck.deterministic("same", {"x": 1}, {"x": 1}).passed
    assert not ck.deterministic("diff", {"x": 1}, {"x": 2}).passed


def test_md_table_and_fmt():
    t = md_table(["a", "b"], [[1, "x|y"]])
    assert t.splitlines()[2] == "| 1 | x\\|y |"
    with pytest.raises(ValueError):
        md_table(["a", "b"], [[1]])
    assert fmt(None) == "—" and fmt(float("nan")) == "—" and fmt(0.123, 1, True) == "12.3%" and fmt(63926) == "63,926"


# ---- instance level -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    specs = dwise_workload(64, 3)
    set_arrivals(specs, "burst-poisson", 16.0, 3)
    return specs


def test_instance_runs_satisfy_littles_law_and_keep_the_trace(small):
    prof = load_profile(PROFILE)
    fcfs = run_instance(small, "fcfs-prefill-first", prof)
    dw = run_instance(small, "dwise", prof)
    for run in (fcfs, dw):
        assert ck.littles_law(run.policy, run.little["L"], run.little["X"], run.little["W"], tol=1e-6).passed
        assert run.offered_hash == run.finished_hash and run.summary["requests"] == 64
    assert fcfs.offered_hash == dw.offered_hash
    assert fcfs.rounds["prefill_only_rounds_frac"] > 0.5 > dw.rounds["prefill_only_rounds_frac"]
    assert dw.rounds["filled_slots_per_round"] > fcfs.rounds["filled_slots_per_round"]
    assert dw.summary["mean_latency_s"] < fcfs.summary["mean_latency_s"]


def test_faulty_schedulers_fail_the_checks(small, monkeypatch):
    """A scheduler that silently drops requests fails the trace check; one that stamps finish times wrong
    (half the true time in system) fails Little's law: the in-system time measured from the scheduler's
    held requests no longer matches throughput x the requests' own latencies."""
    from engine.scheduler import Scheduler

    real = Scheduler.update
    prof = load_profile(PROFILE)

    def dropping(self, plan, result):
        done = real(self, plan, result)
        if self.round_id == 40:
            for rid in list(self.requests)[::2]:
                self.abort(rid)
        return done

    monkeypatch.setattr(Scheduler, "update", dropping)
    run = run_instance(small, "fcfs-prefill-first", prof)
    assert run.offered_hash != run.finished_hash

    def misstamping(self, plan, result):
        done = real(self, plan, result)
        for req in done:
            req.finish_time = (req.finish_time + req.arrival) / 2
        return done

    monkeypatch.setattr(Scheduler, "update", misstamping)
    run = run_instance(small, "dwise", prof)
    assert run.offered_hash == run.finished_hash
    c = ck.littles_law("misstamped", run.little["L"], run.little["X"], run.little["W"])
    assert not c.passed, c.detail


def test_prefill_first_variants_keep_prompts_alone(small):
    prof = load_profile(PROFILE)
    for pol in ("mlfq-prefill-first", "ssjf-prefill-first"):
        run = run_instance(small, pol, prof)
        assert run.rounds["prefill_only_rounds_frac"] > 0.5
    mixed = run_instance(small, "mlfq", prof)
    assert mixed.rounds["prefill_only_rounds_frac"] < 0.5


def test_workload_variants(small):
    half = rescale_blocks(small, 16)
    double = rescale_blocks(small, 64)
    for s, h, d in zip(small, half, double):
        assert len(h.block_rounds) == 2 * len(s.block_rounds) and min(h.block_rounds) >= 1
        assert h.true_rounds >= s.true_rounds
        assert d.true_rounds == s.true_rounds and len(d.block_rounds) == math.ceil(len(s.block_rounds) / 2)
    same = extend_budget(small, 256, 0)
    assert [s.block_rounds for s in same] == [s.block_rounds for s in small]
    b1, b2 = extend_budget(small, 1024, 0), extend_budget(small, 2048, 0)
    for s, x, y in zip(small, b1, b2):
        assert s.output_tokens <= x.output_tokens <= y.output_tokens <= 2048
        assert x.block_rounds[:len(s.block_rounds)] == s.block_rounds  # the same request, continued
    assert sum(y.output_tokens for y in b2) > sum(s.output_tokens for s in small)
    arr = [s.arrival for s in poisson_arrivals(small, 4.0, 0)]
    assert arr == sorted(arr) and 8 < arr[-1] < 30  # 63 gaps of mean 0.25 s


# ---- cluster level --------------------------------------------------------------------------------------------
def _cluster_setup(slo_scale: float = 1.0, n: int = 80, rate: float = 30.0):
    import random

    from cluster import RouterConfig
    from sim.cluster import ClusterConfig, ClusterRequestSpec
    from sim.report.cluster_runs import ClusterSetup

    rng = random.Random(1)
    ths = (0.9, 0.8, 0.7)
    t, specs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        steps9 = float(rng.randint(8, 60))
        specs.append(ClusterRequestSpec(f"r{i}", i, "prose", t, rng.randint(40, 200), 256,
                                        (steps9, max(8.0, steps9 * 0.8), max(8.0, steps9 * 0.6)),
                                        (True, True, False), slo_scale * 3.0))
    rcfg = RouterConfig(thresholds=ths)
    profiles = load_tp_profiles("h200-llada8b-measured", [1, 2])
    cfg = ClusterConfig((2, 1, 1), 32, 32, 396, router=rcfg)
    return ClusterSetup(None, None, rcfg, profiles, specs, cfg, rate, 0)


def test_cluster_runs_littles_law_traces_and_slo_independence():
    from sim.report.cluster_runs import run_combo

    st = _cluster_setup()
    runs = {c: run_combo(st, c, accuracy=False) for c in ("infaas/fcfs", "remask/dwise", "remask-no-migration/dwise")}
    for c, run in runs.items():
        assert ck.littles_law(c, run.little["L"], run.little["X"], run.little["W"]).passed, c
        assert run.finished_hash == st.offered_hash
    assert runs["remask-no-migration/dwise"].summary["migrations"] == 0
    # a fixed-threshold router with FCFS instances never reads SLOs: doubling them changes no latency
    loose = run_combo(_cluster_setup(slo_scale=2.0), "infaas/fcfs", accuracy=False)
    assert loose.latencies == runs["infaas/fcfs"].latencies
    assert loose.attainment() == pytest.approx(runs["infaas/fcfs"].attainment(2.0))


def test_combined_verdicts():
    from sim.report.render_cluster import verdicts

    def s(slo, lat):
        return {"slo_attainment": slo, "mean_latency_s": lat, "p99_latency_s": lat * 2, "filled_slots_per_round": 10}

    data = {"cluster_rates": {  # by load (a multiple of the capacity), its rate in cluster_rates_info
        "0.8": {"remask/dwise": s(0.90, 3.0), "remask/fcfs": s(0.90, 3.01), "infaas/dwise": s(0.5, 3.5)},
        "1": {"remask/dwise": s(0.80, 3.0), "remask/fcfs": s(0.85, 3.0), "infaas/dwise": s(0.5, 3.5)},
        "1.1": {"remask/dwise": s(0.80, 2.0), "remask/fcfs": s(0.70, 3.0), "infaas/dwise": s(0.5, 3.5)}},
        "cluster_rates_info": {"0.8": {"rate": 40.0}, "1": {"rate": 50.0}, "1.1": {"rate": 55.0}}}
    v = {x["scenario"]: x for x in verdicts(data)}
    assert v["load 0.8 (40.0 req/s)"]["ok"] and v["load 0.8 (40.0 req/s)"]["verdict"].startswith("ties")
    assert v["load 1 (50.0 req/s)"]["ok"] is False and v["load 1 (50.0 req/s)"]["verdict"] == "loses on SLO"
    assert v["load 1.1 (55.0 req/s)"]["verdict"] == "wins on SLO and mean latency"


@pytest.mark.slow
def test_tiny_report_instance_sections(tmp_path):
    from sim.report.experiments import run_all
    from sim.report.render import all_checks, write_report
    from sim.report.sizes import TINY

    r = run_all(TINY, progress=False, only={"instance", "instance_seeds"})
    path = write_report(r, tmp_path, "test", 1.0, 1.0)
    text = path.read_text()
    checks = {c.name: c for c in all_checks(r)}
    assert checks["Little's law on every run (L = X W within 5%)"].passed
    assert checks["identical arrival traces across policies (and every request finished)"].passed
    assert "DWISE Table 3" in text and "545.5" in text  # the paper's figure beside Remask's
    assert (tmp_path / "round_composition.png").stat().st_size > 10_000
    assert (tmp_path / "results.json").exists()


def test_accuracy_estimate_with_sampled_replays(monkeypatch):
    """Mixed-threshold requests whose thresholds agree in the table take that answer corrected by sampled
    replays; those that disagree are replayed; with every replay allowed the result is exact."""
    from sim.cluster import ClusterRequestSpec, ClusterResult
    from sim.report import cluster_runs
    from sim.threshold_table import ThresholdTable

    ths = (0.9, 0.8, 0.7)
    correct = ((True, True, True), (True, False, False), (False, False, False))
    table = ThresholdTable("m", ths, ("a", "b", "c"), ("prose",) * 3, ((4, 3, 2),) * 3, correct)
    fins, truth = [], {}
    for k in range(60):
        p = k % 3
        sched = [(0.0, 0.9)] if k < 6 else [(0.0, 0.9), (0.5, 0.7)]
        spec = ClusterRequestSpec(f"r{k}", p, "prose", 0.0, 40, 256, (4.0, 3.0, 2.0), correct[p], 1.0)
        fins.append((spec, 1.0, sched))
        truth[f"r{k}"] = correct[p][0] if k < 6 or p != 1 else (k % 2 == 0)  # p1 mixed: half right when replayed

    def fake_replays(table_, finished, model):
        return [truth[f[0].req_id] for f in finished]

    monkeypatch.setattr(cluster_runs, "accuracy_of", fake_replays)
    res = ClusterResult(finished=fins)
    exact = sum(truth.values()) / len(truth)
    acc, half, scope = cluster_runs.estimate_accuracy(table, res, "m", None, 0)
    assert acc == pytest.approx(exact) and half == 0.0
    acc, half, scope = cluster_runs.estimate_accuracy(table, res, "m", 30, 0)
    assert acc == pytest.approx(exact)  # the disagreeing ones all replayed; the agreeing ones' answers hold
    assert half > 0 and "corrected" in scope
    truth.update({f"r{k}": not truth[f"r{k}"] for k in range(6, 60) if k % 3 == 0})  # replays contradict the table
    acc, half, _ = cluster_runs.estimate_accuracy(table, res, "m", 30, 0)
    assert abs(acc - sum(truth.values()) / len(truth)) <= half  # unbiased, and the interval says how far off
