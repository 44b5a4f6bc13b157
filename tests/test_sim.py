from __future__ import annotations

import json

import pytest

from engine.latency_profile import LatencyProfile, load_profile
from sim.scenarios import run_scenario
from sim.workload import dwise_workload, set_arrivals, spearman
from tools.cli import main


def test_dwise_workload_matches_the_paper_shape():
    specs = dwise_workload(2000, seed=1)
    rounds = sorted(s.true_rounds for s in specs)
    n = len(rounds)
    assert 10 <= rounds[n // 4] <= 20 and 35 <= rounds[n // 2] <= 55 and 125 <= rounds[int(0.9 * n)] <= 170
    assert rounds[-1] <= 279
    true = [s.true_rounds for s in specs]
    assert abs(spearman([s.admission_est for s in specs], true) - 0.74) < 0.03
    assert abs(spearman([s.refined_est for s in specs], true) - 0.87) < 0.03
    set_arrivals(specs, "burst-poisson", rate=16.0)
    assert sum(s.arrival == 0 for s in specs) == 1000 and max(s.arrival for s in specs) > 30
    with pytest.raises(ValueError):
        set_arrivals(specs, "nope")


def test_simulated_policies_order_as_in_the_paper():
    report = run_scenario("dwise-burst-poisson", ["fcfs-prefill-first", "dwise", "oracle"], 600, seed=3)
    p = report["policies"]
    assert p["fcfs-prefill-first"]["prefill_only_round_frac"] > 0.8
    assert p["dwise"]["filled_slots_per_round"] > p["fcfs-prefill-first"]["filled_slots_per_round"]
    assert p["oracle"]["mean_latency_s"] <= p["dwise"]["mean_latency_s"] < p["fcfs-prefill-first"]["mean_latency_s"]
    assert all(v["requests"] == 600 for v in p.values())


def test_simulate_cli_prints_json(capsys):
    assert main(["simulate", "--scenario", "dwise-burst", "--policies", "fcfs-mixed,dwise", "--requests", "200",
                 "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"mean_latency_s", "p50_latency_s", "p99_latency_s", "mean_ttft_s", "throughput_rps", "rounds",
            "prefill_only_round_frac", "filled_slots_per_round"}
    assert out["scenario"] == "dwise-burst" and keys <= set(out["policies"]["dwise"])
    assert main(["simulate", "--scenario", "nope", "--requests", "10", "--quiet"]) == 2
    assert main(["simulate", "--policies", "nope", "--requests", "10", "--quiet"]) == 2


def test_bench_scheduler_cli(capsys):
    assert main(["bench", "scheduler", "--slots", "16", "--resident", "64", "--rounds", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["resident"] == 64 and out["median_ms_per_round"] > 0


def test_profiles_interpolate_and_fail_clearly(tmp_path):
    prof = load_profile("h200-llada8b-measured")  # measured on an H200 (scripts/h200_check.sh), context 96
    assert prof.meta["device"] == "NVIDIA H200" and prof.meta["commit"] == "6cd9128"
    # priced by the model fitted to every measured round (tests/test_latency_model.py: within 10% of each)
    assert prof.round_ms([("denoise", 32, 96)]) == pytest.approx(7.233, rel=0.02)
    assert prof.round_ms([("denoise", 32, 96)] * 32) == pytest.approx(37.151, rel=0.02)
    assert prof.round_ms([("recompute", 128, 0)] * 16) == pytest.approx(135.897, rel=0.02)
    assert prof.round_ms([("denoise", 32, 10096)]) > prof.round_ms([("denoise", 32, 96)])
    assert prof.curve("prefill") == prof.curves["denoise"]  # a full-sequence model's profile: no prefill curve
    only_recompute = LatencyProfile("r", {"recompute": [(128, 9.0), (256, 12.0)]})  # too few points: the fallback
    assert only_recompute.round_ms([("recompute", 128, 0)]) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="no 'denoise' curve and no block-step curve .*it has recompute"):
        only_recompute.round_ms([("denoise", 32, 0)])
    costs = prof.step_costs(32, 396)
    assert costs.recompute > costs.cached
    with pytest.raises(FileNotFoundError, match="known"):
        load_profile("nope")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "curves": {"denoise": [[5, 1], [2, 3]]}}')
    with pytest.raises(ValueError, match="corrupt"):
        load_profile(str(bad))
    with pytest.raises(ValueError):
        LatencyProfile("x", {"warp": [(1, 1)]})


@pytest.mark.slow
def test_model_in_the_loop_runs_the_real_engine(tok):
    from engine.clock import VirtualClock
    from engine.engine import Engine
    from engine.scheduler import Scheduler, SchedulerConfig
    from sim.model_runner import ModelInTheLoopRunner
    from sim.simulator import simulate
    from sim.workload import SimRequestSpec
    from tests.builders import make_model

    model = make_model()
    prompts = ["12+5=", "rev: abc", "story: cat 2", "x", "max: a1 b2 c3 d4"]
    ref = Engine(model, tok).generate(prompts)
    prof = load_profile("h200-llada8b-measured")
    results = {}
    for policy in ("fcfs-prefill-first", "dwise"):
        specs = [SimRequestSpec(f"r{i}", "x", 0.0, len(p), [o.rounds], o.rounds, o.rounds, 8.0, 8,
                                extra={"prompt": p, "check": (lambda text, o=o: text == o.text)})
                 for i, (p, o) in enumerate(zip(prompts, ref))]
        clock = VirtualClock()
        engine = Engine(model, tok, max_slots=2)
        sched = Scheduler(policy, SchedulerConfig(slots=2, block_size=8), clock)
        stats = simulate(specs, sched, ModelInTheLoopRunner(engine, prof), clock)
        assert stats.correct == [True] * len(prompts)  # same tokens as the plain engine, any order
        assert clock.now() > 0 and not engine.sequences
        results[policy] = stats
    assert results["dwise"].rounds <= results["fcfs-prefill-first"].rounds
