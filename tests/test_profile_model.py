"""The modelled DiffusionGemma-26B-A4B H200 profile (engine/profile_model.py, scripts/model_profile.py): the
file loads and says it is modelled and from what, its rounds grow with tokens as the architecture says, the
experts' read follows the tokens that touch them, the command reproduces the shipped file, and the simulator
and the planner price DiffusionGemma canvases on it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine import profile_model as pm
from engine.latency_profile import PROFILES_DIR, load_profile
from planner import costs
from sim.scenarios import run_scenario
from sim.workload import dg_workload
from tools.cli import main

PROFILE = pm.NAME


@pytest.fixture(scope="module")
def generated():
    return pm.model_profile()


def test_the_shipped_profile_loads_and_says_it_is_modelled_and_from_what():
    prof = load_profile(PROFILE)
    meta = prof.meta
    assert meta["modelled"] is True and "modelled" in meta["device"]
    assert "GPU run" in meta["replace_with"] and meta["command"] == pm.COMMAND
    assert meta["source"]["profile"] == "h200-llada8b-measured" and meta["source"]["commit"] == "6cd9128"
    assert meta["source"]["sha256_16"] == pm.file_hash("h200-llada8b-measured")
    assert meta["calibration"]["profile"] == "h200-llada2mini-measured"
    assert meta["architecture"]["text_config"]["num_experts"] == 128
    assert set(prof.measured) == {"prefill", "denoise"}  # a DiffusionGemma replica's kinds
    assert {p.query for p in prof.points if p.kind == "denoise"} == {256.0}  # one canvas per step
    assert prof.model.stand_in["cached"] == "denoise" and prof.model.mode == "fit"
    # nothing in it is measured: every round is priced in the modelled region, and --fit says so
    assert prof.modelled and prof.region("denoise", 256) == "modelled" and prof.fit_report()["modelled"]
    assert not load_profile("h200-llada8b-measured").modelled


def test_the_architecture_gives_the_published_parameter_counts():
    shape = pm.gemma_shape(pm.DG_26B_A4B_TEXT, "dg", 1.0)
    assert abs(shape.total_params / 25.2e9 - 1) < 0.01  # published: 25.2B
    assert abs(shape.active_params / 3.8e9 - 1) < 0.01  # published: 3.8B active
    sliding, full = shape.attention
    assert (sliding.layers, sliding.kv_heads, sliding.head_dim, sliding.window) == (25, 8, 256, 1024)
    assert (full.layers, full.kv_heads, full.head_dim, full.k_eq_v) == (5, 2, 512, True)


def test_the_shapes_match_the_engine_presets_and_the_engine_reads_the_config_alike():
    from engine.models.diffusion_gemma import config_from_hf
    from engine.models.presets import PRESETS

    for name, mine in (("llada-8b-shape", pm.LLADA_8B), ("llada2-mini-shape", pm.LLADA2_MINI)):
        assert {k: PRESETS[name][k] for k in mine} == mine
    cfg = config_from_hf({"text_config": dict(pm.DG_26B_A4B_TEXT), "canvas_length": pm.DG_CANVAS})
    shape = pm.gemma_shape(pm.DG_26B_A4B_TEXT, "dg", 1.0)
    for a in shape.attention:
        kind = "sliding_attention" if a.window else "full_attention"
        layers = [i for i, t in enumerate(cfg.layer_types) if t == kind]
        assert len(layers) == a.layers
        assert {cfg.head_dims[i] for i in layers} == {a.head_dim} and {cfg.kv_heads[i] for i in layers} == {a.kv_heads}
    assert cfg.sliding_window == shape.attention[0].window and cfg.canvas_length == 256


def _close(a, b, rel: float = 1e-6) -> bool:
    """Equal JSON, numbers within ``rel`` (a fit's last digits may differ with the linear algebra library)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a == pytest.approx(b, rel=rel, abs=1e-12)
    return a == b


def test_the_command_reproduces_the_shipped_file(generated, tmp_path, capsys):
    shipped = json.loads((PROFILES_DIR / f"{PROFILE}.json").read_text())
    prof, _ = generated
    assert _close(json.loads(pm.profile_json(prof)), shipped, rel=1e-3)
    import scripts.model_profile as script

    out = tmp_path / "p.json"
    assert script.main(["--out", str(out)]) == 0
    assert _close(json.loads(out.read_text()), shipped, rel=1e-3)
    printed = json.loads(capsys.readouterr().out)
    assert printed["fit"] == shipped["meta"]["fit_error_vs_model"]
    assert not _close(json.loads(out.read_text()), {**shipped, "attn_ms_per_pair": 1.0})  # the check can fail


def test_round_times_grow_with_tokens_and_the_experts_read_follows_the_tokens(generated):
    prof, model = generated
    shape = model.shape
    # the experts a forward reads: few tokens touch about the active ones, a canvas nearly all
    assert shape.touched_experts(1) == pytest.approx(8 / 128)
    assert shape.touched_experts(256) > 0.999
    read = [model.terms("prefill", 1, t, 0)["experts"] for t in (1, 4, 16, 64, 256)]
    assert read == sorted(read) and read[0] < read[-1] / 8
    # a forward of few tokens reads far less than one of many, so costs more per token only by its fixed part
    free = replace(model, rates=replace(model.rates, dispatch_ms_per_kernel=0.0))
    few, many = free.forward_ms("prefill", 1, 4, 0), free.forward_ms("prefill", 1, 512, 0)
    full_read = model.rates.read_ms_per_param * (shape.dense_params("prefill") + shape.expert_params)
    assert few < model.rates.forward_ms + model.rates.step_ms + 0.5 * full_read < many
    # the profile: rounds grow with canvases and with the cache; per canvas they get cheaper
    ms = [prof.forward_ms("denoise", n, 256, 512) for n in (1, 2, 4, 8, 16, 32, 64)]
    assert ms == sorted(ms) and ms[-1] / 64 < ms[0] / 4
    assert prof.forward_ms("denoise", 4, 256, 768) > prof.forward_ms("denoise", 4, 256, 0)
    pre = [prof.forward_ms("prefill", 1, t, 0) for t in (16, 512, 4096, 16384)]
    assert pre == sorted(pre)
    # the fit stays near the model it was sampled from (the file states how near)
    assert prof.meta["fit_error_vs_model"] == pm.fit_check(prof, model)
    assert prof.meta["fit_error_vs_model"]["at_points"] < 0.25


def test_the_published_check_is_recorded(generated):
    prof, model = generated
    check = pm.published_check(prof, model)
    assert check == prof.meta["published_check"]
    assert 0.5 < check["ratio_fp8_graphs"] < 2.0  # the published run's setting: same order as its figure


def test_the_steps_curve_follows_the_bound_and_the_router_level():
    curve = costs.DG_STEPS_PER_CANVAS
    assert curve[costs.DG_BOUND] == pytest.approx(256 / 17.5, abs=1e-3)
    assert costs.dg_bound(0.9) == pytest.approx(0.1) and costs.dg_bound(0.7) == pytest.approx(0.4)
    spt = costs.dg_steps_per_token()
    assert spt[0.9] > spt[0.8] >= spt[0.7]  # a higher bound (a lower level): fewer steps
    mean = lambda specs: sum(map(sum, (s.block_rounds for s in specs))) / sum(len(s.block_rounds) for s in specs)  # noqa: E731
    assert mean(dg_workload(300, 1, level=0.7)) < mean(dg_workload(300, 1, level=0.9))


def test_the_simulator_runs_diffusiongemma_canvases_on_the_profile():
    low = run_scenario("dg-poisson", ["dwise"], 80, seed=2, rate=3.0, threshold=0.9)
    high = run_scenario("dg-poisson", ["dwise"], 80, seed=2, rate=3.0, threshold=0.7)
    assert low["profile"] == PROFILE and low["modelled_profile"] and low["entropy_bound"] == pytest.approx(0.1)
    assert high["steps_per_canvas"] < low["steps_per_canvas"]
    a, b = low["policies"]["dwise"], high["policies"]["dwise"]
    assert a["requests"] == b["requests"] == 80
    steps = lambda r: r["rounds"] * r["filled_slots_per_round"]  # noqa: E731  (every step of every round)
    assert steps(b) < 0.95 * steps(a) and b["mean_latency_s"] < a["mean_latency_s"]
    with pytest.raises(ValueError, match="threshold"):
        run_scenario("dwise-burst", ["dwise"], 10, threshold=0.8)


def test_simulate_and_plan_take_the_profile(capsys):
    path = str(PROFILES_DIR / f"{PROFILE}.json")
    assert main(["simulate", "--scenario", "dg-poisson", "--requests", "60", "--rate", "2", "--threshold", "0.8",
                 "--profile", path, "--policies", "fcfs-prefill-first,dwise", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "entropy bound 0.2" in out and "modelled profile" in out
    assert main(["plan", "--profile", PROFILE, "--gpus", "4", "--rps", "2", "--block", "256", "--kv-cache",
                 "exact", "--steps", "diffusiongemma", "--degrees", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["profile"] == PROFILE and report["stage1"]["feasible"]
    assert main(["plan", "--steps", "nope"]) != 0
    assert "--steps: expected 'diffusiongemma'" in capsys.readouterr().err


def test_a_tp_rank_holds_its_share_of_the_heads_and_columns_and_the_rest_whole():
    whole = pm.gemma_shape(pm.DG_26B_A4B_TEXT, "dg", 119.0)
    two, four = pm.tp_shape(whole, 2), pm.tp_shape(whole, 4)
    assert pm.tp_shape(whole, 1) is whole
    # sliding layers: 8 K/V heads divide; full layers: 2 K/V heads, one per rank at TP-4 (each held by two ranks)
    assert [(a.heads, a.kv_heads) for a in two.attention] == [(8, 4), (8, 1)]
    assert [(a.heads, a.kv_heads) for a in four.attention] == [(4, 2), (4, 1)]
    assert (four.intermediate, four.moe_intermediate, four.experts) == (528, 176, 128)
    # replicated: a denoising step's LM head, soft-embedding product and self-conditioning MLP (1.49B of its 3.15B
    # dense weights) and the routers, so a TP-4 rank reads 61% of them, not a quarter
    whole_rest = whole.dense_params("denoise") - 2 * whole.hidden * whole.vocab - 3 * whole.hidden * 2112
    assert four.dense_params("denoise") - whole.dense_params("denoise") == pytest.approx(-0.75 * whole_rest, rel=0.05)
    assert four.dense_params("denoise") / whole.dense_params("denoise") == pytest.approx(0.61, abs=0.01)
    assert four.expert_params * 4 == whole.expert_params
    assert four.kernels_per_layer == whole.kernels_per_layer + pm.DG_REDUCES_PER_LAYER  # its all-reduces' launches
    with pytest.raises(ValueError, match="TP degree 3 does not divide num_attention_heads = 16"):
        pm.tp_shape(whole, 3)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads = 2"):
        pm.tp_shape(pm.gemma_shape({**pm.DG_26B_A4B_TEXT, "num_attention_heads": 24, "num_key_value_heads": 6,
                                    "intermediate_size": 2112 * 3,
                                    "moe_intermediate_size": 704 * 3}, "dg", 1.0), 3)
    ar = pm.H200_NVLINK
    assert ar.ms(1e6, 1) == 0.0 and ar.ms(2e6, 4) > ar.ms(1e6, 4) > ar.ms(1e6, 2) > ar.latency_ms


@pytest.fixture(scope="module")
def tp_models():
    return {d: pm.model_profile(tp=d) for d in (2, 4)}


def test_tp_profiles_are_modelled_with_their_all_reduces_and_shipped(tp_models, generated):
    """TP-2 and TP-4 rounds of the 26B-A4B shape: a lone canvas's round is launch-bound (a rank launches every
    kernel a whole model does, and its all-reduces): no faster than TP-1's; a round of 64 canvases is faster,
    but by far less than the degree (replicated LM head, self-conditioning and logits; the all-reduces). The
    command writes both beside TP-1's, and they are the shipped files."""
    one, _ = generated
    for d, (prof, model) in tp_models.items():
        meta = prof.meta
        assert prof.name == f"{PROFILE}-tp{d}" and meta["tp"] == d and meta["modelled"] and prof.modelled
        assert meta["tensor_parallel"]["all_reduce"]["source"].startswith("assumed, not measured")
        assert "published_check" not in meta and meta["fit_error_vs_model"]["at_points"] < 0.3
        lone = model.terms("denoise", 1, 256, 512)
        assert lone["launch-bound"] > 0 and lone["all-reduce"] > 0
        assert prof.forward_ms("denoise", 1, 256, 512) > 0.95 * one.forward_ms("denoise", 1, 256, 512)
        big, tp1_big = prof.forward_ms("denoise", 64, 256, 512), one.forward_ms("denoise", 64, 256, 512)
        assert tp1_big / d < big < 0.9 * tp1_big
        assert model.terms("denoise", 64, 256, 512)["all-reduce"] > model.terms("denoise", 4, 256, 512)["all-reduce"]
        shipped = json.loads((PROFILES_DIR / f"{PROFILE}-tp{d}.json").read_text())
        assert _close(json.loads(pm.profile_json(prof)), shipped, rel=1e-3)
    four, two = tp_models[4][0], tp_models[2][0]
    assert four.forward_ms("denoise", 64, 256, 512) < two.forward_ms("denoise", 64, 256, 512)


def test_the_planner_prices_diffusiongemma_tp_from_its_modelled_tp_profiles():
    """load_tp_profiles finds the TP files (not TP-1's scaled by TP_SPEEDUP), and Stage 1 on them keeps every GPU
    in TP-1 instances where TP-1's scaled had chosen four TP-4 instances: per GPU a TP instance does less."""
    from engine.latency_profile import TP_SPEEDUP, load_tp_profiles
    from planner.costs import StepModel, dg_steps_per_token
    from planner.report import default_classes, plan_report, profile_source
    from planner.stage1 import plan_capacity
    from planner.stage2 import Cluster

    profiles = load_tp_profiles(PROFILE, (1, 2, 4))
    assert [p.name for p in profiles.values()][1:] == [f"{PROFILE}-tp2", f"{PROFILE}-tp4"]  # the files, not scaled
    assert profiles[4].meta["tp"] == 4
    steps = StepModel(dg_steps_per_token(), block_tokens=256, kv_cache="exact")
    classes = default_classes(32.0)
    report = plan_report(Cluster.uniform(2, 8), classes, PROFILE, (1, 2, 4), steps=steps)  # remask plan's
    assert report["tp_profiles"] == {"1": f"{PROFILE} (modelled)", "2": f"{PROFILE}-tp2 (modelled)",
                                     "4": f"{PROFILE}-tp4 (modelled)"}
    assert report["stage1"]["feasible"] and report["stage1"]["counts"] == {"1": 16, "2": 0, "4": 0}
    scaled = plan_capacity(classes, 16, {d: profiles[1].scaled(TP_SPEEDUP[d]) for d in (1, 2, 4)}, steps)
    assert scaled.feasible and scaled.counts == {1: 0, 2: 0, 4: 4}
    llada = load_tp_profiles("h200-llada8b-measured", (1, 2))
    assert profile_source(2, llada[2]) == "TP-1's x 0.75 (TP_SPEEDUP)"


@pytest.mark.slow
def test_the_kernel_counts_are_the_engines():
    """The launch term's kernels per layer are what this engine's code dispatches (scripts/model_profile.py
    --count-kernels): a model change that adds or fuses kernels shows here, and the profile is rewritten."""
    from scripts.model_profile import count_kernels

    assert count_kernels() == pm.KERNELS_PER_LAYER
