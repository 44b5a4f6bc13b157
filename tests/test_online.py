"""Online learners (predictors/online.py): priors, refits, the swap rule, bounded memory, the refit thread."""

from __future__ import annotations

import gc
import statistics
import threading
import time
import tracemalloc

import numpy as np
import pytest

from predictors.online import OnlineAdmissionLearner, OnlineStepLearner, RefitWorker, mape

TS = (0.9, 0.8, 0.7)
BLOCKS, OUT = 8, 256


def request(rng: np.random.Generator, threshold: float | None = None, rows_every: int = 1):
    """A finished request with a known relation: a request commits ``rate`` tokens a step, 2 to 12 at 0.9
    (its kind), 1.5x at 0.8 and 2x at 0.7; its rows are ``step_row``'s fields after each step but the last."""
    t = float(rng.choice(TS)) if threshold is None else threshold
    rate = float(rng.choice([2.0, 4.0, 12.0])) * {0.9: 1.0, 0.8: 1.5, 0.7: 2.0}[t]
    total = int(np.ceil(OUT / rate))
    rows, done = [], []
    for k in range(1, total, rows_every):
        p = min(k * rate / OUT, 1.0)
        b = min(int(p * BLOCKS), BLOCKS)
        rows.append([t, OUT, p, p * BLOCKS - b, BLOCKS - b, k % 4, 0.0, 0.0, 0.0, 0.0, 0.0])
        done.append(k)
    return rows, done, total


def truth(learner_rows) -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([np.asarray(r, float) for r, _, _ in learner_rows])
    y = np.concatenate([t - np.asarray(d, float) for _, d, t in learner_rows])
    return x, y


def test_prior_before_any_data_is_one_token_per_step():
    learner = OnlineStepLearner(TS)
    rows = [[0.9, 256, 0.25, 0.0, 6, 0, 0, 0, 0, 0, 0], [0.7, 128, 0.0, 0.0, 4, 0, 0, 0, 0, 0, 0],
            [0.8, 256, 1.0, 1.0, 0, 3, 0, 0, 0, 0, 0]]
    assert learner.predict_rows(rows).tolist() == [192.0, 128.0, 1.0]  # never under one step
    assert learner.predict_rows([]).shape == (0,)
    d = learner.describe()
    assert d["source"] == "prior" and d["version"] == 0 and d["trained_on"] == 0 and d["requests_seen"] == 0
    assert not learner.due()


def test_prior_measures_tokens_per_step_and_lower_thresholds_never_commit_less():
    learner = OnlineStepLearner(TS, min_requests=1000)
    rng = np.random.default_rng(0)
    for _ in range(20):
        learner.record(*request(rng, threshold=0.9))
    assert learner.source == "prior"
    # rates 2, 4, 12 at 0.9: the ratio of sums over their steps
    assert 2.0 < learner.tokens_per_step(0.9) < 12.0
    assert learner.tokens_per_step(0.7) == learner.tokens_per_step(0.9)  # not measured: the higher one's bound
    row = [0.9, 256, 0.5, 0.0, 4, 0, 0, 0, 0, 0, 0]
    assert learner.predict_rows([row])[0] == pytest.approx(128 / learner.tokens_per_step(0.9))
    for _ in range(20):
        learner.record(*request(rng, threshold=0.7))
    assert learner.tokens_per_step(0.7) > learner.tokens_per_step(0.9)
    assert learner.tokens_per_step(0.8) == learner.tokens_per_step(0.9)  # the nearest measured higher one


def test_online_model_beats_the_prior_after_enough_requests():
    rng = np.random.default_rng(1)
    learner = OnlineStepLearner(TS, refit_every=50, min_requests=100)
    seen = []
    for _ in range(160):
        req = request(rng)
        seen.append(req)
        learner.record(*req)
        if learner.due():
            rec = learner.refit()
            assert rec["new"]["mape"] < rec["in_service"]["mape"]
    assert learner.source == "online" and learner.version >= 1 and len(learner.history) == 2
    assert learner.history[0]["requests_seen"] == 100 and learner.history[0]["trained_on"] == 80
    fresh = [request(rng) for _ in range(60)]
    x, y = truth(fresh)
    prior = OnlineStepLearner(TS, min_requests=1000)
    for req in seen:
        prior.record(*req)  # the same measurements, no model
    got, base = mape(learner.predict_rows(x), y), mape(prior.predict_rows(x), y)
    assert got < 0.5 * base, (got, base)
    assert (learner.predict_rows(x) >= 1.0).all()
    d = learner.describe()
    assert set(d) >= {"source", "version", "trained_on", "spearman_recent", "mape_recent"}
    assert d["source"] == "online" and d["trained_on"] == learner.history[-1]["trained_on"]
    assert d["spearman_recent"] > 0.8 and d["mape_recent"] < base


def test_a_worse_refit_is_not_swapped_in():
    class Constant:
        def predict_rows(self, rows):
            return np.full(len(rows), 40.0)

    class Spoilt(OnlineStepLearner):
        bad = False

        def _fit(self, x, y):
            return Constant() if self.bad else super()._fit(x, y)

    rng = np.random.default_rng(2)
    learner = Spoilt(TS, refit_every=50, min_requests=100)
    for _ in range(100):
        learner.record(*request(rng))
    assert learner.refit()["swapped"] and learner.version == 1
    good = learner._served
    learner.bad = True
    for _ in range(50):
        learner.record(*request(rng))
    assert learner.due()
    rec = learner.refit()
    assert not rec["swapped"] and rec["new"]["mape"] > rec["in_service"]["mape"]
    assert learner._served is good and learner.version == 1 and learner.source == "online"
    assert not learner.due()  # the next after refit_every more


def test_a_shipped_model_serves_until_an_online_one_beats_it():
    from predictors.step import StepPredictor

    rng = np.random.default_rng(3)
    x, y = truth([request(rng) for _ in range(200)])
    shipped = StepPredictor.fit(x, y)
    learner = OnlineStepLearner(TS, start=shipped, min_requests=100)
    row = x[:5]
    assert learner.source == "shipped" and np.allclose(learner.predict_rows(row), shipped.predict_rows(row))
    for _ in range(100):
        learner.record(*request(rng))
    rec = learner.refit()
    assert rec["in_service"]["mape"] is not None  # the shipped model was scored on the holdout
    assert learner.source == ("online" if rec["swapped"] else "shipped")


def test_window_is_bounded_and_memory_stays_flat():
    rng = np.random.default_rng(4)
    reqs = [(np.asarray(r), np.asarray(d), t) for r, d, t in (request(rng) for _ in range(50))]
    learner = OnlineStepLearner(TS, window=300, min_requests=10_000)
    gc.collect()
    tracemalloc.start()
    try:
        sizes = []
        for i in range(5000):
            learner.record(*reqs[i % len(reqs)])
            if i in (1499, 4999):
                gc.collect()
                sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert len(learner._reqs) == 300 and learner.seen == 5000
    assert sizes[1] < sizes[0] * 1.05 + 64_000, sizes  # the window was full at 1,500: no growth after


def test_due_follows_the_schedule():
    rng = np.random.default_rng(5)
    learner = OnlineStepLearner(TS, refit_every=100, min_requests=25, early=(25, 50))
    due_at = []
    for i in range(1, 260):
        learner.record(*request(rng))
        if learner.due():
            due_at.append(i)
            learner._fitted_at = learner.seen  # as a refit does, without fitting
    assert due_at == [25, 50, 150, 250]


def test_admission_learner_prior_is_one_round_per_block_then_it_learns():
    rng = np.random.default_rng(6)
    learner = OnlineAdmissionLearner(default_blocks=8, refit_every=50, min_requests=100)
    assert learner.predict_one([10, 0, 40, 0.9]) == 8.0 and learner.predict_one([10, 0, 40, 0.9], blocks=3) == 3.0
    assert learner.predict([[10, 0, 40, 0.9]] * 2, blocks=[2, 4]).tolist() == [2.0, 4.0]
    d = learner.describe()
    assert d["source"] == "prior" and "one round per" in d["prior"]

    def prompt():  # rounds grow with the prompt's words and fall with the threshold
        words = float(rng.integers(1, 60))
        t = float(rng.choice(TS))
        return [words, float(rng.integers(0, 3)), 4 * words, t], (8 + 3 * words) * (1.0 if t == 0.9 else 0.7)

    for _ in range(100):
        row, rounds = prompt()
        learner.record(row, rounds, blocks=8)
    rec = learner.refit()
    assert rec["swapped"] and learner.source == "online" and rec["new"]["mape"] < rec["in_service"]["mape"]
    test = [prompt() for _ in range(100)]
    pred = np.array([learner.predict_one(r) for r, _ in test])
    true = np.array([t for _, t in test])
    assert mape(pred, true) < 0.25 and mape(pred, true) < mape(np.full(100, 8.0), true)
    assert np.allclose(pred, learner.predict([r for r, _ in test]), rtol=1e-6)
    assert "prior" not in learner.describe()


def test_refit_worker_fits_off_the_calling_thread():
    rng = np.random.default_rng(7)
    reqs = [request(rng, rows_every=1) for _ in range(60)]
    learner = OnlineStepLearner(TS, refit_every=400, min_requests=400, window=3000)
    for i in range(400):
        learner.record(*reqs[i % len(reqs)])
    started, release = threading.Event(), threading.Event()
    fit = learner._fit

    def slow_fit(x, y):  # a real LightGBM fit, held open until the caller has measured
        started.set()
        model = fit(x, y)
        release.wait(10)
        return model

    learner._fit = slow_fit
    worker = RefitWorker(learner)
    try:
        caller = threading.get_ident()
        t0 = time.perf_counter()
        worker.notify()
        notify_s = time.perf_counter() - t0
        assert started.wait(30)
        assert worker._thread.ident != caller
        times = []
        for i in range(200):  # the event loop keeps recording (and predicting) while the fit runs
            t0 = time.perf_counter()
            learner.record(*reqs[i % len(reqs)])
            worker.notify()
            times.append(time.perf_counter() - t0)
        assert learner.predict_rows(reqs[0][0][:3]).shape == (3,)
        assert notify_s < 0.005
        assert statistics.median(times) < 0.001, statistics.median(times)
        assert learner.source == "prior"  # not swapped until the fit is done
        release.set()
        deadline = time.time() + 30
        while learner.version == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert learner.source == "online" and worker.refits >= 1 and worker.errors == 0
    finally:
        release.set()
        worker.stop()
    assert not worker.alive


def test_refit_worker_survives_a_failing_fit():
    learner = OnlineStepLearner(TS, min_requests=2, refit_every=1)

    def boom(x, y):
        raise RuntimeError("no")

    learner._fit = boom
    rng = np.random.default_rng(8)
    worker = RefitWorker(learner)
    try:
        for _ in range(3):
            learner.record(*request(rng))
        worker.notify()
        deadline = time.time() + 10
        while worker.errors == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert worker.errors == 1 and worker.alive and learner.source == "prior"
    finally:
        worker.stop()


def test_online_step_estimator_in_the_router():
    from cluster import OnlineStepEstimator, RequestState

    learner = OnlineStepLearner(TS)
    est = OnlineStepEstimator(learner, TS)
    s = RequestState("a", 0.0, 10.0, 40, 256, 32)
    s.progress = 0.5
    assert est.predict([s]) == [[128.0, 128.0, 128.0]]
    assert not est.ready and est.describe()["source"] == "prior"

    class Adm:
        source = "online"

        def predict_one(self, row):
            return 10.0 * row[-1]

        def describe(self):
            return {"source": "online"}

    est = OnlineStepEstimator(learner, TS, admission=Adm())
    fresh = RequestState("b", 0.0, 10.0, 40, 256, 32, extra={"admission": (3.0, 0.0, 40.0)})
    assert est.predict([fresh, s]) == [[9.0, 8.0, 7.0], [128.0, 128.0, 128.0]]
    fresh.steps_done = 1
    assert est.predict([fresh])[0] == [256.0] * 3  # stepped: the step learner answers


def test_table_estimator_memory_is_bounded():
    from cluster import RequestState, TableStepEstimator

    est = TableStepEstimator(TS, lambda s: (10.0, 8.0, 6.0), max_requests=50)
    for i in range(500):
        est.predict([RequestState(f"r{i}", 0.0, 1.0, 10, 64, 32)])
    assert len(est._z) == 50 and "r499" in est._z and "r0" not in est._z
    est.forget("r499")  # Router.finish calls it
    assert "r499" not in est._z
