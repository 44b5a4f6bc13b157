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
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h
