"""scripts/h200_summary.py: the device run's figures against the issue's targets, from what
scripts/h200_check.sh writes (a run's outputs made up here: the script reads files only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from h200_summary import summarize  # noqa: E402


def _round(ms: float, **kw) -> dict:
    return {"model": "llada-8b-shape", "device": "NVIDIA H200", "dtype": "bfloat16", "slots": 128, "tokens": 32,
            "context": 300, "gaps": 0, "in_place": True, "peak_tflops": 800.0, "errors": {},
            "variants": [{"variant": "round", "median_ms": ms, "mfu": 0.7},
                         {"variant": "round, CUDA graphs", "median_ms": ms - 2, "mfu": 0.72}], **kw}


def test_summary_reads_each_step_and_marks_the_targets(tmp_path):
    (tmp_path / "steps.txt").write_text("facts rc=0 3s\ngpu-tests rc=1 40s\nround rc=0 30s\nround-moe rc=124 75s\n"
                                        "profile-moe skipped: out of time (budget 480s)\n")
    (tmp_path / "round.json").write_text(json.dumps(_round(98.2)))
    (tmp_path / "round-single.json").write_text(json.dumps(_round(6.1, slots=1)))
    contenders = {n: {"tokens_per_s": 10.0, "mean_latency_s": 0.5, "mfu": 0.1}
                  for n in ("remask-batched", "remask-single", "fastdllm-loop", "llada-loop")}
    bench = {"batched_vs_best_loop_throughput": 8.4, "single_vs_fastdllm_latency": 0.62, "contenders": contenders,
             "cuda_graphs": {"captures": 5, "replays": 900, "rounds": 950, "failed": None}}
    (tmp_path / "bench-engine.log").write_text("bench engine: 100%|####|\n" + json.dumps(bench) + "\n")
    check = {"rounds": 300, "total_error": 0.08, "median_round_error": 0.08, "warming_rounds": 1,
             "warmup": {"rounds": 300, "measured_s": 9.5, "predicted_s": 6.2, "total_error": 0.35,
                        "warming_rounds": 60}}
    (tmp_path / "profile-check.log").write_text(json.dumps(check))
    (tmp_path / "gpu-tests.log").write_text("FAILED tests/test_runner.py::test_x[a]\n1 failed, 9 passed in 20.1s\n")
    (tmp_path / "kernels-8b.json").write_text(json.dumps({
        "model": "llada-8b-shape", "slots": 128, "tokens": 32, "context": 300, "device_ms_per_round": 124.1,
        "by_category_ms": {"matmul": 81.5, "attention": 9.8, "elementwise/other": 21.1, "copy/index": 11.6}}))
    fams = {"sdar": {"ok": True, "generate": {"rc": 0, "s": 3.0},
                     "instance": {"largest_batch": 3, "rounds": 40, "same_as_alone": 3, "answer_tokens": [9, 9, 9]}},
            "llada2": {"ok": False, "generate": {"rc": 1, "s": 3.0, "error": "RuntimeError: view size"},
                       "instance": {"error": "RuntimeError: view size"}}}
    (tmp_path / "fixtures.json").write_text(json.dumps({"device": "cuda", "families": fams}))
    profile = {"name": "h200-llada8b-measured", "curves": {"cached": [[32, 7.2]], "recompute": [[128, 9.0]]},
               "meta": {"batch_sizes": [1, 128], "prompt_lens": [64, 512],
                        "skipped": ["batch 128 x prompt 512: out of memory"]}}
    (tmp_path / "h200-llada8b-measured.json").write_text(json.dumps(profile))
    text = "\n".join(summarize(tmp_path))
    assert "failed or stopped: gpu-tests (rc 1), round-moe (rc 124, stopped at its limit)" in text
    assert "skipped: profile-moe (out of time (budget 480s))" in text
    assert "fixtures on cuda: 1 of 2 families decode (sdar ok, llada2 FAILED)" in text
    assert "sdar: generate ok; batched round of 3, 40 rounds, 3/3 answers as decoded alone" in text
    assert "llada2: generate rc=1: RuntimeError: view size; instance error: RuntimeError: view size" in text
    assert "gpu tests: 9 of 10 pass; failed: tests/test_runner.py::test_x[a]" in text
    assert "98.2 ms, MFU 70.0%" in text and "(target <= 100 ms: met)" in text
    assert "round, CUDA graphs: 96.2 ms" in text
    # one request: the round as the engine runs it, with CUDA graphs (6.1 - 2)
    assert "round-single (one request, 1x32): round, CUDA graphs 4.10 ms (target <= 5 ms: met)" in text
    assert "kernels-8b (llada-8b-shape, 128x32 over 300): 124.10 ms a round on the device: matmul 81.50, " \
           "attention 9.80, elementwise/other 21.10, copy/index 11.60" in text
    assert "batched / best loop 8.40x (target >= 10x: NOT met)" in text
    assert "Fast-dLLM loop 0.62 (target <= 1: met)" in text and "5 captured, 900 replays" in text
    assert "error 8.0% over the whole run (target <= 10%: met)" in text and "1 of its rounds met a shape first" in text
    assert "warm-up pass (the same run once before, kept out by design): 300 rounds, measured 9.5 s" in text
    assert "round-gaps: no result" in text and "round-moe: no result" in text and "kernels-moe: no result" in text
    assert "h200-llada2mini-measured.json: missing" in text
    assert "h200-llada8b-measured.json: written (cached 1 points, recompute 1 points)" in text
    assert "the 128 x 512 prefill case: out of memory (target: fits: NOT met)" in text


def test_summary_reports_recompute_against_cached_per_size_and_order(tmp_path):
    def row(order, n, re_ms, ca_ms, first=80.0):
        return {"order": order, "tokens": n, "canvas": 128,
                "recompute": {"median_ms": re_ms, "first_ms": first, "ratio": round(re_ms / ca_ms, 3)},
                "recompute, slots apart": {"median_ms": re_ms + 1, "first_ms": first, "ratio": 1.0},
                "recompute, slots apart, copied": {"median_ms": re_ms + 3, "first_ms": first, "ratio": 1.0},
                "recompute, lengths varied": {"median_ms": re_ms - 1, "first_ms": first, "ratio": 1.0},
                "recompute, lengths varied, padded": {"median_ms": re_ms + 4, "first_ms": first, "ratio": 1.0},
                "cached": {"median_ms": ca_ms, "first_ms": 20.0}}
    rows = [row("flash", 128, 9.0, 8.0), row("flash", 2048, 90.0, 70.0), row("cudnn", 128, 9.5, 8.0, first=70.0)]
    (tmp_path / "recompute.json").write_text(json.dumps({"model": "llada-8b-shape", "device": "NVIDIA H200",
                                                         "dtype": "bfloat16", "canvas": 128, "rows": rows}))
    text = "\n".join(summarize(tmp_path))
    assert "recompute vs cached (llada-8b-shape on NVIDIA H200, bfloat16, 128-token canvases; target: " \
           "recompute <= 1.2x cached of as many tokens)" in text
    assert "attention flash first: 1 of 2 sizes within 1.2x" in text and "attention cudnn first: 1 of 1" in text
    assert "  128 tokens: recompute 9.00 ms, cached 8.00 ms, ratio 1.12 (met); first round of the shape 80.0 / " \
           "20.0 ms; slots apart 10.00 ms in place, 12.00 ms copied; lengths varied 8.00 ms packed, " \
           "13.00 ms padded" in text
    assert " 2048 tokens: recompute 90.00 ms, cached 70.00 ms, ratio 1.29 (NOT met)" in text


def test_summary_of_an_empty_folder_names_what_is_missing_and_the_cli_checks_its_argument(tmp_path):
    text = "\n".join(summarize(tmp_path))
    assert "recompute: no result" in text
    assert "no steps.txt" in text and "round: no result" in text and "bench engine: no result" in text
    assert "fixtures: no result" in text and "gpu tests: not run" in text
    script = str(ROOT / "scripts" / "h200_summary.py")
    bad = subprocess.run([sys.executable, script, str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 1 and "usage" in bad.stderr
    ok = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True)
    assert ok.returncode == 0 and "profile check: no result" in ok.stdout


def test_kernel_categories_file_attention_first():
    """tools/kernel_profile.py's categories on kernel names of the first H200 run: cuDNN's flash kernel
    (its name holds "sm90", as the matrix products' do) is attention, copies inside elementwise kernels
    are copies, the softmax of the confidences is neither attention nor a product."""
    from tools.kernel_profile import breakdown, categorize

    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "matmul",
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Ge": "matmul",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16": "matmul",
        "aten::mm": "matmul",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespa": "copy/index",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tenso": "copy/index",
        "void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native::_cuda_scatter_gath": "copy/index",
        "Memcpy DtoD (Device -> Device)": "copy/index",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float": "elementwise/other",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFl": "elementwise/other",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10": "elementwise/other",
    }
    assert {n: categorize(n) for n in names} == names

    class Evt:  # what key_averages() yields on a CPU
        def __init__(self, key, us, count):
            self.key, self.self_cpu_time_total, self.count = key, us, count

    res = breakdown([Evt("aten::mm", 6000.0, 10), Evt("aten::cat", 1000.0, 4), Evt("aten::add", 1000.0, 2),
                     Evt("ProfilerStep#1", 9e9, 1)], rounds=2, cuda=False)
    assert res["device_ms_per_round"] == 4.0 and res["by_category_ms"] == {
        "matmul": 3.0, "attention": 0.0, "elementwise/other": 0.5, "copy/index": 0.5}
    assert res["top"][0] == ["aten::mm", 3.0, 5, "matmul"]


def test_kernel_breakdown_on_cuda_counts_the_kernels_own_device_time():
    from torch.autograd import DeviceType

    from tools.kernel_profile import breakdown

    class Evt:  # what key_averages() yields with the CUDA activity: operators (CPU) and their kernels (CUDA)
        def __init__(self, key, device_type, device_us, count=2):
            self.key, self.device_type, self.self_device_time_total, self.count = key, device_type, device_us, count
            self.self_cpu_time_total = 500.0

    res = breakdown([Evt("aten::mm", DeviceType.CPU, 0.0), Evt("aten::copy_", DeviceType.CPU, 0.0),
                     Evt("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", DeviceType.CUDA, 8000.0),
                     Evt("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", DeviceType.CUDA, 1000.0),
                     Evt("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 1000.0)], rounds=2, cuda=True)
    assert res["device_ms_per_round"] == 5.0
    assert res["by_category_ms"] == {"matmul": 4.0, "attention": 0.5, "elementwise/other": 0.0, "copy/index": 0.5}


def test_summary_reports_the_diffusiongemma_shape_against_its_modelled_profile(tmp_path):
    """The DiffusionGemma-26B-A4B shape's measured profile (made up: the modelled profile's rounds, each twice as
    long): its points, what ran out of memory, random weights, its model's fit, the modelled profile against each
    measured round, and its check."""
    from engine.latency_profile import load_profile

    modelled = load_profile("h200-diffusiongemma-26b-a4b-modelled").to_dict()
    layers = modelled["meta"]["architecture"]["text_config"]["layer_types"]
    measured = {**modelled, "name": "h200-diffusiongemma-26b-a4b-measured",
                "curves": {k: [[t, 2 * ms] for t, ms in v] for k, v in modelled["curves"].items()},
                "points": [{**p, "ms": 2 * p["ms"]} for p in modelled["points"]],
                "meta": {"preset": "diffusiongemma-26b-a4b-shape", "device": "NVIDIA H200",
                         "weights": "random (seeded normal(0, 0.02)): a timing shape",
                         "shape": {"layer_types": layers, "num_experts": 128, "hidden_size": 2816},
                         "skipped": ["batch 32 x prompt 2048: out of memory (allocated 120 GiB)"]}}
    measured.pop("model", None)  # refitted to the measured points
    (tmp_path / "h200-diffusiongemma-26b-a4b-measured.json").write_text(json.dumps(measured))
    (tmp_path / "profile-dg-check.log").write_text(json.dumps({"rounds": 120, "total_error": 0.12,
                                                               "median_round_error": 0.05}))
    text = "\n".join(summarize(tmp_path))
    assert ("h200-diffusiongemma-26b-a4b-measured.json: written (denoise 7 points, prefill 6 points; "
            "diffusiongemma-26b-a4b-shape on NVIDIA H200, 30 layers, 128 experts, hidden 2816; weights random); "
            "skipped: batch 32 x prompt 2048: out of memory (allocated 120 GiB)") in text
    assert "its round-time model: largest error " in text
    line = next(ln for ln in text.splitlines() if "modelled / measured per round" in ln)
    assert "median 0.49x" in line and f"over {len(modelled['points'])} rounds" in line  # its fit: within 2%
    assert "profile check: 120 rounds, error 12.0% over the whole run (target <= 10%: NOT met)" in text
    (tmp_path / "h200-diffusiongemma-26b-a4b-measured.json").unlink()
    assert "h200-diffusiongemma-26b-a4b-measured.json: missing" in "\n".join(summarize(tmp_path))
