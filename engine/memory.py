"""What a forward holds on its device beyond the weights and the KV pool, and the peak measured.

A round's transient memory is the layers' activations (the residual stream, the normed copy, q/k/v, the
attention output, the MLP's gate/up and their product: the largest live set of one layer, per token),
the additive mask, the LM head's logits of the rows the round decodes (in the model's dtype, then float32
for the confidence), and, when the forward cannot attend to the KV pool in place, its own [context |
query] K/V buffer. On the first H200 run a full-sequence round of the LLaDA-8B shape peaked at 656 KB a
token above the weights: 512 KB of it the round's own K/V buffer, about 144 KB the activations, which
``activation_bytes_per_token`` puts at 147 KB. Writing fresh K/V into the pool removes the first part;
``forward_bytes`` is what the runner splits a forward by (``TorchRunner.transient_budget``) and the
engine sets aside before sizing the pool from a memory budget, so a round fits wherever its KV fits.

``peak_bytes`` measures a call's peak allocation above what was live before it: CUDA's allocator
statistics on a GPU, the profiler's allocation events on a CPU (the test suite's check of this model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.config import ModelConfig


def activation_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """The largest live set of one layer's activations, per query token, in bytes: the residual stream and
    its normed copy, the attention sublayer's q/k/v and output, the MLP's gate/up pair, their product and the
    residual beside it (an MoE layer: per routed expert, its pair's rows, plus the shared experts)."""
    h = cfg.hidden_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if cfg.num_experts:
        inter = cfg.moe_intermediate_size * (cfg.experts_per_token + cfg.shared_experts)
        routing = cfg.experts_per_token * h * 2  # each token's rows gathered per expert, and their outputs
    else:
        inter, routing = cfg.intermediate_size, 0
    return itemsize * (6 * h + 3 * inter + qkv + routing)


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """One position of K/V across the layers: 2 x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def forward_bytes(cfg: ModelConfig, itemsize: int, rows: int, query: int, context: int, decoded_rows: int,
                  copied: bool, scores: bool = False) -> int:
    """Transient bytes of one padded forward of ``rows`` x ``query`` tokens over ``context`` keys before them
    that decodes ``decoded_rows`` rows; ``copied``: it builds its own K/V buffer (not the pool in place);
    ``scores``: its attention kernel materialises the scores and their softmax (a CPU's; CUDA's fused
    kernels do not)."""
    keys = context + query
    total = rows * query * activation_bytes_per_token(cfg, itemsize)
    if scores:
        total += 2 * rows * cfg.num_heads * query * keys * max(itemsize, 4)
    total += rows * query * keys * itemsize  # the additive mask
    total += decoded_rows * cfg.vocab_size * (itemsize + 8)  # logits, then float32 softmax and its copy
    if copied:
        total += rows * keys * kv_bytes_per_token(cfg, itemsize)
    return total


def peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """The peak of the bytes ``fn()`` allocated on ``device`` and held at once, above what was live before."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):  # allocations positive, frees negative
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def kv_pool_source(slots: int | None, budget: int | None, fraction: float | None, device: torch.device,
                   max_slots: int, reserve: Callable[[], int], reserve_what: str
                   ) -> tuple[int | None, int | None, str, int | None]:
    """Which sizing a KV pool takes, in the engines' order: ``kv_slots`` (its slots given), ``kv_memory_bytes``
    (a budget given), ``kv_memory_fraction`` of the memory free now on a CUDA device less ``reserve()`` (at most
    half of it: a round's transient memory, ``reserve_what`` names it), else ``max_slots`` slots. Returns
    (slots or None, budget or None, the source in words, the reserve or None)."""
    if slots is not None:
        return slots, None, "kv_slots", None
    if budget is not None:
        return None, budget, "kv_memory_bytes", None
    if fraction is not None and torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        aside = min(reserve(), free // 2)
        return (None, min(int(free * fraction), free - aside),
                f"{fraction:g} of {free / 2**20:.0f} MiB free, {reserve_what} {aside / 2**20:.0f} MiB aside", aside)
    return max_slots, None, "max_slots", None
