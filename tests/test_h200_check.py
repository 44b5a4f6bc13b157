"""scripts/h200_check.sh's dry run: the whole device script end to end on the CPU with tiny shapes
(SIZE=tiny DEV=cpu), into a temporary $OUT. Every step runs and exits 0, the steps that need CUDA say
so, $OUT holds the three files a device call returns, and the archive holds every step's output. The script's
Python commands run through tests/forkserver.py ($PY): each in a process forked from one that imported torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.device_image import without_service_stack

ROOT = Path(__file__).resolve().parents[1]
FORKSERVER = ROOT / "tests" / "forkserver.py"
STEPS = ("facts", "fixtures", "round", "round-single", "round-moe", "recompute", "kernels-8b", "kernels-moe",
         "bench-engine", "profile", "profile-check", "profile-moe", "profile-dg", "profile-dg-check", "round-gaps")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU's; a GPU machine runs the script itself")
def test_device_script_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "DEV": "cpu", "SIZE": "tiny", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    # the script's ~30 Python commands (steps, summaries) run in processes forked from one that imported torch
    # once (tests/forkserver.py): each took ~2 s more to import it than its tiny step ran
    sock_dir = Path(tempfile.mkdtemp(prefix="fs", dir="/tmp"))  # short: a Unix socket's path has ~107 bytes
    sock = sock_dir / "py.sock"
    server = subprocess.Popen([sys.executable, str(FORKSERVER), "--serve", str(sock)], cwd=ROOT,
                              env={**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists(), server.stderr.read() if server.poll() is not None else "no fork server within 120 s"
        env.update(PY=f"{sys.executable} -S {FORKSERVER}", REMASK_FORK_SOCKET=str(sock))
        done = subprocess.run(["bash", "scripts/h200_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
    finally:
        server.kill()
        server.communicate()
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    # what a device call returns: three files, whatever the number of steps
    assert sorted(p.name for p in out.iterdir()) == ["h200-check.tar.gz", "steps.txt", "summary.txt"]
    steps = (out / "steps.txt").read_text().splitlines()
    ran = {line.split()[0]: line for line in steps if " rc=" in line}
    assert set(ran) == set(STEPS), steps
    assert all(" rc=0 " in line for line in ran.values()), steps
    assert "gpu-tests skipped: no CUDA" in steps and steps[-1].startswith("total ")
    assert not list(tmp_path.glob("h200-check.*")), "the work folder is removed"

    with tarfile.open(out / "h200-check.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        fixtures = json.load(tar.extractfile("./fixtures.json"))
        kernels = json.load(tar.extractfile("./kernels-moe.json"))
        profile = json.load(tar.extractfile("./h200-llada8b-measured.json"))
        dg = json.load(tar.extractfile("./h200-diffusiongemma-26b-a4b-measured.json"))
    assert {f"{s}.log" for s in STEPS} <= names
    assert {"round.json", "round-single.json", "round-moe.json", "round-gaps.json", "recompute.json", "kernels-8b.json",
            "kernels-moe.json", "fixtures.json", "h200-llada8b-measured.json", "h200-llada2mini-measured.json",
            "steps.txt"} <= names
    assert not any(n in names for n in ("model.safetensors", "tokenizer.json")), "the checkpoints stay out"
    assert fixtures["families"]["sdar"]["ok"] and fixtures["families"]["sdar"]["instance"]["largest_batch"] == 3
    assert kernels["device_ms_per_round"] > 0 and kernels["by_category_ms"]["matmul"] > 0
    assert profile["curves"] and profile["meta"]["device"] == "cpu"
    assert set(dg["curves"]) == {"prefill", "denoise"} and dg["meta"]["weights"].startswith("random")

    summary = (out / "summary.txt").read_text()
    for line in ("steps: every step that ran exited 0", "skipped: gpu-tests (no CUDA)",
                 "fixtures on cpu: 1 of 1 families decode (sdar ok)", "(target <= 100 ms:",
                 "round-single (one request, 1x8): round ",
                 "round, CUDA graphs: skipped: no CUDA", "(target <= 16 ms:",
                 "recompute vs cached (llada-8b-shape on cpu", "attention flash first: ", "   128 tokens: recompute ",
                 "kernels-8b (llada-8b-shape, 4x8",
                 "kernels-moe (llada2-mini-shape, 4x8", "bench engine: batched / best loop",
                 "profile check: ", "over the whole run (target <= 10%:", "h200-llada8b-measured.json: written",
                 "h200-llada2mini-measured.json: written", "the 128 x 512 prefill case: not in this profile's grid",
                 "h200-diffusiongemma-26b-a4b-measured.json: written (", "2 layers, 16 experts, hidden 64; weights "
                 "random)", "not against h200-diffusiongemma-26b-a4b-modelled: a shrunk shape (2 layers)"):
        assert line in summary, (line, summary)


_BLOCKED = """
    sys.path.insert(0, "scripts")
    import fixtures_check, h200_summary  # noqa: E401
    from engine.instance import Instance  # what fixtures_check imports when it runs
    from tests.checkpoints import build_checkpoint
    from tools.kernel_profile import main
    rc = main(["--model", sys.argv[2], "--slots", "2", "--tokens", "4", "--context", "8", "--rounds", "1",
               "--warmup", "0", "--json"])
    sys.exit(rc or (f"imported {leaked()}" if leaked() else 0))
"""


@pytest.mark.slow
def test_the_new_steps_need_only_the_device_image():
    """The lent machine's Python has torch, safetensors, tokenizers and pytest but not the service's stack
    (tests/test_device_image.py checks the older steps): the kernel breakdown, the fixtures step and the
    summary import none of it."""
    shape = "llada-8b-shape:layers=1,vocab=128,hidden=64,heads=2,kv_heads=2,intermediate=128"
    done = without_service_stack(_BLOCKED, shape, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["slots"] == 2 and set(res["by_category_ms"]) == {"matmul", "attention", "elementwise/other",
                                                                "copy/index"}
