"""A Denoiser replica's start, without Ray: its KV pool sized from the memory budget (the scheduler's
capacity exactly the pool's), and the latency profile it measures on its device and registers with."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from app import config
from app.config import AppConfig
from app.replica import ReplicaServer
from engine.instance import Instance
from engine.latency_profile import LatencyProfile
from engine.loading import load_engine

denoiser = pytest.importorskip("deployments.denoiser")


def test_kv_pool_args_and_the_capacity_override():
    cpu = config.kv_pool_args(AppConfig(slots=4))
    assert cpu == {"kv_memory_bytes": 1024 * 2**20, "kv_memory_fraction": 0.9, "kv_residents_max": 32}
    cuda = config.kv_pool_args(AppConfig(device="cuda", slots=4, kv_memory_fraction=0.5))
    assert cuda["kv_memory_bytes"] is None and cuda["kv_memory_fraction"] == 0.5
    assert config.kv_pool_args(AppConfig(kv_memory_mb=2.5))["kv_memory_bytes"] == int(2.5 * 2**20)
    assert config.kv_capacity_override(AppConfig()) is None  # the default: the pool's real capacity
    assert config.kv_capacity_override(AppConfig(kv_capacity_tokens=5000)) == 5000


def test_a_replica_sizes_its_pool_measures_its_profile_and_registers_with_it(monkeypatch):
    cfg = AppConfig(model="tiny-bd", slots=4, kv_memory_mb=8, profile_seconds=0.5)
    engine = load_engine("tiny-bd", max_slots=4, **config.kv_pool_args(cfg))
    pool = engine.runner.pool
    assert pool.slots == min(8 * 2**20 // pool.bytes_per_slot, 32)  # the budget's slots, at most k x B residents
    cls = denoiser.Denoiser.func_or_class
    rep = cls.__new__(cls)
    rep.cfg, rep.tp, rep.replica_id, rep.app_name, rep.actor_name, rep.worker_names = cfg, 1, "r1", "app", "a", []
    rep.instance = Instance(engine, slots=4, kv_capacity_tokens=config.kv_capacity_override(cfg))
    assert rep.instance.scheduler.cfg.kv_budget == pool.slots * pool.capacity
    rep.profile = rep._measure_profile()
    prof = LatencyProfile.from_dict(rep.profile)
    assert {"prefill", "denoise"} <= set(prof.curves) and prof.meta["tp"] == 1 and prof.meta["replica"] == "r1"
    assert prof.name == "tiny-bd-tp1-measured" and not rep.instance.has_work()
    rep.server = ReplicaServer(rep.instance)
    rep.loop, rep.channel = rep.server.loop, rep.server.channel
    rep._stopped, rep.register_s = threading.Event(), 0.01
    sent = []

    def remote(info):
        sent.append(info)
        rep._stopped.set()
        return SimpleNamespace(result=lambda timeout_s: 0)

    handle = SimpleNamespace(register=SimpleNamespace(remote=remote))
    monkeypatch.setattr(denoiser.serve, "get_deployment_handle", lambda name, app: handle)
    try:
        rep._register()
    finally:
        rep.server.close()
    assert sent and sent[0]["profile"] == rep.profile and sent[0]["tp"] == 1 and "port" in sent[0]
