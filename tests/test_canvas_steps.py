"""The router's step estimates for canvas requests (DiffusionGemma: ``cluster.estimator.CanvasStepEstimator``):
steps per canvas per level, learnt from the canvases finished in the router's step events, times the canvases
a request has left; the prior is the rule's step cap. Through the cluster driver, as the live ingress and the
simulator drive it: the level of each request comes from its SLO budget (Alg. 1) and load control caps it
(Alg. 2). The served DiffusionGemma end to end: tests/test_dg_serving.py."""

from __future__ import annotations

import pytest

from cluster import Router, RouterConfig, StepShape, TpLatencyModel
from cluster.driver import Arrival, ClusterDriver
from cluster.estimator import CanvasStepEstimator
from cluster.state import RequestState
from engine.latency_profile import load_tp_profiles

TS = (0.9, 0.8, 0.7)
CANVAS = 8


def state(rid: str, canvases: int = 3, level: float = 0.9) -> RequestState:
    s = RequestState(rid, 0.0, 60.0, 16, canvases * CANVAS, CANVAS, full_sequence=False)
    s.threshold = level
    return s


def run_canvas(est: CanvasStepEstimator, s: RequestState, steps: int, end: str | None = "canvas") -> None:
    """``steps`` denoising steps of ``s``'s current canvas as the router sees them: progress written, then the
    step event; with the last of them the canvas stops (``end="canvas"``: published, its canvases left fall),
    the request ends (``"request"``) or neither (None: it goes on)."""
    for k in range(steps):
        s.next_heavy = False
        last = k == steps - 1
        if last and end == "canvas":
            s.blocks_left -= 1
        est.observe([(s, False, last and end == "request")])


def prefill(est: CanvasStepEstimator, s: RequestState) -> None:
    s.next_heavy = True  # its prompt's encoder pass: no denoising step
    est.observe([(s, False, False)])


def test_steps_per_canvas_are_learnt_per_level_from_the_canvases_finished():
    est = CanvasStepEstimator(TS, step_cap=6, min_outcomes=2)
    a = state("a")
    assert est.predict([a]) == [[6.0 + 2 * 6.0] * 3]  # the prior: every canvas of the budget at the step cap
    prefill(est, a)
    run_canvas(est, a, 4)
    assert est.describe()["steps_per_canvas"] == {"0.9": {"canvases": 1, "mean": 4.0}}
    # measured at 0.9; the lower levels: no slower than the nearest measured level above them
    assert est.per_canvas() == [4.0, 4.0, 4.0]
    a.threshold = 0.7  # the router lowered its level: its next canvas runs at the higher entropy bound
    run_canvas(est, a, 2)
    assert est.per_canvas() == pytest.approx([4.0, 3.0, 2.0])  # 0.8: between its measured neighbours
    run_canvas(est, a, 1, end=None)  # partway into its last canvas (one step at 0.7 so far)
    s = est.predict([a])[0]
    # p_next measured on two canvases, both followed: 1; its current canvas: the mean less the step it took
    assert a.blocks_left == 1 and s == pytest.approx([4.0 - 1, 3.0 - 1, 2.0 - 1])
    run_canvas(est, a, 2, end="request")  # it ends in its budget's last canvas: no word on a next one
    assert est.describe()["next_canvas"] == {"p": 1.0, "canvases": 2, "source": "measured"}
    assert est.describe()["steps_per_canvas"]["0.7"] == {"canvases": 2, "mean": 2.5}
    b = state("b", canvases=4)
    prefill(est, b)
    run_canvas(est, b, 3, end="request")  # EOS in its first canvas with three more in its budget
    assert est.p_next() == pytest.approx(2 / 3)
    c = state("c", canvases=4)
    later = CanvasStepEstimator.later_canvases(2 / 3, 3)
    assert later == pytest.approx(2 / 3 + 4 / 9 + 8 / 27)
    assert est.predict([c])[0] == pytest.approx([v + later * v for v in est.per_canvas()])
    assert est.per_canvas() == pytest.approx([3.5, 3.0, 2.5])  # 0.9: a's first canvas (4) and b's (3)
    # rows never rise as the level falls, even when a lower level measured slower
    est.record(0.8, 6)
    assert est.per_canvas() == pytest.approx([3.5, 3.5, 2.5])
    only_low = CanvasStepEstimator(TS, step_cap=6)
    only_low.record(0.7, 2)
    assert only_low.per_canvas() == [6.0, 6.0, 2.0]  # above the lowest measured level: the prior


def test_a_moved_request_counts_its_replayed_canvas_from_its_first_step():
    est = CanvasStepEstimator(TS, step_cap=6)
    a = state("a")
    prefill(est, a)
    run_canvas(est, a, 2)
    run_canvas(est, a, 3, end=None)  # three steps into its second canvas, then it moves (its attempt rises)
    assert est.predict([a])[0][0] == max(2.0 - 3, 1.0) + 1 * 2.0
    a.attempt += 1
    assert est.predict([a])[0][0] == 2.0 + 2.0  # the canvas starts over where it went
    # its first step there encodes its prompt and canvas (a prefill), though the router's step kind for a
    # block-causal request does not say so after a move: not a denoising step
    run_canvas(est, a, 6)
    assert est.describe()["steps_per_canvas"]["0.9"] == {"canvases": 2, "mean": 3.5}  # 2 and 5, not 8 or 9
    est.forget("a")
    assert not est._tracks
    with pytest.raises(ValueError, match="step_cap"):
        CanvasStepEstimator(TS, step_cap=0)


def driver(est: CanvasStepEstimator, policy: str = "remask") -> ClusterDriver:
    return ClusterDriver(Router(policy, latency(), est, [(0, 1)], RouterConfig(thresholds=TS)), block_tokens=CANVAS,
                         full_sequence=False)


def latency() -> TpLatencyModel:
    return TpLatencyModel(load_tp_profiles("h200-llada8b-measured", [1]), 8, StepShape(CANVAS, 64, False))


def learnt() -> CanvasStepEstimator:
    """Single-canvas answers measured at 20, 12 and 6 steps at 0.9, 0.8 and 0.7 (a higher entropy bound, fewer
    steps)."""
    est = CanvasStepEstimator(TS, step_cap=48)
    for level, steps in ((0.9, 20), (0.8, 12), (0.7, 6)):
        for _ in range(5):
            est.record(level, steps, followed=False)
    return est


def test_the_level_comes_from_the_slo_budget_and_load_control_caps_it():
    """A request whose SLO budget fits its estimate at 0.9 gets 0.9, a tighter one the highest level that fits,
    the tightest the lowest; in a burst with a budget that fits 0.9 alone, load control leaves the later
    arrivals lower levels than the SLO budget alone would (the same burst without load control)."""
    d = driver(learnt())
    lat = latency()
    light, heavy = lat.round_ms(1, 0, 1), lat.round_ms(1, 1, 0)

    def alone_s(steps: float) -> float:  # Alg. 1's latency of a lone request: its prefill, then its steps
        return (max(heavy - light, 0.0) + steps * light) / 1e3

    slo = {"loose": 1.2 * alone_s(20), "mid": 1.2 * alone_s(12), "tight": 0.5 * alone_s(6)}
    got = {}
    for now, (rid, s) in enumerate(slo.items()):  # one at a time, each alone in the cluster
        adm = d.arrive(Arrival(rid, 8, CANVAS, s), float(now))
        got[rid] = adm.move.threshold
        # one canvas, no next one measured: its canvas's steps at each level
        assert adm.state.est == pytest.approx([20.0, 12.0, 6.0]) and adm.state.cap <= TS.index(got[rid])
        d.cancelled(adm.state)
    assert got == {"loose": 0.9, "mid": 0.8, "tight": 0.7}
    levels = {}
    for policy in ("remask", "dynamic-no-load-control"):
        d = driver(learnt(), policy)
        burst = [d.arrive(Arrival(f"b{i}", 8, CANVAS, 3 * alone_s(20)), 5.0).state for i in range(24)]
        levels[policy] = [TS.index(s.threshold) for s in burst]
        if policy == "remask":
            caps = [s.cap for s in burst]
    capped, free = levels["remask"], levels["dynamic-no-load-control"]
    assert capped[0] == free[0] == 0 and all(c >= f for c, f in zip(capped, free)), (capped, free)
    lower = [i for i, (c, f) in enumerate(zip(capped, free)) if c > f]
    assert lower and all(caps[i] == capped[i] for i in lower), (capped, free, caps)


def test_a_request_capped_at_8_steps_is_estimated_at_8_not_the_servers_48():
    """A request's own ``max_denoising_steps`` (its ``decoding_config``) reaches the router through ``Arrival``:
    before any canvas is measured its prior is its cap, after, no level's steps exceed it; its canvases (cut at
    its cap) stay out of the others' per-level means."""
    from cluster.estimator import request_step_cap

    est = CanvasStepEstimator(TS, step_cap=48)
    d = driver(est)
    capped = d.arrive(Arrival("capped", 8, 2 * CANVAS, 60.0, step_cap=request_step_cap({"max_denoising_steps": 8})),
                      0.0).state
    plain = d.arrive(Arrival("plain", 8, 2 * CANVAS, 60.0), 0.0).state
    assert capped.step_cap == 8 and plain.step_cap is None
    assert capped.est == [8.0 + 8.0] * 3 and plain.est == [48.0 + 48.0] * 3  # two canvases each, at the prior
    for level, steps in ((0.9, 20), (0.8, 12), (0.7, 6)):
        est.record(level, steps)
    assert est.predict([capped]) == [[8.0 + 8.0, 8.0 + 8.0, 6.0 + 6.0]]  # 20 and 12 steps: more than it may take
    assert est.predict([plain]) == [[40.0, 24.0, 12.0]]
    capped.threshold = 0.9
    prefill(est, capped)
    run_canvas(est, capped, 8)  # its first canvas, stopped at its own cap
    assert est.describe()["steps_per_canvas"]["0.9"] == {"canvases": 1, "mean": 20.0}
    assert est.describe()["own_cap_canvases"] == 1 and est.describe()["next_canvas"]["canvases"] == 1
    for bad in (0, 2.5, True, "8"):
        with pytest.raises(ValueError, match="decoding_config.max_denoising_steps"):
            request_step_cap({"max_denoising_steps": bad})
    assert request_step_cap(None) is None and request_step_cap({"entropy_bound": 0.2}) is None


def test_the_ingress_hands_a_requests_step_cap_to_the_router():
    """The dispatcher reads the request's ``decoding_config.max_denoising_steps`` into its ``Arrival``: the
    router's state of it carries the cap (a request waiting for an instance included); a bad value is a 400
    naming the field."""
    import asyncio

    from app.dispatch import DispatchError
    from tests.builders import make_dispatcher, submit

    async def main():
        d = make_dispatcher(router={"predictors": "off"})  # the router's estimator does not matter here
        submit(d, "capped", "rev: abc", 16, sampling={"decoding_config": {"max_denoising_steps": 8}})
        submit(d, "plain", "rev: abc", 16)
        with pytest.raises(DispatchError) as bad:
            submit(d, "bad", "rev: abc", 16, sampling={"decoding_config": {"max_denoising_steps": 0}})
        return d, bad.value

    d, bad = asyncio.run(main())
    assert d.live["capped"].state.step_cap == 8 and d.live["plain"].state.step_cap is None
    assert bad.status == 400 and "decoding_config.max_denoising_steps" in str(bad)
