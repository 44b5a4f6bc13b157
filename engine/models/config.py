"""Model configuration shared by every architecture Remask runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

AttentionMode = Literal["bidirectional", "block_causal", "causal"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and decoding facts of a Llama/Qwen-style diffusion language model.

    ``attention`` is the mask the model was trained with: ``bidirectional`` for
    full-sequence masked diffusion (LLaDA, Dream), ``block_causal`` for block
    diffusion (SDAR, LLaDA2: bidirectional inside a block, causal across
    blocks) and ``causal`` for autoregressive parity tests only.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3 / SDAR: RMSNorm on each head of q and k
    tie_word_embeddings: bool = False
    attention: AttentionMode = "bidirectional"
    block_size: int = 32
    mask_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 1
    logits_shift: int = 0  # Dream: token i is predicted from position i-1
    max_position_embeddings: int = 4096
    rotary_fraction: float = 1.0  # LLaDA2: RoPE on the first half of each head's dimensions only
    # mixture of experts (LLaDA2): layers from ``dense_layers`` on replace the MLP by ``num_experts``
    # experts of ``moe_intermediate_size``, ``experts_per_token`` chosen per token by a sigmoid router with
    # a per-expert bias (used for the choice only), limited to the best ``expert_groups_used`` of
    # ``expert_groups`` groups; the chosen weights are normalised and scaled by ``routed_scaling``, and
    # ``shared_experts`` experts' worth of MLP always runs beside them. 0 experts: a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    expert_groups: int = 1
    expert_groups_used: int = 1
    routed_scaling: float = 1.0
    arch: str = "remask"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.attention not in ("bidirectional", "block_causal", "causal"):
            raise ValueError(f"unknown attention mode {self.attention!r}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.logits_shift not in (0, 1):
            raise ValueError("logits_shift must be 0 or 1")
        rotary = self.head_dim * self.rotary_fraction
        if not 0 < rotary <= self.head_dim or rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"rotary_fraction {self.rotary_fraction} of head_dim {self.head_dim} must give an even "
                             "number of dimensions")
        if self.num_experts:
            e, k, g = self.num_experts, self.experts_per_token, self.expert_groups
            if not 0 < k <= e or self.moe_intermediate_size <= 0 or e % g or not 0 < self.expert_groups_used <= g:
                raise ValueError(f"bad mixture of experts: {e} experts, {k} per token, intermediate "
                                 f"{self.moe_intermediate_size}, {self.expert_groups_used} of {g} groups")
            if k > self.expert_groups_used * (e // g):
                raise ValueError(f"{k} experts per token do not fit in {self.expert_groups_used} groups of {e // g}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.dense_layers

    @property
    def attention_weights(self) -> int:
        """Weights of one layer's q, k, v and o projections."""
        return self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)

    def mlp_weights(self, layer: int, active: bool = True) -> int:
        """Weights of one layer's MLP: gate, up and down of the dense MLP, or of the experts a token uses
        (``active``; all of them otherwise), the shared experts and the router."""
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        return 3 * h * self.moe_intermediate_size * (experts + self.shared_experts) + h * self.num_experts

    def replace(self, **changes) -> ModelConfig:
        data = asdict(self)
        data.update(changes)
        return ModelConfig(**data)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        layers = sum(self.attention_weights + self.mlp_weights(n, active=False) + 2 * h for n in range(self.num_layers))
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + emb + h
