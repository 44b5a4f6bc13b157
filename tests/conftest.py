from __future__ import annotations

import pytest
import torch

from engine.models.config import ModelConfig
from engine.models.transformer import DLMTransformer
from engine.tokenizer import CharTokenizer

torch.set_num_threads(1)


def make_config(**kw) -> ModelConfig:
    tok = CharTokenizer.default()
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                attention="block_causal", block_size=8, mask_token_id=tok.mask_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_position_embeddings=512)
    base.update(kw)
    return ModelConfig(**base)


# a small LLaDA2-style mixture of experts (one dense layer first) for make_config / make_model
MOE = dict(num_experts=8, experts_per_token=3, moe_intermediate_size=16, shared_experts=1, dense_layers=1,
           expert_groups=4, expert_groups_used=2, routed_scaling=2.5, qk_norm=True, rotary_fraction=0.5)


def make_model(seed: int = 0, **kw) -> DLMTransformer:
    torch.manual_seed(seed)
    model = DLMTransformer(make_config(**kw))
    for p in model.parameters():  # larger weights: sharper, more varied confidences
        p.data.mul_(3.0) if p.dim() > 1 else None
    return model.eval()


@pytest.fixture
def tok() -> CharTokenizer:
    return CharTokenizer.default()


# The test tiers (`make test` runs all; `make test-fast` deselects `ray` and `slow`).
# Modules that start a Ray cluster and the Serve application (1-4 minutes each): marked `ray`.
RAY_MODULES = frozenset({"test_serve.py", "test_serve_guard.py", "test_autoscale_serve.py"})
# Tests measured over ~3 s on the shared 2-core machine (load average 5-9; `pytest -q --durations=150 -m "not ray"`),
# marked `slow`, by "module::function" (every parametrized case of it); tests may also carry @pytest.mark.slow.
SLOW_TESTS = frozenset({
    "test_bench_engine.py::test_bench_engine_on_a_tiny_preset",
    "test_bench_engine.py::test_fastdllm_loop_is_the_engine_with_a_prefix_cache_and_needs_fewer_forwards",
    "test_bench_engine.py::test_llada_loop_gives_the_engine_low_confidence_tokens",
    "test_cli.py::test_eval_prints_the_json_of_the_issue",
    "test_cluster_reconfig.py::test_dilaserve_trace_short_run_reconfigures_with_the_load_and_loses_nothing",
    "test_cluster_reconfig.py::test_draining_instances_mid_run_moves_their_requests_and_loses_none",
    "test_cluster_reconfig.py::test_planner_controller_follows_the_plan_and_keeps_every_request",
    "test_cluster_sim.py::test_dynamic_thresholds_beat_fixed_under_overload_and_load_control_caps",
    "test_cluster_sim.py::test_online_estimator_learns_from_the_run_and_reports_its_curve",
    "test_cluster_sim.py::test_simulate_cli_online_estimator_and_learning_curve_plot",
    "test_device_image.py::test_device_run_commands_need_only_the_device_image",
    "test_dispatch.py::test_online_learners_train_on_the_requests_served",
    "test_dispatch.py::test_router_migrates_requests_to_a_new_instance",
    "test_loadgen.py::test_plot_writes_pngs",
    "test_loadgen.py::test_replay_ctrl_c_writes_partial_results",
    "test_loadgen.py::test_synth_from_prompts_file_and_replay",
    "test_online.py::test_refit_worker_fits_in_another_process_and_swaps_as_refit_does",
    "test_online.py::test_refit_worker_restarts_a_dead_process",
    "test_online.py::test_refit_worker_scores_a_shipped_admission_model_as_refit_does",
    "test_online.py::test_the_worker_process_exits_with_its_parent",
    "test_online.py::test_window_is_bounded_and_memory_stays_flat",
    "test_planner.py::test_cli_plan_json_stdout_is_only_json",
    "test_planner_fast.py::test_fast_model_matches_the_reference_for_fixed_counts_single_batch_and_no_cache",
    "test_playground.py::test_page_in_a_real_browser_with_a_scripted_stream",
    "test_predictors.py::test_collect_train_eval_cli",
    "test_predictors.py::test_refiner_learns_hidden_signal_and_round_trips",
    "test_profiling.py::test_check_profile_compares_predicted_with_measured_rounds",
    "test_profiling.py::test_profile_cli_writes_and_checks",
    "test_profiling.py::test_tp2_profile_runs_one_process_per_rank",
    "test_replica_start.py::test_every_tp_rank_starts_its_shard_as_rank_0_and_decodes_as_one_engine",
    "test_report.py::test_tiny_report_instance_sections",
    "test_router.py::test_router_memory_stays_flat_under_every_policy",
    "test_sampling.py::test_resume_on_a_new_engine_gives_the_uninterrupted_tokens",
    "test_sim.py::test_model_in_the_loop_runs_the_real_engine",
    "test_tensor_parallel.py::test_tp2_gives_the_same_tokens_as_tp1",
    "test_training.py::test_short_training_lowers_the_loss_and_saves_a_loadable_checkpoint",
})


def pytest_configure(config):
    """A SLOW_TESTS entry must name a test function that exists: a renamed test would silently join the fast tier."""
    import ast
    from pathlib import Path

    here = Path(__file__).parent
    for entry in sorted(SLOW_TESTS):
        module, _, name = entry.partition("::")
        path = here / module
        tree = ast.parse(path.read_text()) if path.is_file() else None
        if tree is None or not any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
                                   for n in tree.body):
            raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names {entry!r}, which is no test function")


def pytest_collection_modifyitems(config, items):
    """Marks the tiers' tests (RAY_MODULES, SLOW_TESTS); GPU tests run only where CUDA is available
    (never on CI)."""
    for item in items:
        module = item.path.name
        if module in RAY_MODULES:
            item.add_marker(pytest.mark.ray)
        if f"{module}::{getattr(item, 'originalname', item.name)}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def wait_until(cond, limit_s: float = 120.0, step_s: float = 0.5) -> bool:
    """Poll ``cond()`` until it holds (True) or ``limit_s`` passes (False); HTTP errors count as not yet."""
    import time

    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            if cond():
                return True
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(step_s)
    return False


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict:
    """Tiny real-format checkpoints (config, weights, BPE tokenizer, chat template) of every diffusion-LM
    family, built once per session: {arch: directory} (tests/checkpoints.py)."""
    from tests.checkpoints import ARCHS, build_checkpoint

    root = tmp_path_factory.mktemp("hf_checkpoints")
    return {arch: build_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_checkpoint_notemplate(tmp_path_factory):
    """The tiny Dream checkpoint without a chat template in its tokenizer_config.json."""
    from tests.checkpoints import build_checkpoint

    return build_checkpoint("dream", tmp_path_factory.mktemp("hf_notemplate") / "dream", chat_template=False)
