"""Checkpoint loading and logits parity of engine.models.loader against transformers.

Tiny random models (fp32, CPU): HF Llama/Qwen2/Qwen3 saved with save_pretrained,
fake LLaDA/Dream/SDAR checkpoints derived from them, and Remask's own format.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models import checkpoint
from engine.models.config import ModelConfig
from engine.models.loader import load_config, load_model
from engine.models.masks import full_mask
from engine.models.transformer import DLMTransformer

transformers = pytest.importorskip("transformers")

SMALL = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 5000.0,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 7,
}
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
IDS = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))

# HF Llama names -> LLaDA names, written out here independently of the loader's table.
LLADA_TOP = {
    "model.embed_tokens.weight": "model.transformer.wte.weight",
    "model.norm.weight": "model.transformer.ln_f.weight",
    "lm_head.weight": "model.transformer.ff_out.weight",
}
LLADA_BLOCK = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough to matter, norms away from 1 so swapped norms show up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)


def hf_model(kind: str, **overrides):
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[kind])
    model = model_cls._from_config(config_cls(**{**SMALL, **overrides}), attn_implementation="eager")
    randomize(model)
    return model.eval()


def reference_logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=IDS).logits


def our_logits(model: DLMTransformer, mode: str = "causal") -> torch.Tensor:
    positions = torch.arange(IDS.shape[1]).expand_as(IDS)
    mask = full_mask(mode, positions, torch.ones_like(IDS, dtype=torch.bool), model.config.block_size)
    with torch.no_grad():
        return model(IDS, positions, mask)[0]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def rewrite_config(directory, **changes) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


# ---------------------------------------------------------------- HF parity


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {"head_dim": 32})],
)
def test_hf_causal_lm_parity(tmp_path, kind, overrides):
    hf = hf_model(kind, **overrides)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    cfg = model.config
    assert (cfg.arch, cfg.attention, cfg.eos_token_id, cfg.rope_theta) == (kind, "causal", 7, 5000.0)
    assert (cfg.qkv_bias, cfg.qk_norm) == (kind == "qwen2", kind == "qwen3")
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert cfg.head_dim == overrides.get("head_dim", 16)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    assert_close(our_logits(model), reference_logits(hf))


def test_sharded_checkpoint_parity(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 3
    assert_close(our_logits(load_model(tmp_path)), reference_logits(hf))


# ---------------------------------------------------------------- diffusion layouts


def llada_name(name: str, group_size: int) -> str:
    if name in LLADA_TOP:
        return LLADA_TOP[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    i, part = int(m[1]), LLADA_BLOCK[m[2]]
    where = f"blocks.{i}" if group_size == 1 else f"block_groups.{i // group_size}.{i % group_size}"
    return f"model.transformer.{where}.{part}.weight"


def llada_config(group_size: int, n_layers: int = SMALL["num_hidden_layers"]) -> dict:
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "activation_type": "silu",
        "block_type": "llama",
        "layer_norm_type": "rms",
        "block_group_size": group_size,
        "d_model": SMALL["hidden_size"],
        "n_layers": n_layers,
        "n_heads": SMALL["num_attention_heads"],
        "n_kv_heads": SMALL["num_key_value_heads"],
        "mlp_hidden_size": SMALL["intermediate_size"],
        "mlp_ratio": 4,
        "vocab_size": SMALL["vocab_size"],
        "embedding_size": SMALL["vocab_size"],
        "rope": True,
        "rope_theta": SMALL["rope_theta"],
        "rms_norm_eps": SMALL["rms_norm_eps"],
        "include_bias": False,
        "include_qkv_bias": False,
        "weight_tying": False,
        "mask_token_id": 126336,
        "eos_token_id": 126081,
        "pad_token_id": 126081,
        "max_sequence_length": 4096,
    }


@pytest.mark.parametrize("group_size", [1, 2])
def test_llada_layout_maps_onto_llama(tmp_path, group_size):
    hf = hf_model("llama", num_hidden_layers=4)
    tensors = {llada_name(k, group_size): v.contiguous() for k, v in hf.state_dict().items()}
    assert len(tensors) == len(hf.state_dict())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(llada_config(group_size, n_layers=4)))
    model = load_model(tmp_path)
    cfg = model.config
    assert (cfg.arch, cfg.attention, cfg.block_size, cfg.logits_shift) == ("llada", "bidirectional", 32, 0)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.intermediate_size) == (126336, 126081, 96)
    assert_close(our_logits(model), reference_logits(hf))


def test_llada_8b_config(tmp_path):
    """The shapes of the released LLaDA-8B config.json (load_config needs no weights)."""
    data = {**llada_config(1), "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32}
    data.update(mlp_hidden_size=12288, vocab_size=126464, embedding_size=126464, rope_theta=500000.0)
    (tmp_path / "config.json").write_text(json.dumps(data))
    cfg = load_config(tmp_path)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (128, 12288, 126464, 500000.0)
    assert 7.9e9 < cfg.num_params < 8.1e9


def test_dream_layout(tmp_path):
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    rewrite_config(tmp_path, architectures=["DreamModel"], model_type="Dream")
    model = load_model(tmp_path)
    cfg = model.config
    assert (cfg.arch, cfg.attention, cfg.block_size, cfg.logits_shift) == ("dream", "bidirectional", 32, 1)
    assert (cfg.mask_token_id, cfg.qkv_bias, cfg.qk_norm) == (151666, True, False)
    assert_close(our_logits(model), reference_logits(hf))
    rewrite_config(tmp_path, mask_token_id=99)
    assert load_config(tmp_path).mask_token_id == 99


def test_sdar_layout(tmp_path):
    hf = hf_model("qwen3", head_dim=32)
    hf.save_pretrained(tmp_path)
    rewrite_config(tmp_path, architectures=["SDARForCausalLM"], model_type="sdar", block_size=8)
    model = load_model(tmp_path)
    cfg = model.config
    assert (cfg.arch, cfg.attention, cfg.block_size, cfg.logits_shift) == ("sdar", "block_causal", 8, 0)
    assert (cfg.mask_token_id, cfg.qkv_bias, cfg.qk_norm, cfg.head_dim) == (151669, False, True, 32)
    assert_close(our_logits(model), reference_logits(hf))
    rewrite_config(tmp_path, block_size=None)
    assert load_config(tmp_path).block_size == 4


# ---------------------------------------------------------------- Remask format


def remask_checkpoint(directory) -> DLMTransformer:
    cfg = ModelConfig(
        vocab_size=100,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        qkv_bias=True,
        qk_norm=True,
        tie_word_embeddings=True,
        attention="block_causal",
        block_size=4,
        mask_token_id=99,
        eos_token_id=98,
    )
    model = DLMTransformer(cfg)
    randomize(model)
    checkpoint.save_pretrained(model.eval(), directory)
    return model


def test_remask_roundtrip(tmp_path):
    original = remask_checkpoint(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == original.config == load_config(tmp_path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert torch.equal(our_logits(loaded, "block_causal"), our_logits(original, "block_causal"))


def test_weights_are_never_randomly_initialised(tmp_path, monkeypatch):
    remask_checkpoint(tmp_path)
    devices = []

    def recording(init):
        def wrapper(tensor, *args, **kwargs):
            devices.append(tensor.device.type)
            return init(tensor, *args, **kwargs)

        return wrapper

    for name in ("kaiming_uniform_", "normal_", "uniform_"):
        monkeypatch.setattr(torch.nn.init, name, recording(getattr(torch.nn.init, name)))
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert devices and set(devices) == {"meta"}
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())


# ---------------------------------------------------------------- errors


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_model(tmp_path)
    assert "LLaDAModelLM" in str(err.value) and "Qwen3ForCausalLM" in str(err.value)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(checkpoint.hf_config(remask_checkpoint(tmp_path / "m").config)))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_unexpected_and_missing_tensors(tmp_path):
    remask_checkpoint(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    save_file({**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(weights))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(tmp_path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(weights))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)
