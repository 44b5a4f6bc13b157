"""Save and load Remask's own checkpoints in HF format (config.json + safetensors).

Parameter names follow the Llama layout (``model.layers.N.self_attn.q_proj``
...), so the embedded defaults are ordinary HF-format directories.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.models.config import ModelConfig
from engine.models.meta import on_meta
from engine.models.transformer import DLMTransformer

ARCH = "RemaskDiffusionLM"
INDEX_FILE = "model.safetensors.index.json"


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json of a Remask checkpoint: Llama-style keys plus a ``remask`` section."""
    return {
        "architectures": [ARCH],
        "model_type": "remask",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "mask_token_id": cfg.mask_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "remask": {
            "attention": cfg.attention,
            "block_size": cfg.block_size,
            "logits_shift": cfg.logits_shift,
            "qkv_bias": cfg.qkv_bias,
            "qk_norm": cfg.qk_norm,
            **cfg.extra,
        },
    }


def state_dict_hf(model: DLMTransformer) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        out[name if name.startswith("lm_head.") else "model." + name] = tensor.detach().contiguous()
    return out


def save_pretrained(model: DLMTransformer, directory: str | Path, metadata: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(model.config), indent=2))
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    save_file(state_dict_hf(model), str(directory / "model.safetensors"), metadata=meta)
    return directory


def config_from_remask(data: dict) -> ModelConfig:
    extra = dict(data.get("remask", {}))
    known = {k: extra.pop(k) for k in ("attention", "block_size", "logits_shift", "qkv_bias", "qk_norm") if k in extra}
    return ModelConfig(
        vocab_size=data["vocab_size"],
        hidden_size=data["hidden_size"],
        num_layers=data["num_hidden_layers"],
        num_heads=data["num_attention_heads"],
        num_kv_heads=data.get("num_key_value_heads", data["num_attention_heads"]),
        head_dim=data.get("head_dim", 0) or 0,
        intermediate_size=data["intermediate_size"],
        rope_theta=data.get("rope_theta", 10000.0),
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=data.get("tie_word_embeddings", False),
        max_position_embeddings=data.get("max_position_embeddings", 4096),
        mask_token_id=data["mask_token_id"],
        eos_token_id=data["eos_token_id"],
        pad_token_id=data.get("pad_token_id", data["eos_token_id"]),
        arch="remask",
        extra=extra,
        **known,
    )


def load_remask(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DLMTransformer:
    directory = Path(directory)
    cfg = config_from_remask(json.loads((directory / "config.json").read_text()))
    with on_meta():
        model = DLMTransformer(cfg)
    tensors = load_file(str(directory / "model.safetensors"), device=device)
    state = {k.removeprefix("model."): v for k, v in tensors.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=dtype).eval()


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or model.safetensors."""
    index = directory / INDEX_FILE
    if index.is_file():
        files = [directory / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no .safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} lacks shards listed in {INDEX_FILE}: {missing[:5]}")
    return files
