"""Tensor-parallel worker actors: ranks 1..d-1 of one Denoiser replica.

Created by the replica inside its own placement group (one bundle per rank);
each holds its shard of the model and replays rank 0's rounds.
"""

from __future__ import annotations

import datetime

import ray


@ray.remote
class TPWorker:
    def __init__(self, config: dict, rank: int, world: int, addr: str, port: int) -> None:
        import torch.distributed as dist

        from app.config import AppConfig, kv_pool_args
        from engine.engine import Engine
        from engine.instance import Follower
        from engine.loading import resolve_model
        from engine.models.loader import load_model
        from engine.models.tensor_parallel import all_reduce_sum, shard_model
        from engine.tokenizer import load_tokenizer

        cfg = AppConfig(**config)
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        path = resolve_model(cfg.model)
        model = shard_model(load_model(path, dtype=cfg.torch_dtype()), rank, world, all_reduce_sum())
        engine = Engine(model.to(cfg.device), load_tokenizer(path), device=cfg.device, cache=cfg.cache,
                        max_slots=cfg.slots, default_gen_length=cfg.default_max_tokens,
                        max_gen_length=cfg.max_tokens_limit, kv_slot_tokens=cfg.kv_slot_tokens,
                        **kv_pool_args(cfg))  # the KV pool sized as rank 0's: its shard's caches fit in it
        self.follower = Follower(engine)
        self.rank = rank

    def step(self, commands: list[tuple], plan) -> int:
        return self.follower.step(commands, plan)

    def ready(self) -> int:
        return self.rank
