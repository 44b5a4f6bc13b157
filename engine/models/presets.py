"""Random-weight models of real shapes, for profiles and benchmarks with no weights to download.

``llada-8b-shape`` is LLaDA-8B's shape (Llama layout, bidirectional), ``dream-7b-shape`` Dream-7B's
(Qwen2: grouped KV heads, qkv bias, shifted logits), ``sdar-8b-shape`` SDAR-8B's (Qwen3: q/k
norms, block-causal with blocks of 4) and ``llada2-mini-shape`` LLaDA2.0-mini's (a mixture of 256
experts, 8 per token plus a shared one, after one dense layer; q/k norms, RoPE on half of each head,
block-causal with blocks of 32).

A name may carry overrides after a colon, ``llada-8b-shape:layers=2,vocab=4096``, to run the same
code at a size a CPU can afford (tests do). The weights are random (seeded), so what such a model
decodes is noise: presets are for timing, never for answers. They take token ids, not text.
"""

from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.models.meta import on_meta
from engine.models.transformer import DLMTransformer

PRESETS: dict[str, dict] = {
    "llada-8b-shape": dict(vocab_size=126464, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                           intermediate_size=12288, rope_theta=500000.0, rms_norm_eps=1e-5,
                           attention="bidirectional", block_size=32, mask_token_id=126336, eos_token_id=126081,
                           pad_token_id=126081, max_position_embeddings=4096, arch="llada"),
    "dream-7b-shape": dict(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                           intermediate_size=18944, rope_theta=1000000.0, qkv_bias=True, attention="bidirectional",
                           block_size=32, mask_token_id=151666, eos_token_id=151643, pad_token_id=151643,
                           logits_shift=1, max_position_embeddings=4096, arch="dream"),
    "sdar-8b-shape": dict(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                          intermediate_size=12288, rope_theta=1000000.0, qk_norm=True,
                          attention="block_causal", block_size=4, mask_token_id=151669, eos_token_id=151645,
                          pad_token_id=151643, max_position_embeddings=4096, arch="sdar"),
    "llada2-mini-shape": dict(vocab_size=157184, hidden_size=2048, num_layers=20, num_heads=16, num_kv_heads=4,
                              head_dim=128, intermediate_size=5120, rope_theta=600000.0, qk_norm=True,
                              rotary_fraction=0.5, num_experts=256, experts_per_token=8, moe_intermediate_size=512,
                              shared_experts=1, dense_layers=1, expert_groups=8, expert_groups_used=4,
                              routed_scaling=2.5, attention="block_causal", block_size=32, mask_token_id=156895,
                              eos_token_id=156892, pad_token_id=156892, max_position_embeddings=32768,
                              arch="llada2"),
}
OVERRIDES = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
             "intermediate": "intermediate_size", "vocab": "vocab_size", "block": "block_size", "head_dim": "head_dim",
             "experts": "num_experts", "experts_per_token": "experts_per_token",
             "moe_intermediate": "moe_intermediate_size"}


def is_preset(name: str) -> bool:
    return name.split(":", 1)[0] in PRESETS


def preset_config(name: str) -> ModelConfig:
    """The config of ``name`` (``preset[:key=value,...]``); ValueError on an unknown preset or key."""
    base, _, rest = name.partition(":")
    if base not in PRESETS:
        raise ValueError(f"unknown model preset {base!r}; known: {', '.join(sorted(PRESETS))}")
    kwargs = dict(PRESETS[base])
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key not in OVERRIDES or not eq:
            raise ValueError(f"bad preset override {item!r}: use key=integer with key one of {', '.join(OVERRIDES)}")
        try:
            kwargs[OVERRIDES[key]] = int(value)
        except ValueError:
            raise ValueError(f"bad preset override {item!r}: {value!r} is not an integer") from None
    vocab = kwargs["vocab_size"]
    if max(kwargs["mask_token_id"], kwargs["eos_token_id"], kwargs["pad_token_id"]) >= vocab:
        kwargs.update(mask_token_id=vocab - 1, eos_token_id=vocab - 2, pad_token_id=vocab - 2)  # a shrunk vocabulary
    return ModelConfig(**kwargs, extra={"name": name, "preset": True})


def build_preset(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, tp: int = 1) -> DLMTransformer:
    """A random-weight model of the preset's shape, made on ``device`` in ``dtype`` (no float32 copy).
    ``tp`` > 1: one tensor-parallel rank's shard of that shape (its heads and MLP columns; the caller
    sets each layer's ``reduce``), for timing TP rounds without building the whole model first."""
    cfg = preset_config(name)
    if tp > 1:
        from engine.models.tensor_parallel import shard_config

        cfg = shard_config(cfg, tp)
    with on_meta():
        model = DLMTransformer(cfg).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif pname.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


class IdTokenizer:
    """A preset's tokenizer: prompts are token ids; decoding shows the ids."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.mask_token_id, self.eos_token_id, self.pad_token_id = cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def prompt_ids(self, prompt: str, block_size: int) -> list[int]:
        raise ValueError("a preset model has random weights and no tokenizer: pass the prompt as token ids")

    encode = prompt_ids

    def decode(self, ids, skip_special: bool = True) -> str:
        skip = {self.mask_token_id, self.eos_token_id, self.pad_token_id} if skip_special else set()
        return " ".join(str(int(i)) for i in ids if int(i) not in skip)


def random_prompt(cfg: ModelConfig, length: int, seed: int = 0) -> list[int]:
    """``length`` random token ids, none of them special."""
    gen = torch.Generator().manual_seed(seed)
    special = {cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id}
    ids = torch.randint(0, cfg.vocab_size, (length * 2 + 8,), generator=gen).tolist()
    return [i for i in ids if i not in special][:length]
