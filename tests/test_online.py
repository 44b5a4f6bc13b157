"""Online learners (predictors/online.py): priors, refits, the swap rule, bounded memory; the refit worker
(predictors/refit_worker.py)."""

from __future__ import annotations

import gc
import os
import signal
import statistics
import time
import tracemalloc

import numpy as np
import pytest

from predictors.online import OnlineAdmissionLearner, OnlineStepLearner, mape
from predictors.refit_worker import RefitWorker
from tests.builders import LEARNER_BLOCKS, LEARNER_OUT, LEARNER_TS, learner_request

TS, BLOCKS, OUT = LEARNER_TS, LEARNER_BLOCKS, LEARNER_OUT  # learner_request's


def request(rng: np.random.Generator, threshold: float | None = None, rows_every: int = 1):
    """A finished request with a known relation: a request commits ``rate`` tokens a step, 2 to 12 at 0.9
    (its kind), 1.5x at 0.8 and 2x at 0.7; its rows are ``step_row``'s fields after each step but the last."""
    return learner_request(rng, threshold, rows_every=rows_every)


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

        def _fit(self, x, y, n_refits):
            return Constant() if self.bad else super()._fit(x, y, n_refits)

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


@pytest.mark.slow
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
    # the arrival estimates' measured error, which admission gives an arrival the benefit of
    assert learner.holdout_mape == rec["mape"] == rec["new"]["mape"]
    from cluster.estimator import OnlineStepEstimator

    est = OnlineStepEstimator(OnlineStepLearner(), TS, admission=learner)
    assert est.arrival_error == rec["mape"]
    assert OnlineStepEstimator(OnlineStepLearner(), TS, admission=OnlineAdmissionLearner()).arrival_error == 0.0


class SlowFit(OnlineStepLearner):
    """Fits as usual, and takes at least a second doing it (in the worker process)."""

    def _fit(self, x, y, n_refits):
        t0 = time.perf_counter()
        model = super()._fit(x, y, n_refits)
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
        return model


class FailingFit(OnlineStepLearner):
    def _fit(self, x, y, n_refits):
        raise RuntimeError("no fit today")


class HangingFit(OnlineStepLearner):
    def _fit(self, x, y, n_refits):
        time.sleep(120)
        return super()._fit(x, y, n_refits)


def wait_for(cond, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow
def test_refit_worker_fits_in_another_process_and_swaps_as_refit_does():
    rng = np.random.default_rng(7)
    reqs = [request(rng) for _ in range(60)]
    learner = SlowFit(TS, refit_every=100, min_requests=100, window=3000)
    twin = OnlineStepLearner(TS, refit_every=100, min_requests=100, window=3000)  # the same, refit in place
    for i in range(100):
        learner.record(*reqs[i % len(reqs)])
        twin.record(*reqs[i % len(reqs)])
    worker = RefitWorker(learner)
    try:
        assert worker.pid not in (None, os.getpid())
        t0 = time.perf_counter()
        worker.notify()
        notify_s = time.perf_counter() - t0
        wait_for(lambda: learner._fitted_at == 100)  # the job is on its way, with the first 100 requests
        times = []
        while not learner.history:  # the event loop keeps recording and predicting while the fit runs
            if len(times) < 50:
                t0 = time.perf_counter()
                learner.record(*reqs[len(times) % len(reqs)])
                learner.predict_rows(reqs[0][0][:3])
                times.append(time.perf_counter() - t0)
            time.sleep(0.001)
        assert len(times) == 50, "the fit ended before the loop had recorded 50 requests"
        assert notify_s < 0.005 and statistics.median(times) < 0.002, (notify_s, statistics.median(times))
        rec = learner.history[0]
        # the fit (a second at least) ran in the worker: this process spent a small part of that on the job
        assert rec["fit_s"] >= 1.0 and rec["parent_cpu_s"] < 0.2, rec
        assert rec["requests_seen"] == 100 and rec["swapped"] and learner.source == "online" and learner.version == 1
        ref = twin.refit()  # the same data and seed in this process: the same scores and the same model
        assert {k: rec[k] for k in ref if k != "fit_s"} == {k: v for k, v in ref.items() if k != "fit_s"}
        x, _ = truth(reqs[:20])
        assert np.allclose(learner.predict_rows(x), twin.predict_rows(x))
        # the next job sends only the requests recorded since; the worker's copy holds the model in service (v1)
        for i in range(150):
            if i >= 50:
                learner.record(*reqs[i % len(reqs)])
            twin.record(*reqs[i % len(reqs)])
        assert learner.due() and twin.due()
        worker.notify()
        wait_for(lambda: len(learner.history) >= 2)
        ref = twin.refit()
        rec = learner.history[1]
        assert {k: rec[k] for k in ref if k != "fit_s"} == {k: v for k, v in ref.items() if k != "fit_s"}, (rec, ref)
        assert rec["requests_seen"] == 250
        assert rec["in_service"]["mape"] is not None and learner.version == twin.version
        assert worker.errors == 0 and worker.restarts == 0 and worker.refits == 2
    finally:
        worker.stop()
    assert not worker.alive and worker._proc.poll() is not None


def test_admission_models_cross_the_pipe_intact():
    from predictors.refit_worker import _portable, _rebuild

    rng = np.random.default_rng(9)
    learner = OnlineAdmissionLearner(min_requests=50)
    for _ in range(60):
        words = float(rng.integers(1, 60))
        learner.record([words, 0.0, 4 * words, 0.9], 8 + 3 * words, blocks=8)
    learner.refit()
    model = learner._served.model
    copy = _rebuild(_portable(model))
    rows = [[float(w), 1.0, 4.0 * w, 0.8] for w in range(1, 60, 7)]
    assert [copy.predict_one(r) for r in rows] == [model.predict_one(r) for r in rows]
    assert np.array_equal(copy.predict(rows), model.predict(rows))


@pytest.mark.slow
def test_refit_worker_scores_a_shipped_admission_model_as_refit_does():
    from predictors.admission import AdmissionPredictor

    rng = np.random.default_rng(11)

    def prompt():
        words = float(rng.integers(1, 60))
        return [words, 0.0, 4 * words, 0.9], 8 + 3 * words + float(rng.integers(0, 4))

    x, y = zip(*(prompt() for _ in range(100)))
    shipped = AdmissionPredictor.fit(np.asarray(x), np.asarray(y))
    learner = OnlineAdmissionLearner(start=shipped, min_requests=60, refit_every=60)
    twin = OnlineAdmissionLearner(start=shipped, min_requests=60, refit_every=60)
    for _ in range(60):
        row, rounds = prompt()
        learner.record(row, rounds, blocks=8)
        twin.record(row, rounds, blocks=8)
    worker = RefitWorker(learner)
    try:
        worker.notify()
        wait_for(lambda: learner.history or worker.errors)
    finally:
        worker.stop()
    ref = twin.refit()
    rec = learner.history[0]
    assert {k: rec[k] for k in ref if k != "fit_s"} == {k: v for k, v in ref.items() if k != "fit_s"}, (rec, ref)
    assert learner.source == twin.source and learner.version == twin.version
    row = [30.0, 0.0, 120.0, 0.9]
    assert learner.predict_one(row) == pytest.approx(twin.predict_one(row))


@pytest.mark.parametrize("sched, policy", [(None, "SCHED_IDLE"), ("idle", "SCHED_IDLE"), ("normal", "SCHED_OTHER")])
def test_the_refit_worker_yields_the_cpu_unless_told_otherwise(monkeypatch, sched, policy):
    """The worker process's CPU policy (``apply_cpu_policy``, the first thing it does), in a forked child: idle by
    default (serving comes first); ``REMASK_REFIT_SCHED=normal`` (what the test suite sets) leaves it normal."""
    from predictors.refit_worker import SCHED_ENV, apply_cpu_policy

    if sched is None:
        monkeypatch.delenv(SCHED_ENV, raising=False)
    else:
        monkeypatch.setenv(SCHED_ENV, sched)
    pid = os.fork()
    if pid == 0:  # the child: exits with its policy's number
        try:
            apply_cpu_policy()
            os._exit(os.sched_getscheduler(0))
        finally:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == getattr(os, policy)


def test_refit_worker_logs_a_failing_fit_and_keeps_the_model(caplog):
    learner = FailingFit(TS, min_requests=2, refit_every=1)
    rng = np.random.default_rng(8)
    worker = RefitWorker(learner)
    try:
        for _ in range(3):
            learner.record(*request(rng))
        worker.notify()
        # the count goes up just before the traceback is logged (the learner's thread): wait for both
        wait_for(lambda: worker.errors >= 1 and "no fit today" in caplog.text)
        assert worker.alive and learner.source == "prior" and not learner.history
    finally:
        worker.stop()


@pytest.mark.slow
def test_refit_worker_restarts_a_dead_process():
    rng = np.random.default_rng(10)
    learner = OnlineStepLearner(TS, min_requests=20, refit_every=20)
    worker = RefitWorker(learner)
    try:
        first = worker.pid
        os.kill(first, signal.SIGKILL)
        for _ in range(20):
            learner.record(*request(rng))
        worker.notify()
        wait_for(lambda: learner.history or worker.errors)
        if worker.errors:  # the job went to the dead process: counted, and the next one starts another
            for _ in range(20):
                learner.record(*request(rng))
            worker.notify()
            wait_for(lambda: learner.history)
        assert worker.pid != first and worker.restarts == 1 and learner.source == "online"
    finally:
        worker.stop()


def test_refit_worker_ends_a_process_that_does_not_answer():
    rng = np.random.default_rng(12)
    learner = HangingFit(TS, min_requests=2, refit_every=2)
    worker = RefitWorker(learner, timeout_s=3.0)
    try:
        first = worker.pid
        for _ in range(2):
            learner.record(*request(rng))
        worker.notify()
        wait_for(lambda: worker.errors >= 1, 30)
        assert not alive(first) and learner.source == "prior"  # ended; the learner serves what it had
        for _ in range(2):
            learner.record(*request(rng))
        worker.notify()
        wait_for(lambda: worker.restarts == 1, 30)  # the next job starts another process
        assert worker.pid != first
    finally:
        worker.stop()


ORPHAN = """
import sys, time
import numpy as np
sys.path.insert(0, {root!r})
from predictors.online import OnlineStepLearner
from predictors.refit_worker import RefitWorker
worker = RefitWorker(OnlineStepLearner((0.9,)))
print(worker.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_the_worker_process_exits_with_its_parent():
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN.format(root=root)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()  # no chance to clean up
        parent.wait()
        wait_for(lambda: not alive(child), 10)
    finally:
        if parent.poll() is None:
            parent.kill()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


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


def rule_request(rng: np.random.Generator, rule: str):
    """``request``'s relation, with ``credit`` committing twice the tokens a step of ``threshold`` commits at the
    same level (half the steps): rows of the 11 step features, the rule passed beside them."""
    return learner_request(rng, faster=2.0 if rule == "credit" else 1.0)


def test_the_step_learner_learns_steps_per_rule_and_knob():
    """Two rules at the same levels, one needing half the steps of the other: after a refit the online model
    (13 columns: the rule's code and knob) predicts each rule's own remaining steps for the same state, in the
    router too (``decoding_row``)."""
    from cluster import OnlineStepEstimator, RequestState
    from cluster.thresholds import decoding_row
    from predictors.features import rule_code, with_decoding

    rng = np.random.default_rng(2)
    learner = OnlineStepLearner(TS, min_requests=100, max_rows=4000)
    for i in range(120):
        rule = ("threshold", "credit")[i % 2]
        learner.record(*rule_request(rng, rule), decoding=rule)
    rec = learner.refit()
    assert rec["swapped"] and learner.source == "online" and learner._served.model.width == 13  # rule columns read
    # the prior measured each rule's tokens a step apart (less than twice: a request's last step commits what is left)
    assert learner.tokens_per_step(0.9, "credit") > 1.5 * learner.tokens_per_step(0.9)
    assert set(learner.describe()["tokens_per_step_by_rule"]) == {"threshold", "credit"}
    for rule in ("threshold", "credit"):
        fresh = [rule_request(rng, rule) for _ in range(30)]
        x, y = truth(fresh)
        assert mape(learner.predict_rows(with_decoding(x, rule)), y) < 0.35, rule
    state = [0.9, OUT, 0.25, 0.0, 6, 1, 0.0, 0.0, 0.0, 0.0, 0.0]
    slow, fast = learner.predict_rows(with_decoding([state], "threshold"))[0], learner.predict_rows(
        with_decoding([state], "credit"))[0]
    assert 1.5 < slow / fast < 2.6, (slow, fast)  # half the steps, not one answer for both
    est = OnlineStepEstimator(learner, TS, row=decoding_row)
    a, b = RequestState("a", 0.0, 10.0, 40, OUT, 32), RequestState("b", 0.0, 10.0, 40, OUT, 32, decoding="credit")
    for s in (a, b):
        s.progress, s.blocks_left, s.step_in_block = 0.25, 6, 1
    ea, eb = est.predict([a, b])
    assert all(1.5 < p / q < 2.6 for p, q in zip(ea, eb)), (ea, eb)
    assert decoding_row(b, 0.8)[-2:] == [rule_code("credit"), 0.8]  # the columns recorded: code, knob at the level


def test_threshold_only_traffic_fits_the_eleven_step_features():
    """One rule in the window: the fit reads the 11 step features (the rule's columns say nothing new), so
    threshold-only traffic gets the model it got before rules had columns; rows recorded with the rule, without
    one, or already carrying its columns are the same rows."""
    from cluster.learning import LiveLearning
    from predictors.features import with_decoding

    rng = np.random.default_rng(3)
    reqs = [request(rng) for _ in range(120)]
    a, b = OnlineStepLearner(TS, min_requests=100), OnlineStepLearner(TS, min_requests=100)
    live = LiveLearning(b, OnlineAdmissionLearner(), learn=False)
    for rows, done, total in reqs:
        a.record(rows, done, total)
        live.finished(with_decoding(rows, "threshold").tolist(), done, total, [1.0, 0.0, 4.0, 0.9], BLOCKS, None,
                      decoding="threshold")
    a.refit(), b.refit()
    assert a._served.model.width == 11 == b._served.model.width
    x, _ = truth(reqs[:10])
    assert np.array_equal(a.predict_rows(x), b.predict_rows(with_decoding(x, "threshold")))
    assert "tokens_per_step_by_rule" not in a.describe()
    with pytest.raises(ValueError, match="12"):
        a.record([[0.9] * 12], None, 3)
