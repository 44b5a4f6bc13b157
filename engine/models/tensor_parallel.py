"""Tensor parallelism: attention heads and MLP columns sharded across ranks.

Each rank holds a DLMTransformer built from a *sharded config* (num_heads,
num_kv_heads and intermediate_size divided by the world size, head_dim kept),
so its KV caches hold only its own heads. q/k/v and gate/up projections are
column-parallel (each rank computes its heads / columns); o_proj and
down_proj are row-parallel, and their partial outputs are summed across ranks
(one all-reduce after attention and one after the MLP of every layer).
Embeddings, norms and the LM head are replicated, so every rank sees the same
logits and makes the same unmasking decisions. A mixture of experts shards each
expert (and the shared ones) like a dense MLP and replicates the router, so every
rank routes each token to the same experts and the weighted sum of their partial
outputs is reduced once, as a dense MLP's is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.config import ModelConfig
from engine.models.meta import on_meta
from engine.models.transformer import DLMTransformer

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split
ROW = ("o_proj", "down_proj")  # input columns split


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    sizes = [("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
             ("intermediate_size", cfg.intermediate_size)]
    if cfg.num_experts:  # each expert (and the shared ones) split like a dense MLP; the router is replicated
        sizes.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, value in sizes:
        if value % world:
            raise ValueError(f"TP degree {world} does not divide {name} = {value}")
    return cfg.replace(num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                       intermediate_size=cfg.intermediate_size // world, head_dim=cfg.head_dim,
                       moe_intermediate_size=cfg.moe_intermediate_size // world)


def _fused_parts(module: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[int] | None:
    """Row counts of the projections stacked in a fused weight (q, k, v or gate, up), else None."""
    if module == "qkv_proj":
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    if module == "gate_up_proj":
        return [tensor.shape[0] // 2] * 2
    return None


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, world: int,
                 cfg: ModelConfig | None = None) -> torch.Tensor:
    """This rank's slice of ``name``: output rows of q/k/v, gate and up (each projection of a fused
    weight sliced on its own; ``cfg`` gives their sizes), input columns of o and down, else all of it."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in COLUMN:
        return tensor.chunk(world, dim=0)[rank].contiguous()
    if module in ROW and parts[-1] == "weight":
        return tensor.chunk(world, dim=1)[rank].contiguous()
    if cfg is not None and (rows := _fused_parts(module, tensor, cfg)) is not None:
        return torch.cat([p.chunk(world, dim=0)[rank] for p in tensor.split(rows)]).contiguous()
    if parts[-1] == "w_gate_up":  # stacked experts [experts, gate | up, hidden]: each half's rows
        return torch.cat([p.chunk(world, dim=1)[rank] for p in tensor.chunk(2, dim=1)], dim=1).contiguous()
    if parts[-1] == "w_down":  # [experts, hidden, intermediate]: input columns
        return tensor.chunk(world, dim=2)[rank].contiguous()
    return tensor


def shard_model(model: DLMTransformer, rank: int, world: int,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> DLMTransformer:
    """This rank's shard of ``model`` (built on meta, then assigned the slices), with the same fused
    projections as ``model`` (an LLaDA2 checkpoint's q/k/v come fused)."""
    cfg = shard_config(model.config, world)
    with on_meta():
        shard = DLMTransformer(cfg)
        for src, dst in zip(model.layers, shard.layers):
            if src.self_attn.qkv_proj is not None:
                dst.self_attn.fuse()
            if src.mlp.fused:
                dst.mlp.fuse()
    state = {k: shard_tensor(k, v, rank, world, model.config) for k, v in model.state_dict().items()}
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
