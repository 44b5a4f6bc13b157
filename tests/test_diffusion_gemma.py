"""DiffusionGemma: Remask's own implementation against transformers' ``DiffusionGemmaForBlockDiffusion``.

The checkpoint is built by transformers itself (tests/checkpoints.py ``build_diffusion_gemma``: four layers,
sliding and full alternating with their own head sizes and K/V heads, a sliding window of 8, experts in every
layer, norms and per-layer scalars randomised) and loaded by both. Float32 throughout, tolerance 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.models import diffusion_gemma as dg
from tests.checkpoints import DG_CANVAS, build_diffusion_gemma, family_ids
from tests.dg_builders import ThreadAllReduce, run_ranks, same_draws

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
    # what a request keeps between steps: the soft embeddings [N, L, H], not the logits [N, L, V]
    assert torch.equal(ours.decode(canvas, mine, ours.soft_embeddings(sc)), conditioned)

    # the canvas encoded after the prompt (the cache is past the window now), then the next canvas
    enc = hf_model.model.encoder(input_ids=canvas, cache=theirs)
    assert _close(ours.encode(canvas, mine), enc.last_hidden_state) <= TOL
    assert mine.length == 21 and [mine.kept(i) for i in range(4)] == [7, 21, 7, 21]
    assert mine.nbytes == 2 * cfg.cache_bytes(21, dtype_bytes=4)  # two rows, float32
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
    assert cfg.generation["max_denoising_steps"] == 6 and cfg.generation["entropy_bound"] == 0.1
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


# ---------------------------------------------------------------- the renoise rule against transformers' sampler


def _hf_sampler_parts(hf_model, rule, length):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler,
        EntropyBoundSamplerConfig,
        LinearTemperatureScheduleLogitsProcessor,
        StableAndConfidentStoppingCriteria,
    )

    sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=rule.entropy_bound), length,
                                  hf_model.config.text_config.vocab_size, rule.max_denoising_steps)
    processors = [LinearTemperatureScheduleLogitsProcessor(rule.t_min, rule.t_max, rule.max_denoising_steps)]
    stopper = StableAndConfidentStoppingCriteria(rule.stability_threshold, rule.confidence_threshold)
    return sampler, processors, stopper


@pytest.mark.parametrize("bound", [0.1, 3.0])
@torch.no_grad()
def test_renoise_rule_matches_transformers_sampler_step_by_step(hf_model, ours, bound):
    """The same raw logits and the same draws (transformers' global generator seeded as the rule's per-step
    generator): the same processed logits, next canvas, argmax and stop, step by step, until both stop."""
    from transformers import LogitsProcessorList

    from engine.canvas import CanvasEngine, CanvasParams
    from engine.decoding import renoise

    rule = renoise.RenoiseRule(entropy_bound=bound, max_denoising_steps=10, stability_threshold=2,
                               confidence_threshold=0.05)
    engine = CanvasEngine(ours, None, rule=rule)
    seq = engine.add_request([5, 6, 7], CanvasParams(seed=11))
    cfg, length = ours.config, DG_CANVAS
    sampler, processors, stopper = _hf_sampler_parts(hf_model, rule, length)
    g = torch.Generator().manual_seed(0)
    sharp = torch.randn(length, cfg.vocab_size, generator=g) * 30  # from step 4 on: confident and stable
    current = renoise.noise(length, cfg.vocab_size, renoise.canvas_generator(seq.seed, 0, -1))
    seq.canvas, argmax, sc, finished = current.clone(), current[None].clone(), None, torch.zeros(1, dtype=torch.bool)
    stopped_at = None
    for step in range(rule.max_denoising_steps):
        raw = sharp if step >= 4 else torch.randn(length, cfg.vocab_size, generator=g) * (1 + step)

        def forward(_raw=raw, **_):
            return type("Out", (), {"logits": _raw[None].clone()})()

        torch.manual_seed(renoise.draw_seed(seq.seed, 0, step + 1))  # the rule's draws for this step
        hf_canvas, argmax, sc, finished = hf_model._denoising_step(
            decoder_forward=forward, current_canvas=current[None], argmax_canvas=argmax, input_ids=None,
            decoder_position_ids=None, self_conditioning_logits=sc, mask_mapping=None, cache=None,
            finished_denoising=finished, cur_step=rule.max_denoising_steps - step, sampler=sampler,
            logits_processor=LogitsProcessorList(processors), diffusion_stopping_criteria=stopper)
        decision, processed = engine.denoise_logits(seq, raw)
        assert _close(processed, sc[0]) == 0.0
        assert decision.canvas.tolist() == hf_canvas[0].tolist()
        assert decision.output.tolist() == argmax[0].tolist()
        assert decision.done == bool(finished[0]) or step + 1 == rule.max_denoising_steps
        kept = int((~decision.edit).sum())
        assert kept == int(sampler.accepted_token_mask.sum())
        seq.canvas, current = torch.as_tensor(decision.canvas), hf_canvas[0]
        seq.step_in_canvas += 1
        if decision.done:
            stopped_at = step
            break
    # the sharp canvas (steps 4 on) turns stable at step 6 and confident as the temperature falls: both stop
    # on the criterion before the step cap
    assert stopped_at is not None and 6 <= stopped_at < rule.max_denoising_steps - 1, stopped_at


def test_renoise_rule_config_and_errors():
    from engine.decoding import make_rule, renoise

    rule = make_rule("renoise", entropy_bound=0.5, max_denoising_steps=4)
    assert rule.temperature(0) == pytest.approx(0.8) and rule.temperature(3) == pytest.approx(0.5)
    assert rule.knob_at(0.9) == pytest.approx(0.5) and rule.knob_at(0.5) > rule.knob_at(0.9)
    # sorted 0.01, 0.02, 0.5, 3.0: the sums without the largest are 0, 0.01, 0.03, 0.53
    assert renoise.eb_accept([0.5, 0.01, 0.02, 3.0], 0.1).tolist() == [True, True, True, False]
    assert renoise.eb_accept([5.0, 6.0], 0.1).tolist() == [True, False]  # the lowest one always
    for bad, field in [({"entropy_bound": 0}, "entropy_bound"), ({"t_min": 0.9}, "t_max"),
                       ({"max_denoising_steps": 0}, "max_denoising_steps"),
                       ({"confidence_threshold": 0}, "confidence_threshold")]:
        with pytest.raises(ValueError, match=field):
            make_rule("renoise", **bad)
    from engine.decoding import BlockStep

    with pytest.raises(ValueError, match="whole canvases"):
        rule.decide(BlockStep(np.ones(2, bool), np.zeros(2, bool), np.zeros(2, np.int64), np.ones(2, np.float32)))
    # the draws depend on (seed, canvas, step) only
    assert renoise.draw_seed(1, 0, 1) == renoise.draw_seed(1, 0, 1) != renoise.draw_seed(1, 1, 1)
    a = renoise.noise(6, 100, renoise.canvas_generator(9, 2, 3))
    torch.randint(0, 10, (50,))  # the process-wide generator moves: no effect
    assert torch.equal(a, renoise.noise(6, 100, renoise.canvas_generator(9, 2, 3)))


# ---------------------------------------------------------------- the canvas engine, end to end


def test_canvas_engine_generates_deterministically_and_resumes(dg_dir, ours):
    from engine.canvas import CanvasEngine, CanvasParams
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(dg_dir)
    engine = CanvasEngine(ours, tok)
    ids = tok.prompt_ids("What is 2+2?", 0)
    first, other = engine.generate([ids, tok.prompt_ids("Name a colour.", 0)], CanvasParams(max_tokens=20, seed=7))
    again = engine.generate([ids], CanvasParams(max_tokens=20, seed=7))[0]  # alone: the same text
    assert again.token_ids == first.token_ids and first.finish_reason in ("stop", "length")
    assert all(1 <= s <= engine.rule.max_denoising_steps for s in first.steps_per_canvas)
    assert len(first.token_ids) <= 20 and not set(first.token_ids) & engine.stop_ids
    # paused in its second canvas, resumed on a fresh engine from the snapshot's JSON
    seq = engine.add_request(ids, CanvasParams(max_tokens=20, seed=7))
    while not seq.finished and not (seq.canvas_index == 1 and seq.step_in_canvas == 2):
        engine.step([seq])
    snap = json.loads(json.dumps(seq.snapshot()))
    resumed = CanvasEngine(ours, tok)
    seq2 = resumed.restore(snap)
    while not seq2.finished:
        resumed.step([seq2])
    assert resumed.output(seq2).token_ids == first.token_ids
    with pytest.raises(ValueError, match="images are not served"):
        engine.add_request([*ids, ours.config.image_token_id])
    with pytest.raises(ValueError, match="entropy_bound"):
        engine.add_request(ids, CanvasParams(entropy_bound=-1.0))


def test_remask_generate_answers_on_the_fixture(dg_dir, ours, capsys):
    from engine.canvas import CanvasEngine, CanvasParams
    from engine.tokenizer import load_tokenizer
    from tools.cli import main

    assert main(["generate", "--model", str(dg_dir), "--prompt", "What is 2+2?", "--seed", "5",
                 "--max-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    tok = load_tokenizer(dg_dir)
    want = CanvasEngine(ours, tok).generate([tok.prompt_ids("What is 2+2?", 0)], CanvasParams(max_tokens=12, seed=5))
    assert printed == want[0].text + "\n" and want[0].text
    assert main(["generate", "--model", str(dg_dir), "--prompt", "x", "--threshold", "0.5"]) == 2
    assert "entropy-bound" in capsys.readouterr().err


# ---------------------------------------------------------------- tensor parallelism (ranks as threads)


@pytest.mark.parametrize("world", [2, 4])
@torch.no_grad()
def test_tensor_parallel_ranks_give_tp1s_logits_and_text(ours, world):
    from engine.canvas import CanvasEngine, CanvasParams

    cfg = ours.config
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, cfg.vocab_size, (1, 13), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (1, DG_CANVAS), generator=g)
    cache = dg.DGCache(cfg)
    ours.encode(prompt, cache)
    want = ours.decode(canvas, cache)
    want_text = CanvasEngine(ours).generate([prompt[0].tolist()], CanvasParams(max_tokens=16, seed=3))[0].token_ids
    ar = ThreadAllReduce(world)

    def rank_run(rank):
        part = dg.shard(ours, rank, world, ar.for_rank(rank))
        c = dg.DGCache(part.config)
        part.encode(prompt, c)
        logits = part.decode(canvas, c)
        text = CanvasEngine(part).generate([prompt[0].tolist()], CanvasParams(max_tokens=16, seed=3))[0].token_ids
        return part, c, logits, text

    results = run_ranks(world, rank_run)
    part, c = results[0][0], results[0][1]
    # rank 0 holds 4 / world query heads; full layers' single K/V head is replicated, sliding ones split
    assert part.config.num_heads == 4 // world and part.config.kv_heads == (2 // min(world, 2), 1) * 2
    assert c.layers[0][0].shape[1] == part.config.kv_heads[0]
    for _, _, logits, text in results:
        assert _close(logits, want) <= TOL, _close(logits, want)
        assert text == want_text
    with pytest.raises(ValueError, match="num_attention_heads"):
        dg.shard_config(cfg, 3)


@torch.no_grad()
def test_canvases_of_different_requests_in_one_decoder_forward(ours):
    """Rows over caches of different lengths (one past the sliding window, one not), one self-conditioned and
    one at its first step: each row's logits are those of its own forward."""
    cfg = ours.config
    g = torch.Generator().manual_seed(8)
    caches, canvases = [], torch.randint(0, cfg.vocab_size, (2, DG_CANVAS), generator=g)
    for n in (13, 5):
        c = dg.DGCache(cfg)
        ours.encode(torch.randint(0, cfg.vocab_size, (1, n), generator=g), c)
        caches.append(c)
    sc = torch.randn(2, DG_CANVAS, cfg.vocab_size, generator=g) * 3
    got = ours.decode(canvases, caches, sc, torch.tensor([True, False]))
    assert _close(got[0], ours.decode(canvases[:1], caches[0], sc[:1])[0]) <= TOL
    assert _close(got[1], ours.decode(canvases[1:], caches[1])[0]) <= TOL


@torch.no_grad()
def test_remask_export_writes_a_checkpoint_transformers_loads(dg_dir, ours, tmp_path, capsys):
    from transformers import DiffusionGemmaForBlockDiffusion

    from tools.cli import main

    out = tmp_path / "exported"
    assert main(["export", str(dg_dir), str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(out), dtype=torch.float32).eval()
    again = dg.load(out)
    assert again.config.generation == ours.config.generation and again.config.head_dims == ours.config.head_dims
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, ours.config.vocab_size, (1, 10), generator=g)
    canvas = torch.randint(0, ours.config.vocab_size, (1, DG_CANVAS), generator=g)
    mine, theirs = dg.DGCache(ours.config), _hf_cache(hf)
    ours.encode(prompt, mine)
    hf.model.encoder(input_ids=prompt, cache=theirs)
    assert _close(ours.decode(canvas, mine), hf(decoder_input_ids=canvas, cache=theirs).logits) <= TOL
    assert main(["export", "tiny-bd", str(tmp_path / "x")]) == 2
    assert "masked-diffusion" in capsys.readouterr().err


def test_hub_id_from_an_offline_cache(dg_dir, ours, tmp_path, monkeypatch, capsys):
    """A hub id resolves through the hub cache (offline) for generate and for serve's dry run."""
    from engine.canvas import CanvasEngine, CanvasParams
    from engine.tokenizer import load_tokenizer
    from tests.hubcache import go_offline, lay_out
    from tools.cli import main

    lay_out(dg_dir, tmp_path / "home", "google/diffusiongemma-26B-A4B-it")
    go_offline(monkeypatch, tmp_path / "home")
    assert main(["generate", "--model", "google/diffusiongemma-26B-A4B-it", "--prompt", "hi", "--seed", "5",
                 "--max-tokens", "8"]) == 0
    tok = load_tokenizer(dg_dir)
    want = CanvasEngine(ours, tok).generate([tok.prompt_ids("hi", 0)], CanvasParams(max_tokens=8, seed=5))[0]
    assert capsys.readouterr().out == want.text + "\n"
    assert main(["serve", "google/diffusiongemma-26B-A4B-it", "--dry-run"]) == 0
    assert "diffusiongemma-26B-A4B-it" in capsys.readouterr().out


def test_streaming_by_canvas_and_stop_strings(dg_dir, ours):
    from engine.canvas import CanvasEngine, CanvasParams
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(dg_dir)
    engine = CanvasEngine(ours, tok)
    ids = tok.prompt_ids("Tell me a story.", 0)
    assert engine.add_request(ids).max_tokens == 4 * DG_CANVAS  # generation_config.json's max_new_tokens
    whole = engine.generate([ids], CanvasParams(max_tokens=24, seed=1))[0]
    pieces = list(engine.stream(ids, CanvasParams(max_tokens=24, seed=1)))
    assert "".join(pieces) == whole.text and 1 <= len(pieces) <= 3  # at most one piece per canvas
    assert len(whole.text) >= 6, whole.text
    stop = whole.text[4:6]
    cut = engine.generate([ids], CanvasParams(max_tokens=24, seed=1, stop=(stop,)))[0]
    assert cut.text == whole.text[: whole.text.find(stop)] and cut.finish_reason == "stop"


# adaptive stopping on: no stability wanted, and a mean entropy of 5.97 nats (this random model's canvases sit
# near 6 nats and fall as the temperature does) stops canvases before the step cap
@pytest.mark.parametrize("stopping", [None, {"stability_threshold": 0, "confidence_threshold": 5.97}])
@torch.no_grad()
def test_transformers_generate_gives_the_same_tokens_on_the_same_draws(hf_model, ours, monkeypatch, stopping):
    """End to end: transformers' own ``generate`` with its random draws taken from Remask's per-(seed, canvas,
    step) generators (its global-generator calls redirected in order: each canvas's initial noise, then per step
    the sample and the renoising noise) gives the tokens CanvasEngine gives, up to the first EOS."""
    from engine.canvas import CanvasEngine, CanvasParams
    from engine.decoding import renoise

    seed, prompt = 21, [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]  # longer than the sliding window
    gen = {**ours.config.generation, **(stopping or {})}
    engine = CanvasEngine(ours, None, rule=renoise.RenoiseRule.from_generation(gen))
    ours_out = engine.generate([prompt], CanvasParams(max_tokens=3 * DG_CANVAS, seed=seed))[0]

    where = same_draws(monkeypatch, seed)
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=3 * DG_CANVAS,
                            **(stopping or {}))
    monkeypatch.undo()
    theirs = out.sequences[0, len(prompt):].tolist()
    stops = set(ours.config.eos_token_ids)
    cut = next((i for i, t in enumerate(theirs) if t in stops), len(theirs))
    assert ours_out.token_ids == theirs[:cut]
    if stopping:  # adaptive stopping: canvases stop before the step cap
        assert min(ours_out.steps_per_canvas) < gen["max_denoising_steps"], ours_out.steps_per_canvas
    assert len(ours_out.steps_per_canvas) == where["canvas"] + 1


def test_abort_frees_the_request(ours):
    from engine.canvas import CanvasEngine

    engine = CanvasEngine(ours, None)
    seq = engine.add_request([5, 6, 7])
    assert [r.kind for r in engine.step([seq])] == ["prefill"] and seq.cache.nbytes > 0
    assert [r.kind for r in engine.step([seq])] == ["denoise"]
    engine.abort(seq)
    assert seq.finished and seq.finish_reason == "abort" and seq.cache.nbytes == 0
    assert engine.step([seq]) == [] and seq.seq_id not in engine.sequences


@torch.no_grad()
def test_grouped_experts_equal_the_loop(ours):
    experts = ours.layers[0].experts
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, ours.config.hidden_size, generator=g)
    weights, ids = ours.layers[0].router(x)
    assert experts.kernel == "grouped"  # torch 2.13's CPU kernels
    grouped = experts(x, ids, weights)
    experts.grouped = False
    try:
        assert experts.kernel == "loop"
        assert _close(experts(x, ids, weights), grouped) <= TOL
    finally:
        experts.grouped = True


@torch.no_grad()
def test_encoder_passes_of_different_requests_in_one_forward(ours):
    """A fresh prompt past the sliding window beside a cached request's next chunk: each row's K/V as its own."""
    cfg = ours.config
    g = torch.Generator().manual_seed(12)
    first, prefix, second = (torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (13, 5, 4))
    alone = [dg.DGCache(cfg), dg.DGCache(cfg)]
    ours.encode(torch.tensor([first]), alone[0])
    ours.encode(torch.tensor([prefix]), alone[1])
    ours.encode(torch.tensor([second]), alone[1])
    together = [dg.DGCache(cfg), dg.DGCache(cfg)]
    ours.encode(torch.tensor([prefix]), together[1])
    ours.encode_many([first, second], together)
    for a, b in zip(alone, together):
        assert a.length == b.length
        for i in range(cfg.num_layers):
            assert _close(a.layers[i][0], b.layers[i][0]) <= TOL and _close(a.layers[i][1], b.layers[i][1]) <= TOL


def test_masked_sweeps_leave_the_canvas_rule_out(monkeypatch):
    """``remask eval --decoding all`` sweeps every rule on a masked model: not the whole-canvas renoise rule."""
    from engine.decoding import RULES
    from tools import evaluate

    swept = []
    monkeypatch.setattr(evaluate, "sweep_rule", lambda engine, rule, config, **kw: swept.append(rule) or [])
    evaluate.sweep_all(None, sweeps=())
    assert "renoise" in RULES and "renoise" not in swept and "threshold" in swept


def test_padded_caches_are_reused_only_while_they_fit(ours):
    cfg = ours.config
    a, b = dg.DGCache(cfg), dg.DGCache(cfg)
    ours.encode(torch.tensor([[5, 6, 7]]), a)
    ours.encode(torch.tensor([[5]]), b)
    padded = dg.PaddedCaches([a, b], DG_CANVAS, "cpu")
    assert padded.fits([a, b]) and not padded.fits([b, a])
    ours.encode(torch.tensor([[8]]), b)  # a cache that grows no longer fits
    assert not padded.fits([a, b]) and not padded.fits([a, dg.DGCache(cfg)])


def test_a_masked_model_refuses_the_canvas_rule():
    """A request (or server, or checkpoint) naming ``renoise`` for a masked model: a ValueError naming the
    field (the API's 400), not a round that fails."""
    from engine.commands import resolve_rule

    with pytest.raises(ValueError, match=r"^decoding: 'renoise' decodes DiffusionGemma canvases"):
        resolve_rule(None, "renoise", None)
    assert resolve_rule(None, "threshold", {"threshold": 0.8}).name == "threshold"
