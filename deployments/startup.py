"""A replica's engine from the config: one start-up for every rank of a Denoiser replica.

Rank 0 runs in the Denoiser replica itself (``deployments.denoiser``); ranks 1..d-1 of a tensor-parallel
replica are ``TPWorker`` actors (``deployments.tp_worker``). Each calls ``start_engine`` with the same
config, so every rank loads the same model, shards it the same way and sizes its KV pool the same way
(``kv_pool_args``: a shard's caches fit in the budget rank 0 reserves against).
"""

from __future__ import annotations

import datetime

from app.config import AppConfig, kv_pool_args

PROCESS_GROUP_TIMEOUT_S = 120.0  # how long a rank waits for the others to join the process group


def engine_kwargs(cfg: AppConfig) -> dict:
    """The ``Engine``'s arguments from the config (every rank's the same)."""
    e = cfg.engine
    return dict(cache=e.cache, max_slots=e.slots, default_gen_length=cfg.http.default_max_tokens,
                rule=e.decoding, decoding_config=e.decoding_config,  # over the checkpoint's (engine.loading)
                max_gen_length=cfg.http.max_tokens_limit, kv_slot_tokens=e.kv_slot_tokens,
                cuda_graphs=None if e.cuda_graphs else False,  # None: where they apply (not on a TP shard)
                **kv_pool_args(e, cfg.resources.gpu_share))  # a replica sharing its GPUs takes its share


def start_engine(cfg: AppConfig, rank: int = 0, world: int = 1, init_method: str | None = None):
    """Rank ``rank`` of ``world``'s engine: with ``world`` 1 the whole model (``engine.loading.load_engine``:
    embedded models, presets and checkpoints); otherwise this process joins the group's process group at
    ``init_method`` (``tcp://host:port``; NCCL on cuda, gloo on cpu) and its engine holds its shard of the
    checkpoint's model. Every rank of a group must call it: joining waits for the others."""
    from engine.engine import Engine
    from engine.loading import engine_rule, is_canvas_model, load_engine, resolve_model
    from engine.models.loader import load_model
    from engine.models.tensor_parallel import all_reduce_sum, shard_model
    from engine.tokenizer import load_tokenizer

    e = cfg.engine
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world}: need 0 <= rank < world")
    if world == 1:
        return load_engine(e.model, device=e.device, dtype=e.torch_dtype(), **engine_kwargs(cfg))
    if init_method is None:
        raise ValueError("a tensor-parallel rank needs the process group's init_method (tcp://host:port)")
    import torch.distributed as dist

    dist.init_process_group("nccl" if e.device.startswith("cuda") else "gloo", init_method=init_method,
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    path = resolve_model(e.model)
    kwargs = engine_kwargs(cfg)
    rule = engine_rule(path, kwargs.pop("rule"), kwargs.pop("decoding_config"))
    if is_canvas_model(path):  # DiffusionGemma: its own shards (heads, MLP and expert columns) and engine
        from engine.canvas_serving import CanvasServeEngine
        from engine.models import diffusion_gemma as dg

        part = dg.shard(dg.load(path, dtype=e.torch_dtype()), rank, world, all_reduce_sum())
        return CanvasServeEngine(part.to(e.device), load_tokenizer(path), device=e.device, rule=rule, **kwargs)
    model = shard_model(load_model(path, dtype=e.torch_dtype()), rank, world, all_reduce_sum())
    return Engine(model.to(e.device), load_tokenizer(path), device=e.device, rule=rule, **kwargs)
