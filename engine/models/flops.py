"""Counted FLOPs of a forward pass, for model FLOP utilisation (MFU).

A multiply-add is two FLOPs. The count is what the forward computes, padding
included: the linear layers (2 x rows x weights), attention scores and their
weighted sum (2 x 2 x query rows x key rows x head_dim per head) and the LM
head. Norms, RoPE, softmax and activations are left out (a few per cent of a
transformer's work at these shapes), as MFU figures usually do.
"""

from __future__ import annotations

from engine.models.config import ModelConfig


def linear_weights(cfg: ModelConfig) -> int:
    """Weights a token goes through in the layers' projections (q, k, v, o and the MLP's gate, up and
    down; of a mixture of experts, the experts it is routed to, the shared ones and the router)."""
    return sum(cfg.attention_weights + cfg.mlp_weights(n) for n in range(cfg.num_layers))


def forward_flops(cfg: ModelConfig, batch: int, query: int, context: int = 0, lm_rows: int | None = None) -> int:
    """FLOPs of one forward over ``batch`` rows of ``query`` tokens that attend to ``context`` cached
    tokens plus themselves. ``lm_rows``: rows the LM head is applied to (default every query row)."""
    rows = batch * query
    attention = cfg.num_layers * 4 * rows * (context + query) * cfg.num_heads * cfg.head_dim
    layers = 2 * rows * linear_weights(cfg) + attention
    lm = 2 * (rows if lm_rows is None else lm_rows) * cfg.hidden_size * cfg.vocab_size
    return layers + lm
