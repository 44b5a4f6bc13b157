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
    (tmp_path / "steps.txt").write_text("facts rc=0 3s\ngpu-tests rc=1 40s\nround rc=0 30s\n")
    (tmp_path / "round.json").write_text(json.dumps(_round(104.2)))
    (tmp_path / "round-single.json").write_text(json.dumps(_round(6.1, slots=1)))
    contenders = {n: {"tokens_per_s": 10.0, "mean_latency_s": 0.5, "mfu": 0.1}
                  for n in ("remask-batched", "remask-single", "fastdllm-loop", "llada-loop")}
    bench = {"batched_vs_best_loop_throughput": 8.4, "single_vs_fastdllm_latency": 0.62, "contenders": contenders,
             "cuda_graphs": {"captures": 5, "replays": 900, "rounds": 950, "failed": None}}
    (tmp_path / "bench-engine.log").write_text("bench engine: 100%|####|\n" + json.dumps(bench) + "\n")
    check = {"rounds": 300, "total_error": 0.14, "median_round_error": 0.08, "warming_rounds": 40,
             "steady": {"total_error": 0.06, "median_round_error": 0.05}}
    (tmp_path / "profile-check.log").write_text(json.dumps(check))
    (tmp_path / "h200-llada8b-measured.json").write_text("{}")
    text = "\n".join(summarize(tmp_path))
    assert "failed or stopped: gpu-tests" in text
    assert "104.2 ms, MFU 70.0%" in text and "(target <= 110 ms: met)" in text
    assert "round, CUDA graphs: 102.2 ms" in text
    assert "batched / best loop 8.40x (target >= 10x: NOT met)" in text
    assert "Fast-dLLM loop 0.62 (target <= 1: met)" in text and "5 captured, 900 replays" in text
    assert "error 14.0% (target <= 10%: NOT met)" in text and "40 warming rounds: error 6.0% (met)" in text
    assert "round-gaps: no result" in text and "round-moe: no result" in text
    assert "h200-llada2mini-measured.json: missing" in text and "llada8b-measured.json: written" in text


def test_summary_of_an_empty_folder_names_what_is_missing_and_the_cli_checks_its_argument(tmp_path):
    text = "\n".join(summarize(tmp_path))
    assert "no steps.txt" in text and "round: no result" in text and "bench engine: no result" in text
    script = str(ROOT / "scripts" / "h200_summary.py")
    bad = subprocess.run([sys.executable, script, str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 1 and "usage" in bad.stderr
    ok = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True)
    assert ok.returncode == 0 and "profile check: no result" in ok.stdout
