"""Load local HF-format checkpoints into Remask's DLMTransformer.

A checkpoint directory holds ``config.json`` and either ``model.safetensors``
or shards listed in ``model.safetensors.index.json``. The ``architectures``
entry of config.json picks an :class:`Architecture`: how its config maps onto
:class:`ModelConfig` and how its tensor names map onto our module names
(``embed_tokens``, ``layers.N.self_attn.q_proj``, ``norm``, ``lm_head`` ...).

Weights are never initialised randomly: the model is built on the meta
device and each shard's tensors are assigned in place of the meta
parameters. Nothing here touches the network.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models import checkpoint, diffusion_gemma
from engine.models.checkpoint import INDEX_FILE, weight_files  # noqa: F401 - weight_files: re-exported
from engine.models.config import ModelConfig
from engine.models.meta import on_meta
from engine.models.transformer import DLMTransformer

LLADA_MASK_ID, LLADA_EOS_ID = 126336, 126081
DREAM_MASK_ID = 151666
SDAR_MASK_ID, SDAR_BLOCK_SIZE = 151669, 4
LLADA2_MASK_ID, LLADA2_EOS_ID, LLADA2_BLOCK_SIZE = 156895, 156892, 32
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # RoPE tables some old checkpoints store; we recompute them


@dataclass(frozen=True)
class Architecture:
    """How one ``architectures`` value maps onto Remask: config and tensor names."""

    config: Callable[[dict], ModelConfig]
    rename: Callable[[str], str | None]  # checkpoint tensor name -> our name, None if unknown
    prepare: Callable[[DLMTransformer], None] | None = None  # module layout changes before loading (on meta)


# ---------------------------------------------------------------- tensor names


def hf_name(name: str) -> str | None:
    """Llama/Qwen layout: ``model.X`` -> ``X``; ``lm_head.weight`` stays."""
    if name == "lm_head.weight":
        return name
    return name.removeprefix("model.") if name.startswith("model.") else None


LLADA_TOP = {"wte.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight", "ff_out.weight": "lm_head.weight"}
LLADA_BLOCK = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_proj": "mlp.gate_proj",  # LLaDA applies the activation to ff_proj
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ff_norm": "post_attention_layernorm",
}
_LLADA_BLOCK_RE = re.compile(r"blocks\.(\d+)\.(\w+)\.weight")
_LLADA_GROUP_RE = re.compile(r"block_groups\.(\d+)\.(\d+)\.(\w+)\.weight")


def llada_renamer(group_size: int) -> Callable[[str], str | None]:
    """Names of LLaDA's ``model.transformer`` (blocks, or block_groups of ``group_size``)."""

    def rename(name: str) -> str | None:
        rest = name.removeprefix("model.transformer.")
        if rest == name:
            return None
        if rest in LLADA_TOP:
            return LLADA_TOP[rest]
        if m := _LLADA_BLOCK_RE.fullmatch(rest):
            layer, part = int(m[1]), m[2]
        elif m := _LLADA_GROUP_RE.fullmatch(rest):
            layer, part = int(m[1]) * group_size + int(m[2]), m[3]
        else:
            return None
        return f"layers.{layer}.{LLADA_BLOCK[part]}.weight" if part in LLADA_BLOCK else None

    return rename


LLADA2_ATTENTION = {"query_key_value": "qkv_proj", "dense": "o_proj", "query_layernorm": "q_norm",
                    "key_layernorm": "k_norm"}
_LLADA2_ATTN_RE = re.compile(r"layers\.(\d+)\.attention\.(\w+)\.weight")


def llada2_name(name: str) -> str | None:
    """LLaDA2 (``LLaDA2MoeModelLM``): ``word_embeddings`` and ``attention.query_key_value`` (q, k and v in
    one matrix: the model is built with fused attention projections), ``dense``, ``query_layernorm`` and
    ``key_layernorm``; the MLP names (``mlp.gate`` the router, ``mlp.experts.N``, ``mlp.shared_experts``)
    are ours already."""
    ours = hf_name(name)
    if ours is None or ours == "lm_head.weight":
        return ours
    if ours == "word_embeddings.weight":
        return "embed_tokens.weight"
    if m := _LLADA2_ATTN_RE.fullmatch(ours):
        part = LLADA2_ATTENTION.get(m[2])
        return f"layers.{m[1]}.self_attn.{part}.weight" if part else None
    return ours


def fuse_attention(model: DLMTransformer) -> None:
    for layer in model.layers:
        layer.self_attn.fuse()


# ---------------------------------------------------------------- configs


def _first(value, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return default if value is None else int(value)


def _rope_theta(data: dict) -> float:
    """rope_theta from a flat key (transformers 4) or ``rope_parameters`` (transformers 5)."""
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"RoPE scaling {kind!r} is not supported")
    return float(data.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def _unsupported(data: dict, **expected) -> None:
    wrong = {k: data[k] for k, v in expected.items() if k in data and data[k] != v}
    if wrong:
        raise ValueError(f"unsupported config values {wrong} (supported: {expected})")


def hf_config(data: dict, arch: str, **overrides) -> ModelConfig:
    """Llama/Qwen2/Qwen3-style config.json -> ModelConfig (causal unless overridden)."""
    _unsupported(data, hidden_act="silu", mlp_bias=False, use_sliding_window=False)
    eos = _first(data.get("eos_token_id"), 1)
    fields = {
        "vocab_size": data["vocab_size"],
        "hidden_size": data["hidden_size"],
        "num_layers": data["num_hidden_layers"],
        "num_heads": data["num_attention_heads"],
        "num_kv_heads": data.get("num_key_value_heads") or data["num_attention_heads"],
        "intermediate_size": data["intermediate_size"],
        "head_dim": data.get("head_dim") or 0,
        "rope_theta": _rope_theta(data),
        "rms_norm_eps": data.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": data.get("tie_word_embeddings", False),
        "attention": "causal",
        "mask_token_id": _first(data.get("mask_token_id"), 0),
        "eos_token_id": eos,
        "pad_token_id": _first(data.get("pad_token_id"), eos),
        "max_position_embeddings": data.get("max_position_embeddings", 4096),
        "arch": arch,
    }
    return ModelConfig(**{**fields, **overrides})


def llama_config(data: dict) -> ModelConfig:
    _unsupported(data, attention_bias=False)
    return hf_config(data, "llama")


def qwen2_config(data: dict) -> ModelConfig:
    return hf_config(data, "qwen2", qkv_bias=True)


def qwen3_config(data: dict) -> ModelConfig:
    _unsupported(data, attention_bias=False)
    return hf_config(data, "qwen3", qk_norm=True)


def dream_config(data: dict) -> ModelConfig:
    return hf_config(
        data,
        "dream",
        qkv_bias=True,
        attention="bidirectional",
        block_size=32,
        logits_shift=1,
        mask_token_id=_first(data.get("mask_token_id"), DREAM_MASK_ID),
    )


def sdar_config(data: dict) -> ModelConfig:
    _unsupported(data, attention_bias=False)
    return hf_config(
        data,
        "sdar",
        qk_norm=True,
        attention="block_causal",
        block_size=data.get("block_size") or SDAR_BLOCK_SIZE,
        mask_token_id=_first(data.get("mask_token_id"), SDAR_MASK_ID),
    )


def llada_config(data: dict) -> ModelConfig:
    """LLaDA (OLMo-derived) config keys -> ModelConfig; only the Llama-style block is supported."""
    _unsupported(
        data,
        block_type="llama",
        activation_type="silu",
        layer_norm_type="rms",
        include_bias=False,
        include_qkv_bias=False,
        attention_layer_norm=False,
        rope=True,
        alibi=False,
        input_emb_norm=False,
        scale_logits=False,
    )
    d_model, n_heads = data["d_model"], data["n_heads"]
    n_kv = data.get("n_kv_heads") or (1 if data.get("multi_query_attention") else n_heads)
    eos = _first(data.get("eos_token_id"), LLADA_EOS_ID)
    return ModelConfig(
        vocab_size=data.get("embedding_size") or data["vocab_size"],
        hidden_size=d_model,
        num_layers=data["n_layers"],
        num_heads=n_heads,
        num_kv_heads=n_kv,
        # activation "silu" (not "swiglu"): ff_proj/up_proj are both full mlp_hidden_size
        intermediate_size=data.get("mlp_hidden_size") or data.get("mlp_ratio", 4) * d_model,
        rope_theta=float(data.get("rope_theta", 10000.0)),
        rms_norm_eps=data.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=bool(data.get("weight_tying", False)),
        attention="bidirectional",
        block_size=32,
        mask_token_id=_first(data.get("mask_token_id"), LLADA_MASK_ID),
        eos_token_id=eos,
        pad_token_id=_first(data.get("pad_token_id"), eos),
        max_position_embeddings=data.get("max_sequence_length", 4096),
        arch="llada",
    )


def llada2_config(data: dict) -> ModelConfig:
    """LLaDA2 (MoE, block diffusion) config.json -> ModelConfig."""
    _unsupported(data, hidden_act="silu", use_qkv_bias=False, use_bias=False, use_qk_norm=True,
                 score_function="sigmoid", norm_topk_prob=True, moe_router_enable_expert_bias=True,
                 norm_head=False)
    experts = data.get("num_experts") or 0
    return hf_config(
        {**data, "mask_token_id": data.get("mask_token_id", LLADA2_MASK_ID),
         "eos_token_id": data.get("eos_token_id", LLADA2_EOS_ID)},
        "llada2",
        qk_norm=True,
        attention="block_causal",
        block_size=data.get("block_size") or LLADA2_BLOCK_SIZE,
        rotary_fraction=float(data.get("partial_rotary_factor", 1.0)),
        num_experts=experts,
        experts_per_token=data.get("num_experts_per_tok") or 0,
        moe_intermediate_size=data.get("moe_intermediate_size") or 0,
        shared_experts=data.get("num_shared_experts") or 0,
        dense_layers=data.get("first_k_dense_replace") or 0,
        expert_groups=data.get("n_group") or 1,
        expert_groups_used=data.get("topk_group") or 1,
        routed_scaling=float(data.get("routed_scaling_factor", 1.0)),
    )


def _llada(data: dict) -> Architecture:
    return Architecture(llada_config, llada_renamer(data.get("block_group_size", 1)))


ARCHITECTURES: dict[str, Callable[[dict], Architecture]] = {
    checkpoint.ARCH: lambda data: Architecture(checkpoint.config_from_remask, hf_name),
    "LLaDAModelLM": _llada,
    "DreamModel": lambda data: Architecture(dream_config, hf_name),
    "SDARForCausalLM": lambda data: Architecture(sdar_config, hf_name),
    "LLaDA2MoeModelLM": lambda data: Architecture(llada2_config, llada2_name, fuse_attention),
    "LlamaForCausalLM": lambda data: Architecture(llama_config, hf_name),
    "Qwen2ForCausalLM": lambda data: Architecture(qwen2_config, hf_name),
    "Qwen3ForCausalLM": lambda data: Architecture(qwen3_config, hf_name),
    # its own model class (engine/models/diffusion_gemma.py): load_config summarises it, load_model refuses it
    diffusion_gemma.ARCH: lambda data: Architecture(
        lambda d: diffusion_gemma.config_from_hf(d).to_model_config(), diffusion_gemma.checkpoint_name),
}


# ---------------------------------------------------------------- files


def _read_config(path: str | Path) -> tuple[Path, dict]:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    return directory, json.loads(config_file.read_text())


def _architecture(data: dict, directory: Path) -> Architecture:
    names = data.get("architectures") or []
    if not names:
        raise ValueError(f"{directory}/config.json names no architecture; known: {', '.join(ARCHITECTURES)}")
    if names[0] not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {names[0]!r} in {directory}; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[names[0]](data)


def _few(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" ... ({len(names)} in all)" if len(names) > 5 else "")


def _plan(files: list[Path], rename, model: DLMTransformer) -> dict[Path, dict[str, str]]:
    """Per file, checkpoint name -> our name; raises on unknown, duplicate or missing tensors."""
    expected = {name for name, _ in model.named_parameters()}  # a tied lm_head is not listed
    plan: dict[Path, dict[str, str]] = {}
    unexpected, seen = [], set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = f.keys()  # a safe_open handle is not iterable itself
        names = {key: rename(key) for key in keys if not key.endswith(IGNORED_SUFFIXES)}
        if model.config.tie_word_embeddings:
            names = {k: v for k, v in names.items() if v != "lm_head.weight"}
        for key, ours in names.items():
            if ours not in expected or ours in seen:
                unexpected.append(key)
            seen.add(ours)
        plan[file] = names
    if unexpected:
        raise ValueError(f"unexpected or duplicate tensors in checkpoint: {_few(unexpected)}")
    if missing := expected - seen:
        raise ValueError(f"tensors missing from checkpoint: {_few(missing)}")
    return plan


def _load_shards(model: DLMTransformer, plan: dict[Path, dict[str, str]], dtype, device) -> None:
    for file, names in plan.items():
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            part = {ours: f.get_tensor(key).to(dtype=dtype) for key, ours in names.items()}
        model.load_state_dict(part, strict=False, assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"parameters not loaded (still on the meta device): {_few(still_meta)}")


# ---------------------------------------------------------------- public API


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the checkpoint directory at ``path``."""
    directory, data = _read_config(path)
    return _architecture(data, directory).config(data)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DLMTransformer:
    """Load the checkpoint directory at ``path`` into an eval-mode DLMTransformer."""
    directory, data = _read_config(path)
    arch = _architecture(data, directory)
    if (data.get("architectures") or [None])[0] == diffusion_gemma.ARCH:
        raise ValueError(f"{directory} is a DiffusionGemma checkpoint: it runs as encoder passes and canvas "
                         "denoising steps (engine.models.diffusion_gemma.load, engine.canvas), not as a masked "
                         "diffusion model")
    with on_meta():
        model = DLMTransformer(arch.config(data))
        if arch.prepare is not None:
            arch.prepare(model)
    _load_shards(model, _plan(weight_files(directory), arch.rename, model), dtype, device)
    return model.eval()


# LLaDA2.1's own generation arguments (its model card's generate(): threshold, editing_threshold,
# max_post_steps) -> joint_threshold's fields, for a generation_config.json that names them without a rule
_LLADA21_EDITING = {"threshold": "threshold", "editing_threshold": "edit_threshold",
                    "max_post_steps": "max_post_edit_steps"}


def checkpoint_decoding(path: str | Path) -> tuple[str, dict] | None:
    """The decoding rule a checkpoint directory names, and its configuration, or None (``threshold``):
    ``"decoding"`` (a rule's registered name) and ``"decoding_config"`` (its fields) in ``generation_config.json``,
    else in ``config.json``; or LLaDA2.1's editing arguments in ``generation_config.json``
    (``editing_threshold`` set, with ``threshold`` and ``max_post_steps``): ``joint_threshold``. The rule is
    checked when the engine makes it (an unknown rule or a bad value is a ValueError naming the field)."""
    directory = Path(path)
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        data = json.loads(file.read_text()) if file.is_file() else {}
        if data.get("decoding") is not None or data.get("decoding_config") is not None:
            rule, config = data.get("decoding"), data.get("decoding_config")
            if rule is not None and not isinstance(rule, str):
                raise ValueError(f"{file}: decoding must be a rule's name, got {rule!r}")
            if config is not None and not isinstance(config, dict):
                raise ValueError(f"{file}: decoding_config must be an object, got {config!r}")
            return rule or "threshold", dict(config or {})
        if name == "generation_config.json" and data.get("editing_threshold") is not None:
            return "joint_threshold", {field: data[key] for key, field in _LLADA21_EDITING.items()
                                       if data.get(key) is not None}
    return None
