"""Random-weight models of real shapes, for profiles and benchmarks with no weights to download.

``llada-8b-shape`` is LLaDA-8B's shape (Llama layout, bidirectional), ``dream-7b-shape`` Dream-7B's
(Qwen2: grouped KV heads, qkv bias, shifted logits), ``sdar-8b-shape`` SDAR-8B's (Qwen3: q/k
norms, block-causal with blocks of 4) and ``llada2-mini-shape`` LLaDA2.0-mini's (a mixture of 256
experts, 8 per token plus a shared one, after one dense layer; q/k norms, RoPE on half of each head,
block-causal with blocks of 32). ``diffusiongemma-26b-a4b-shape`` is DiffusionGemma-26B-A4B's (the Gemma-4
26B-A4B backbone: 30 layers, five sliding-window layers to one full layer, 128 experts of which 8 per token
beside a dense MLP, keys as values in the full layers, a 256-token canvas; ``engine.profile_model.DG_26B_A4B_TEXT``,
checked there against the published parameter counts): a canvas model, built as ``engine.models.diffusion_gemma``
builds a checkpoint and served by ``CanvasServeEngine`` (``build_dg_preset``, ``dg_preset_engine``: ``remask profile``).

A name may carry overrides after a colon, ``llada-8b-shape:layers=2,vocab=4096``, to run the same
code at a size a CPU can afford (tests do). The weights are random (seeded), so what such a model
decodes is noise: presets are for timing, never for answers. They take token ids, not text.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from engine.models.config import ModelConfig
from engine.models.meta import on_meta
from engine.models.transformer import DLMTransformer
from engine.profile_model import DG_26B_A4B_TEXT, DG_CANVAS

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


# canvas (DiffusionGemma) shapes: a checkpoint's text_config and its canvas length
DG_PRESETS: dict[str, dict] = {
    "diffusiongemma-26b-a4b-shape": {"text_config": DG_26B_A4B_TEXT, "canvas_length": DG_CANVAS},
}
DG_OVERRIDES = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                "kv_heads": "num_key_value_heads", "global_kv_heads": "num_global_key_value_heads",
                "head_dim": "head_dim", "global_head_dim": "global_head_dim", "intermediate": "intermediate_size",
                "vocab": "vocab_size", "window": "sliding_window", "experts": "num_experts",
                "experts_per_token": "top_k_experts", "moe_intermediate": "moe_intermediate_size",
                "canvas": "canvas_length"}
RANDOM_WEIGHTS = ("random (seeded normal(0, 0.02); norms, router scales and layer scalars 1): a timing shape, "
                  "not the checkpoint's weights")


def is_preset(name: str) -> bool:
    """A shape preset's name (random weights): a masked family's (``PRESETS``) or a canvas model's (``DG_PRESETS``)."""
    return name.split(":", 1)[0] in PRESETS or is_dg_preset(name)


def is_dg_preset(name: str) -> bool:
    return name.split(":", 1)[0] in DG_PRESETS


def _overrides(name: str, known: dict[str, str]) -> tuple[str, dict[str, int]]:
    """``preset[:key=value,...]`` -> (preset, {field: integer}); ValueError naming a bad item."""
    base, _, rest = name.partition(":")
    out = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key not in known or not eq:
            raise ValueError(f"bad preset override {item!r}: use key=integer with key one of {', '.join(known)}")
        try:
            out[known[key]] = int(value)
        except ValueError:
            raise ValueError(f"bad preset override {item!r}: {value!r} is not an integer") from None
    return base, out


def preset_config(name: str) -> ModelConfig:
    """The config of ``name`` (``preset[:key=value,...]``); ValueError on an unknown preset or key. A canvas
    preset's is its ``dg_preset_config`` summarised (``DiffusionGemmaConfig.to_model_config``), marked a preset."""
    if is_dg_preset(name):
        cfg = dg_preset_config(name).to_model_config()
        cfg.extra.update(name=name, preset=True)
        return cfg
    base, over = _overrides(name, OVERRIDES)
    if base not in PRESETS:
        raise ValueError(f"unknown model preset {base!r}; known: {', '.join(sorted([*PRESETS, *DG_PRESETS]))}")
    kwargs = dict(PRESETS[base])
    kwargs.update(over)
    vocab = kwargs["vocab_size"]
    if max(kwargs["mask_token_id"], kwargs["eos_token_id"], kwargs["pad_token_id"]) >= vocab:
        kwargs.update(mask_token_id=vocab - 1, eos_token_id=vocab - 2, pad_token_id=vocab - 2)  # a shrunk vocabulary
    return ModelConfig(**kwargs, extra={"name": name, "preset": True})


def build_preset(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, tp: int = 1) -> DLMTransformer:
    """A random-weight model of the preset's shape, made on ``device`` in ``dtype`` (no float32 copy).
    ``tp`` > 1: one tensor-parallel rank's shard of that shape (its heads and MLP columns; the caller
    sets each layer's ``reduce``), for timing TP rounds without building the whole model first."""
    if is_dg_preset(name):
        raise ValueError(f"{name!r} is a canvas (DiffusionGemma) shape: build it with build_dg_preset, profile it "
                         "with remask profile (the masked families' round benches do not run it)")
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


def dg_preset_config(name: str):
    """The ``DiffusionGemmaConfig`` of a canvas preset (``diffusiongemma-26b-a4b-shape[:key=value,...]``, keys in
    ``DG_OVERRIDES``): ``layers=N`` keeps the 5:1 sliding-to-full pattern (the last layer full, as transformers
    forces it); a shrunk vocabulary keeps the token ids (pad 0, EOS 1, BOS 2) below it."""
    from engine.models import diffusion_gemma as dg

    base, over = _overrides(name, DG_OVERRIDES)
    if base not in DG_PRESETS:
        raise ValueError(f"unknown canvas model preset {base!r}; known: {', '.join(sorted(DG_PRESETS))}")
    data = DG_PRESETS[base]
    text = dict(data["text_config"])
    canvas = over.pop("canvas_length", data["canvas_length"])
    text.update(over)
    if "num_hidden_layers" in over:
        n = text["num_hidden_layers"]
        text["layer_types"] = [dg.SLIDING if (i + 1) % 6 else dg.FULL for i in range(n)]
    for key, value in (("num_hidden_layers", text["num_hidden_layers"]), ("canvas", canvas),
                       ("vocab", text["vocab_size"] - 2), ("window", text["sliding_window"] - 1)):
        if value < 1:
            raise ValueError(f"bad preset override in {name!r}: {key} is too small")
    return dg.config_from_hf({"text_config": text, "canvas_length": canvas})


def build_dg_preset(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0, tp: int = 1, reduce=None):
    """A random-weight ``DiffusionGemma`` of a canvas preset's shape, made on the meta device and materialised
    on ``device`` in ``dtype`` (no float32 copy, no initialiser run twice): matrices normal(0, 0.02), norms,
    the router's scales and the layer scalars 1 (``RANDOM_WEIGHTS``). ``tp`` > 1: one tensor-parallel rank's
    shard of that shape (``diffusion_gemma.shard_config``), whose layers sum their partial outputs with
    ``reduce``, for timing TP rounds without building the whole model first."""
    from engine.models import diffusion_gemma as dg

    cfg = dg_preset_config(name)
    if tp > 1:
        cfg = dg.shard_config(cfg, tp)
    with on_meta():
        model = dg.DiffusionGemma(cfg).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for _, b in model.named_buffers():  # the layer scalars (decoder's and encoder's)
            b.fill_(1.0)
    if tp > 1:
        for layer in model.layers:
            layer.reduce = reduce
    return model.eval()


def dg_preset_engine(name: str, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, tp: int = 1, reduce=None,
                     **engine_kwargs):
    """A ``CanvasServeEngine`` over ``build_dg_preset(name)`` (a rank's shard with ``tp`` > 1) with an
    ``IdTokenizer`` (prompts are token ids); its ``cfg.extra`` says it is a preset (name, random weights, the
    shape), as ``preset_meta`` reads it."""
    from engine.canvas_serving import CanvasServeEngine

    model = build_dg_preset(name, device=device, dtype=dtype, tp=tp, reduce=reduce)
    engine = CanvasServeEngine(model, IdTokenizer(model.config.to_model_config()), device=device, **engine_kwargs)
    engine.cfg.extra.update(name=name, preset=True)
    return engine


def preset_meta(cfg: ModelConfig) -> dict:
    """What a profile's ``meta`` says of a preset model (``cfg.extra["preset"]``): its weights are random and its
    shape (the masked families' config fields; a canvas model's text config as ``DiffusionGemmaConfig``);
    nothing for a checkpoint."""
    if not cfg.extra.get("preset"):
        return {}
    if "diffusion_gemma" in cfg.extra:
        shape = dict(cfg.extra["diffusion_gemma"])
        shape.pop("generation", None)
    else:
        shape = {k: v for k, v in asdict(cfg).items() if k != "extra"}
    return {"preset": cfg.extra.get("name"), "weights": RANDOM_WEIGHTS, "shape": shape}


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
