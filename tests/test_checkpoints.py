"""The tiny real-format checkpoints of tests/checkpoints.py: the loader takes them, transformers reads their
tokenizers (byte-level BPE round trips, single-id special tokens, the family's chat template), and a forward
pass gives finite logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engine.models.loader import load_config, load_model
from engine.models.masks import full_mask
from tests.checkpoints import ARCHS, MULTILINGUAL, build_checkpoint, family_ids, special_ids

transformers = pytest.importorskip("transformers")

ATTENTION = {"llada": "bidirectional", "dream": "bidirectional", "sdar": "block_causal", "llada2": "block_causal"}
ARCHITECTURE = {"llada": "LLaDAModelLM", "dream": "DreamModel", "sdar": "SDARForCausalLM",
                "llada2": "LLaDA2MoeModelLM"}
MASK_TOKEN = {"llada": "<|mdm_mask|>", "dream": "<|mask|>", "sdar": "<|MASK|>", "llada2": "<|mask|>"}
EOS_TOKEN = {"llada": "<|endoftext|>", "dream": "<|endoftext|>", "sdar": "<|im_end|>", "llada2": "<|endoftext|>"}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Grüße 🙂"},
    {"role": "assistant", "content": "Hallo!"},
    {"role": "user", "content": "日本語?"},
]
# each family's rendering of CHAT with the generation prompt, exactly
RENDERED = {
    "llada": "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\nGrüße 🙂<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\nHallo!<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\n日本語?<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "dream": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGrüße 🙂<|im_end|>\n"
             "<|im_start|>assistant\nHallo!<|im_end|>\n<|im_start|>user\n日本語?<|im_end|>\n<|im_start|>assistant\n",
    "sdar": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGrüße 🙂<|im_end|>\n"
            "<|im_start|>assistant\nHallo!<|im_end|>\n<|im_start|>user\n日本語?<|im_end|>\n<|im_start|>assistant\n",
    "llada2": "<role>SYSTEM</role>Be brief.\ndetailed thinking off<|role_end|><role>HUMAN</role>Grüße 🙂<|role_end|>"
              "<role>ASSISTANT</role>Hallo!<|role_end|><role>HUMAN</role>日本語?<|role_end|><role>ASSISTANT</role>",
}
# a single user message: Dream adds its default system message, SDAR none, LLaDA2 its thinking switch
USER_ONLY = {
    "llada": "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "dream": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
             "<|im_start|>assistant\n",
    "sdar": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "llada2": "<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>hi<|role_end|>"
              "<role>ASSISTANT</role>",
}
FIRST_TENSOR = {"llada": "model.transformer.wte.weight", "dream": "model.embed_tokens.weight",
                "sdar": "model.embed_tokens.weight", "llada2": "model.word_embeddings.weight"}


def tokenizer(directory):
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # a handle is not iterable
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_loader_takes_checkpoint(hf_checkpoints, arch):
    directory = hf_checkpoints[arch]
    data = json.loads((directory / "config.json").read_text())
    assert data["architectures"] == [ARCHITECTURE[arch]]
    model = load_model(directory)
    cfg = model.config
    ids = special_ids(directory)
    assert ids == family_ids(arch)
    assert (cfg.arch, cfg.attention) == (arch, ATTENTION[arch])
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (ids["mask"], ids["eos"], ids["pad"])
    assert data.get("bos_token_id") == ids["bos"]
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size > max(ids.values())
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (64, 2, 4)
    assert cfg.max_position_embeddings >= 1024
    assert load_config(directory) == cfg
    # the weights are the file's (the embedding under the family's own name), not a fresh initialisation
    assert torch.equal(model.embed_tokens.weight, tensors(directory)[FIRST_TENSOR[arch]].float())
    assert all(not p.is_meta and p.dtype == torch.float32 for p in model.parameters())


def test_family_specifics(hf_checkpoints):
    llada, sdar, llada2 = hf_checkpoints["llada"], hf_checkpoints["sdar"], hf_checkpoints["llada2"]
    index = json.loads((llada / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    assert not (llada / "model.safetensors").exists()
    assert "model.transformer.blocks.1.ff_proj.weight" in index["weight_map"]
    assert load_model(llada).config.num_kv_heads == 4
    names = set(tensors(sdar))
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names  # tied
    model = load_model(sdar)
    assert (model.config.head_dim, model.config.block_size, model.config.num_kv_heads) == (32, 4, 2)
    assert model.lm_head.weight is model.embed_tokens.weight
    names = set(tensors(llada2))
    assert {"model.layers.0.attention.query_key_value.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.mlp.gate.expert_bias", "model.layers.1.mlp.experts.3.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight"} <= names
    cfg = load_model(llada2).config
    assert (cfg.num_experts, cfg.experts_per_token, cfg.shared_experts, cfg.dense_layers) == (4, 2, 1, 1)
    assert (cfg.expert_groups, cfg.expert_groups_used, cfg.rotary_fraction) == (2, 1, 0.5)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer(hf_checkpoints, arch):
    directory = hf_checkpoints[arch]
    tok = tokenizer(directory)
    ids = special_ids(directory)
    text_ids = tok.encode(MULTILINGUAL, add_special_tokens=False)
    assert tok.decode(text_ids) == MULTILINGUAL
    assert len(text_ids) < len(MULTILINGUAL.encode())  # merges learned, not bytes only
    assert 400 <= len(tok) <= 600
    assert tok.encode(MASK_TOKEN[arch], add_special_tokens=False) == [ids["mask"]]
    assert tok.encode(EOS_TOKEN[arch], add_special_tokens=False) == [ids["eos"]]
    assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id) == (ids["mask"], ids["eos"], ids["pad"])
    assert tok.convert_tokens_to_ids(MASK_TOKEN[arch]) == ids["mask"]
    # special tokens inside text stay single ids; skip_special_tokens drops them
    mixed = tok.encode(f"a{MASK_TOKEN[arch]}{MASK_TOKEN[arch]}b", add_special_tokens=False)
    assert mixed.count(ids["mask"]) == 2
    assert tok.decode(mixed, skip_special_tokens=True) == "ab"
    gen = json.loads((directory / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == ids["eos"]


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(hf_checkpoints, arch):
    tok = tokenizer(hf_checkpoints[arch])
    ids = special_ids(hf_checkpoints[arch])
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == RENDERED[arch]
    one = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(one, tokenize=False, add_generation_prompt=True) == USER_ONLY[arch]
    encoded = tok.encode(text, add_special_tokens=False)
    assert tok.decode(encoded) == text
    assert encoded.count(ids["end_of_turn"]) == 4
    assert ids["end_of_turn"] in json.loads((hf_checkpoints[arch] / "generation_config.json").read_text())[
        "eos_token_id"]


def test_generation_defaults(hf_checkpoints):
    gens = {a: json.loads((hf_checkpoints[a] / "generation_config.json").read_text()) for a in ARCHS}
    assert (gens["dream"]["temperature"], gens["dream"]["top_p"]) == (0.2, 0.95)
    assert all("temperature" not in gens[a] for a in ("llada", "sdar", "llada2"))


def test_llada_adds_bos(hf_checkpoints):
    """As a Llama-3 tokenizer, LLaDA's puts BOS in front when asked for special tokens; the others add none."""
    for arch in ARCHS:
        tok = tokenizer(hf_checkpoints[arch])
        plain = tok.encode("hi", add_special_tokens=False)
        expected = [special_ids(hf_checkpoints[arch])["bos"], *plain] if arch == "llada" else plain
        assert tok.encode("hi", add_special_tokens=True) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_forward(hf_checkpoints, arch):
    model = load_model(hf_checkpoints[arch])
    cfg = model.config
    tok = tokenizer(hf_checkpoints[arch])
    ids = torch.tensor([tok.encode("Grüße 🙂 café", add_special_tokens=False)[:6] + [cfg.mask_token_id] * 2])
    positions = torch.arange(ids.shape[1])[None]
    mask = full_mask(cfg.attention, positions, torch.ones_like(ids, dtype=torch.bool), cfg.block_size)
    with torch.no_grad():
        logits = model(ids, positions, mask)[0]
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_without_template(hf_checkpoint_notemplate):
    tok = tokenizer(hf_checkpoint_notemplate)
    assert not getattr(tok, "chat_template", None)
    assert "chat_template" not in json.loads((hf_checkpoint_notemplate / "tokenizer_config.json").read_text())
    assert load_model(hf_checkpoint_notemplate).config.arch == "dream"


def test_seeded(tmp_path):
    a = tensors(build_checkpoint("llada2", tmp_path / "a", seed=3))
    b = tensors(build_checkpoint("llada2", tmp_path / "b", seed=3))
    c = tensors(build_checkpoint("llada2", tmp_path / "c", seed=4))
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "c" / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="unknown arch"):
        build_checkpoint("gpt2", tmp_path / "d")
