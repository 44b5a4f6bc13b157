"""DiffusionGemma (``DiffusionGemmaForBlockDiffusion``): uniform-state block diffusion over Gemma-4 layers.

One set of layers runs two ways:

* **encoder** (``encode``): the prompt, then each finished canvas, causally, appending each layer's K/V to a
  cache (``DGCache``). Exact and reusable, as an autoregressive model's prefill. Sliding-window layers keep only
  their last ``sliding_window - 1`` positions (what the next tokens can still see). A cache has tensors of its own
  (grown by each pass) or a ring and pages of a preallocated ``DGPool`` (full layers' positions in pages, sliding
  layers' in one ring indexed by position modulo the window, K already rotated so order does not matter; see
  ``DGPool``).
* **decoder** (``decode``): a canvas of ``canvas_length`` tokens bidirectionally over itself and over the cache
  (read only), its input embeddings mixed with the previous step's logits (self-conditioning); out come
  soft-capped float32 logits for every canvas position. Over pooled caches each layer writes the canvases' K/V
  into the pool's canvas rows and gathers every row's keys by index (``PoolStep``), with static addresses that a
  CUDA graph replays (engine/dg_graphs.py); otherwise the caches are copied side by side (``PaddedCaches``).

The layers, as transformers' ``modeling_diffusion_gemma`` defines them (this is an own implementation, checked
against it by tests/test_diffusion_gemma.py within 1e-5 in float32): Gemma-4 RMSNorm (float32 inside, the
weight multiplied unshifted), q/k norms and an unscaled v norm, attention scores unscaled (the norms make the
factor 1), sliding layers (``sliding_window``) with their own head size and K/V heads beside full layers
(``global_head_dim``, K = V: full layers have no v_proj), RoPE per layer type (full layers "proportional":
a fraction of each head's frequencies, the rest zero), four norms around attention and the feed-forward, a dense
GELU-tanh MLP beside top-k routed experts (a softmax router with per-expert scales) summed after their own norms,
a per-layer scalar (the encoder's and the decoder's are separate buffers), embeddings scaled by sqrt(hidden),
tied LM head, logits soft-capped by ``final_logit_softcapping``.

Not served: images. The vision tower's weights are skipped at load time and a prompt holding the image token
is refused (``check_text_only``).
"""

from __future__ import annotations

import heapq
import itertools
import json
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layouts import attention
from engine.models.meta import on_meta

ARCH = "DiffusionGemmaForBlockDiffusion"
KV = tuple[torch.Tensor, torch.Tensor]
SLIDING, FULL = "sliding_attention", "full_attention"
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
# transformers' generation defaults (DiffusionGemmaGenerationConfig._get_default_generation_params)
GENERATION_DEFAULTS = {"max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
                       "stability_threshold": 1, "confidence_threshold": 0.005, "max_new_tokens": 256}


# ---------------------------------------------------------------- config


@dataclass(frozen=True)
class Rope:
    """One layer type's rotary embedding: ``kind`` "default" (every dimension) or "proportional" (the first
    ``fraction`` of each head's frequencies rotate, the rest are zero: those dimensions pass through)."""

    theta: float
    kind: str = "default"
    fraction: float = 1.0
    factor: float = 1.0

    def inv_freq(self, head_dim: int, device=None) -> torch.Tensor:
        """Frequencies [head_dim / 2] (as transformers computes them for this RoPE type)."""
        if self.kind == "proportional":
            angles = int(self.fraction * head_dim // 2)
            rotated = 1.0 / (self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device)
                                            .float() / head_dim))
            zeros = torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)
            return torch.cat((rotated, zeros)) / self.factor
        dim = int(head_dim * self.fraction)
        if dim != head_dim:
            raise ValueError(f"default RoPE with partial_rotary_factor {self.fraction} is not supported")
        return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """The text model of a DiffusionGemma checkpoint, per layer where layers differ."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    sliding_window: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    ropes: dict = field(default_factory=dict)  # layer type -> Rope
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    canvas_length: int = 256
    pad_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    bos_token_id: int = 2
    image_token_id: int | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    generation: dict = field(default_factory=lambda: dict(GENERATION_DEFAULTS))
    self_conditioning_size: int = 0  # the self-conditioning MLP's width; 0: intermediate_size (TP shards keep it)

    def __post_init__(self) -> None:
        n = len(self.layer_types)
        if not n or len(self.head_dims) != n or len(self.kv_heads) != n:
            raise ValueError("layer_types, head_dims and kv_heads must name every layer")
        if bad := sorted(set(self.layer_types) - {SLIDING, FULL}):
            raise ValueError(f"unknown layer_types {bad} (known: {SLIDING}, {FULL})")
        for i, kv in enumerate(self.kv_heads):
            if kv <= 0 or self.num_heads % kv:
                raise ValueError(f"layer {i}: num_attention_heads ({self.num_heads}) must be a multiple of its "
                                 f"num_key_value_heads ({kv})")
        if not self.num_experts or not 0 < self.top_k_experts <= self.num_experts or self.moe_intermediate_size <= 0:
            raise ValueError(f"DiffusionGemma layers always route to experts: num_experts {self.num_experts}, "
                             f"top_k_experts {self.top_k_experts}, moe_intermediate_size {self.moe_intermediate_size}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"hidden_activation {self.hidden_activation!r} is not supported")
        if self.sliding_window <= 1:
            raise ValueError(f"sliding_window must be > 1, got {self.sliding_window}")
        for kind in set(self.layer_types):
            if kind not in self.ropes:
                raise ValueError(f"rope_parameters has no entry for {kind}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def kept(self, layer: int) -> int | None:
        """How many past positions a layer's cache keeps: ``sliding_window - 1`` for sliding layers (as
        transformers' DynamicCache), None (all) for full ones."""
        return self.sliding_window - 1 if self.sliding(layer) else None

    def replace(self, **changes) -> DiffusionGemmaConfig:
        data = {f: getattr(self, f) for f in self.__dataclass_fields__}
        data.update(changes)
        return DiffusionGemmaConfig(**data)

    def cache_bytes(self, length: int, dtype_bytes: int = 2) -> int:
        """The bytes of one request's encoder cache after ``length`` encoded positions: K and V of every layer,
        sliding layers holding at most ``sliding_window - 1`` positions (what ``DGCache`` keeps)."""
        total = 0
        for i in range(self.num_layers):
            kept = length if self.kept(i) is None else min(length, self.kept(i))
            total += 2 * self.kv_heads[i] * self.head_dims[i] * dtype_bytes * kept
        return total

    def to_model_config(self) -> ModelConfig:
        """A summary in the shape the rest of Remask reads (context length, vocabulary, token ids, the canvas
        as the block): the sliding layers' heads; ``extra`` holds this config (``diffusion_gemma``)."""
        first = self.layer_types.index(SLIDING) if SLIDING in self.layer_types else 0
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.kv_heads[first], head_dim=self.head_dims[first],
            intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps, qk_norm=True,
            tie_word_embeddings=self.tie_word_embeddings, attention="block_causal", block_size=self.canvas_length,
            mask_token_id=self.pad_token_id, eos_token_id=self.eos_token_ids[0], pad_token_id=self.pad_token_id,
            max_position_embeddings=self.max_position_embeddings, num_experts=self.num_experts,
            experts_per_token=self.top_k_experts, moe_intermediate_size=self.moe_intermediate_size,
            arch="diffusion_gemma", extra={"diffusion_gemma": self.to_dict()})

    def to_dict(self) -> dict:
        """JSON-ready (tuples as lists)."""
        data = asdict(self)
        data["ropes"] = {k: asdict(v) for k, v in self.ropes.items()}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}


def _ids(value, default: int) -> tuple[int, ...]:
    if value is None:
        return (default,)
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def config_from_hf(data: dict, generation: dict | None = None) -> DiffusionGemmaConfig:
    """A DiffusionGemma config.json (``text_config`` inside it; transformers 5.25's spelling, or the released
    checkpoints' ``global_head_dim`` / ``num_global_key_value_heads``) -> DiffusionGemmaConfig. ``generation``:
    its generation_config.json, whose diffusion fields override transformers' defaults."""
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("a DiffusionGemma config.json needs a text_config object")
    if text.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention 'all' (a bidirectional encoder) is not supported")
    n = int(text.get("num_hidden_layers", 30))
    types = list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n:
        raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers is {n}")
    types[-1] = FULL  # as transformers forces it
    head_dim, kv = int(text.get("head_dim", 256)), int(text.get("num_key_value_heads", 4))
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        glob_kv = text.get("num_global_key_value_heads")
        per_layer = {str(i): {"head_dim": int(text.get("global_head_dim", 512)),
                              **({"num_key_value_heads": int(glob_kv)} if glob_kv is not None else {})}
                     for i, t in enumerate(types) if t == FULL}
    head_dims, kv_heads = [], []
    for i in range(n):
        over = per_layer.get(str(i)) or per_layer.get(i) or {}
        head_dims.append(int(over.get("head_dim", head_dim)))
        kv_heads.append(int(over.get("num_key_value_heads", kv)))
    rope_params = text.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    ropes = {}
    for kind in set(types):
        p = rope_params.get(kind)
        if p is None:
            raise ValueError(f"rope_parameters has no entry for {kind}")
        rtype = p.get("rope_type", "default")
        if rtype not in ("default", "proportional"):
            raise ValueError(f"rope_parameters[{kind!r}]: RoPE type {rtype!r} is not supported")
        ropes[kind] = Rope(float(p["rope_theta"]), rtype, float(p.get("partial_rotary_factor", 1.0)),
                           float(p.get("factor", 1.0)))
    gen = dict(GENERATION_DEFAULTS)
    for key, value in (generation or {}).items():
        if key == "sampler_config" and isinstance(value, dict) and value.get("entropy_bound") is not None:
            gen["entropy_bound"] = float(value["entropy_bound"])
        elif key in gen and value is not None:
            gen[key] = value
    cap = text.get("final_logit_softcapping", 30.0)
    return DiffusionGemmaConfig(
        vocab_size=int(text.get("vocab_size", 262_144)), hidden_size=int(text.get("hidden_size", 2304)),
        intermediate_size=int(text.get("intermediate_size", 9216)),
        num_heads=int(text.get("num_attention_heads", 8)), layer_types=tuple(types), head_dims=tuple(head_dims),
        kv_heads=tuple(kv_heads), sliding_window=int(text.get("sliding_window", 512)),
        num_experts=int(text.get("num_experts") or 0), top_k_experts=int(text.get("top_k_experts") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0), ropes=ropes,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=None if cap is None else float(cap),
        hidden_activation=text.get("hidden_activation", "gelu_pytorch_tanh"),
        canvas_length=int(data.get("canvas_length") or 256), pad_token_id=int(text.get("pad_token_id") or 0),
        eos_token_ids=_ids((generation or {}).get("eos_token_id", text.get("eos_token_id")), 1),
        bos_token_id=int(text.get("bos_token_id") or 2), image_token_id=data.get("image_token_id"),
        max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", True)), generation=gen)


# ---------------------------------------------------------------- pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma-4's RMSNorm: float32 inside (the mean square's power -1/2), times the weight in float32 (unshifted),
    rounded once to ``x``'s dtype; no weight: the unscaled norm."""
    f = x.float()
    out = f * torch.pow(f.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda x: F.gelu(x, approximate="tanh")) if name == "gelu_pytorch_tanh" else F.gelu


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over the whole head (zero frequencies leave their dimensions as they are)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax over experts of the unscaled-normed hidden state times ``scale`` / sqrt(hidden); the top k
    renormalised to sum to one, each times its expert's ``per_expert_scale``."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.root = cfg.hidden_size ** -0.5
        self.eps, self.k = cfg.rms_norm_eps, cfg.top_k_experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] float32, expert ids [N, k])."""
        h = rms_norm(x, None, self.eps) * self.scale * self.root
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k=self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Experts(nn.Module):
    """The routed experts, stacked: ``gate_up_proj`` [E, 2 x I, H] and ``down_proj`` [E, H, I] (the checkpoint's
    layout). The (token, choice) pairs are sorted by expert; where torch has a grouped product for the device
    and dtype (``transformer.grouped_mm_works``) every expert runs in one grouped product per projection with
    the groups' ends computed on the device (no host sync: capturable), else each expert with pairs runs once
    on them (the host reads the counts). Each pair's output is weighted in float32 and a token's k outputs are
    summed in float32, then rounded once (as transformers' grouped experts do)."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act = _act(cfg.hidden_activation)
        self.grouped = True  # use the grouped product where it runs (False: the loop over experts)

    @property
    def kernel(self) -> str:
        from engine.models.transformer import grouped_mm_works

        w = self.down_proj
        aligned = all(n * w.element_size() % 16 == 0 for n in w.shape[1:])  # grouped kernels read 16-byte rows
        return "grouped" if self.grouped and aligned and grouped_mm_works(w.device.type, w.dtype) else "loop"

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        rows = x[order // k]
        n_experts = self.gate_up_proj.shape[0]
        if self.kernel == "grouped":
            from engine.models.transformer import GROUPED_MM

            counts = flat.new_zeros(n_experts).index_add_(0, flat, torch.ones_like(flat))
            ends = counts.cumsum(0).to(torch.int32)
            gate, up = GROUPED_MM(rows, self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
            out = GROUPED_MM(self.act(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        else:
            out = torch.empty(len(rows), x.shape[-1], dtype=x.dtype, device=x.device)
            start = 0
            for expert, n in enumerate(torch.bincount(flat, minlength=n_experts).tolist()):
                if n:
                    gate, up = F.linear(rows[start:start + n], self.gate_up_proj[expert]).chunk(2, dim=-1)
                    out[start:start + n] = F.linear(self.act(gate) * up, self.down_proj[expert])
                    start += n
        routed = torch.empty_like(out).index_copy_(0, order, out).unflatten(0, (len(x), k))
        return (routed * weights[..., None]).sum(1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, layer: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.kv_heads[layer], cfg.head_dims[layer]
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        # full layers: V is K's projection (before K's norm and rotation)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False) if cfg.sliding(layer) else None
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = Norm(self.hd, cfg.rms_norm_eps)
        self.k_norm = Norm(self.hd, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def forward(self, x, cos, sin, mask, past: KV | PoolRead | None) -> tuple[torch.Tensor, KV]:
        """x [N, T, H]; past: (K, V) [N, kv heads, C, D], the pool's keys (``PoolRead``: the fresh K/V written
        to the canvas rows, the keys gathered) or None. Returns (output, all K/V: past + fresh)."""
        n, t, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).unflatten(-1, (self.nh, self.hd))), cos, sin).transpose(1, 2)
        raw = self.k_proj(x).unflatten(-1, (self.nkv, self.hd))
        v = raw if self.v_proj is None else self.v_proj(x).unflatten(-1, (self.nkv, self.hd))
        k = rotate(self.k_norm(raw), cos, sin)
        v = rms_norm(v, None, self.eps)
        if isinstance(past, PoolRead):
            k, v = past.attend(k, v)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if past is not None and past[0].shape[2]:
                k, v = torch.cat((past[0], k), 2), torch.cat((past[1], v), 2)
        # the kernel's output may come back in any strides (engine/models/layouts.py): transposed, then one reshape
        out = attention(q, k, v, attn_mask=mask, enable_gqa=self.nh != self.nkv, scale=1.0).transpose(1, 2)
        return self.o_proj(out.reshape(n, t, -1)), (k, v)


class Layer(nn.Module):
    """One Gemma-4 layer; the encoder and the decoder share its weights but not their per-layer scalars."""

    def __init__(self, cfg: DiffusionGemmaConfig, index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, index)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.hidden_activation)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            setattr(self, name, Norm(h, eps))
        self.register_buffer("layer_scalar", torch.ones(1))  # the decoder's
        self.register_buffer("encoder_layer_scalar", torch.ones(1))
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallelism: sums partials

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.reduce is None else self.reduce(x)

    def forward(self, x, cos, sin, mask, past: KV | None, encoder: bool) -> tuple[torch.Tensor, KV]:
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + self.post_attention_layernorm(self._sum(h))
        dense = self.post_feedforward_layernorm_1(self._sum(self.mlp(self.pre_feedforward_layernorm(x))))
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat)
        routed = self._sum(self.experts(self.pre_feedforward_layernorm_2(flat), ids, weights)).reshape(x.shape)
        ff = self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))
        return (x + ff) * (self.encoder_layer_scalar if encoder else self.layer_scalar), kv


class SelfConditioning(MLP):
    """The previous step's logits as soft embeddings through a gated MLP (a normed input), added to the canvas's
    embeddings, the sum normed (unscaled)."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.self_conditioning_size or cfg.intermediate_size, cfg.hidden_activation)
        self.pre_norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def condition(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is not None:  # none (the first step): a zero signal, whose MLP output is exactly zero
            embeds = embeds + super().forward(self.pre_norm(soft))
        return rms_norm(embeds, None, self.eps)




_CACHE_UIDS = itertools.count()


class DGPool:
    """Preallocated encoder K/V for DiffusionGemma requests: per layer-shape group (sliding or full, K/V heads, head
    size) one zeroed tensor [2 (K, V), positions, kv heads, head dim], K already rotated, so keys may be read in
    any order. Its positions, one layer of the group after the other:

    * a full layer's ``slots`` pages of ``capacity`` positions each (a request's position p at page
      ``slots[p // capacity]``, offset ``p % capacity``: a longer cache takes several pages);
    * a sliding layer's ``rings`` rings of ``sliding_window - 1`` positions each (position p at
      ``p % (sliding_window - 1)`` of the request's one ring: what the next tokens can still see, however long the
      request);
    * after every layer's pages or rings, ``rows`` canvases of ``canvas_length`` positions, shared by the group's
      layers (they run one after the other): a decoder forward's row r writes its canvas's K/V there and attends
      to them with the request's gathered keys (scratch, overwritten by the next layer).

    A request takes one ring and whole pages (``slots_for``) together, for its whole life (its prompt plus
    ``max_tokens``: what the instance scheduler reserves, so serving never asks for more than is free), and gives
    both back when it finishes, is aborted or migrates out (``DGCache.release``; also when the cache is dropped):
    ``acquire`` takes both or neither, ``release`` checks both before it frees either. ``rings`` (default
    ``slots``; never more, since a request holds at least one page) is the most requests that can hold the pool at
    once: sized to the most residents the scheduler allows (``CanvasServeEngine``; ``Instance`` caps its residents
    at it), so the rings never run out while its reservations hold. A cache that cannot take a ring and its pages
    (no pool, not enough free) keeps tensors of its own, counted in ``beyond``."""

    def __init__(self, cfg: DiffusionGemmaConfig, slots: int, capacity: int, rows: int, dtype, device,
                 rings: int | None = None) -> None:
        rings = slots if rings is None else rings
        if slots < 1 or capacity < 1 or rows < 1 or rings < 1:
            raise ValueError(f"a DiffusionGemma KV pool needs at least one page, ring, position and row, got "
                             f"{slots} pages x {capacity} positions, {rings} rings, {rows} rows")
        if rings > slots:
            raise ValueError(f"a DiffusionGemma KV pool's rings ({rings}) exceed its pages ({slots}): a request "
                             "holds at least one page, so the extra rings could never be used")
        self.cfg, self.capacity, self.rows, self.window = cfg, capacity, rows, cfg.sliding_window - 1
        self.length = cfg.canvas_length
        self.shapes, self.where, members = self.groups(cfg)
        self.span = [self.window if s else capacity for s, _, _ in self.shapes]  # a page's or ring's positions
        self.units = [rings if s else slots for s, _, _ in self.shapes]  # a layer's rings or pages
        self.base = [len(m) * n * span for m, n, span in zip(members, self.units, self.span)]  # the canvas rows
        self.kv = [torch.zeros(2, b + rows * self.length, kv, d, dtype=dtype, device=device)
                   for b, (_, kv, d) in zip(self.base, self.shapes)]
        self.num_slots, self.num_rings = slots, rings
        self._free = list(range(slots))  # heaps: the lowest free page and ring first
        self._free_rings = list(range(rings))
        self.beyond = 0  # caches that could not take a ring and pages and got tensors of their own

    @staticmethod
    def groups(cfg: DiffusionGemmaConfig) -> tuple[list[tuple], list[tuple[int, int]], list[list[int]]]:
        """The layer-shape groups: their (sliding, kv heads, head dim), each layer's (group, index in it), each
        group's layers."""
        keys: dict[tuple, int] = {}
        where, members = [], []
        for i in range(cfg.num_layers):
            g = keys.setdefault((cfg.sliding(i), cfg.kv_heads[i], cfg.head_dims[i]), len(keys))
            if g == len(members):
                members.append([])
            where.append((g, len(members[g])))
            members[g].append(i)
        return list(keys), where, members

    @classmethod
    def sizes(cls, cfg: DiffusionGemmaConfig, capacity: int, rows: int, dtype_bytes: int) -> tuple[int, int, int]:
        """(bytes of one page: its full layers' ``capacity`` positions, bytes of one ring: its sliding layers'
        ``sliding_window - 1`` positions, bytes of ``rows`` canvas rows) of a pool of ``cfg``."""
        shapes, _, members = cls.groups(cfg)
        per = [len(m) * 2 * kv * d * dtype_bytes for m, (_, kv, d) in zip(members, shapes)]
        page = sum(b * capacity for b, (s, _, _) in zip(per, shapes) if not s)
        ring = sum(b * (cfg.sliding_window - 1) for b, (s, _, _) in zip(per, shapes) if s)
        row = sum(2 * kv * d * dtype_bytes * cfg.canvas_length for _, kv, d in shapes)
        return page, ring, rows * row

    @property
    def slots(self) -> int:
        """Its pages (full layers' positions)."""
        return self.num_slots

    @property
    def rings(self) -> int:
        """Its rings (sliding layers' positions): the most requests it holds at once."""
        return self.num_rings

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def free_rings(self) -> int:
        return len(self._free_rings)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes of one page: its full layers' ``capacity`` positions."""
        return self.sizes(self.cfg, self.capacity, self.rows, self.dtype.itemsize)[0]

    @property
    def bytes_per_ring(self) -> int:
        """Device bytes of one ring: its sliding layers' ``sliding_window - 1`` positions."""
        return self.sizes(self.cfg, self.capacity, self.rows, self.dtype.itemsize)[1]

    @property
    def row_bytes(self) -> int:
        """Device bytes of the canvas rows (the decoder's scratch), all of them."""
        return self.nbytes - self.slots * self.bytes_per_slot - self.rings * self.bytes_per_ring

    def slots_for(self, positions: int) -> int:
        return max(-(-positions // self.capacity), 1)

    def acquire(self, pages: int) -> tuple[int, list[int]] | None:
        """One ring and ``pages`` pages, or None (nothing taken) when either is short."""
        if pages > len(self._free) or not self._free_rings:
            return None
        return heapq.heappop(self._free_rings), [heapq.heappop(self._free) for _ in range(pages)]

    def release(self, ring: int, slots: list[int]) -> None:
        """Give back a ring and its pages; a ring or page not held (never taken, or given back already) is an
        error, raised before anything is freed."""
        if not 0 <= ring < self.rings or ring in self._free_rings:
            raise ValueError(f"ring {ring} is not held")
        for slot in slots:
            if not 0 <= slot < self.slots or slot in self._free or slots.count(slot) > 1:
                raise ValueError(f"slot {slot} is not held")
        heapq.heappush(self._free_rings, ring)
        for slot in slots:
            heapq.heappush(self._free, slot)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s group tensor [2, positions, kv heads, head dim] (its positions: ``index``)."""
        return self.kv[self.where[i][0]]

    def index(self, i: int, ring: int, slots: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Where layer ``i`` of a cache holding ``ring`` and ``slots`` keeps its ``positions`` in its group's tensor
        (host)."""
        g, j = self.where[i]
        offset = j * self.units[g] * self.span[g]
        if self.shapes[g][0]:
            return offset + ring * self.window + positions % self.window
        table = torch.tensor(slots, dtype=torch.long)
        return offset + table[positions // self.capacity] * self.capacity + positions % self.capacity

    def canvas_rows(self, g: int, rows: int) -> slice:
        """The positions of the first ``rows`` canvas rows of group ``g``, one after the other."""
        if rows > self.rows:
            raise ValueError(f"{rows} canvases exceed the pool's {self.rows} canvas rows")
        return slice(self.base[g], self.base[g] + rows * self.length)


class DGCache:
    """The encoder's K/V per layer for N rows of equal length (N is 1 in the pool). Sliding-window layers keep
    only their last ``sliding_window - 1`` positions; full layers keep all. ``length``: positions encoded so far
    (the next token's position).

    Its own tensors (``layers``: [N, kv heads, kept positions, head dim] per layer, grown by each encoder pass),
    or, once ``place``d, one ring and pages of a ``DGPool`` (``ring``, ``slots``; ``layers`` stays empty): no
    allocation per encoder pass, ``release`` gives them back."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        self.cfg = cfg
        self.layers: list[KV | None] = [None] * cfg.num_layers
        self.length = 0
        self.uid = next(_CACHE_UIDS)  # never reused in the process (unlike id()): names this cache in keys
        self.pool: DGPool | None = None
        self.ring: int | None = None  # its sliding layers' ring in the pool
        self.slots: list[int] = []  # its full layers' pages in the pool
        self.positions = 0  # the positions its pages hold
        self._finalizer = None

    @property
    def pooled(self) -> bool:
        return self.pool is not None

    def place(self, pool: DGPool | None, positions: int, dtype: torch.dtype | None = None) -> bool:
        """Take a ring and the pages for ``positions`` positions of ``pool`` (an empty cache, once). False,
        counted in ``pool.beyond``, when they are not free or the pool is not this cache's (another head layout, or
        not of ``dtype``, the model's): the cache keeps tensors of its own. False without a pool."""
        if pool is None or self.pooled:
            return self.pooled
        if self.length or any(kv is not None for kv in self.layers):
            raise RuntimeError("only an empty cache takes pool slots")
        mine, its = self.cfg, pool.cfg
        fits = ((mine.layer_types, mine.kv_heads, mine.head_dims, mine.sliding_window)
                == (its.layer_types, its.kv_heads, its.head_dims, its.sliding_window) and dtype in (None, pool.dtype))
        got = pool.acquire(pool.slots_for(positions)) if fits else None
        if got is None:
            pool.beyond += 1
            return False
        ring, slots = got
        self.pool, self.ring, self.slots, self.positions = pool, ring, slots, len(slots) * pool.capacity
        self._finalizer = weakref.finalize(self, pool.release, ring, slots)  # back however it is dropped
        return True

    def release(self) -> None:
        """Give its ring and pages back to the pool, its tensors to the allocator (a finished, aborted or
        migrated request): it holds nothing after (``length`` stays: the positions it had encoded)."""
        if self._finalizer is not None:
            self._finalizer()
        self.pool, self.ring, self.slots, self.positions, self._finalizer = None, None, [], 0, None
        self.layers = [None] * self.cfg.num_layers

    def kept(self, layer: int) -> int:
        if self.pooled:
            keep = self.cfg.kept(layer)
            return self.length if keep is None else min(self.length, keep)
        kv = self.layers[layer]
        return 0 if kv is None else kv[0].shape[2]

    def held(self, layer: int) -> torch.Tensor:
        """Pooled: the positions layer ``layer`` holds, in order (host)."""
        return torch.arange(self.length - self.kept(layer), self.length)

    def where(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Pooled: where layer ``layer`` keeps ``positions`` in its group's tensor (host)."""
        return self.pool.index(layer, self.ring, self.slots, positions)

    def past(self, layer: int) -> KV | None:
        """Layer ``layer``'s K/V [1, kv heads, kept, head dim] in position order (pooled: gathered)."""
        if not self.pooled:
            return self.layers[layer]
        if not self.kept(layer):
            return None
        kv = self.pool.layer(layer)
        idx = self.where(layer, self.held(layer)).to(kv.device)
        k, v = kv[0].index_select(0, idx), kv[1].index_select(0, idx)
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def store(self, layer: int, kv: KV, fresh: int | None = None) -> None:
        """Layer ``layer``'s K/V after an encoder pass: ``kv`` [1, kv heads, kept + fresh, head dim], its last
        ``fresh`` positions the pass's (at ``length`` onward; ``length`` is not moved here). Own tensors keep the
        whole (the window's tail for a sliding layer); pooled, the fresh positions are written into its pages (a
        sliding layer's last ``sliding_window - 1`` of them into its ring)."""
        keep = self.cfg.kept(layer)
        k, v = kv
        if not self.pooled:
            if keep is not None and k.shape[2] > keep:
                k, v = k[:, :, -keep:].contiguous(), v[:, :, -keep:].contiguous()
            self.layers[layer] = (k, v)
            return
        n = k.shape[2] if fresh is None else fresh
        if self.length + n > self.positions:
            raise RuntimeError(f"a pooled cache of {self.positions} positions cannot hold {self.length + n}")
        lo = n if keep is None else min(n, keep)  # a sliding layer's ring takes the last ``keep`` of them
        pos = torch.arange(self.length + n - lo, self.length + n)
        dst = self.pool.layer(layer)
        idx = self.where(layer, pos).to(dst.device)
        dst[0].index_copy_(0, idx, k[0, :, k.shape[2] - lo:].transpose(0, 1))
        dst[1].index_copy_(0, idx, v[0, :, v.shape[2] - lo:].transpose(0, 1))

    @property
    def nbytes(self) -> int:
        """The bytes of K/V it holds (pooled: its kept positions' share of the pool)."""
        if self.pooled:
            return self.cfg.cache_bytes(self.length, self.pool.dtype.itemsize)
        return sum(k.nbytes + v.nbytes for kv in self.layers if kv is not None for k, v in [kv])


class PoolStep:
    """The decoder forward over pooled caches, as the layers read it: ``rows`` canvases of ``t`` tokens (the
    first ``len(caches)`` the caches', any others fillers that attend only to their own canvas), per layer the
    positions of each row's keys in its group's tensor [rows, keys] (its held positions left-padded to
    ``past[group]``, then its canvas row's; padding points at the row's canvas), per group the mask
    [rows, 1, 1, keys] of the keys a row holds. Built on the host, moved once; a graph copies these tensors into
    its own (engine/dg_graphs.py)."""

    def __init__(self, pool: DGPool, caches: list[DGCache], t: int, device, rows: int | None = None,
                 past: list[int] | None = None) -> None:
        n = len(caches)
        rows = n if rows is None else rows
        if t != pool.length:
            raise ValueError(f"the pool's canvas rows hold {pool.length} tokens, not {t}")
        self.pool, self.t, self.rows, self.n = pool, t, rows, n
        self.lengths = [c.length for c in caches] + [0] * (rows - n)
        self.key = tuple((c.uid, c.length) for c in caches)
        first = [pool.where.index((g, 0)) for g in range(len(pool.shapes))]
        kept = [[c.kept(i) for c in caches] + [0] * (rows - n) for i in first]  # a group's layers keep alike
        self.past = [max(k, default=0) for k in kept] if past is None else list(past)
        if any(p < max(k, default=0) for p, k in zip(self.past, kept)):
            raise ValueError("past key room shorter than a cache's held positions")
        canvas = torch.arange(t)
        rowbase, ok = [], []
        for g in range(len(first)):
            width = self.past[g] + t
            base = pool.base[g] + torch.arange(rows)[:, None] * t
            rowbase.append(base.expand(rows, width).clone())  # padding: the row's own canvas start
            rowbase[g][:, self.past[g]:] = base + canvas
            mask = torch.zeros(rows, width, dtype=torch.bool)
            mask[:, self.past[g]:] = True
            for r, k in enumerate(kept[g][:n]):
                mask[r, self.past[g] - k: self.past[g]] = True
            ok.append(mask)
        self.index = []
        for i, (g, _) in enumerate(pool.where):
            idx = rowbase[g].clone()
            for r, c in enumerate(caches):
                k = kept[g][r]
                if k:
                    idx[r, self.past[g] - k: self.past[g]] = c.where(i, c.held(i))
            self.index.append(idx.to(device))
        self.mask = [m[:, None, None, :].to(device) for m in ok]
        self.pos = (torch.tensor(self.lengths)[:, None] + canvas).to(device)

    def fits(self, caches: list[DGCache]) -> bool:
        return self.key == tuple((c.uid, c.length) for c in caches)

    @staticmethod
    def over(caches: list[DGCache], t: int) -> DGPool | None:
        """The pool a step over ``caches`` with canvases of ``t`` reads in place: the one every cache is in, when
        it has a canvas row for each and its rows are of ``t`` tokens; else None (the caches go side by side)."""
        pools = {id(c.pool): c.pool for c in caches}
        pool = next(iter(pools.values()), None) if len(pools) == 1 else None
        return pool if pool is not None and len(caches) <= pool.rows and t == pool.length else None

    def layer(self, i: int) -> PoolRead:
        g, _ = self.pool.where[i]
        return PoolRead(self.pool.layer(i), self.pool.canvas_rows(g, self.rows), self.index[i])


@dataclass(frozen=True)
class PoolRead:
    """One layer's keys in the pool: the canvases' K/V go to ``rows`` (their scratch), then every key is gathered
    by ``index`` [N, keys]."""

    kv: torch.Tensor  # [2, positions, kv heads, head dim]
    rows: slice
    index: torch.Tensor

    def attend(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        """k, v [N, T, kv heads, D] (the canvases') -> all keys and values [N, kv heads, keys, D]."""
        n, t, h, d = k.shape
        self.kv[0, self.rows].copy_(k.reshape(n * t, h, d))
        self.kv[1, self.rows].copy_(v.reshape(n * t, h, d))
        flat = self.index.reshape(-1)
        keys = self.kv[0].index_select(0, flat).view(n, -1, h, d).transpose(1, 2)
        values = self.kv[1].index_select(0, flat).view(n, -1, h, d).transpose(1, 2)
        return keys, values


# ---------------------------------------------------------------- the model


class DiffusionGemma(nn.Module):
    """Module names are the checkpoint's decoder names (``model.decoder.`` stripped), plus each layer's
    ``encoder_layer_scalar``."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._inv_freq: dict[tuple, torch.Tensor] = {}
        self._scales: dict[tuple, torch.Tensor] = {}

    # -- inputs

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        return F.embedding(ids, w) * self._embed_scale(w)

    def rope_tables(self, positions: torch.Tensor, dtype) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer index: cos, sin [N, T, 1, head dim] for positions [N, T] (one table per layer type)."""
        tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        out = {}
        for i, kind in enumerate(self.config.layer_types):
            key = (kind, self.config.head_dims[i])
            if key not in tables:
                cache_key = (*key, positions.device)
                inv = self._inv_freq.get(cache_key)
                if inv is None:
                    inv = self._inv_freq[cache_key] = self.config.ropes[kind].inv_freq(key[1], positions.device)
                freqs = positions.float()[..., None] * inv
                emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
                tables[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
            out[i] = tables[key]
        return out

    def soft_embeddings(self, logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning signal of a step's logits [..., V]: their softmax (float32, then the embeddings'
        dtype) times the embedding matrix, scaled as the embeddings are: [..., H]."""
        w = self.embed_tokens.weight
        probs = logits.softmax(dim=-1, dtype=torch.float32).to(w.dtype)
        return torch.matmul(probs, w) * self._embed_scale(w)

    def _embed_scale(self, w: torch.Tensor) -> torch.Tensor:
        """sqrt(hidden) in the embeddings' dtype on their device, made once (a CUDA graph's capture may not copy a
        host scalar to the device)."""
        key = (w.dtype, w.device)
        scale = self._scales.get(key)
        if scale is None:
            scale = self._scales[key] = torch.tensor(self.config.hidden_size ** 0.5, dtype=w.dtype, device=w.device)
        return scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # -- the two passes

    def encode(self, input_ids: torch.Tensor, cache: DGCache) -> torch.Tensor:
        """Append ``input_ids`` [N, T] (at positions cache.length onward) to ``cache``, causally. Returns the
        final normed hidden states [N, T, H] (transformers' ``encoder_last_hidden_state``)."""
        n, t = input_ids.shape
        x = self.embed(input_ids)
        start = cache.length
        qpos = torch.arange(start, start + t, device=x.device)
        tables = self.rope_tables(qpos.expand(n, t), x.dtype)
        masks: dict[tuple[bool, int], torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            kept = cache.kept(i)
            sliding = self.config.sliding(i)
            mkey = (sliding, kept)
            if mkey not in masks:
                kpos = torch.arange(start - kept, start + t, device=x.device)
                allowed = kpos[None, :] <= qpos[:, None]
                if sliding:
                    allowed &= kpos[None, :] > qpos[:, None] - self.config.sliding_window
                masks[mkey] = allowed[None, None]
            cos, sin = tables[i]
            x, kv = layer(x, cos, sin, masks[mkey], cache.past(i), encoder=True)
            cache.store(i, kv, t)
        cache.length = start + t
        return self.norm(x)

    def encode_many(self, chunks: list[list[int]], caches: list[DGCache]) -> None:
        """Encode each ``chunks[n]`` into ``caches[n]`` (different requests: their own lengths, their own caches)
        in one forward: the new tokens right-padded, the cached K/V left-padded, one mask per row and layer
        (causal, the sliding window, no padding; a padded query sees itself, so no row is empty)."""
        if len(chunks) != len(caches) or not chunks or any(not c for c in chunks):
            raise ValueError("encode_many needs one non-empty chunk per cache")
        if len(chunks) == 1:
            self.encode(torch.tensor([chunks[0]], device=self.embed_tokens.weight.device), caches[0])
            return
        dev = self.embed_tokens.weight.device
        n, t = len(chunks), max(len(c) for c in chunks)
        ids = torch.full((n, t), self.config.pad_token_id, dtype=torch.long, device=dev)
        for row, chunk in enumerate(chunks):
            ids[row, : len(chunk)] = torch.tensor(chunk, device=dev)
        lengths = torch.tensor([len(c) for c in chunks], device=dev)
        starts = torch.tensor([c.length for c in caches], device=dev)
        qpos = starts[:, None] + torch.arange(t, device=dev)  # [N, T]
        x = self.embed(ids)
        tables = self.rope_tables(qpos, x.dtype)
        kept_all = [[c.kept(i) for c in caches] for i in range(len(self.layers))]
        masks: dict[tuple, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            kept = kept_all[i]
            longest = max(kept)
            past = None
            if longest:
                held = [c.past(i) for c in caches]  # pooled caches: gathered from their slots
                ref = next(kv for kv in held if kv is not None)[0]
                shape = (n, ref.shape[1], longest, ref.shape[3])
                keys, values = ref.new_zeros(shape), ref.new_zeros(shape)
                for row, kv in enumerate(held):
                    if kept[row]:
                        keys[row, :, longest - kept[row]:], values[row, :, longest - kept[row]:] = kv
                past = (keys, values)
            sliding = self.config.sliding(i)
            mkey = (sliding, tuple(kept))
            if mkey not in masks:
                kept_t = torch.tensor(kept, device=dev)
                j = torch.arange(longest + t, device=dev)[None, :]  # [1, K]
                in_past = j < longest
                kpos = torch.where(in_past, starts[:, None] - (longest - j), starts[:, None] + (j - longest))
                valid = torch.where(in_past, j >= longest - kept_t[:, None], (j - longest) < lengths[:, None])
                allowed = valid[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])  # [N, T, K]
                if sliding:
                    allowed &= kpos[:, None, :] > qpos[:, :, None] - self.config.sliding_window
                allowed |= (j - longest)[:, None, :] == torch.arange(t, device=dev)[None, :, None]  # itself
                masks[mkey] = allowed[:, None]
            cos, sin = tables[i]
            x, (keys, values) = layer(x, cos, sin, masks[mkey], past, encoder=True)
            for row, c in enumerate(caches):
                lo, hi = longest - kept[row], longest + len(chunks[row])
                k, v = keys[row:row + 1, :, lo:hi], values[row:row + 1, :, lo:hi]
                c.store(i, (k, v) if c.pooled else (k.clone(), v.clone()), len(chunks[row]))
        for c, chunk in zip(caches, chunks):
            c.length += len(chunk)

    def decode(self, canvas: torch.Tensor, cache: DGCache | list[DGCache] | PaddedCaches | PoolStep,
               self_conditioning: torch.Tensor | None = None,
               conditioned: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of ``decode_hidden`` (below): soft-capped float32 [N, L, V]."""
        return self.logits(self.decode_hidden(canvas, cache, self_conditioning, conditioned))

    def decode_hidden(self, canvas: torch.Tensor, cache: DGCache | list[DGCache] | PaddedCaches | PoolStep,
                      self_conditioning: torch.Tensor | None = None,
                      conditioned: torch.Tensor | None = None) -> torch.Tensor:
        """One denoising forward: ``canvas`` [N, L] at positions cache.length onward, bidirectionally over itself
        and the cache (read only), ``self_conditioning`` the previous step's (processed) logits [N, L, V] or None.
        ``cache`` may be one per row (different requests, different lengths): their K/V are left-padded to the
        longest and the padding masked out (``PaddedCaches``: padded once, reused by every step while the
        caches stay as they are). Caches in one ``DGPool`` (or a ``PoolStep`` over them) are read in place
        instead: each layer writes the canvases' K/V into the pool's canvas rows and gathers every row's keys by
        index (no padded copy; the mask hides a row's padding). ``conditioned`` (bool [N]): the rows whose
        ``self_conditioning`` counts (the others get a zero signal, as at their first step; transformers'
        ``self_conditioning_mask``). Returns the final normed hidden states [N, L, H] (``decode``: their logits)."""
        n, t = canvas.shape
        x = self.embed(canvas)
        soft = None
        if self_conditioning is not None:  # logits [N, L, V], or their soft embeddings [N, L, H] already
            soft = self_conditioning if self_conditioning.shape[-1] != self.config.vocab_size \
                else self.soft_embeddings(self_conditioning)
            if conditioned is not None:  # a zero signal gives exactly the unconditioned embeddings
                soft = soft * conditioned.to(device=soft.device, dtype=soft.dtype)[:, None, None]
        x = self.self_conditioning.condition(x, soft)
        caches = [cache] if isinstance(cache, DGCache) else cache
        if isinstance(caches, list) and (pool := PoolStep.over(caches, t)) is not None:
            cache = PoolStep(pool, caches, t, x.device)
        if isinstance(cache, PoolStep):
            if cache.rows != n or cache.t != t:
                raise ValueError(f"pool step built for {cache.rows} canvases of {cache.t}, got {n} of {t}")
            pos = cache.pos
            pasts = [cache.layer(i) for i in range(len(self.layers))]
            masks = [cache.mask[cache.pool.where[i][0]] for i in range(len(self.layers))]
        elif isinstance(cache, DGCache):
            pos = torch.arange(cache.length, cache.length + t, device=x.device).expand(n, t)
            pasts, masks = cache.layers, [None] * len(self.layers)
        else:
            padded = cache if isinstance(cache, PaddedCaches) else PaddedCaches(cache, t, x.device)
            if len(padded.lengths) != n or padded.t != t:
                raise ValueError(f"caches padded for {len(padded.lengths)} canvases of {padded.t}, got {n} of {t}")
            pos = torch.tensor(padded.lengths, device=x.device)[:, None] + torch.arange(t, device=x.device)
            pasts, masks = padded.pasts, padded.masks
        tables = self.rope_tables(pos, x.dtype)
        for i, layer in enumerate(self.layers):
            cos, sin = tables[i]
            x, _ = layer(x, cos, sin, masks[i], pasts[i], encoder=False)
        return self.norm(x)


class PaddedCaches:
    """Caches of different requests laid side by side for one decoder forward over canvases of ``t`` tokens:
    per layer their K/V left-padded to the longest (zeros) and the mask [N, 1, t, C + t] that hides the padding
    (None where no row is padded). ``key`` says which caches at which lengths it was built from: a caller may
    reuse it for as long as that holds (a canvas's denoising steps do not change the caches)."""

    def __init__(self, caches: list[DGCache], t: int, device) -> None:
        self.t = t
        self.lengths = [c.length for c in caches]
        self.key = tuple((c.uid, c.length) for c in caches)
        self.pasts: list[KV | None] = []
        self.masks: list[torch.Tensor | None] = []
        for i in range(len(caches[0].layers)):
            kvs = [c.past(i) for c in caches]
            kept = [0 if kv is None else kv[0].shape[2] for kv in kvs]
            longest = max(kept)
            if longest == 0:
                self.pasts.append(None)
                self.masks.append(None)
                continue
            ref = next(kv for kv in kvs if kv is not None)[0]
            shape = (len(caches), ref.shape[1], longest, ref.shape[3])
            keys, values = ref.new_zeros(shape), ref.new_zeros(shape)
            for row, (kv, k) in enumerate(zip(kvs, kept)):
                if k:
                    keys[row, :, longest - k:], values[row, :, longest - k:] = kv
            self.pasts.append((keys, values))
            if min(kept) == longest:
                self.masks.append(None)
                continue
            first = torch.tensor([longest - k for k in kept], device=device)
            allowed = torch.arange(longest + t, device=device)[None, :] >= first[:, None]  # [N, C + t]
            self.masks.append(allowed[:, None, None, :].expand(len(caches), 1, t, longest + t))

    def fits(self, caches: list[DGCache]) -> bool:
        """Whether this was built from exactly ``caches`` at their current lengths."""
        return self.key == tuple((c.uid, c.length) for c in caches)


# ---------------------------------------------------------------- loading


def checkpoint_name(name: str) -> str | None:
    """A checkpoint tensor's name here; None for tensors not loaded (the vision tower, the encoder's copies of
    tied weights, a tied lm_head)."""
    if name.startswith(VISION_PREFIXES):
        return None
    if name.startswith("model.decoder."):
        return name.removeprefix("model.decoder.")
    if name.startswith("model.encoder.language_model.layers.") and name.endswith(".layer_scalar"):
        return name.removeprefix("model.encoder.language_model.").removesuffix("layer_scalar") + "encoder_layer_scalar"
    if name == "lm_head.weight":
        return name
    if name.startswith("model.encoder.language_model."):
        return None  # tied to the decoder's (transformers writes them only when they are not tied)
    return ""  # unknown


def read_config(directory: str | Path) -> DiffusionGemmaConfig:
    directory = Path(directory)
    data = json.loads((directory / "config.json").read_text())
    gen_file = directory / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return config_from_hf(data, generation)


def load(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
         ) -> DiffusionGemma:
    """Load a DiffusionGemma checkpoint directory (the vision tower's weights skipped) into an eval-mode model."""
    from safetensors import safe_open

    from engine.models.checkpoint import weight_files

    directory = Path(path)
    cfg = read_config(directory)
    with on_meta():
        model = DiffusionGemma(cfg)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    seen: set[str] = set()
    unknown: list[str] = []
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            part = {}
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                ours = checkpoint_name(key)
                if ours is None or (ours == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                if ours not in expected or ours in seen:
                    unknown.append(key)
                    continue
                seen.add(ours)
                part[ours] = f.get_tensor(key).to(dtype=dtype)
        model.load_state_dict(part, strict=False, assign=True)
    if unknown:
        raise ValueError(f"unexpected or duplicate tensors in checkpoint: {sorted(unknown)[:5]}")
    missing = expected - seen - {n for n in expected if n.endswith("encoder_layer_scalar")}
    if missing:
        raise ValueError(f"tensors missing from checkpoint: {sorted(missing)[:5]} ({len(missing)} in all)")
    for layer in model.layers:  # an encoder scalar the checkpoint leaves out is one (transformers' init)
        if layer.encoder_layer_scalar.is_meta:
            layer.encoder_layer_scalar = torch.ones(1, dtype=dtype, device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    still = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still:
        raise RuntimeError(f"parameters not loaded (still on the meta device): {still[:5]}")
    return model.eval()


def check_text_only(token_ids, cfg: DiffusionGemmaConfig) -> None:
    """Refuse a prompt that holds the image token: images are not served."""
    if cfg.image_token_id is not None and int(cfg.image_token_id) in set(int(t) for t in token_ids):
        raise ValueError("images are not served for DiffusionGemma: the prompt holds the image token "
                         f"({cfg.image_token_id})")


# ---------------------------------------------------------------- tensor parallelism


def kv_head_slice(kv_heads: int, world: int, rank: int) -> slice:
    """The K/V heads rank ``rank`` of ``world`` holds: an even share when ``kv_heads`` divides among the ranks,
    else the one head its query heads read (heads replicated over world / kv_heads ranks)."""
    if kv_heads >= world:
        if kv_heads % world:
            raise ValueError(f"TP degree {world} does not divide num_key_value_heads = {kv_heads}")
        per = kv_heads // world
        return slice(rank * per, (rank + 1) * per)
    if world % kv_heads:
        raise ValueError(f"TP degree {world} is not a multiple of num_key_value_heads = {kv_heads}")
    head = rank * kv_heads // world
    return slice(head, head + 1)


def shard_config(cfg: DiffusionGemmaConfig, world: int) -> DiffusionGemmaConfig:
    """Each rank's config: query heads, MLP and expert columns divided by ``world``; K/V heads divided, or one
    per rank where there are fewer K/V heads than ranks (``kv_head_slice``)."""
    for name, value in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size),
                        ("moe_intermediate_size", cfg.moe_intermediate_size)):
        if value % world:
            raise ValueError(f"TP degree {world} does not divide {name} = {value}")
    kv = []
    for n in cfg.kv_heads:
        s = kv_head_slice(n, world, 0)
        kv.append(s.stop - s.start)
    return cfg.replace(num_heads=cfg.num_heads // world, kv_heads=tuple(kv),
                       self_conditioning_size=cfg.self_conditioning_size or cfg.intermediate_size,
                       intermediate_size=cfg.intermediate_size // world,
                       moe_intermediate_size=cfg.moe_intermediate_size // world)


def _shard_tensor(name: str, t: torch.Tensor, cfg: DiffusionGemmaConfig, rank: int, world: int) -> torch.Tensor:
    parts = name.split(".")
    if parts[0] != "layers":  # embeddings, final norm, self-conditioning, LM head: replicated
        return t
    layer, module, leaf = int(parts[1]), parts[-2], parts[-1]
    if module == "q_proj" or (parts[2] == "mlp" and module in ("gate_proj", "up_proj")):
        return t.chunk(world, dim=0)[rank].contiguous()
    if module in ("k_proj", "v_proj"):
        s = kv_head_slice(cfg.kv_heads[layer], world, rank)
        d = cfg.head_dims[layer]
        return t[s.start * d: s.stop * d].contiguous()
    if module in ("o_proj", "down_proj") and parts[2] in ("self_attn", "mlp"):
        return t.chunk(world, dim=1)[rank].contiguous()
    if module == "experts" and leaf == "gate_up_proj":  # [E, gate | up, H]: each half's rows
        return torch.cat([h.chunk(world, dim=1)[rank] for h in t.chunk(2, dim=1)], dim=1).contiguous()
    if module == "experts" and leaf == "down_proj":  # [E, H, I]: input columns
        return t.chunk(world, dim=2)[rank].contiguous()
    return t  # norms, router, scalars


def shard(model: DiffusionGemma, rank: int, world: int,
          reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> DiffusionGemma:
    """Rank ``rank``'s shard of ``model``: query heads and the MLP's and experts' columns split (column-parallel
    q/k/v, gate/up; row-parallel o and down, whose partial outputs ``reduce`` sums across the ranks: after
    attention, after the dense MLP and after the experts, each before the norm that follows it). The router,
    norms, embeddings, self-conditioning and LM head are replicated, so every rank sees the same logits and,
    with the same (seed, canvas, step) draws, makes the same decisions."""
    cfg = shard_config(model.config, world)
    with on_meta():
        part = DiffusionGemma(cfg)
    state = {k: _shard_tensor(k, v, model.config, rank, world) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    part.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    if cfg.tie_word_embeddings:
        part.lm_head.weight = part.embed_tokens.weight
    for layer in part.layers:
        layer.reduce = reduce
    return part.eval()


# ---------------------------------------------------------------- export (an HF checkpoint transformers loads)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")
EXPORT_VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}


def hf_text_config(cfg: DiffusionGemmaConfig) -> dict:
    """``cfg`` as transformers' DiffusionGemmaTextConfig keyword arguments (per-layer head sizes and K/V heads
    where they differ from the first sliding layer's)."""
    first = cfg.layer_types.index(SLIDING) if SLIDING in cfg.layer_types else 0
    base_dim, base_kv = cfg.head_dims[first], cfg.kv_heads[first]
    per_layer = {i: {"head_dim": d, "num_key_value_heads": kv}
                 for i, (d, kv) in enumerate(zip(cfg.head_dims, cfg.kv_heads)) if (d, kv) != (base_dim, base_kv)}
    ropes = {}
    for kind, r in cfg.ropes.items():
        ropes[kind] = {"rope_type": r.kind, "rope_theta": r.theta}
        if r.kind == "proportional" or r.fraction != 1.0:
            ropes[kind]["partial_rotary_factor"] = r.fraction
        if r.factor != 1.0:
            ropes[kind]["factor"] = r.factor
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": base_kv, "head_dim": base_dim, "hidden_activation": cfg.hidden_activation,
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
            "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_ids[0], "bos_token_id": cfg.bos_token_id,
            "tie_word_embeddings": cfg.tie_word_embeddings, "rope_parameters": ropes,
            "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
            "final_logit_softcapping": cfg.final_logit_softcapping, "num_experts": cfg.num_experts,
            "top_k_experts": cfg.top_k_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
            "per_layer_config": per_layer}


def hf_state_dict(model: DiffusionGemma) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' names (the decoder's; the encoder's per-layer scalars apart)."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                out[name] = t
            continue
        if name.endswith(".encoder_layer_scalar"):
            out["model.encoder.language_model." + name.removesuffix("encoder_layer_scalar") + "layer_scalar"] = t
        else:
            out["model.decoder." + name] = t
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def save_pretrained(model: DiffusionGemma, directory: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write ``model`` as a ``DiffusionGemmaForBlockDiffusion`` checkpoint that transformers loads: config.json
    (written by transformers' own config class, with a one-layer vision tower whose weights transformers
    initialises: images are not Remask's), model.safetensors, generation_config.json (the diffusion
    defaults) and the tokenizer files of ``tokenizer_dir``."""
    import shutil

    from safetensors.torch import save_file
    from transformers import DiffusionGemmaConfig as HFConfig

    cfg = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = HFConfig(text_config=hf_text_config(cfg), vision_config=dict(EXPORT_VISION), canvas_length=cfg.canvas_length,
                  image_token_id=cfg.image_token_id, tie_word_embeddings=cfg.tie_word_embeddings)
    hf.architectures = [ARCH]
    hf.to_json_file(str(directory / "config.json"))
    save_file(hf_state_dict(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    gen = cfg.generation
    generation = {"max_denoising_steps": int(gen["max_denoising_steps"]),
                  "sampler_config": {"entropy_bound": float(gen["entropy_bound"]),
                                     "_cls_name": "EntropyBoundSamplerConfig"},
                  "t_min": float(gen["t_min"]), "t_max": float(gen["t_max"]),
                  "stability_threshold": int(gen["stability_threshold"]),
                  "confidence_threshold": float(gen["confidence_threshold"]),
                  "max_new_tokens": int(gen["max_new_tokens"]), "bos_token_id": cfg.bos_token_id,
                  "pad_token_id": cfg.pad_token_id,
                  "eos_token_id": list(cfg.eos_token_ids)}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    return directory
