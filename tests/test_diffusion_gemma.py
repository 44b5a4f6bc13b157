"""DiffusionGemma: Remask's own implementation against transformers' ``DiffusionGemmaForBlockDiffusion``.

The checkpoint is built by transformers itself (tests/checkpoints.py ``build_diffusion_gemma``: four layers,
sliding and full alternating with their own head sizes and K/V heads, a sliding window of 8, experts in every
layer, norms and per-layer scalars randomised) and loaded by both. Float32 throughout, tolerance 1e-5.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.models import diffusion_gemma as dg
from tests.checkpoints import DG_CANVAS, build_diffusion_gemma, family_ids

TOL = 1e-5


@pytest.fixture(scope="module")
def dg_dir(tmp_path_factory):
    return build_diffusion_gemma(tmp_path_factory.mktemp("dg") / "ckpt")


@pytest.fixture(scope="module")
def hf_model(dg_dir):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(dg_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(dg_dir):
    return dg.load(dg_dir)


def _hf_cache(hf_model):
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=hf_model.config.get_text_config(decoder=True))


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


@torch.no_grad()
def test_encoder_and_decoder_steps_match_transformers(hf_model, ours):
    cfg = ours.config
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert cfg.head_dims == (8, 16, 8, 16) and cfg.kv_heads == (2, 1, 2, 1) and cfg.sliding_window == 8
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, cfg.vocab_size, (2, 13), generator=g)  # longer than the sliding window
    theirs, mine = _hf_cache(hf_model), dg.DGCache(cfg)

    enc = hf_model.model.encoder(input_ids=prompt, cache=theirs)
    assert _close(ours.encode(prompt, mine), enc.last_hidden_state) <= TOL
    for i in range(cfg.num_layers):  # sliding layers keep window - 1 positions, full ones all 13
        assert mine.kept(i) == (7 if cfg.sliding(i) else 13)
        assert _close(mine.layers[i][0], theirs.layers[i].keys) <= TOL
        assert _close(mine.layers[i][1], theirs.layers[i].values) <= TOL

    canvas = torch.randint(0, cfg.vocab_size, (2, DG_CANVAS), generator=g)
    first = ours.decode(canvas, mine)  # the first step: no self-conditioning
    assert _close(first, hf_model(decoder_input_ids=canvas, cache=theirs).logits) <= TOL
    sc = torch.randn(2, DG_CANVAS, cfg.vocab_size, generator=g) * 3
    conditioned = ours.decode(canvas, mine, sc)
    assert _close(conditioned, hf_model(decoder_input_ids=canvas, cache=theirs,
                                        self_conditioning_logits=sc).logits) <= TOL
    assert _close(conditioned, first) > 1e-3  # the signal matters

    # the canvas encoded after the prompt (the cache is past the window now), then the next canvas
    enc = hf_model.model.encoder(input_ids=canvas, cache=theirs)
    assert _close(ours.encode(canvas, mine), enc.last_hidden_state) <= TOL
    assert mine.length == 21 and [mine.kept(i) for i in range(4)] == [7, 21, 7, 21]
    nxt = torch.randint(0, cfg.vocab_size, (2, DG_CANVAS), generator=g)
    assert _close(ours.decode(nxt, mine, sc), hf_model(decoder_input_ids=nxt, cache=theirs,
                                                       self_conditioning_logits=sc).logits) <= TOL


@torch.no_grad()
def test_cuda_layouts_and_bf16(dg_dir, ours):
    from transformers import DiffusionGemmaForBlockDiffusion

    from engine.models.layouts import cuda_layouts

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, ours.config.vocab_size, (1, 11), generator=g)
    canvas = torch.randint(0, ours.config.vocab_size, (1, DG_CANVAS), generator=g)
    cache = dg.DGCache(ours.config)
    ours.encode(prompt, cache)
    want = ours.decode(canvas, cache)
    with cuda_layouts():  # attention outputs in CUDA's strides: no .view on them anywhere
        cache2 = dg.DGCache(ours.config)
        ours.encode(prompt, cache2)
        assert torch.equal(ours.decode(canvas, cache2), want)
    # bf16: the same roundings as transformers' (experts weighted and summed in float32, rounded once)
    half = dg.load(dg_dir, dtype=torch.bfloat16)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(dg_dir), dtype=torch.bfloat16).eval()
    assert half.embed_tokens.weight.dtype == torch.bfloat16
    cache3, theirs = dg.DGCache(half.config), _hf_cache(hf)
    hf.model.encoder(input_ids=prompt, cache=theirs)
    half.encode(prompt, cache3)
    assert cache3.layers[0][0].dtype == torch.bfloat16
    got = half.decode(canvas, cache3)
    assert got.dtype == torch.float32
    assert _close(got, hf(decoder_input_ids=canvas, cache=theirs).logits) <= 1e-2


def test_checkpoint_holds_vision_weights_that_are_skipped(dg_dir, ours):
    from safetensors import safe_open

    with safe_open(str(dg_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert any(k.startswith(dg.VISION_PREFIXES) for k in keys)
    assert not any("vision" in name for name, _ in ours.named_parameters())
    image = family_ids("diffusion_gemma")["image"]
    assert ours.config.image_token_id == image
    dg.check_text_only([5, 6, 7], ours.config)
    with pytest.raises(ValueError, match="images are not served"):
        dg.check_text_only([5, image, 7], ours.config)


def test_config_from_the_checkpoint_and_its_errors(dg_dir):
    data = json.loads((dg_dir / "config.json").read_text())
    gen = json.loads((dg_dir / "generation_config.json").read_text())
    cfg = dg.config_from_hf(data, gen)
    assert cfg.generation["max_denoising_steps"] == 12 and cfg.generation["entropy_bound"] == 0.1
    assert cfg.canvas_length == DG_CANVAS and cfg.ropes["full_attention"].kind == "proportional"
    # the released checkpoints' spelling: global_head_dim / num_global_key_value_heads instead of per_layer_config
    text = {k: v for k, v in data["text_config"].items() if k != "per_layer_config"}
    released = dg.config_from_hf({**data, "text_config": {**text, "global_head_dim": 16,
                                                          "num_global_key_value_heads": 1}})
    assert released.head_dims == cfg.head_dims and released.kv_heads == cfg.kv_heads
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        dg.config_from_hf({**data, "text_config": {**text, "use_bidirectional_attention": "all"}})
    with pytest.raises(ValueError, match="num_experts"):
        dg.config_from_hf({**data, "text_config": {**text, "num_experts": None}})
    with pytest.raises(ValueError, match="text_config"):
        dg.config_from_hf({"architectures": [dg.ARCH]})


def test_loader_reads_the_family(dg_dir):
    from engine.models.loader import load_config

    cfg = load_config(dg_dir)
    assert cfg.arch == "diffusion_gemma" and cfg.block_size == DG_CANVAS
    assert cfg.extra["diffusion_gemma"]["layer_types"] == ["sliding_attention", "full_attention"] * 2
