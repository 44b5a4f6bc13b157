"""Planner-driven autoscaling without Ray: the service follows Stage 2's transition under the shared
follower's rules (cluster.transition), and the application-level policy hands its targets to the Denoiser
deployments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.autoscaling import build_service, initial_counts, pack, planner_policy
from app.config import INGRESS, AppConfig, denoiser_name


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def config(**planner) -> AppConfig:
    return AppConfig(engine={"model": "tiny-bd"}, resources={"tp_degrees": [1, 2]}, planner={
        "nodes": 1, "gpus_per_node": 2, "period_s": 10, "window_s": 10, "profile": "cpu-tiny-bd", "min_gain": 0.05,
        **planner})


def offer(svc, clock, rate: float, seconds: float) -> None:
    """``rate`` arrivals per second of a tiny-bd-sized request (24 prompt tokens, 32 out)."""
    n = int(rate * seconds)
    start = clock.t
    for i in range(n):
        clock.t = start + i / rate
        svc.observe(24, 32)
    clock.t = start + seconds


def follow(svc, clock) -> list[dict[int, int]]:
    """Carry out every step the service asks for, as Serve and the replicas would; the targets seen."""
    seen = [dict(svc.targets)]
    for _ in range(10):
        svc.set_live(svc.targets)  # the replicas reached the step
        clock.t += 1
        svc.tick()
        if svc.targets == seen[-1] and not svc.pending:
            break
        seen.append(dict(svc.targets))
    return seen


def test_service_moves_replicas_between_tp_groups_with_the_load():
    clock = Clock()
    svc = build_service(config(), clock=clock)
    assert svc.targets == {1: 2, 2: 0}  # every GPU in TP-1 at start
    svc.set_live({1: 2})
    offer(svc, clock, 1.0, 11)  # low load: fewer, larger instances
    svc.tick()
    assert svc.transitions == 1
    seen = follow(svc, clock)
    assert seen[-1] == {1: 0, 2: 1}
    # the TP-1 replicas stop first (the TP-2 one needs their GPUs), and it starts only once they are gone:
    # never more GPUs than the cluster has
    assert seen == [{1: 0, 2: 0}, {1: 0, 2: 1}]  # the first: both stops issued at the replan
    assert all(c[1] + 2 * c[2] <= 2 for c in seen)
    # a step is not taken before the previous one took effect
    offer(svc, clock, 30.0, 11)  # high load: more TP-1 instances
    svc.tick()
    assert svc.transitions == 2
    first = dict(svc.targets)
    svc.set_live({2: 1})  # Serve has not stopped the TP-2 replica yet
    clock.t += 1
    svc.tick()
    assert svc.targets == first
    assert follow(svc, clock)[-1] == {1: 2, 2: 0}
    assert svc.describe()["last_decision"]["proposal"] == {1: 2, 2: 0}


def test_a_stuck_step_times_out():
    clock = Clock()
    svc = build_service(config(step_timeout_s=5), clock=clock)
    offer(svc, clock, 1.0, 11)
    svc.tick()
    first = dict(svc.targets)
    svc.set_live({1: 2})  # nothing ever changes
    clock.t += 2
    svc.tick()
    assert svc.targets == first
    clock.t += 10
    svc.tick()
    assert svc.targets != first


def test_initial_counts_and_packing():
    assert initial_counts(config()) == {1: 2, 2: 0}
    cfg = AppConfig(engine={"model": "tiny-bd"}, resources={"tp_degrees": [1, 2], "replicas": {2: 1}},
                    planner={"gpus_per_node": 2})
    assert initial_counts(cfg) == {1: 0, 2: 1}
    with pytest.raises(ValueError, match="need 4 GPUs"):
        initial_counts(AppConfig(engine={"model": "tiny-bd"}, resources={"tp_degrees": [1, 2], "replicas": {2: 2}},
                                 planner={"gpus_per_node": 2}))
    nodes = [i.node for i in pack({1: 2, 4: 1}, (4, 2))]
    assert nodes == [0, 1, 1]


def ctx(name: str, target: int, raw: dict | None = None):
    return SimpleNamespace(deployment_name=name, target_num_replicas=target, raw_metrics=raw or {},
                           aggregated_metrics={})


def test_policy_applies_the_ingress_targets():
    ts = SimpleNamespace
    rid = "ingress-replica"
    contexts = {
        "ing": ctx(INGRESS, 1, {"target_tp1": {rid: [ts(timestamp=1.0, value=2.0), ts(timestamp=2.0, value=0.0)]},
                                  "target_tp2": {rid: [ts(timestamp=2.0, value=1.0)]}}),
        "tp1": ctx(denoiser_name(1), 2),
        "tp2": ctx(denoiser_name(2), 0),
        "tp4": ctx(denoiser_name(4), 3),  # no target published: left alone
    }
    decisions, state = planner_policy(contexts)
    assert decisions == {"ing": 1, "tp1": 0, "tp2": 1, "tp4": 3}
    assert set(state) == set(contexts)
