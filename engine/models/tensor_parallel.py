"""Tensor parallelism: attention heads and MLP columns sharded across ranks.

Each rank holds a DLMTransformer built from a *sharded config* (num_heads,
num_kv_heads and intermediate_size divided by the world size, head_dim kept),
so its KV caches hold only its own heads. q/k/v and gate/up projections are
column-parallel (each rank computes its heads / columns); o_proj and
down_proj are row-parallel, and their partial outputs are summed across ranks
(one all-reduce after attention and one after the MLP of every layer).
Embeddings, norms and the LM head are replicated, so every rank sees the same
logits and makes the same unmasking decisions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.config import ModelConfig
from engine.models.transformer import DLMTransformer

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split
ROW = ("o_proj", "down_proj")  # input columns split


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    if cfg.num_experts and world > 1:
        raise ValueError("tensor parallelism of mixture-of-experts models is not supported yet; serve them at TP 1")
    for name, value in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"TP degree {world} does not divide {name} = {value}")
    return cfg.replace(num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                       intermediate_size=cfg.intermediate_size // world, head_dim=cfg.head_dim)


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in COLUMN:
        return tensor.chunk(world, dim=0)[rank].contiguous()
    if module in ROW and parts[-1] == "weight":
        return tensor.chunk(world, dim=1)[rank].contiguous()
    return tensor


def shard_model(model: DLMTransformer, rank: int, world: int,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> DLMTransformer:
    """This rank's shard of ``model`` (built on meta, then assigned the slices). Shard before fusing
    projections (the runner fuses on CUDA): a fused q/k/v matrix cannot be split by rows."""
    if model.fused:
        raise ValueError("cannot shard a model whose projections are fused; shard first, then fuse")
    cfg = shard_config(model.config, world)
    with torch.device("meta"):
        shard = DLMTransformer(cfg)
    state = {k: shard_tensor(k, v, rank, world) for k, v in model.state_dict().items()}
    shard.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        shard.lm_head.weight = shard.embed_tokens.weight
    for layer in shard.layers:
        layer.reduce = reduce
    return shard.eval()


def all_reduce_sum(group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch.distributed as dist

    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    return reduce
