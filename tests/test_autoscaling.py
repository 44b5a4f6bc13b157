"""Planner-driven autoscaling without Ray: the service follows Stage 2's transition under the shared
follower's rules (cluster.transition), and the application-level policy hands its targets to the Denoiser
deployments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.autoscaling import initial_counts, planner_policy
from app.config import INGRESS, AppConfig, EngineArgs, ResourceArgs, denoiser_name, kv_pool_args
from app.planner_service import build_service, pack


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


# ---- make-before-break: replicas that share GPUs ------------------------------------------------------------
def shared(**planner) -> AppConfig:
    """Two logical GPUs, half a GPU per rank: a new replica fits beside the one it replaces."""
    return AppConfig(engine={"model": "tiny-bd"}, resources={"tp_degrees": [1, 2], "gpus_per_rank": 0.5}, planner={
        "nodes": 1, "gpus_per_node": 2, "period_s": 10, "window_s": 10, "profile": "cpu-tiny-bd", "min_gain": 0.05,
        **planner})


def test_make_before_break_starts_the_new_replicas_before_it_lowers_the_old_counts():
    clock = Clock()
    svc = build_service(shared(), clock=clock)
    assert svc.make_before_break and svc.describe()["make_before_break"]
    svc.set_live({1: 2})
    offer(svc, clock, 1.0, 11)
    svc.tick()
    assert svc.transitions == 1
    # the TP-2 replica loads beside the two TP-1 ones, which serve until it does
    assert svc.targets == {1: 2, 2: 1}
    assert [(p["kind"], p["issued"]) for p in svc.pending] == [("start", True), ("stop", False), ("stop", False)]
    clock.t += 1
    svc.tick()
    assert svc.targets == {1: 2, 2: 1}  # not joined yet: the old counts hold
    seen = follow(svc, clock)
    assert seen == [{1: 2, 2: 1}, {1: 0, 2: 1}]
    assert all(c[1] + 2 * c[2] <= 2 * 2 for c in seen)  # at most two replicas' ranks on a GPU
    first = svc.describe()["history"][-1]
    assert first["from"] == {1: 2, 2: 0} and first["to"] == {1: 0, 2: 1} and first["make_before_break"]
    # the start is done once the new replica joined while the old ones served; then the stops go
    assert [s["live"] for s in first["steps"]] == [{1: 2, 2: 0}, {1: 2, 2: 1}, {1: 0, 2: 1}]
    assert [(a["kind"], a["tp"]) for a in first["steps"][0]["issued"]] == [("start", 2)]
    assert sorted(a["instance"] for a in first["steps"][1]["issued"]) == ["tp1-0", "tp1-1"]
    assert all(a["kind"] == "stop" for a in first["steps"][1]["issued"]) and first["done_at"] is not None
    # back at high load: both TP-1 replicas start beside the TP-2 one before it stops
    offer(svc, clock, 30.0, 11)
    svc.tick()
    assert svc.transitions == 2 and svc.targets == {1: 2, 2: 1}
    assert follow(svc, clock) == [{1: 2, 2: 1}, {1: 2, 2: 0}]


def test_make_before_break_follows_the_resources_and_refuses_what_cannot_fit():
    assert shared().planner.make_before_break is True  # half a GPU per rank: on by default
    assert config().planner.make_before_break is False  # no GPUs in Ray's accounting: off unless asked
    assert config(make_before_break=True).planner.make_before_break is True
    assert shared(make_before_break=False).planner.make_before_break is False
    whole = {"tp_degrees": [1, 2], "gpus_per_rank": 1}
    cuda = {"device": "cuda"}  # whole GPUs per rank: a cuda engine (a cpu one holding GPUs is refused)
    assert AppConfig(engine=cuda, resources=whole, planner={"gpus_per_node": 2}).planner.make_before_break is False
    with pytest.raises(ValueError, match="fit beside the ones they replace"):
        AppConfig(engine=cuda, resources=whole, planner={"gpus_per_node": 2, "make_before_break": True})
    # Ray gives a fractional GPU demand the fullest GPU it fits: two ranks of a TP group could share a device
    with pytest.raises(ValueError, match="two ranks of a TP group on one GPU"):
        AppConfig(engine={"device": "cuda"}, resources={"tp_degrees": [1, 2], "gpus_per_rank": 0.5})
    assert AppConfig(engine={"device": "cuda"}, resources={"gpus_per_rank": 0.5}).resources.shares_gpus
    with pytest.raises(ValueError, match="a fraction of one GPU"):
        AppConfig(resources={"gpus_per_rank": 1.5})
    assert [ResourceArgs(gpus_per_rank=g).gpu_share for g in (0, 0.25, 0.5, 1, 2)] == [1, 0.25, 0.5, 1, 1]
    assert [ResourceArgs(gpus_per_rank=g).shares_gpus for g in (0, 0.25, 0.5, 0.75, 1)] == [False, True, True,
                                                                                           False, False]


def test_a_replica_sharing_its_gpu_takes_its_share_of_the_kv_budget():
    from deployments.startup import engine_kwargs

    cpu = kv_pool_args(EngineArgs(), 0.5)
    assert cpu["kv_memory_bytes"] == 512 * 2**20  # half the CPU default
    cuda = kv_pool_args(EngineArgs(device="cuda", kv_memory_fraction=0.8), 0.5)
    assert cuda["kv_memory_bytes"] is None and cuda["kv_memory_fraction"] == pytest.approx(0.4)
    assert kv_pool_args(EngineArgs(kv_memory_mb=64), 0.5)["kv_memory_bytes"] == 64 * 2**20  # the operator's own
    with pytest.raises(ValueError, match="gpu_share"):
        kv_pool_args(EngineArgs(), 0)
    assert engine_kwargs(shared())["kv_memory_bytes"] == 512 * 2**20
    assert engine_kwargs(config())["kv_memory_bytes"] == 1024 * 2**20


def test_the_builder_gives_each_rank_its_share_of_a_gpu():
    pytest.importorskip("ray.serve")
    from deployments.builder import build_app

    handles, _ = build_app(shared())._bound_deployment.init_args
    for d, handle in handles.items():
        dep = handle._bound_deployment
        assert dep._replica_config.ray_actor_options["num_gpus"] == 0.5
        assert [b["GPU"] for b in dep._replica_config.placement_group_bundles] == [0.5] * d
        # two replicas' ranks may hold a GPU while one replaces the other
        assert dep._deployment_config.autoscaling_config.max_replicas == 2 * (2 // d)
    handles, _ = build_app(config())._bound_deployment.init_args
    assert handles[1]._bound_deployment._deployment_config.autoscaling_config.max_replicas == 2
