"""One scenario through both executors of the cluster driver: the cluster simulator runs it; its world
(arrivals, instances joining, each round's steps as a live instance reports them) is replayed into the
live ``Dispatcher`` (fake channels, the simulator's clock), and the two drivers' decisions (placements,
thresholds, migrations) must be the same, in the same order, at the same instants."""

from __future__ import annotations

import random

import pytest

from app.dispatch import Dispatcher
from app.protocol import Thresholds
from cluster import Router, RouterConfig, StepShape, TableStepEstimator, TpLatencyModel
from engine.latency_profile import load_tp_profiles
from engine.progress import Done, ProgressBatch, StepItem
from predictors.features import StepFeatures
from sim.cluster import ClusterConfig, ClusterRequestSpec, ClusterSimulator
from tests.fakes import RecordingLink

TS = (0.9, 0.8, 0.7)
BLOCK = 32


def specs(n: int, rate: float, seed: int) -> list[ClusterRequestSpec]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        blocks = rng.choice((1, 2, 4, 8))
        base = blocks * rng.uniform(4.0, 12.0)
        steps = tuple(base * f for f in (1.0, 0.8, 0.6))
        out.append(ClusterRequestSpec(f"q{i}", i, "mixed", t, rng.randrange(40, 300), blocks * BLOCK, steps,
                                      (True,) * 3, slo_s=rng.uniform(0.5, 4.0)))
    return out


def simulate(policy: str, reqs: list[ClusterRequestSpec], join_at: float):
    profiles = load_tp_profiles("h200-llada8b-measured", [1, 2])
    cfg = ClusterConfig((1, 1), slots=8, block_tokens=BLOCK, sequence_tokens=396,
                        router=RouterConfig(thresholds=TS), estimator_sigma=0.3)
    sim = ClusterSimulator(cfg, profiles, policy, seed=3, log=True)
    sim.call_at(join_at, lambda now: sim.add_instance(2))
    res = sim.run(reqs)
    assert res.lost == 0 and len(res.finished) == len(reqs)
    return sim, profiles, cfg


def replay(sim: ClusterSimulator, profiles, cfg: ClusterConfig, policy: str, reqs: list[ClusterRequestSpec]):
    totals = {s.req_id: s.steps for s in reqs}
    est = TableStepEstimator(TS, lambda s: totals[s.req_id], sigma=cfg.estimator_sigma, seed=3)
    latency = TpLatencyModel(dict(profiles), cfg.slots, StepShape(cfg.block_tokens, cfg.sequence_tokens, True))
    router = Router(policy, latency, est, [], cfg.router)
    now = [0.0]
    d = Dispatcher(router, lambda ids: "", block_tokens=BLOCK, full_sequence=True, per_instance_limit=10**6,
                   shed_over_capacity=False, clock=lambda: now[0], log_decisions=True,
                   calibrate=False)  # the simulator's profiles are exact
    links = {}
    for inst_id, tp in enumerate(cfg.tp_degrees):
        links[inst_id] = RecordingLink()
        assert d.attach(f"r{inst_id}", tp, links[inst_id], read=False) == inst_id
    rounds = {}
    for event in sim.world:
        kind, now[0] = event[0], event[1]
        if kind == "arrive":
            spec = event[2]
            d.submit(spec.req_id, [1] * spec.prompt_tokens, spec.output_tokens, slo_ms=spec.slo_s * 1000.0)
        elif kind == "join":
            links[event[2]] = RecordingLink()
            assert d.attach(f"r{event[2]}", event[3], links[event[2]], read=False) == event[2]
        else:
            _, t, inst_id, dt, stepped = event
            rounds[inst_id] = rounds.get(inst_id, 0) + 1
            items = []
            for req_id, row, heavy, done in stepped:
                attempt = d.live[req_id].state.attempt
                items.append(StepItem(req_id, [], 0, heavy, StepFeatures(*row),
                                      done=Done("length", 0, 0) if done else None, attempt=attempt))
            d.handle_batch(inst_id, ProgressBatch(t, rounds[inst_id], dt * 1000.0, items=items))
    return d, links


@pytest.mark.parametrize("policy", ["remask", "llumnix"])
def test_simulator_and_live_dispatcher_decide_the_same(policy):
    reqs = specs(120, rate=30.0, seed=1)
    sim, profiles, cfg = simulate(policy, reqs, join_at=1.5)
    d, links = replay(sim, profiles, cfg, policy, reqs)
    ours, theirs = sim.driver.decisions, d.driver.decisions
    kinds = {e[1] for e in ours}
    assert {"place", "threshold"} <= kinds and len(ours) > 200
    assert any(e[1] == "place" and e[4] == 2 for e in ours), "the joining instance took requests"
    if policy == "remask":
        assert "migrate" in kinds and len({e[4] for e in ours if e[1] == "threshold"}) > 1
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert first is None and len(ours) == len(theirs), (
        f"first difference at decision {first}: simulator {ours[first - 2:first + 3] if first else ours[-3:]} "
        f"live {theirs[first - 2:first + 3] if first else theirs[-3:]}")
    assert not d.live, "every request finished live too"
    # the live decisions reached the wire: each placement an Add with its attempt, thresholds answered
    adds = [m for link in links.values() for m in link.sent if type(m).__name__ == "Add"]
    assert len(adds) == sum(e[1] in ("place", "migrate", "evacuate", "resume") for e in theirs)
    assert all(m.attempt >= 1 for m in adds)
    answered = any(isinstance(m, Thresholds) for link in links.values() for m in link.sent)
    assert answered == (policy == "remask")  # only a dynamic policy answers rounds with thresholds
