"""A Denoiser replica's start, without Ray: every rank's engine from one start-up (``start_engine``), its KV
pool sized from the memory budget (the scheduler's capacity exactly the pool's), and the latency profile it
measures on its device and registers with."""

from __future__ import annotations

import json
import os
import socket
import threading
from types import SimpleNamespace

import pytest

from app.config import INGRESS, AppConfig, EngineArgs, kv_pool_args
from app.replica import ReplicaServer
from engine.instance import Instance
from engine.latency_profile import LatencyProfile
from engine.sequence import SamplingParams

denoiser = pytest.importorskip("deployments.denoiser")
startup = pytest.importorskip("deployments.startup")


def test_kv_pool_args_and_the_capacity_override():
    cpu = kv_pool_args(EngineArgs(slots=4))
    assert cpu == {"kv_memory_bytes": 1024 * 2**20, "kv_memory_fraction": 0.9, "kv_residents_max": 32}
    cuda = kv_pool_args(EngineArgs(device="cuda", slots=4, kv_memory_fraction=0.5))
    assert cuda["kv_memory_bytes"] is None and cuda["kv_memory_fraction"] == 0.5
    assert kv_pool_args(EngineArgs(kv_memory_mb=2.5))["kv_memory_bytes"] == int(2.5 * 2**20)
    assert AppConfig().engine.kv_capacity_tokens is None  # the default: the pool's real capacity


def test_engine_kwargs_come_from_the_engine_and_http_sections():
    cfg = AppConfig(engine={"slots": 4, "cache": "prefix", "kv_slot_tokens": 300, "cuda_graphs": False},
                    http={"max_tokens_limit": 200, "default_max_tokens": 64})
    kw = startup.engine_kwargs(cfg)
    assert kw == {"cache": "prefix", "max_slots": 4, "default_gen_length": 64, "max_gen_length": 200,
                  "kv_slot_tokens": 300, "cuda_graphs": False, "rule": None, "decoding_config": None,
                  **kv_pool_args(cfg.engine)}
    assert startup.engine_kwargs(AppConfig())["cuda_graphs"] is None  # where they apply
    kw = startup.engine_kwargs(AppConfig(engine={"decoding": "credit", "decoding_config": {"alpha": 0.5}}))
    assert kw["rule"] == "credit" and kw["decoding_config"] == {"alpha": 0.5}


def test_start_engine_refuses_a_rank_outside_its_group_or_without_a_group():
    cfg = AppConfig()
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        startup.start_engine(cfg, 2, 2, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="init_method"):
        startup.start_engine(cfg, 1, 2)


PROMPTS = ["rev: abcdef", "12+5=", "story: cat 3"]
TP_CONFIG = {"engine": {"model": "tiny-bd", "slots": 4, "kv_memory_mb": 8}, "http": {"max_tokens_limit": 64}}


def _rank_main(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        engine = startup.start_engine(AppConfig.model_validate(TP_CONFIG), rank, world, init_method)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=24, threshold=0.7))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"tokens": [o.token_ids for o in outs], "budget": engine.kv_pool_budget,
                       "heads": engine.cfg.num_heads}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_tp_rank_starts_its_shard_as_rank_0_and_decodes_as_one_engine(tmp_path):
    """Rank 0 (the Denoiser) and rank 1 (a TPWorker) both start through ``start_engine`` from the one config:
    each holds half the heads, sizes its KV pool from the same budget, and together they decode what the
    whole model decodes."""
    import torch.multiprocessing as mp

    cfg = AppConfig.model_validate(TP_CONFIG)
    whole = startup.start_engine(cfg)
    ref = [o.token_ids for o in whole.generate(PROMPTS, SamplingParams(max_tokens=24, threshold=0.7))]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(2, f"tcp://127.0.0.1:{port}", str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["tokens"] == ref for r in ranks)
    assert all(r["heads"] * 2 == whole.cfg.num_heads for r in ranks)
    assert all(r["budget"]["source"] == "kv_memory_bytes" and r["budget"]["budget_bytes"] == 8 * 2**20 for r in ranks)
    assert ranks[0]["budget"] == ranks[1]["budget"]


def test_a_replica_sizes_its_pool_measures_its_profile_and_registers_with_it(monkeypatch):
    cfg = AppConfig(engine={"model": "tiny-bd", "slots": 4, "kv_memory_mb": 8, "profile_seconds": 0.5})
    engine = startup.start_engine(cfg)
    pool = engine.runner.pool
    assert pool.slots == min(8 * 2**20 // pool.bytes_per_slot, 32)  # the budget's slots, at most k x B residents
    cls = denoiser.Denoiser.func_or_class
    rep = cls.__new__(cls)
    rep.cfg, rep.tp, rep.replica_id, rep.app_name, rep.actor_name, rep.worker_names = cfg, 1, "r1", "app", "a", []
    rep.instance = Instance(engine, slots=4, kv_capacity_tokens=cfg.engine.kv_capacity_tokens)
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
    asked = []
    monkeypatch.setattr(denoiser.serve, "get_deployment_handle", lambda name, app: asked.append(name) or handle)
    try:
        rep._register()
    finally:
        rep.server.close()
    assert sent and sent[0]["profile"] == rep.profile and sent[0]["tp"] == 1 and "port" in sent[0]
    assert asked == [INGRESS]
