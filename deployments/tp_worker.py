"""Tensor-parallel worker actors: ranks 1..d-1 of one Denoiser replica.

Created by the replica inside its own placement group (one bundle per rank);
each starts its shard of the engine as rank 0 does (``deployments.startup``)
and replays rank 0's rounds.
"""

from __future__ import annotations

import ray

from app.config import AppConfig


@ray.remote
class TPWorker:
    def __init__(self, cfg: AppConfig, rank: int, world: int, init_method: str) -> None:
        from app import gc_pauses
        from deployments.startup import start_engine
        from engine.instance import Follower

        self.follower = Follower(start_engine(cfg, rank, world, init_method))
        self.rank = rank
        gc_pauses.settle(f"tensor-parallel rank {rank}")

    def step(self, commands: list[tuple], plan) -> int:
        return self.follower.step(commands, plan)

    def ready(self) -> int:
        return self.rank
