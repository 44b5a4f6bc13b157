"""Mixture-of-experts models (LLaDA2): the router and expert MLP against a per-token reference, partial
rotary embeddings, loading an LLaDA2-format checkpoint, the llada2-mini-shape preset in the engine."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from engine.engine import Engine
from engine.loading import load_engine
from engine.models.config import ModelConfig
from engine.models.flops import forward_flops, linear_weights
from engine.models.fused import apply_rope
from engine.models.loader import load_config, load_model
from engine.models.presets import IdTokenizer, preset_config, random_prompt
from engine.models.tensor_parallel import shard_config
from engine.models.transformer import DLMTransformer, SparseMoE, grouped_mm_works, rope_cos_sin
from engine.sequence import SamplingParams
from tests.builders import MOE, make_config

SMALL = ("llada2-mini-shape:layers=2,hidden=128,heads=4,kv_heads=2,head_dim=32,intermediate=256,vocab=512,"
         "experts=16,moe_intermediate=32")


def moe_model(seed: int = 0, **kw) -> DLMTransformer:
    torch.manual_seed(seed)
    model = DLMTransformer(make_config(**{**MOE, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("expert_bias"):
                p.copy_(torch.randn(p.shape) * 0.3)  # a bias that changes the choice, as trained ones do
            elif p.dim() > 1:
                p.mul_(3.0)
    return model.eval()


def reference_moe(moe: SparseMoE, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sigmoid scores, the best groups by their two best biased scores, the top experts
    by biased score within them, their unbiased scores normalised and scaled, plus the shared expert."""
    out = []
    per_group = cfg.num_experts // cfg.expert_groups
    for t in x:
        scores = torch.sigmoid(moe.gate.weight.float() @ t.float())
        biased = scores + moe.gate.expert_bias
        group_best = [sorted(biased[g * per_group:(g + 1) * per_group].tolist())[-2:] for g in range(cfg.expert_groups)]
        groups = sorted(range(cfg.expert_groups), key=lambda g: -sum(group_best[g]))[: cfg.expert_groups_used]
        allowed = [e for e in range(cfg.num_experts) if e // per_group in groups]
        chosen = sorted(allowed, key=lambda e: -float(biased[e]))[: cfg.experts_per_token]
        w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling
        y = sum(wi * moe.experts[e](t[None])[0] for wi, e in zip(w, chosen))
        out.append(y + moe.shared_experts(t[None])[0])
    return torch.stack(out)


def test_experts_and_router_match_a_per_token_reference():
    model = moe_model()
    cfg = model.config
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
    moe = model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and not isinstance(model.layers[0].mlp, SparseMoE)
    x = torch.randn(2, 7, cfg.hidden_size)
    with torch.no_grad():
        got = moe(x)
        want = reference_moe(moe, cfg, x.reshape(-1, cfg.hidden_size)).view_as(got)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert moe.kernel == "loop"
        moe.fuse()  # the experts stacked, each one's gate and up in one product: the same function
        assert moe.kernel == ("grouped" if grouped_mm_works("cpu", torch.float32) else "grid")
        torch.testing.assert_close(moe(x), want, atol=1e-5, rtol=1e-5)
        moe.grouped = False  # the padded grid of batched products
        assert moe.kernel == "grid"
        torch.testing.assert_close(moe(x), want, atol=1e-5, rtol=1e-5)
    ids, _ = moe.gate(x.reshape(-1, cfg.hidden_size))
    per_group = cfg.num_experts // cfg.expert_groups
    assert all(len({int(e) // per_group for e in row}) <= cfg.expert_groups_used for row in ids)


@pytest.mark.skipif(not grouped_mm_works("cpu", torch.float32), reason="this torch has no grouped product on a CPU")
def test_grouped_experts_match_the_loop_with_idle_experts_and_fall_back_when_misaligned():
    """Few tokens over many experts (most idle, the grouped product's empty groups), a batch of them,
    and an intermediate size whose rows are not 16-byte multiples (the grid instead of the grouped kernel)."""
    for inter, kernel in ((16, "grouped"), (6, "grid")):
        model = moe_model(seed=3, num_experts=16, moe_intermediate_size=inter)
        moe = model.layers[1].mlp
        loop = copy.deepcopy(moe)
        moe.fuse()
        assert moe.kernel == kernel
        for n in (1, 2, 37):
            x = torch.randn(n, model.config.hidden_size)
            with torch.no_grad():
                torch.testing.assert_close(moe(x), loop(x), atol=1e-5, rtol=1e-5)


def test_bench_round_times_the_grouped_experts_against_the_grid():
    from tools.bench_round import bench_round

    res = bench_round(SMALL, slots=2, tokens=8, context=8, warmup=0, repeats=1, peak=1e9)
    names = [v["variant"] for v in res["variants"]]
    assert names[0] == "round" and "round, unfused" in names
    assert ("round, experts in a grid" in names) == grouped_mm_works("cpu", torch.float32)
    assert "round, GQA folded" in names  # 4 query heads over 2 K/V heads: unfolded is the CPU's default


def test_partial_rotary_embeddings_rotate_the_first_dimensions_only():
    pos = torch.arange(6)[None]
    x = torch.randn(1, 2, 6, 16)
    cos, sin = rope_cos_sin(pos, 8, 10000.0, x.dtype)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])
    torch.testing.assert_close(y[..., :8], apply_rope(x[..., :8], cos, sin))
    assert not torch.allclose(y[..., :8], x[..., :8])
    with pytest.raises(ValueError, match="even number"):
        make_config(rotary_fraction=0.3)


@pytest.mark.parametrize("bad, message", [
    (dict(experts_per_token=9), "bad mixture of experts"),
    (dict(expert_groups=3), "bad mixture of experts"),
    (dict(expert_groups_used=1, experts_per_token=3), "do not fit"),
])
def test_bad_expert_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        make_config(**{**MOE, **bad})


def test_flops_and_params_count_active_experts():
    cfg = make_config(**MOE)
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    dense = 3 * h * cfg.intermediate_size
    moe_active = 3 * h * 16 * (3 + 1) + h * 8  # 3 routed + 1 shared expert, and the router
    assert linear_weights(cfg) == 2 * attn + dense + moe_active
    assert forward_flops(cfg, 1, 4, lm_rows=0) == 2 * 4 * linear_weights(cfg) + 2 * 4 * 4 * 4 * cfg.num_heads * d
    full = 3 * h * 16 * (8 + 1) + h * 8
    model = DLMTransformer(cfg)
    counted = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n and "expert_bias" not in n)
    assert cfg.num_params == counted + 2 * 2 * h + h  # plus two norms per layer and the final one
    assert cfg.mlp_weights(1, active=False) == full
    assert shard_config(cfg, 2).moe_intermediate_size == 8
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        shard_config(cfg.replace(moe_intermediate_size=12, num_heads=8, num_kv_heads=8), 8)


def llada2_checkpoint(model: DLMTransformer, path) -> None:
    """Write ``model`` as an LLaDA2 (``LLaDA2MoeModelLM``) checkpoint: its config keys and tensor names."""
    cfg = model.config
    config = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token, "num_shared_experts": cfg.shared_experts,
        "first_k_dense_replace": cfg.dense_layers, "n_group": cfg.expert_groups, "topk_group": cfg.expert_groups_used,
        "routed_scaling_factor": cfg.routed_scaling, "partial_rotary_factor": cfg.rotary_fraction,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "score_function": "sigmoid",
        "norm_topk_prob": True, "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False,
        "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 512,
        "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id, "mask_token_id": cfg.mask_token_id,
    }
    tensors = {"model.word_embeddings.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
               "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        a, pre = layer.self_attn, f"model.layers.{i}."
        tensors[pre + "attention.query_key_value.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                                       a.v_proj.weight])
        tensors[pre + "attention.dense.weight"] = a.o_proj.weight
        tensors[pre + "attention.query_layernorm.weight"] = a.q_norm.weight
        tensors[pre + "attention.key_layernorm.weight"] = a.k_norm.weight
        tensors[pre + "input_layernorm.weight"] = layer.input_layernorm.weight
        tensors[pre + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for name, p in layer.mlp.named_parameters():
            tensors[pre + "mlp." + name] = p
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def test_llada2_checkpoint_loads_and_computes_the_same(tmp_path):
    model = moe_model()
    llada2_checkpoint(model, tmp_path)
    cfg = load_config(tmp_path)
    assert (cfg.arch, cfg.attention, cfg.block_size, cfg.num_experts, cfg.experts_per_token) == \
        ("llada2", "block_causal", 32, 8, 3)
    assert (cfg.rotary_fraction, cfg.routed_scaling, cfg.expert_groups_used, cfg.dense_layers) == (0.5, 2.5, 2, 1)
    loaded = load_model(tmp_path)
    assert loaded.fused  # q/k/v come as one matrix
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    pos = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, pos, None)[0], model(ids, pos, None)[0], atol=1e-4, rtol=1e-4)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "score_function": "softmax"}))
    with pytest.raises(ValueError, match="unsupported config values"):
        load_config(tmp_path)


def test_llada2_mini_shape_preset_runs_in_the_engine():
    cfg = preset_config("llada2-mini-shape")
    assert 15e9 < cfg.num_params < 17e9  # 16B in all
    assert 0.7e9 < linear_weights(cfg) < 0.9e9  # about 1.4B active with the embeddings and head
    engine = load_engine(SMALL, max_slots=4)
    assert isinstance(engine.tokenizer, IdTokenizer) and engine.cfg.num_experts == 16
    prompts = [random_prompt(engine.cfg, n, seed=n) for n in (20, 40, 70)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, threshold=0.9))
    assert all(o.rounds >= 1 and o.finish_reason for o in outs)
    assert engine.runner.pooled > 0 and engine.runner.pool.free == 4
    fused = Engine(engine.model, engine.tokenizer, max_slots=4)
    fused.runner.model.fuse_projections()
    again = fused.generate(prompts, SamplingParams(max_tokens=40, threshold=0.9))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


@pytest.mark.parametrize("error", [TypeError, RuntimeError, NotImplementedError])
def test_a_grouped_product_that_fails_its_probe_means_the_grid(monkeypatch, error):
    """Another torch (the device image's) may lack the kernel or spell its signature differently: the probe
    answers False, so the experts run in the grid, instead of the model failing to load."""
    import engine.models.transformer as tr

    def broken(*args, **kwargs):
        raise error("no grouped product here")

    monkeypatch.setattr(tr, "GROUPED_MM", broken)
    tr.grouped_mm_works.cache_clear()
    try:
        assert not tr.grouped_mm_works("cpu", torch.float32)
    finally:
        tr.grouped_mm_works.cache_clear()
