"""The load generator: trace synthesis, open-loop replay, metrics, plots, chat, Locust (no Ray).

Servers are the no-op server in a subprocess; Locust runs in a subprocess (it gevent-patches on import).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from engine import tasks
from loadgen.arrivals import ArrivalParams, arrivals
from loadgen.client import RequestResult
from loadgen.lengths import LENGTHS, answer_need, max_tokens_for, sample_lengths
from loadgen.metrics import summarize
from loadgen.noop_server import spawn
from loadgen.replay import ReplayConfig, replay
from loadgen.trace import SynthConfig, TraceRequest, read_trace, synth, write_trace

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def server(request):
    procs = []

    def start(*args: str) -> str:
        proc, url = spawn(*args)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def arith(i: int, a: int, b: int, at: float, endpoint: str = "completion") -> TraceRequest:
    prompt = f"{a}+{b}="
    return TraceRequest(request_id=f"r{i}", arrival_s=at, endpoint=endpoint, max_tokens=8, category="arith",
                        answer=str(a + b), prompt=prompt if endpoint == "completion" else None,
                        messages=[{"role": "user", "content": prompt}] if endpoint == "chat" else None)


# ---- synthesis -------------------------------------------------------------------------------------------------


def test_synth_is_deterministic_and_prompts_do_not_depend_on_arrivals():
    cfg = SynthConfig(n=50, arrivals="poisson", arrival_params=ArrivalParams(rate=3.0), seed=7, endpoint="mixed")
    a, b = synth(cfg), synth(cfg)
    assert a == b
    assert synth(replace(cfg, seed=8)) != a
    g = synth(replace(cfg, arrivals="gamma", arrival_params=ArrivalParams(rate=3.0, burstiness=0.3)))
    assert [r.text for r in g] == [r.text for r in a] and [r.arrival_s for r in g] != [r.arrival_s for r in a]
    assert {r.endpoint for r in a} == {"completion", "chat"}
    for r in a:
        assert tasks.is_heldout(r.text) and r.check(r.answer)


def test_synth_eval_prompts_are_remask_evals_set():
    trace = synth(SynthConfig(n=25, seed=3, prompts="eval"))
    assert [(r.category, r.text) for r in trace] == [(e.category, e.prompt) for e in tasks.heldout_set(25, 2026)]


def _gaps(kind: str, n: int, **kw) -> np.ndarray:
    return np.diff(arrivals(kind, n, ArrivalParams(**kw), np.random.default_rng(0)))


def test_poisson_and_gamma_rates_and_cv():
    g = _gaps("poisson", 20000, rate=4.0)
    assert 1 / g.mean() == pytest.approx(4.0, rel=0.03)
    assert (g.std() / g.mean()) ** 2 == pytest.approx(1.0, rel=0.08)
    for k in (0.25, 4.0):
        g = _gaps("gamma", 20000, rate=4.0, burstiness=k)
        assert 1 / g.mean() == pytest.approx(4.0, rel=0.05)
        assert (g.std() / g.mean()) ** 2 == pytest.approx(1 / k, rel=0.1)


def test_burst_and_burst_poisson_and_diurnal():
    assert not arrivals("burst", 10, ArrivalParams(), np.random.default_rng(0)).any()
    t = arrivals("burst-poisson", 1000, ArrivalParams(rate=10.0, burst_frac=0.3), np.random.default_rng(0))
    assert (t == 0).sum() == 300 and np.all(np.diff(t) >= 0)
    assert 699 / t[-1] == pytest.approx(10.0, rel=0.1)
    p = ArrivalParams(rate=5.0, period_s=200.0, amplitude=0.8, bursts_per_period=2.0, burst_s=5.0, burst_factor=3.0)
    t = arrivals("diurnal", 10000, p, np.random.default_rng(1))
    assert np.all(np.diff(t) >= 0) and len(t) / t[-1] == pytest.approx(5.0, rel=0.15)
    phase = (t % 200.0) / 200.0  # the sine peaks in the first half of each period and dips in the second
    assert ((phase > 0.1) & (phase < 0.4)).sum() > 2.5 * ((phase > 0.6) & (phase < 0.9)).sum()
    with pytest.raises(ValueError, match="unknown arrival"):
        arrivals("uniform", 3, ArrivalParams(), np.random.default_rng(0))


def test_lengths_are_lognormal_and_clipped():
    x_in, x_out = sample_lengths("azure-conv", 40000, np.random.default_rng(0))
    assert np.median(x_in) == pytest.approx(np.exp(6.63), rel=0.05)
    assert np.median(x_out) == pytest.approx(np.exp(5.02), rel=0.05)
    s_in, s_out = sample_lengths("sharegpt", 40000, np.random.default_rng(0))
    assert s_in.mean() == pytest.approx(140, rel=0.06) and s_out.mean() == pytest.approx(264, rel=0.06)
    c_in, c_out = sample_lengths("azure-conv", 5000, np.random.default_rng(0), max_input=500, max_output=64)
    assert c_in.max() == 500 and c_out.max() == 64 and c_in.min() >= 1 and c_out.min() >= 1
    assert set(LENGTHS) == {"azure-conv", "sharegpt"}


def test_max_tokens_always_fit_the_answer():
    rng = __import__("random").Random(0)
    for _ in range(500):
        ex = tasks.sample(rng, None, split="heldout")
        assert answer_need(ex) >= len(ex.answer)
        m = max_tokens_for(ex, None, cap=256)
        assert m > len(ex.answer) and m % 8 == 0
        assert max_tokens_for(ex, 10_000, cap=256) == max(256, m)
        assert max_tokens_for(ex, 1, cap=256) == m


def test_trace_round_trip_and_bad_lines(tmp_path):
    trace = synth(SynthConfig(n=20, seed=1, endpoint="mixed", lengths="sharegpt", threshold=0.9, slo_ms=500.0,
                              slo_ms_per_token=2.0))
    write_trace(trace, tmp_path / "t.jsonl")
    back = read_trace(tmp_path / "t.jsonl")
    assert back == trace
    assert all(r.slo_ms == 500.0 + 2.0 * r.max_tokens and r.output_len for r in back)
    (tmp_path / "bad.jsonl").write_text('{"request_id": "x", "arrival_s": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_trace(tmp_path / "bad.jsonl")


# ---- metrics --------------------------------------------------------------------------------------------------


def test_summary_follows_vllm_conventions():
    a = RequestResult("a", "arith", "completion", 0.0, send_s=0.0, status=200, ok=True, ttft_ms=100.0, e2el_ms=500.0,
                      itl_ms=[200.0, 200.0], output_tokens=5, slo_ms=600.0, slo_met=True, correct=True)
    b = RequestResult("b", "prose", "chat", 1.0, send_s=1.0, status=200, ok=True, ttft_ms=300.0, e2el_ms=1300.0,
                      itl_ms=[1000.0], output_tokens=11, slo_ms=1000.0, slo_met=False, correct=False)
    c = RequestResult("c", "arith", "completion", 2.0, send_s=2.0, status=503, error="HTTP 503", slo_ms=900.0)
    s = summarize([a, b, c], duration_s=4.0, not_sent=1)
    assert (s["completed"], s["errors"], s["errors_by_kind"], s["not_sent"], s["requests"]) == (2, 1, {"503": 1}, 1, 4)
    assert s["mean_ttft_ms"] == 200.0 and s["median_e2el_ms"] == 900.0
    assert s["mean_tpot_ms"] == pytest.approx((400 / 4 + 1000 / 10) / 2)
    assert s["mean_itl_ms"] == pytest.approx(1400 / 3)
    assert s["request_throughput"] == 0.5 and s["request_goodput"] == 0.25
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # the failed request counts as a miss
    assert s["accuracy"] == 0.5 and s["accuracy_by_category"] == {"arith": 1.0, "prose": 0.0}


# ---- replay against the no-op server ---------------------------------------------------------------------------

SUMMARY_KEYS = {f"{k}_{m}_ms" for k in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")} | {
    "duration", "completed", "errors", "request_throughput", "request_goodput", "slo_attainment", "accuracy"}


@pytest.mark.parametrize("transport", ["raw", "httpx"])
def test_replay_records_timings_and_checks_answers(server, transport):
    url = server("--reply", "42", "--chunks", "2", "--gap-ms", "20")
    trace = [arith(0, 40, 2, 0.0), arith(1, 41, 1, 0.05, "chat"), arith(2, 1, 1, 0.1)]
    trace[0].slo_ms, trace[2].slo_ms = 10_000.0, 1.0
    doc = replay(trace, ReplayConfig(url=url, progress=False, transport=transport))
    s, reqs = doc["summary"], doc["requests"]
    assert SUMMARY_KEYS <= set(s) and not doc["interrupted"]
    assert s["completed"] == 3 and s["errors"] == 0
    assert s["accuracy"] == pytest.approx(2 / 3)
    assert [r["correct"] for r in reqs] == [True, True, False]
    assert s["slo_attainment"] == 0.5
    for r in reqs:
        assert r["text"] == "42" and r["output_tokens"] == 2 and r["finish_reason"] == "stop"
        assert 0 < r["ttft_ms"] < r["e2el_ms"] and len(r["itl_ms"]) == 1 and r["itl_ms"][0] >= 15.0


def test_replay_counts_http_errors(server):
    url = server("--reply", "42", "--fail-every", "3", "--fail-status", "503")
    trace = [arith(i, 40, 2, 0.01 * i) for i in range(9)]
    s = replay(trace, ReplayConfig(url=url, progress=False))["summary"]
    assert (s["completed"], s["errors"], s["errors_by_kind"]) == (6, 3, {"503": 3})
    url = server("--fail-every", "1", "--fail-status", "400")
    assert replay(trace[:2], ReplayConfig(url=url, progress=False))["summary"]["errors_by_kind"] == {"400": 2}


def test_replay_is_open_loop(server):
    """Every response takes 1 s; the 10 requests must still go out at their arrival times."""
    url = server("--reply", "42", "--first-delay-ms", "1000")
    trace = [arith(i, 40, 2, 0.05 * i, "chat" if i % 2 else "completion") for i in range(10)]
    doc = replay(trace, ReplayConfig(url=url, progress=False))
    reqs = doc["requests"]
    assert doc["summary"]["completed"] == 10
    assert max(abs(r["send_lag_ms"]) for r in reqs) < 50.0
    assert all(950.0 <= r["ttft_ms"] < 1500.0 for r in reqs)  # a chat's role-only chunk is not the first token
    assert doc["summary"]["duration"] < 2.5


def test_replay_ctrl_c_writes_partial_results(server, tmp_path):
    url = server("--reply", "42")
    write_trace([arith(i, 40, 2, 0.1 * i) for i in range(100)], tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "loadgen.cli", "loadgen", "replay", "--url", url, "--trace",
                             str(tmp_path / "t.jsonl"), "--out", str(out), "--quiet"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while len(httpx.get(url + "/noop/log").json()) < 3 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    doc = json.loads(out.read_text())
    assert doc["interrupted"] and doc["summary"]["completed"] >= 3 and doc["summary"]["not_sent"] > 0
    assert "partial results" in stdout


def test_overhead_measurement(tmp_path):
    from loadgen.overhead import measure_overhead

    r = measure_overhead(n=40, rate=40.0)
    assert r["measured"] == 40 and r["errors"] == 0
    assert 0.0 < r["client_ttft_ms"]["median"] and r["ttft_error_ms"]["median"] < 10.0
    assert set(r["ttft_error_ms"]) == {"mean", "median", "p99", "max"} and "median_within_limit" in r


# ---- plots, chat, CLI ------------------------------------------------------------------------------------------


def test_plot_writes_pngs(server, tmp_path):
    from loadgen.plot import plot_results

    url = server("--reply", "42", "--fail-every", "4")
    trace = [arith(i, 40, 2 + i % 2, 0.02 * i) for i in range(12)]
    for r in trace:
        r.slo_ms = 1000.0
    (tmp_path / "r.json").write_text(json.dumps(replay(trace, ReplayConfig(url=url, progress=False))))
    paths = plot_results(tmp_path / "r.json", tmp_path / "plots")
    assert [p.name for p in paths] == ["latency_cdf.png", "slo_over_time.png", "ttft_vs_prompt.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_chat_client_streams_and_keeps_history(server):
    from loadgen.chat import chat

    url = server("--reply", "hello there", "--chunks", "3")
    out = io.StringIO()
    assert chat(url, inp=io.StringIO("hi\n\nagain\n"), out=out, interactive=False) == 0
    assert out.getvalue() == "hello there\nhello there\n"
    out = io.StringIO()
    chat(url, show_steps=True, inp=io.StringIO("hi\n"), out=out, interactive=False)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and "chunk   1" in lines[0] and lines[2].endswith("|hello there|") and "done" in lines[3]


def test_cli_synth(tmp_path):
    from app.cli import main

    out = tmp_path / "trace.jsonl"
    assert main(["loadgen", "synth", "--n", "30", "--rate", "2", "--arrivals", "gamma", "--burstiness", "0.5",
                 "--seed", "3", "--threshold", "0.9", "--out", str(out)]) == 0
    trace = read_trace(out)
    assert len(trace) == 30 and all(r.threshold == 0.9 for r in trace)


# ---- Locust (subprocess: it gevent-patches on import) ----------------------------------------------------------


def _locust(url: str, tmp_path: Path, *args: str, env: dict | None = None) -> dict[tuple[str, str], list[str]]:
    cmd = [str(VENV_BIN / "locust"), "-f", str(ROOT / "loadgen/locustfile.py"), "--headless", "--host", url,
           "--csv", str(tmp_path / "loc"), "--only-summary", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 1: some requests failed (wrong answers count)
    rows = (tmp_path / "loc_stats.csv").read_text().splitlines()
    return {(r.split(",")[0], r.split(",")[1]): r.split(",") for r in rows[1:]}


@pytest.mark.slow
def test_locust_streaming_user_and_trace_shape(server, tmp_path):
    url = server("--reply", "42", "--chunks", "2")
    stats = _locust(url, tmp_path, "-u", "3", "-r", "3", "-t", "3s")
    assert int(stats[("TTFT", "completion")][2]) > 0 and int(stats[("E2E", "completion")][2]) > 0
    assert int(stats[("POST", "/v1/completions (headers)")][3]) == 0
    write_trace([arith(i, 40, 2, 0.2 * i) for i in range(10)], tmp_path / "t.jsonl")
    stats = _locust(url, tmp_path, env={"REMASK_TRACE": str(tmp_path / "t.jsonl")})
    assert int(stats[("POST", "/v1/completions (headers)")][2]) == 10  # the shape ends once the trace is done
    assert stats[("ANSWER", "arith")][2:4] == ["10", "0"]
    assert int(stats[("LAG", "send")][2]) == 10
