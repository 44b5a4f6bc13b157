"""Measured latency profiles: `remask profile` on a shape preset, and the check of a profile against a
recorded real run (the simulator's round-time model against measured rounds)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.latency_profile import LatencyProfile, load_profile
from engine.loading import load_engine
from engine.profiling import check_profile, profile_engine, profile_instance
from tools.cli import main

SMALL = "llada-8b-shape:layers=2,vocab=512,hidden=128,heads=4,kv_heads=4,intermediate=256"


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    engine = load_engine(SMALL, dtype=torch.float32, max_slots=16)
    prof = profile_engine(engine, "small", batch_sizes=(1, 4, 16), rounds=4, prompt_lens=(64, 192), max_tokens=64)
    return engine, prof


def test_profile_of_a_preset_has_curves_by_kind_and_an_attention_term(measured):
    _, prof = measured
    assert {"recompute", "cached", "denoise"} <= set(prof.curves)
    for pts in prof.curves.values():
        assert [t for t, _ in pts] == sorted(t for t, _ in pts) and all(ms > 0 for _, ms in pts)
    # 16 recompute steps of 128 tokens take longer than one
    rec = prof.curves["recompute"]
    assert rec[-1][0] == 16 * rec[0][0] and rec[-1][1] > rec[0][1]
    assert 64 <= prof.ref_context <= 128 and prof.attn_ms_per_pair >= 0
    assert prof.meta["device"] == "cpu" and prof.meta["dtype"] == "float32" and prof.meta["prompt_lens"] == [64, 192]
    # batches of identical requests hold consecutive pool slots: every forward attends to the pool in place
    assert prof.meta["forwards_in_kv_pool"] == prof.meta["forwards"] > 0
    again = LatencyProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.curves == prof.curves


@pytest.mark.slow
def test_check_profile_compares_predicted_with_measured_rounds(measured):
    engine, prof = measured
    res = check_profile(engine, prof, requests=12, slots=8)
    assert res["requests"] == 12 and res["rounds"] > 12
    assert res["measured_s"] > 0 and res["predicted_s"] > 0
    assert 0 < res["forwards_in_kv_pool"] <= res["forwards"]
    slow = check_profile(engine, prof.scaled(20.0), requests=12, slots=8)
    # twenty times every curve: the prediction is far off, and the check says so (the same rounds are priced, so
    # the prediction is exactly 20x; the measured time is this machine's, which may drift a few-fold under load)
    assert slow["rounds"] == res["rounds"] and slow["predicted_s"] == pytest.approx(20 * res["predicted_s"], rel=1e-3)
    assert slow["predicted_s"] > 4 * slow["measured_s"] and slow["total_error"] > 3


@pytest.mark.slow
def test_profile_cli_writes_and_checks(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", SMALL, "--out", str(out), "--batch-sizes", "1,4", "--rounds", "3",
                 "--max-tokens", "32"]) == 0
    assert load_profile(str(out)).name == "llada-8b-shape"
    capsys.readouterr()
    assert main(["profile", "--model", SMALL, "--check", str(out), "--requests", "4", "--slots", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["requests"] == 4 and res["profile"] == "llada-8b-shape"


@pytest.mark.parametrize("argv, message", [
    (["--model", SMALL], "give --out FILE"),
    (["--model", SMALL, "--out", "x.json", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["--model", "gpt-shape:layers=2", "--out", "x.json"], "not an embedded model"),
    (["--model", "llada-8b-shape:depth=2", "--out", "x.json"], "bad preset override"),
])
def test_profile_cli_rejects_bad_input(argv, message, capsys):
    assert main(["profile", *argv]) == 2
    assert message in capsys.readouterr().err


DG_SMALL = ("diffusiongemma-26b-a4b-shape:layers=2,hidden=64,heads=4,kv_heads=2,global_kv_heads=1,head_dim=16,"
            "global_head_dim=32,intermediate=96,vocab=256,window=16,experts=16,experts_per_token=4,moe_intermediate=32,"
            "canvas=16")


def test_the_diffusiongemma_shape_preset_is_the_published_config():
    """DiffusionGemma-26B-A4B's shape: the published text config (30 layers, 5 sliding to 1 full, 128 experts of
    which 8 active, keys as values in the full layers), the modelled profile's weights, built on the meta device;
    overrides keep the layer pattern and refuse unknown keys."""
    from engine.models import diffusion_gemma as dg
    from engine.models.meta import on_meta
    from engine.models.presets import dg_preset_config, is_dg_preset, is_preset

    cfg = dg_preset_config("diffusiongemma-26b-a4b-shape")
    assert is_preset("diffusiongemma-26b-a4b-shape") and is_dg_preset("diffusiongemma-26b-a4b-shape:layers=2")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_experts, cfg.top_k_experts) == \
        (30, 2816, 16, 128, 8)
    assert cfg.layer_types.count(dg.FULL) == 5 and cfg.kv_heads[:6] == (8,) * 5 + (2,)
    assert cfg.head_dims[5] == 512 and cfg.sliding_window == 1024 and cfg.canvas_length == 256
    with on_meta():
        matrices = sum(p.numel() for p in dg.DiffusionGemma(cfg).parameters() if p.dim() > 1)
    # the modelled profile's architecture (engine.profile_model's Shape, checked against the published counts in
    # tests/test_profile_model.py): the same weight matrices, 25.25B (the self-conditioning MLP included)
    modelled = load_profile("h200-diffusiongemma-26b-a4b-modelled").meta["architecture"]
    assert matrices == modelled["total_params"] == 25_250_283_520
    small = dg_preset_config("diffusiongemma-26b-a4b-shape:layers=7,vocab=300")
    assert small.layer_types == (dg.SLIDING,) * 5 + (dg.FULL, dg.FULL) and small.vocab_size == 300
    with pytest.raises(ValueError, match="bad preset override 'depth=2'"):
        dg_preset_config("diffusiongemma-26b-a4b-shape:depth=2")


def test_profile_fit_and_check_of_the_diffusiongemma_shape_on_the_cpu(tmp_path, capsys):
    """`remask profile` of the DiffusionGemma shape preset (tiny overrides): random weights built on the meta device
    and served by the canvas engine; the profile's meta names the preset, says the weights are random and holds
    the shape; --fit and --check run on it."""
    out = tmp_path / "dg.json"
    assert main(["profile", "--model", DG_SMALL, "--out", str(out), "--batch-sizes", "1,2", "--prompt-lens", "8",
                 "--rounds", "1", "--max-tokens", "16"]) == 0
    prof = load_profile(str(out))
    meta = prof.meta
    assert prof.name == "diffusiongemma-26b-a4b-shape" and set(prof.curves) == {"prefill", "denoise"}
    assert [t for t, _ in prof.curves["denoise"]] == [16, 32]  # one 16-token canvas per request
    assert meta["preset"] == DG_SMALL and meta["weights"].startswith("random") and meta["block_size"] == 16
    assert meta["shape"]["num_experts"] == 16 and meta["shape"]["layer_types"] == ["sliding_attention",
                                                                                     "full_attention"]
    capsys.readouterr()
    assert main(["profile", "--fit", str(out)]) == 0
    assert "profile diffusiongemma-26b-a4b-shape:" in capsys.readouterr().out
    assert main(["profile", "--model", DG_SMALL, "--check", str(out), "--requests", "2", "--slots", "2",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["requests"] == 2 and res["rounds"] > 0 and res["model"] == DG_SMALL


def test_the_diffusiongemma_shape_is_refused_where_only_masked_models_run(capsys):
    from engine.models.presets import build_preset

    with pytest.raises(ValueError, match="canvas"):
        build_preset(DG_SMALL)
    assert main(["profile", "--model", DG_SMALL, "--tp", "3", "--out", "x.json"]) == 2  # in the parent, at once
    assert "TP degree 3 does not divide num_attention_heads = 4" in capsys.readouterr().err


@pytest.mark.slow
def test_tp2_profile_of_the_diffusiongemma_shape(tmp_path):
    """`remask profile --tp 2` of the canvas preset: one process per rank (gloo), each its shard of the random
    model (query heads, MLP and expert columns halved) in a canvas engine, summing partial outputs after
    attention, the MLP and the experts; rank 0 writes both kinds' curves."""
    out = tmp_path / "dg-tp2.json"
    assert main(["profile", "--model", DG_SMALL, "--tp", "2", "--out", str(out), "--batch-sizes", "1,2",
                 "--prompt-lens", "8", "--rounds", "1", "--max-tokens", "16"]) == 0
    prof = load_profile(str(out))
    assert prof.name == "diffusiongemma-26b-a4b-shape-tp2" and prof.meta["tp"] == 2
    assert set(prof.curves) == {"prefill", "denoise"} and [t for t, _ in prof.curves["denoise"]] == [16, 32]
    assert prof.meta["shape"]["num_heads"] == 2  # a rank's shard of the 4 query heads


def test_bench_round_times_the_round_and_its_variants(tmp_path, capsys):
    from engine.models.flops import forward_flops
    from engine.models.presets import preset_config
    from tools.bench_round import bench_round

    res = bench_round(SMALL, slots=4, tokens=8, context=16, warmup=1, repeats=2, peak=1e9)
    assert [v["variant"] for v in res["variants"]] == ["round", "round, contexts copied", "forward only",
                                                       "round, unfused"]
    flops = forward_flops(preset_config(SMALL), 4, 8, 16)
    assert res["tflop_per_round"] == round(flops / 1e12, 3)
    body = forward_flops(preset_config(SMALL), 4, 8, 16, lm_rows=0)  # the forward alone runs no LM head
    for v in res["variants"]:
        f = body if v["variant"] == "forward only" else flops
        assert v["min_ms"] <= v["median_ms"]
        assert v["mfu"] == pytest.approx(f / (v["median_ms"] / 1000) / 1e9, rel=1e-3)
    out = tmp_path / "round.json"
    assert main(["bench", "round", "--model", SMALL, "--slots", "2", "--tokens", "8", "--context", "8",
                 "--repeats", "1", "--json", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["slots"] == 2 == json.loads(out.read_text())["slots"]


def test_bench_round_with_gaps_fills_them_only_where_copying_costs_more():
    from tools.bench_round import bench_round

    short = bench_round(SMALL, slots=4, tokens=8, context=16, gaps=1, warmup=0, repeats=1, variants=False, peak=1e9)
    long = bench_round(SMALL, slots=4, tokens=8, context=200, gaps=1, warmup=0, repeats=1, variants=False, peak=1e9)
    assert short["gaps"] == long["gaps"] == 1
    assert not short["in_place"] and long["in_place"]  # 8 filler tokens against 4 x 16 or 4 x 200 copied


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny-bd"], "unknown model preset 'tiny-bd'"),
    (["--model", SMALL, "--gaps", "-1"], "context and gaps non-negative"),
    (["--model", SMALL, "--slots", "0"], "slots and tokens must be positive"),
    (["--model", SMALL, "--context", "5000"], "exceeds the model's 4096"),
    (["--model", SMALL, "--dtype", "int8"], "unknown dtype"),
])
def test_bench_round_rejects_bad_input(argv, message, capsys):
    assert main(["bench", "round", *argv]) == 2
    assert message in capsys.readouterr().err


def test_profile_and_check_of_an_embedded_text_model():
    """Text models get prompts of about the asked length (characters of the profile prompt)."""
    engine = load_engine("tiny-bd", max_slots=8)
    prof = profile_engine(engine, "tiny-bd", batch_sizes=(1, 4), rounds=3, prompt_lens=(16, 48))
    assert {"prefill", "denoise"} <= set(prof.curves) and prof.attn_ms_per_pair >= 0
    res = check_profile(engine, prof, requests=6, slots=4)
    assert res["requests"] == 6 and res["rounds"] >= 6 and res["model"] == "tiny-bd"


def test_profile_keeps_the_points_measured_before_running_out_of_memory(monkeypatch):
    engine = load_engine(SMALL, dtype=torch.float32, max_slots=16)
    real_step = engine.step

    def step(plan=None):
        if plan is not None and len(plan) >= 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_step(plan)

    monkeypatch.setattr(engine, "step", step)
    prof = profile_engine(engine, "small", batch_sizes=(1, 4, 16), rounds=3, max_tokens=64)
    pool_gib = engine.runner.pool.kv.numel() * engine.runner.pool.kv.element_size() / 2**30
    # what the device held then: here (a CPU) the pool and the round's budget
    assert prof.meta["skipped"] == [f"batch 16 x prompt None: out of memory (KV pool {pool_gib:.1f} GiB, "
                                    "round budget none)"]
    assert max(t for t, _ in prof.curves["recompute"]) < 16 * 64 and not engine.sequences  # aborted, none left


@pytest.mark.slow
def test_tp2_profile_runs_one_process_per_rank(tmp_path):
    out = tmp_path / "small-tp2.json"
    assert main(["profile", "--model", SMALL, "--tp", "2", "--out", str(out), "--batch-sizes", "1,4", "--rounds", "3",
                 "--max-tokens", "32"]) == 0
    prof = load_profile(str(out))
    assert prof.name == "llada-8b-shape-tp2" and prof.meta["tp"] == 2
    assert {"recompute", "cached"} <= set(prof.curves) and all(ms > 0 for pts in prof.curves.values() for _, ms in pts)


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3", "--out", "x.json"], "TP degree 3 does not divide num_heads = 4"),
    (["--tp", "2", "--check", "cpu-tiny-bd"], "--check runs one process"),
    (["--tp", "2", "--device", "cuda", "--out", "x.json"], "needs 2 GPUs"),
])
def test_tp_profile_rejects_bad_input(argv, message, capsys):
    if "cuda" in argv and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs")
    assert main(["profile", "--model", SMALL, *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_instance_measures_its_own_profile_within_a_budget_and_is_left_as_it_was():
    """A replica at start: rounds of 1 to B requests through its own scheduler for about ``budget_s``;
    the profile is the one engine.latency_profile loads and the router's latency model reads; no request, KV
    reservation or pool slot is left behind."""
    import time

    from cluster.latency import StepShape, TpLatencyModel
    from engine.instance import Instance

    inst = Instance(load_engine("tiny-bd", max_slots=8), slots=8)
    t0 = time.perf_counter()
    prof = profile_instance(inst, "tiny-bd-tp1-measured", budget_s=1.0)
    assert time.perf_counter() - t0 < 5.0
    assert {"prefill", "denoise"} <= set(prof.curves)
    assert prof.meta["batch_sizes"][:2] == [1, 8] and prof.meta["slots"] == 8  # the extremes first
    tokens = [t for t, _ in prof.curves["denoise"]]
    assert tokens[0] == 8 and 64 in tokens or prof.meta["skipped"]  # one block, and B blocks unless skipped
    again = LatencyProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.curves == prof.curves and again.meta["slots"] == 8
    model = TpLatencyModel({1: again}, 8, StepShape(block_tokens=8, full_sequence=False))
    assert 0 < model.step_ms(1, 1, "denoise") <= model.step_ms(1, 8, "denoise")
    s, pool = inst.scheduler, inst.engine.runner.pool
    assert not inst.has_work() and not inst.seqs and not inst.outputs and not inst.engine.sequences
    assert s.kv_reserved == 0 and pool.free == pool.slots and pool.beyond == 0
    skipped = profile_instance(inst, "t", budget_s=0.0)  # no time: the first batch only
    assert skipped.meta["batch_sizes"] == [1, 8, 2, 4] and len(skipped.meta["skipped"]) == 3


def test_a_profile_measured_at_one_shape_scales_with_tokens_both_ways():
    """A replica measuring its profile on a busy machine may get one batch size per kind: the curve is then
    proportional to the tokens, below and above the point (it raised IndexError above it)."""
    from engine.latency_profile import LatencyProfile

    prof = LatencyProfile.from_dict({"name": "one-point", "curves": {"denoise": [[8.0, 888.8]]}, "meta": {}})
    assert prof.curve_ms("denoise", 8) == pytest.approx(888.8)
    assert prof.curve_ms("denoise", 64) == pytest.approx(888.8 * 8)
    assert prof.curve_ms("denoise", 4) == pytest.approx(888.8 / 2)
    assert prof.curve_ms("prefill", 16) == pytest.approx(888.8 * 2)  # a missing kind reads the denoise curve


@pytest.mark.slow
def test_the_check_warms_up_by_design_and_reports_the_warm_up_apart():
    """Item 7 of issue 34: the whole-run figure is over a run that meets no shape for the first time (the
    same run went once before, untimed), and the warm-up pass's own figures are reported beside it. CUDA
    graphs are emulated on the CPU (engine/graphs.py), so first meetings and captures happen here too."""
    from engine.graphs import ForwardGraphs
    from tools.profile_cli import format_check

    tiny = "llada-8b-shape:layers=1,vocab=256,hidden=64,heads=2,kv_heads=2,intermediate=128"

    def engine_with_graphs():
        engine = load_engine(tiny, dtype=torch.float32, max_slots=4)
        engine.runner.graphs = ForwardGraphs(engine.runner.forward, "cpu", emulate=True)
        return engine

    engine = engine_with_graphs()
    prof = profile_engine(engine, "tiny", batch_sizes=(1, 2), rounds=2, max_tokens=64)
    assert prof.meta["warmup"] and {"recompute", "cached"} <= set(prof.curves)
    assert [t for t, _ in prof.curves["recompute"]] == [128, 256]  # both batches' recompute rounds were steady
    warmed = check_profile(engine_with_graphs(), prof, requests=4, slots=2)
    cold = check_profile(engine_with_graphs(), prof, requests=4, slots=2, warmup=False)
    w = warmed["warmup"]
    assert w["rounds"] == warmed["rounds"] == cold["rounds"]  # the same run, twice
    assert w["warming_rounds"] == cold["warming_rounds"] > 0  # its first meetings fell in the warm-up pass...
    assert warmed["warming_rounds"] < w["warming_rounds"]  # ...not in the timed run
    assert cold["warmup"] is None and cold["steady"]["rounds"] == cold["rounds"] - cold["warming_rounds"]
    text = format_check(warmed)
    assert "over the whole run" in text and "warm-up (the same run once before" in text
    assert f"{w['rounds']} rounds, measured {w['measured_s']} s" in text
    assert "no warm-up pass (--no-warmup" in format_check(cold)
