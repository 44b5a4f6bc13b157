"""Tiny HF-format checkpoints of each diffusion-LM family Remask serves, laid out as the published ones.

``build_checkpoint(arch, directory)`` writes, with no download and in well under a second:

* ``config.json`` spelled as the family's released checkpoint spells it (LLaDA-8B-Instruct's OLMo keys,
  Dream-v0-Instruct-7B's Qwen2 keys, SDAR's Qwen3 keys, LLaDA2.0-mini's Bailing-MoE keys), shrunk to a
  hidden size of 64, two layers and four heads;
* random, seeded bf16 weights under the family's own tensor names (written out below, independently of
  ``engine.models.loader``'s renamers) in ``model.safetensors``, or in two shards with
  ``model.safetensors.index.json`` for LLaDA;
* a real byte-level BPE tokenizer (``tokenizer.json``, trained once per process on a small multilingual
  corpus) with the family's special tokens appended after the learned vocabulary, ``tokenizer_config.json``
  with the family's chat template, ``special_tokens_map.json`` and ``generation_config.json``.

The special-token ids are the tokenizer's added-token ids; config.json's ``mask_token_id``,
``eos_token_id``, ``pad_token_id`` and ``bos_token_id`` are those ids, and ``vocab_size`` (LLaDA:
``embedding_size`` too) covers them, rounded up to a multiple of 64.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHS = ("llada", "dream", "sdar", "llada2")

# a sample the tests round-trip through each tokenizer: accents, CJK, emoji, digits, code and odd spacing
MULTILINGUAL = ("Grüße, café! naïve señor — Ærøskøbing. 日本語のテキスト 中文 한국어 🙂🚀 "
                "x = f(42) + 3.14;  # done\n\tend")

HIDDEN, LAYERS, HEADS, INTERMEDIATE = 64, 2, 4, 128
MAX_POSITIONS = 4096
TRAINED_VOCAB = 480  # byte-level BPE size before the special tokens
SCALE = 0.02


# ---------------------------------------------------------------- tokenizer

# Per family: the special tokens in the order they are appended (their ids follow the learned vocabulary),
# and which of them plays each role. "end_of_turn" is what the chat template writes after an answer.
SPECIAL_TOKENS = {
    "llada": ("<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|start_header_id|>", "<|end_header_id|>",
              "<|eot_id|>"),
    "dream": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"),
    "sdar": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"),
    "llada2": ("<role>", "</role>", "<|role_end|>", "<|startoftext|>", "<|endoftext|>", "<|mask|>"),
}
ROLES = {
    "llada": {"bos": "<|startoftext|>", "eos": "<|endoftext|>", "pad": "<|endoftext|>", "mask": "<|mdm_mask|>",
              "end_of_turn": "<|eot_id|>"},
    "dream": {"bos": "<|beginoftext|>", "eos": "<|endoftext|>", "pad": "<|endoftext|>", "mask": "<|mask|>",
              "end_of_turn": "<|im_end|>"},
    # Qwen3: the tokenizer's EOS is <|im_end|>, <|endoftext|> pads and is config.json's bos_token_id
    "sdar": {"bos": "<|endoftext|>", "eos": "<|im_end|>", "pad": "<|endoftext|>", "mask": "<|MASK|>",
             "end_of_turn": "<|im_end|>"},
    "llada2": {"bos": "<|startoftext|>", "eos": "<|endoftext|>", "pad": "<|endoftext|>", "mask": "<|mask|>",
               "end_of_turn": "<|role_end|>"},
}
# the tokenizer_config.json role names each family sets (SDAR, as Qwen3, names no BOS token)
TOKENIZER_ROLES = {"llada": ("bos", "eos", "pad", "mask"), "dream": ("bos", "eos", "pad", "mask"),
                   "sdar": ("eos", "pad", "mask"), "llada2": ("bos", "eos", "pad", "mask")}

# Chat templates modelled on the published ones (rendered by transformers' Jinja sandbox).
# LLaDA-8B-Instruct: Llama-3 headers, BOS before the first message, contents trimmed.
LLADA_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Dream-v0-Instruct-7B: ChatML with a default system message.
DREAM_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# SDAR (Qwen3 chat): ChatML, the system message only when given; no tools; an empty think block when
# thinking is turned off, as Qwen3 writes it.
SDAR_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# LLaDA2.0 (Bailing / Ling 2.0 chat): a system turn always, the given system text then the thinking switch.
LLADA2_TEMPLATE = (
    "{%- set thinking_option = 'off' %}"
    "{{- '<role>SYSTEM</role>' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- 'detailed thinking ' + thinking_option + '<|role_end|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<role>HUMAN</role>' + message.content + '<|role_end|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<role>ASSISTANT</role>' + message.content + '<|role_end|>' }}"
    "{%- elif message.role == 'system' and not loop.first %}"
    "{{- '<role>SYSTEM</role>' + message.content + '<|role_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<role>ASSISTANT</role>' }}{%- endif %}"
)
CHAT_TEMPLATES = {"llada": LLADA_TEMPLATE, "dream": DREAM_TEMPLATE, "sdar": SDAR_TEMPLATE, "llada2": LLADA2_TEMPLATE}


def _corpus() -> list[str]:
    """A few hundred lines of mixed English, accented European text, CJK, emoji, numbers and code."""
    english = ["The quick brown fox jumps over the lazy dog.", "Diffusion language models unmask tokens in parallel.",
               "Please summarise the following paragraph in one sentence.", "What is the capital of France?",
               "You are a helpful assistant.", "Let me think step by step about this problem."]
    european = ["Grüße aus München, schöne Straße.", "Un café crème et une crêpe, s'il vous plaît.",
                "naïve façade, déjà vu, résumé.", "¿Dónde está el señor? Mañana, año, niño.",
                "Ærøskøbing og Østerbro, smørrebrød.", "Žluťoučký kůň úpěl ďábelské ódy."]
    cjk = ["日本語のテキストです。", "中文文本，你好世界。", "東京と大阪の天気は晴れ。", "机器学习模型",
           "한국어 문장입니다."]
    emoji = ["🙂", "🚀", "🎉", "👍🏽", "🔥", "❤️", "🌍"]
    code = ["def f(x):\n    return x * 2 + 1", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
            "x = {'key': [1, 2, 3], \"value\": None}", "SELECT id, name FROM users WHERE age > 30;",
            "if err != nil { return fmt.Errorf(\"bad: %w\", err) }", "  \t# indented comment\n"]
    lines = []
    for i in range(240):
        parts = [english[i % len(english)], european[(i * 5) % len(european)], cjk[(i * 7) % len(cjk)],
                 emoji[i % len(emoji)] * (1 + i % 3), str(i * 37 % 1009), f"{i / 7:.3f}", code[(i * 3) % len(code)]]
        k = i % len(parts)
        lines.append(" ".join(parts[k:] + parts[:k]))
    return lines + [MULTILINGUAL] * 4


@functools.lru_cache(maxsize=1)
def _trained_bpe() -> str:
    """The learned byte-level BPE (no special tokens), as tokenizer.json text: trained once per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


@functools.cache
def _tokenizer_json(family: str) -> str:
    """The family's tokenizer.json text: the learned BPE with its special tokens appended."""
    from tokenizers import AddedToken, Tokenizer, processors

    tok = Tokenizer.from_str(_trained_bpe())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[family]])
    if family == "llada":  # a Llama-3-style tokenizer: BOS in front when special tokens are added
        bos = ROLES[family]["bos"]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                          special_tokens=[(bos, tok.token_to_id(bos))]),
        ])
    return tok.to_str()


@functools.cache
def _token_ids(family: str) -> dict[str, int]:
    data = json.loads(_tokenizer_json(family))
    return {t["content"]: t["id"] for t in data["added_tokens"]}


def _vocab_size(family: str) -> int:
    n = len(json.loads(_tokenizer_json(family))["model"]["vocab"])
    n = max(n, max(_token_ids(family).values()) + 1)
    return -(-n // 64) * 64


def family_ids(family: str) -> dict[str, int]:
    """{"bos", "eos", "pad", "mask", "end_of_turn"} -> token id for ``family`` (no files needed)."""
    ids = _token_ids(family)
    return {role: ids[token] for role, token in ROLES[family].items()}


def _token_entry(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def _write_tokenizer(family: str, directory: Path, chat_template: bool) -> None:
    (directory / "tokenizer.json").write_text(_tokenizer_json(family), encoding="utf-8")
    ids = _token_ids(family)
    roles = {role: ROLES[family][role] for role in TOKENIZER_ROLES[family]}
    extra = [t for t in SPECIAL_TOKENS[family] if t not in roles.values()]
    config = {
        "add_bos_token": family == "llada",
        "add_eos_token": False,
        "added_tokens_decoder": {str(ids[t]): {**_token_entry(t), "special": True} for t in SPECIAL_TOKENS[family]},
        **{f"{role}_token": token for role, token in roles.items()},
        "additional_special_tokens": extra,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if family == "sdar":
        config["bos_token"] = None
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATES[family]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
    special_map = {f"{role}_token": _token_entry(token) for role, token in roles.items()}
    special_map["additional_special_tokens"] = extra
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def _generation_config(family: str) -> dict:
    ids = family_ids(family)
    eos = list(dict.fromkeys([ids["eos"], ids["end_of_turn"]]))
    if family == "dream":  # Dream ships sampling defaults
        return {"bos_token_id": ids["bos"], "pad_token_id": ids["pad"], "eos_token_id": eos, "do_sample": True,
                "temperature": 0.2, "top_p": 0.95, "transformers_version": "4.46.2"}
    if family == "sdar":  # as Qwen3: <|im_end|>, then <|endoftext|>
        return {"bos_token_id": ids["bos"], "pad_token_id": ids["pad"], "eos_token_id": [ids["eos"], ids["pad"]],
                "transformers_version": "4.51.3"}
    return {"bos_token_id": ids["bos"], "pad_token_id": ids["pad"], "eos_token_id": eos,
            "transformers_version": "4.46.3" if family == "llada" else "4.52.3"}


# ---------------------------------------------------------------- configs


def _llada_config() -> dict:
    """LLaDA-8B-Instruct's config.json keys (OLMo style), shrunk."""
    ids, vocab = family_ids("llada"), _vocab_size("llada")
    return {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "bos_token_id": ids["bos"],
        "d_model": HIDDEN,
        "embedding_dropout": 0.0,
        "embedding_size": vocab,
        "eos_token_id": ids["eos"],
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": ids["mask"],
        "max_sequence_length": MAX_POSITIONS,
        "mlp_hidden_size": INTERMEDIATE,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": HEADS,
        "n_kv_heads": HEADS,  # LLaDA-8B uses full multi-head attention
        "n_layers": LAYERS,
        "pad_token_id": ids["pad"],
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": vocab,
        "weight_tying": False,
    }


def _dream_config() -> dict:
    """Dream-v0-Instruct-7B's config.json keys (Qwen2 style), shrunk."""
    ids = family_ids("dream")
    return {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "mask_token_id": ids["mask"],
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": LAYERS,
        "model_type": "Dream",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2,
        "pad_token_id": ids["pad"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": _vocab_size("dream"),
    }


SDAR_HEAD_DIM = 32  # as Qwen3: head_dim is its own key, not hidden_size / heads


def _sdar_config() -> dict:
    """SDAR's config.json keys (Qwen3 style, block diffusion), shrunk; embeddings tied as SDAR-1.7B's."""
    ids = family_ids("sdar")
    return {
        "architectures": ["SDARForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 4,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "head_dim": SDAR_HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "mask_token_id": ids["mask"],
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": LAYERS,
        "model_type": "sdar",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2,
        "pad_token_id": ids["pad"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": _vocab_size("sdar"),
    }


LLADA2_EXPERTS, LLADA2_PER_TOKEN, LLADA2_SHARED, LLADA2_MOE_INTERMEDIATE = 4, 2, 1, 32


def _llada2_config() -> dict:
    """LLaDA2.0-mini's config.json keys (Bailing MoE v2), shrunk: layer 0 dense, layer 1 a mixture of experts."""
    ids = family_ids("llada2")
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "block_size": 32,
        "bos_token_id": ids["bos"],
        "embedding_dropout": 0.0,
        "eos_token_id": ids["eos"],
        "first_k_dense_replace": 1,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "mask_token_id": ids["mask"],
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": LAYERS,
        "model_type": "llada2_moe",
        "moe_intermediate_size": LLADA2_MOE_INTERMEDIATE,
        "moe_router_enable_expert_bias": True,
        "moe_shared_expert_intermediate_size": LLADA2_MOE_INTERMEDIATE * LLADA2_SHARED,
        "n_group": 2,
        "norm_head": False,
        "norm_softmax": False,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts": LLADA2_EXPERTS,
        "num_experts_per_tok": LLADA2_PER_TOKEN,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2,
        "num_shared_experts": LLADA2_SHARED,
        "output_dropout": 0.0,
        "output_router_logits": False,
        "pad_token_id": ids["pad"],
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 600000.0,
        "rotary_dim": HIDDEN // HEADS // 2,
        "routed_scaling_factor": 2.5,
        "router_dtype": "fp32",
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.3",
        "use_bias": False,
        "use_cache": True,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "use_sliding_window": False,
        "vocab_size": _vocab_size("llada2"),
    }


CONFIGS = {"llada": _llada_config, "dream": _dream_config, "sdar": _sdar_config, "llada2": _llada2_config}


# ---------------------------------------------------------------- tensor names and shapes


def _llada_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["d_model"], cfg["mlp_hidden_size"], cfg["embedding_size"]
    hd = h // cfg["n_heads"]
    kv = cfg["n_kv_heads"] * hd
    shapes = {"model.transformer.wte.weight": (v, h)}
    for n in range(cfg["n_layers"]):
        b = f"model.transformer.blocks.{n}"
        shapes.update({
            f"{b}.attn_norm.weight": (h,),
            f"{b}.q_proj.weight": (h, h),
            f"{b}.k_proj.weight": (kv, h),
            f"{b}.v_proj.weight": (kv, h),
            f"{b}.attn_out.weight": (h, h),
            f"{b}.ff_norm.weight": (h,),
            f"{b}.ff_proj.weight": (i, h),  # the activated half
            f"{b}.up_proj.weight": (i, h),
            f"{b}.ff_out.weight": (h, i),
        })
    shapes["model.transformer.ln_f.weight"] = (h,)
    shapes["model.transformer.ff_out.weight"] = (v, h)
    return shapes


def _qwen_shapes(cfg: dict, *, bias: bool, qk_norm: bool) -> dict[str, tuple[int, ...]]:
    """Qwen2 (``bias``: q/k/v biases) and Qwen3 (``qk_norm``) layouts."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{n}"
        shapes.update({
            f"{b}.input_layernorm.weight": (h,),
            f"{b}.self_attn.q_proj.weight": (q, h),
            f"{b}.self_attn.k_proj.weight": (kv, h),
            f"{b}.self_attn.v_proj.weight": (kv, h),
            f"{b}.self_attn.o_proj.weight": (h, q),
            f"{b}.post_attention_layernorm.weight": (h,),
            f"{b}.mlp.gate_proj.weight": (i, h),
            f"{b}.mlp.up_proj.weight": (i, h),
            f"{b}.mlp.down_proj.weight": (h, i),
        })
        if bias:
            shapes.update({f"{b}.self_attn.q_proj.bias": (q,), f"{b}.self_attn.k_proj.bias": (kv,),
                           f"{b}.self_attn.v_proj.bias": (kv,)})
        if qk_norm:
            shapes.update({f"{b}.self_attn.q_norm.weight": (hd,), f"{b}.self_attn.k_norm.weight": (hd,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _llada2_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Bailing MoE v2 names: fused ``attention.query_key_value``, ``dense``, per-head q/k layernorms; dense
    MLPs in the first ``first_k_dense_replace`` layers, then ``mlp.gate`` (router weight and expert bias),
    ``mlp.experts.E`` and ``mlp.shared_experts``."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
    si = mi * cfg["num_shared_experts"]
    shapes = {"model.word_embeddings.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{n}"
        shapes.update({
            f"{b}.input_layernorm.weight": (h,),
            f"{b}.attention.query_key_value.weight": ((nh + 2 * nkv) * hd, h),
            f"{b}.attention.query_layernorm.weight": (hd,),
            f"{b}.attention.key_layernorm.weight": (hd,),
            f"{b}.attention.dense.weight": (h, nh * hd),
            f"{b}.post_attention_layernorm.weight": (h,),
        })
        if n < cfg["first_k_dense_replace"]:
            shapes.update({f"{b}.mlp.gate_proj.weight": (i, h), f"{b}.mlp.up_proj.weight": (i, h),
                           f"{b}.mlp.down_proj.weight": (h, i)})
            continue
        shapes.update({f"{b}.mlp.gate.weight": (e, h), f"{b}.mlp.gate.expert_bias": (e,)})
        for x in range(e):
            shapes.update({f"{b}.mlp.experts.{x}.gate_proj.weight": (mi, h),
                           f"{b}.mlp.experts.{x}.up_proj.weight": (mi, h),
                           f"{b}.mlp.experts.{x}.down_proj.weight": (h, mi)})
        shapes.update({f"{b}.mlp.shared_experts.gate_proj.weight": (si, h),
                       f"{b}.mlp.shared_experts.up_proj.weight": (si, h),
                       f"{b}.mlp.shared_experts.down_proj.weight": (h, si)})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def tensor_shapes(arch: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, in the family's published naming."""
    if arch == "llada":
        return _llada_shapes(cfg)
    if arch == "dream":
        return _qwen_shapes(cfg, bias=True, qk_norm=False)
    if arch == "sdar":
        return _qwen_shapes(cfg, bias=False, qk_norm=True)
    if arch == "llada2":
        return _llada2_shapes(cfg)
    raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")


def _weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights: norms 1, expert biases 0, the rest normal * SCALE; bf16 as published (the
    router's expert bias float32, as Bailing keeps it)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith(("norm.weight", "layernorm.weight", "ln_f.weight")):
            t = torch.ones(shape)
        elif name.endswith("expert_bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=g) * SCALE
        out[name] = t if name.endswith("expert_bias") else t.to(torch.bfloat16)
    return out


def _save_weights(tensors: dict[str, torch.Tensor], directory: Path, shards: int) -> None:
    meta = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata=meta)
        return
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, str(directory / file), metadata=meta)
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------- public API


def build_checkpoint(arch: str, directory: str | Path, *, chat_template: bool = True, seed: int = 0) -> Path:
    """Write a tiny checkpoint of family ``arch`` (one of ``ARCHS``) into ``directory`` (created) and return
    it. ``chat_template=False`` leaves the template out of tokenizer_config.json (a model without one)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = CONFIGS[arch]()
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(_generation_config(arch), indent=2) + "\n")
    _write_tokenizer(arch, directory, chat_template)
    _save_weights(_weights(tensor_shapes(arch, cfg), seed), directory, shards=2 if arch == "llada" else 1)
    return directory


# LLaDA2.1's quality mode as its card gives it (threshold 0.7, editing threshold 0.5), the post-edit steps bounded
# low so the tiny fixture's blocks close quickly
LLADA21_DECODING = {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 2}


def build_llada21_checkpoint(llada2: str | Path, directory: str | Path, *, named: bool = True) -> Path:
    """A LLaDA2.1-format checkpoint in ``directory``: the LLaDA2 one built at ``llada2`` (``build_checkpoint(
    "llada2", ...)``: the same architecture, weights and tokenizer, linked, not rebuilt) with an editing
    ``generation_config.json``: naming ``joint_threshold`` and its config (``"decoding"``, ``"decoding_config"``:
    ``LLADA21_DECODING``), or with ``named=False`` LLaDA2.1's own generate arguments (``threshold``,
    ``editing_threshold``, ``max_post_steps``)."""
    src, directory = Path(llada2), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "generation_config.json" and not (directory / f.name).exists():
            (directory / f.name).symlink_to(f.resolve())
    gen = json.loads((src / "generation_config.json").read_text())
    if named:
        gen.update(decoding="joint_threshold", decoding_config=dict(LLADA21_DECODING))
    else:
        gen.update(threshold=LLADA21_DECODING["threshold"], editing_threshold=LLADA21_DECODING["edit_threshold"],
                   max_post_steps=LLADA21_DECODING["max_post_edit_steps"])
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return directory


def special_ids(directory: str | Path) -> dict[str, int]:
    """{"mask", "eos", "end_of_turn", "bos", "pad"} -> id, read from a built checkpoint's tokenizer.json
    (its family from config.json's architectures)."""
    directory = Path(directory)
    arch = json.loads((directory / "config.json").read_text())["architectures"][0]
    family = {"LLaDAModelLM": "llada", "DreamModel": "dream", "SDARForCausalLM": "sdar",
              "LLaDA2MoeModelLM": "llada2"}[arch]
    added = {t["content"]: t["id"] for t in json.loads((directory / "tokenizer.json").read_text())["added_tokens"]}
    return {role: added[token] for role, token in ROLES[family].items()}
