"""The constraint column of the step rows (predictors.features.CONSTRAINT_FEATURES): carried from a request's
``SamplingParams.constraint`` to the rows the router asks with and the online step learner records, read by
models trained on it and ignored by shipped models trained on fewer columns, and kept across a resume."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cluster import OnlineStepEstimator, RequestState
from cluster.learning import LiveLearning
from cluster.thresholds import decoding_row, request_row
from engine.constraints.spec import ConstraintSpec
from predictors.features import (
    CONSTRAINT_FEATURES,
    RULE_FEATURES,
    STEP_FEATURES,
    constraint_value,
    decoding_rows,
    step_row,
    with_decoding,
)
from predictors.online import CONSTRAINT_COL, ROW_WIDTH, OnlineAdmissionLearner, OnlineStepLearner
from tests.builders import LEARNER_BLOCKS, LEARNER_OUT, LEARNER_TS, learner_request

TS, BLOCKS, OUT = LEARNER_TS, LEARNER_BLOCKS, LEARNER_OUT  # learner_request's
SPEC = ConstraintSpec("regex", r"[0-9]{1,3}", "guided_regex")


def request(rng: np.random.Generator, constrained: bool):
    """A finished request whose steps fall with the threshold (3 to 5 tokens a step at 0.9, 1.5x at 0.8, 2x at 0.7),
    a constrained one taking 1.5x the steps of a free one in the same state: rows of the 11 step features (the
    constraint passed beside them)."""
    return learner_request(rng, rates=(3.0, 4.0, 5.0), slower=1.5 if constrained else 1.0)


def state(req_id: str, constrained: float) -> RequestState:
    s = RequestState(req_id, 0.0, 10.0, 40, OUT, 32, constrained=constrained)
    s.progress, s.blocks_left, s.step_in_block = 0.25, 6, 1
    return s


def test_rows_carry_the_constraint_column_for_constrained_and_free_requests():
    assert CONSTRAINT_FEATURES == ("constrained",) and ROW_WIDTH == 14 and CONSTRAINT_COL == 13
    assert constraint_value(None) == 0.0 and constraint_value(SPEC.to_dict()) == 1.0 == constraint_value(SPEC)
    free, held = state("f", 0.0), state("c", 1.0)
    for s, c in ((free, 0.0), (held, 1.0)):
        row = request_row(s, 0.8)
        assert len(row) == len(STEP_FEATURES) + len(RULE_FEATURES) + 1 == 14
        assert row[:13] == decoding_row(s, 0.8) and row[0] == 0.8 and row[-1] == c
    # every width a step row comes in gets the 14 the learner keeps: 11 (a replica's), 13 (with the rule's), 14
    base = [[0.9, OUT, 0.5, 0.5, 4, 1, 0.1, 0.2, 0.3, 0.4, 0.5]] * 2
    eleven = decoding_rows(base, "threshold", 1.0)
    assert eleven.shape == (2, 14) and (eleven[:, 13] == 1.0).all()
    assert np.array_equal(decoding_rows(with_decoding(np.array(base), "threshold"), None, 1.0), eleven)
    assert np.array_equal(decoding_rows(eleven), eleven)  # carrying its own column: kept as it is
    assert (decoding_rows(base)[:, 13] == 0.0).all()  # no constraint said: free
    with pytest.raises(ValueError, match=r"11 columns.*13.*14.*\(2, 12\)"):
        decoding_rows(np.zeros((2, 12)))
    # the learner keeps each finished request's rows with its column, from 11-column rows or 14-column ones
    learner = OnlineStepLearner(TS)
    live = LiveLearning(learner, OnlineAdmissionLearner(), learn=False)
    rng = np.random.default_rng(0)
    rows, done, total = request(rng, True)
    live.finished(rows, done, total, [1.0, 0.0, 4.0, 0.9], BLOCKS, None, decoding="threshold", constrained=1.0)
    live.finished([request_row(free, 0.9)], [1], 5, [1.0, 0.0, 4.0, 0.9], BLOCKS, None)
    (_, x1, _, _), (_, x2, _, _) = learner._reqs
    assert x1.shape[1] == 14 and (x1[:, 13] == 1.0).all() and x2.shape[1] == 14 and x2[0, 13] == 0.0


def test_shipped_models_read_their_own_columns_of_a_14_column_row():
    """An 11- or a 13-column step model (what shipped artifacts are) answers 14-column rows from its own first
    columns: the constraint's column changes nothing for it, served alone or as a learner's start."""
    from predictors.step import StepPredictor

    rng = np.random.default_rng(1)
    reqs = [request(rng, False) for _ in range(40)]
    x = np.concatenate([np.asarray(r, float) for r, _, _ in reqs])
    y = np.concatenate([t - np.asarray(d, float) for _, d, t in reqs])
    eleven = StepPredictor.fit(x, y)
    thirteen = StepPredictor.fit(with_decoding(x, "threshold"), y)
    assert (eleven.width, thirteen.width) == (11, 13)
    probe = x[::25]
    for c in (0.0, 1.0):
        wide = decoding_rows(probe, "threshold", c)
        assert wide.shape[1] == 14
        assert np.array_equal(eleven.predict_rows(wide), eleven.predict_rows(probe))
        assert np.array_equal(thirteen.predict_rows(wide), thirteen.predict_rows(wide[:, :13]))
        assert np.array_equal(eleven.predict(probe, TS, constrained=c), eleven.predict(probe, TS))
        learner = OnlineStepLearner(TS, start=eleven)
        assert learner.source == "shipped" and np.array_equal(learner.predict_rows(wide), eleven.predict_rows(probe))


def test_the_shipped_tiny_bd_step_artifact_answers_14_column_rows():
    from predictors.bundle import artifact_dir
    from predictors.step import StepPredictor

    shipped = StepPredictor.load(artifact_dir("tiny-bd") / "step.txt")
    s = state("c", 1.0)
    s.conf_stats = (0.1, 0.3, 0.5, 0.5, 0.7)
    rows = np.array([request_row(s, t) for t in TS])
    assert shipped.width < rows.shape[1] == 14
    assert np.array_equal(shipped.predict_rows(rows), shipped.predict_rows(rows[:, : shipped.width]))
    est = OnlineStepEstimator(OnlineStepLearner(TS, start=shipped), TS, row=request_row)
    free = state("f", 0.0)
    free.conf_stats = s.conf_stats
    assert est.predict([s]) == est.predict([free])  # it cannot tell them apart: it reads its own columns


def test_the_router_estimates_more_steps_for_a_constrained_request_when_they_take_more():
    """Rows where constrained requests take 1.5x the steps: the online model fits the 14 columns and the router's
    estimate (``request_row``: the column from ``RequestState.constrained``) for a constrained request is about
    1.5x a free one's in the same state; the prior, before any model, measures their tokens a step apart. A
    learner that never saw a constrained request answers both alike."""
    rng = np.random.default_rng(2)
    learner = OnlineStepLearner(TS, min_requests=100, max_rows=4000)
    blind = OnlineStepLearner(TS, min_requests=100, max_rows=4000)
    for i in range(120):
        held = i % 2 == 1
        req = request(rng, held)
        learner.record(*req, constrained=float(held))
        blind.record(*req)
    assert learner.tokens_per_step(0.9, constrained=1.0) < 0.8 * learner.tokens_per_step(0.9)
    assert set(learner.describe()["tokens_per_step_by_rule"]) == {"threshold", "threshold, constrained"}
    est = OnlineStepEstimator(learner, TS, row=request_row)
    prior_free, prior_held = est.predict([state("a", 0.0), state("b", 1.0)])
    assert all(h > 1.2 * f for f, h in zip(prior_free, prior_held)), (prior_free, prior_held)
    rec, _ = learner.refit(), blind.refit()
    assert rec["swapped"] and learner._served.model.width == 14 and blind._served.model.width == 11
    free, held = est.predict([state("a", 0.0), state("b", 1.0)])
    assert all(1.3 < h / f < 1.8 for f, h in zip(free, held)), (free, held)
    f2, h2 = OnlineStepEstimator(blind, TS, row=request_row).predict([state("a", 0.0), state("b", 1.0)])
    assert f2 == h2


def test_the_column_survives_a_resume():
    """An app's router asks with ``request_row``. A constrained request refused by its instance resumes on
    another: its add carries the constraint again,
    its state (and so the row the router asks with) keeps the column, and the rows the learner records when it
    finishes carry it; a free request's carry 0."""
    from app.config import AppConfig
    from app.dispatch import Dispatcher
    from app.protocol import Add, Done, ErrorItem, ProgressBatch, StepItem
    from cluster.factory import build_router
    from engine.loading import resolve_model
    from engine.models.loader import load_config
    from tests.fakes import RecordingLink

    cfg = AppConfig(engine={"model": "tiny-bd", "slots": 8})
    learner = OnlineStepLearner(cfg.router.thresholds)
    learning = LiveLearning(learner, OnlineAdmissionLearner(), learn=False)
    mcfg = load_config(resolve_model("tiny-bd"))
    feats = step_row(0.9, 32, 8, 8, 32, 1, 1, [0.2, 0.4, 0.6, 0.6, 0.8])

    router = build_router(cfg, mcfg, learning)
    assert router.estimator.row is request_row  # an app's router asks with the constraint column

    async def main():
        d = Dispatcher(router, lambda ids: "", block_tokens=mcfg.block_size,
                       full_sequence=False, per_instance_limit=64, learning=learning)
        links = [RecordingLink(), RecordingLink()]
        a, b = (d.attach(f"r{i}", 1, links[i], read=False) for i in range(2))
        streams = {}
        for rid, sampling in (("held", {"constraint": SPEC.to_dict()}), ("free", None)):
            streams[rid] = d.submit(rid, [5, 6, 7], 32, sampling=sampling)
            st = d.live[rid].state
            assert st.constrained == (1.0 if sampling else 0.0)
            assert links[st.instance].sent[-1].params.constraint == (sampling or {}).get("constraint")
        st = d.live["held"].state
        first = st.instance
        other = b if first == a else a
        d.handle_batch(first, ProgressBatch(0.0, 1, 1.0, items=[
            StepItem("held", [1], 1, False, features=feats, attempt=1),
            StepItem("held", [2], 2, False, features=feats, attempt=1)]))
        d.handle_batch(first, ProgressBatch(0.0, 2, 1.0, items=[ErrorItem("held", "full", 429, 1)]))
        add = links[other].sent[-1]
        assert isinstance(add, Add) and add.req_id == "held" and add.attempt == 2
        assert add.params.constraint == SPEC.to_dict() and add.committed == [1, 2]
        assert d.live["held"].state is st and st.instance == other and st.constrained == 1.0
        assert request_row(st, 0.9)[-1] == 1.0 and router.estimator.row(st, 0.9)[-1] == 1.0
        for rid, inst, attempt in (("held", other, 2), ("free", d.live["free"].state.instance, 1)):
            d.handle_batch(inst, ProgressBatch(0.0, 3, 1.0, items=[
                StepItem(rid, [3], 3, False, features=feats, attempt=attempt)]))
            d.handle_batch(inst, ProgressBatch(0.0, 4, 1.0, items=[
                StepItem(rid, [4], 4, False, features=feats, attempt=attempt)]))
            d.handle_batch(inst, ProgressBatch(0.0, 5, 1.0, items=[
                StepItem(rid, [5], 5, False, done=Done("length", 5, 5), attempt=attempt)]))
            events = [e async for e in streams[rid]]
            assert events[-1]["type"] == "done", events[-1]

    asyncio.run(main())
    assert learner.seen == 2
    held, free = (r[1] for r in learner._reqs)
    assert len(held) >= 2 and (held[:, CONSTRAINT_COL] == 1.0).all()
    assert len(free) >= 1 and (free[:, CONSTRAINT_COL] == 0.0).all()
