"""A Llama/Qwen-style transformer for diffusion language models.

One implementation serves LLaDA (Llama layout, bidirectional), Dream (Qwen2
layout, qkv bias, logits shifted by one), SDAR (Qwen3 layout, q/k norms,
block-causal) and Remask's embedded defaults. The forward pass takes the
attention mask and optional per-layer context K/V from the caller, so the
same code trains, recomputes full sequences and decodes one block over a cache.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.models.config import ModelConfig
from engine.models.fused import Elementwise, rms_norm, rope, swiglu
from engine.models.layouts import attention, emulating

KV = tuple[torch.Tensor, torch.Tensor]


class Slots(NamedTuple):
    """Where a forward of steps with no context writes its fresh K/V (``Attention.forward``): row n's into
    ``past``'s row ``rows[n]`` (the KV pool's slot) at positions ``positions[n]``, wherever those rows are."""

    rows: torch.Tensor  # [N, 1], or [1, T] for packed steps (each token's slot)
    positions: torch.Tensor  # [N, T]
    # packed steps (one row of N steps' tokens one after another): each step's (first token, tokens) along the
    # row; each attends to its own tokens only, one unmasked attention call per step. None: a batch of rows
    segments: tuple[tuple[int, int], ...] | None = None


Room = bool | tuple[torch.Tensor, int] | Slots  # where fresh K/V go in ``past`` (Attention.forward)
# the order in which a CUDA forward asks scaled_dot_product_attention for its kernels (DLMTransformer.attention_order):
# "flash" (the default): FlashAttention-2, then the memory-efficient kernel, cuDNN's, the unfused math. torch
# on Hopper and Blackwell puts cuDNN's first, and cuDNN builds an execution plan for every new (batch, query,
# keys) shape it meets (tens of ms each: the first H200 run's recompute rounds, each the first of its shape,
# took ~65 ms more than cached rounds of as many tokens), where the flash kernels need none; the engine's
# forwards change shape every round. "cudnn": cuDNN's first (torch's own choice there); "torch": whatever
# torch's global order is (no override). REMASK_SDPA in the environment sets the default.
ATTENTION_ORDERS: dict[str, tuple[SDPBackend, ...] | None] = {
    "flash": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
              SDPBackend.MATH),
    "cudnn": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH),
    "torch": None,
}


def attention_order_default() -> str:
    """The attention kernel order named by REMASK_SDPA (default "flash"); an unknown name is an error."""
    name = os.environ.get("REMASK_SDPA", "").strip().lower() or "flash"
    if name not in ATTENTION_ORDERS:
        raise ValueError(f"REMASK_SDPA={name!r} is not an attention order; known: {sorted(ATTENTION_ORDERS)}")
    return name
# one product per group of rows, each group against its own matrix, group ends on the device (torch >= 2.9;
# the public name from 2.10): fused experts in one launch per projection with no host sync
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype:
            # one fused kernel (torch >= 2.8) instead of seven passes over x; float32 inside, the product
            # with the weight rounded once (the composite rounds before it: at most an ulp apart)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype,
                 inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables of shape [N, 1, T, head_dim] for integer positions [N, T]: the sin table's
    first half is negated (what ``apply_rope``, engine/models/fused.py, multiplies the half-swapped head by)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1)[:, None].cos().to(dtype), torch.cat((-sin, sin), dim=-1)[:, None].to(dtype)


def stacked_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose outputs are those of ``parts`` in order (their weights and biases stacked)."""
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

        self.qkv_proj: nn.Linear | None = None  # fuse(): q, k and v in one matrix product
        self.kernels: Elementwise | None = None  # fused elementwise groups (engine/models/fused.py), or None

    def fuse(self) -> None:
        """Replace q/k/v_proj by one ``qkv_proj`` (same weights, one larger product). For inference:
        the state dict then holds the fused name, so fuse after loading and sharding, never before saving."""
        self.qkv_proj = stacked_linear(self.q_proj, self.k_proj, self.v_proj)
        self.q_proj, self.k_proj, self.v_proj = None, None, None

    def forward(self, x, cos, sin, mask, past: KV | None, room: Room = False) -> tuple[torch.Tensor, KV]:
        """``room``: ``past`` holds C + T positions and this call writes its T fresh K/V into the last T in
        place (no concatenation per layer); ``(index, n_keys)`` instead scatters each row's T fresh K/V
        to positions ``index`` [N, T] along ``past`` and attends to its first ``n_keys`` positions; ``Slots``
        writes them into rows ``rows`` of ``past`` ([S, kv_heads, P, head_dim] each: the KV pool's slots, in any
        order) at their positions and attends to the fresh K/V alone: steps with no context, whose keys are their
        own queries (a full-sequence recompute), written in place with no buffer or copy of their own (with
        ``segments``, steps packed one after another in one row, each attending to its own segment).
        Otherwise ``past`` is the C context positions only. Returns the output and the fresh K/V, or with an
        in-place ``room`` the views of ``past`` they were written into: a forward's layers must not each hold
        their fresh K/V (and, through v, their whole q/k/v product) until its end."""
        n, t, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split((self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd), -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # heads split off the last dimension: a view whatever the products' strides (unflatten, not .view)
        q = q.unflatten(-1, (self.nh, self.hd)).transpose(1, 2)
        k = k.unflatten(-1, (self.nkv, self.hd)).transpose(1, 2)
        v = v.unflatten(-1, (self.nkv, self.hd)).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (rope if self.kernels is None else self.kernels.rope)(q, k, cos, sin)
        keys, values = k, v
        if isinstance(room, Slots):  # written in place wherever their rows are; attended as they are
            past[0][room.rows, :, room.positions] = k.transpose(1, 2)  # [N, T, kv heads, D] both sides
            past[1][room.rows, :, room.positions] = v.transpose(1, 2)
            kv = past  # handed back: where they now live (the fresh tensors, and v's projection output, go)
        elif isinstance(room, tuple):
            index, n_keys = room
            keys, values = past
            where = index[:, None, :, None].expand(n, self.nkv, t, self.hd)
            keys.scatter_(2, where, k)
            values.scatter_(2, where, v)
            keys, values = keys[:, :, :n_keys], values[:, :, :n_keys]
            kv = keys, values
        elif room:
            keys, values = past
            keys[:, :, -t:], values[:, :, -t:] = k, v
            kv = keys[:, :, -t:], values[:, :, -t:]
        else:
            kv = k, v
            if past is not None and past[0].shape[2]:
                keys, values = torch.cat((past[0], k), 2), torch.cat((past[1], v), 2)
        group = self.nh // self.nkv
        if isinstance(room, Slots) and room.segments is not None:  # packed steps: each over its own tokens
            out = torch.cat([attention(q[:, :, o : o + m], k[:, :, o : o + m], v[:, :, o : o + m],
                                       enable_gqa=group > 1) for o, m in room.segments], 2)
            return self.o_proj(out.transpose(1, 2).reshape(n, t, -1)), kv
        # the attention kernel's output may come back in any strides (CUDA's fused kernels hand back a
        # transposed [N, T, heads, D] buffer; engine/models/layouts.py): split with unflatten, which is a view
        # whatever the strides, and laid out [N, T, heads x D] for o_proj by one reshape (one copy at most)
        if group > 1 and mask is not None and mask.shape[-2] == group * t:  # grouped query heads folded as rows
            out = attention(q.reshape(n, self.nkv, group * t, self.hd), keys, values, attn_mask=mask)
            out = out.unflatten(2, (group, t)).permute(0, 3, 1, 2, 4)  # [N, T, kv heads, group, D]
        else:
            out = attention(q, keys, values, attn_mask=mask, enable_gqa=group > 1).transpose(1, 2)
        return self.o_proj(out.reshape(n, t, -1)), kv


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate: int | None = None) -> None:
        super().__init__()
        i = intermediate or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, i, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, i, bias=False)
        self.down_proj = nn.Linear(i, cfg.hidden_size, bias=False)

        self.gate_up_proj: nn.Linear | None = None  # fuse(): gate and up in one matrix product
        self.kernels: Elementwise | None = None  # fused elementwise groups (engine/models/fused.py), or None

    def fuse(self) -> None:
        """Replace gate/up_proj by one ``gate_up_proj`` (as Attention.fuse)."""
        self.gate_up_proj = stacked_linear(self.gate_proj, self.up_proj)
        self.gate_proj, self.up_proj = None, None

    @property
    def fused(self) -> bool:
        return self.gate_up_proj is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj((swiglu if self.kernels is None else self.kernels.swiglu)(self.gate_up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """LLaDA2's expert choice: sigmoid scores of float32 logits; experts are chosen on score + bias
    among the ``expert_groups_used`` groups whose best two biased scores sum highest; the chosen
    experts' unbiased scores, normalised to sum to one, times ``routed_scaling``, weight their outputs."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Linear
        self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        # sees (and may replace) each call's chosen expert ids [N, k]: records one model's choices or holds
        # another's equal to them, e.g. to compare a bf16 forward with a float32 one on the same experts
        self.choice_hook: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, k], weights [N, k] in float32)."""
        cfg = self.cfg
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        biased = scores + self.expert_bias.float()
        if cfg.expert_groups_used < cfg.expert_groups:
            groups = biased.unflatten(1, (cfg.expert_groups, -1))
            best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)  # [N, groups]
            keep = torch.zeros_like(best, dtype=torch.bool)
            keep.scatter_(1, best.topk(cfg.expert_groups_used, dim=-1).indices, True)
            biased = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = biased.topk(cfg.experts_per_token, dim=-1).indices
        if self.choice_hook is not None:
            ids = self.choice_hook(ids)
        weights = scores.gather(1, ids)
        if cfg.experts_per_token > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch's grouped product runs, and gives the right answer, for ``dtype`` on the current
    ``device_type`` device (probed once: CUDA needs bf16 on sm80 or newer; CPU kernels came with 2.9)."""
    if GROUPED_MM is None:
        return False
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(3, 8, 16, generator=gen)
    offs = torch.tensor([2, 2, 8], dtype=torch.int32)  # the middle group empty, as an idle expert's
    want = torch.cat([a[:2] @ b[0].T, a[2:] @ b[2].T])
    try:
        got = GROUPED_MM(a.to(device_type, dtype), b.to(device_type, dtype).transpose(1, 2),
                         offs=offs.to(device_type)).float().cpu()
    except Exception:  # no kernel for this device or dtype, or another torch's signature: use the grid
        return False
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=0.05, atol=0.5))


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP: each token through its routed experts (their outputs weighted) plus the
    shared experts. The (token, expert) pairs are sorted by expert. Unfused, each expert with tokens runs
    once on all of them: a loop over experts, fine on a CPU, launch-bound on a GPU, and the host reads
    the pair counts (one wait on the device per expert layer). ``fuse`` stacks the experts' weights, and
    every expert then runs in one grouped product per projection, each expert's pairs against its own
    weights, with the groups' ends computed on the device: no wait, and capturable in a CUDA graph.
    Where torch has no grouped product for the device and dtype (or ``grouped`` is turned off), the
    stacked experts run as two batched products over a grid of their pairs padded to the busiest
    expert's count, whose size the host reads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts: nn.ModuleList | None = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size)
                                                           for _ in range(cfg.num_experts))
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.shared_experts) if cfg.shared_experts else None
        self.w_gate_up: nn.Parameter | None = None  # fuse(): [experts, 2 x intermediate, hidden]
        self.w_down: nn.Parameter | None = None  # fuse(): [experts, hidden, intermediate]
        self.num_experts = cfg.num_experts
        self.fused = False
        self.grouped = True  # fused experts in grouped products where they run (else the padded grid)

    def fuse(self) -> None:
        """Stack the experts (gate and up as one product) and fuse the shared experts; for inference, after
        loading and sharding, as ``Attention.fuse``."""
        with torch.no_grad():
            gate_up = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in self.experts])
            down = torch.stack([e.down_proj.weight for e in self.experts])
        self.experts = None
        self.w_gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.w_down = nn.Parameter(down, requires_grad=False)
        if self.shared_experts is not None:
            self.shared_experts.fuse()
        self.fused = True

    @property
    def kernel(self) -> str:
        """How the routed experts run here: "loop" (unfused), "grouped" or "grid" (fused)."""
        if not self.fused:
            return "loop"
        w = self.w_down
        aligned = all(n * w.element_size() % 16 == 0 for n in w.shape[1:])  # grouped kernels read 16-byte rows
        return "grouped" if self.grouped and aligned and grouped_mm_works(w.device.type, w.dtype) else "grid"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights = self.gate(x)
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        # pairs per expert, counted on the device (bincount would read its input's maximum on the host)
        counts = flat.new_zeros(self.num_experts).index_add_(0, flat, torch.ones_like(flat))
        rows = x[order // k]
        kernel = self.kernel
        if kernel == "grouped":
            out = self._grouped(rows, counts)
        else:
            out = self._grid(rows, flat[order], counts) if kernel == "grid" else self._each(rows, counts)
        routed = torch.empty_like(out).index_copy_(0, order, out).unflatten(0, (len(x), k))
        y = (routed.float() * weights[..., None]).sum(1).to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)

    def _each(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        start = 0
        for expert, n in zip(self.experts, counts.tolist()):  # the host needs the group sizes
            if n:
                out[start : start + n] = expert(rows[start : start + n])
                start += n
        return out

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` sorted by expert, ``counts`` of them per expert: each group through its own weights."""
        ends = counts.cumsum(0).to(torch.int32)
        gate, up = GROUPED_MM(rows, self.w_gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return GROUPED_MM(F.silu(gate) * up, self.w_down.transpose(1, 2), offs=ends)

    def _grid(self, rows: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` sorted by ``experts``: each placed in its expert's row of an [experts, busiest, hidden]
        grid (zeros elsewhere), two batched products, and read back from the same places."""
        busiest = int(counts.max())  # the host needs the grid's size
        starts = counts.cumsum(0) - counts
        place = torch.arange(len(rows), device=rows.device) - starts[experts]
        grid = rows.new_zeros(self.num_experts, busiest, rows.shape[-1])
        grid[experts, place] = rows
        gate, up = torch.bmm(grid, self.w_gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.w_down.transpose(1, 2))[experts, place]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)
        self.reduce = None  # tensor parallelism: sums the row-parallel partial outputs across ranks
        self.kernels: Elementwise | None = None  # fused elementwise groups (engine/models/fused.py), or None

    def forward(self, x, cos, sin, mask, past: KV | None, room: Room = False) -> tuple[torch.Tensor, KV]:
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past, room)
        if self.reduce is not None:
            h = self.reduce(h)
        if self.kernels is not None:  # the residual add and the norm after it in one kernel
            norm = self.post_attention_layernorm
            x, normed = self.kernels.add_rms_norm(x, h, norm.weight, norm.eps)
        else:
            x = x + h
            normed = self.post_attention_layernorm(x)
        m = self.mlp(normed)
        if self.reduce is not None:
            m = self.reduce(m)
        return x + m, kv


class DLMTransformer(nn.Module):
    """Token ids in, logits (and the final hidden states and fresh K/V) out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # RoPE frequencies per device
        # Grouped-query attention under a mask: SDPA's fused kernels take no GQA with a mask (it falls back
        # to the unfused math kernel, K/V repeated per query head), so each key/value head's group of query
        # heads is folded into its query rows and the mask repeated to match, once per forward. None: on
        # CUDA only (on a CPU the math kernel is the one anyway), and where CUDA's layouts are emulated.
        self.fold_gqa: bool | None = None
        # which attention kernels a CUDA forward (or one where CUDA is emulated) asks for first: a name of
        # ATTENTION_ORDERS; the default from REMASK_SDPA
        self.attention_order = attention_order_default()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        past: list[KV] | None = None,
        room: Room = False,
        head: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor, list[KV]]:
        """Run the model.

        input_ids, positions: [N, T]. mask: bool [N, 1, T, C + T] (True = may
        attend) where C is the context length of ``past``, or None for full
        attention. past: per layer (K, V) of shape [N, kv_heads, C, head_dim],
        RoPE already applied. With ``room``, each layer's (K, V) in ``past``
        holds C + T positions and the fresh K/V are written into the last T in
        place (the runner preallocates them; the mask then is [N, 1, T, C + T]
        over that buffer); ``room=(index, n_keys)`` scatters row n's fresh K/V
        to positions index[n] of that row instead and attends to the first
        n_keys positions (the runner's KV pool, where each row's query sits at
        its own positions and padding writes to a scratch position past them;
        the mask is then [N, 1, T, n_keys]). The mask may be float (added to
        the scores).
        Returns (logits [N, T, V], hidden [N, T, H], fresh per-layer (K, V) of
        the T input tokens; views of ``past`` when ``room`` is True, the views
        of ``past`` they were written into for the other in-place rooms, so no
        layer's fresh tensors outlive it). ``head=False``
        skips the LM head (logits None): the runner applies ``lm_head`` to the
        rows it needs only.
        """
        x = self.embed_tokens(input_ids)
        cfg = self.config
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:  # once per device (not a buffer: models are built on the meta device)
            inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, positions.device)
            self._inv_freq[positions.device] = inv_freq
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, x.dtype, inv_freq)
        group = cfg.num_heads // cfg.num_kv_heads
        if self.folds_gqa(x.device) and group > 1 and mask is not None and mask.shape[-2] == input_ids.shape[1]:
            mask = mask.repeat(1, 1, group, 1)  # rows ordered (query head within its group, position), as q's
        fresh: list[KV] = []
        with self.attention_kernels(x.device):
            for i, layer in enumerate(self.layers):
                x, kv = layer(x, cos, sin, mask, None if past is None else past[i], room)
                fresh.append(kv)
        hidden = self.norm(x)
        return (self.lm_head(hidden) if head else None), hidden, fresh

    def attention_kernels(self, device: torch.device):
        """The context a forward on ``device`` runs its layers in: scaled_dot_product_attention's kernels in
        ``attention_order`` on CUDA (and where CUDA is emulated, so the CPU's tests see the same order);
        nothing on a CPU otherwise, nor for "torch"."""
        order = ATTENTION_ORDERS.get(self.attention_order, ())
        if order == ():
            raise ValueError(f"attention_order {self.attention_order!r} is not one of {sorted(ATTENTION_ORDERS)}")
        if order is None or not (device.type == "cuda" or emulating()):
            return contextlib.nullcontext()
        return sdpa_kernel(list(order), set_priority=True)

    def folds_gqa(self, device: torch.device) -> bool:
        """Whether a masked forward on ``device`` folds grouped query heads into rows (``fold_gqa``)."""
        if self.fold_gqa is not None:
            return self.fold_gqa
        return device.type == "cuda" or emulating()  # CUDA's choice, where CUDA is emulated too

    def fuse_projections(self) -> DLMTransformer:
        """Fuse q/k/v and gate/up into single products (inference only; see Attention.fuse)."""
        for layer in self.layers:
            if layer.self_attn.qkv_proj is None:
                layer.self_attn.fuse()
            if not layer.mlp.fused:
                layer.mlp.fuse()
        return self

    @property
    def fused(self) -> bool:
        return bool(len(self.layers)) and self.layers[0].self_attn.qkv_proj is not None

    def use_elementwise(self, kernels: Elementwise | None) -> DLMTransformer:
        """Run the layers' elementwise groups (residual add + norm, rotary embedding, SwiGLU) through
        ``kernels`` (engine/models/fused.py), or through the modules' own eager code (None)."""
        for layer in self.layers:
            layer.kernels = layer.self_attn.kernels = kernels
            mlps = [layer.mlp] if isinstance(layer.mlp, MLP) else [layer.mlp.shared_experts]
            for mlp in mlps:
                if mlp is not None:
                    mlp.kernels = kernels
        return self

    @property
    def elementwise(self) -> str:
        """Which elementwise path runs: "eager" (the modules' own) or the fused implementation's name."""
        k = self.layers[0].kernels if len(self.layers) else None
        return "eager" if k is None else k.name
