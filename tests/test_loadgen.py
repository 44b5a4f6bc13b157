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

import tasksuite as tasks
from loadgen.arrivals import ArrivalParams, arrivals
from loadgen.client import RequestResult
from loadgen.lengths import LENGTHS, answer_need, max_tokens_for, sample_lengths
from loadgen.metrics import summarize
from loadgen.replay import ReplayConfig, replay
from loadgen.trace import SynthConfig, TraceRequest, read_trace, synth, write_trace

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


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
def test_replay_records_timings_and_checks_answers(noop_server, transport):
    url = noop_server("--reply", "42", "--chunks", "2", "--gap-ms", "20")
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


def test_replay_counts_http_errors(noop_server):
    url = noop_server("--reply", "42", "--fail-every", "3", "--fail-status", "503")
    trace = [arith(i, 40, 2, 0.01 * i) for i in range(9)]
    s = replay(trace, ReplayConfig(url=url, progress=False))["summary"]
    assert (s["completed"], s["errors"], s["errors_by_kind"]) == (6, 3, {"503": 3})
    url = noop_server("--fail-every", "1", "--fail-status", "400")
    assert replay(trace[:2], ReplayConfig(url=url, progress=False))["summary"]["errors_by_kind"] == {"400": 2}


def test_replay_is_open_loop(noop_server):
    """Every response takes 1 s; the 10 requests must still go out at their arrival times."""
    url = noop_server("--reply", "42", "--first-delay-ms", "1000")
    trace = [arith(i, 40, 2, 0.05 * i, "chat" if i % 2 else "completion") for i in range(10)]
    doc = replay(trace, ReplayConfig(url=url, progress=False))
    reqs = doc["requests"]
    assert doc["summary"]["completed"] == 10
    assert max(abs(r["send_lag_ms"]) for r in reqs) < 50.0
    assert all(950.0 <= r["ttft_ms"] < 1500.0 for r in reqs)  # a chat's role-only chunk is not the first token
    assert doc["summary"]["duration"] < 2.5


@pytest.mark.slow
def test_replay_ctrl_c_writes_partial_results(noop_server, tmp_path):
    url = noop_server("--reply", "42")
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


@pytest.mark.slow
def test_plot_writes_pngs(noop_server, tmp_path):
    from loadgen.plot import plot_results

    url = noop_server("--reply", "42", "--fail-every", "4")
    trace = [arith(i, 40, 2 + i % 2, 0.02 * i) for i in range(12)]
    for r in trace:
        r.slo_ms = 1000.0
    (tmp_path / "r.json").write_text(json.dumps(replay(trace, ReplayConfig(url=url, progress=False))))
    paths = plot_results(tmp_path / "r.json", tmp_path / "plots")
    assert [p.name for p in paths] == ["latency_cdf.png", "slo_over_time.png", "ttft_vs_prompt.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_chat_client_streams_and_keeps_history(noop_server):
    from loadgen.chat import chat

    url = noop_server("--reply", "hello there", "--chunks", "3")
    out = io.StringIO()
    assert chat(url, inp=io.StringIO("hi\n\nagain\n"), out=out, interactive=False) == 0
    assert out.getvalue() == "hello there\nhello there\n"
    out = io.StringIO()
    chat(url, show_steps=True, inp=io.StringIO("hi\n"), out=out, interactive=False)
    lines = out.getvalue().splitlines()  # a canvas line per round (the no-op server: one per chunk), then the chunk
    assert len(lines) == 7 and "chunk   1" in lines[1] and lines[5].endswith("|hello there|") and "done" in lines[6]
    assert [ln.split("] ", 1)[1] for ln in lines[0:6:2]] == [
        "round   1 thr 0.90 +4  i0 tp1 |[hell]_______|", "round   2 thr 0.90 +4  i0 tp1 |hell[o th]___|",
        "round   3 thr 0.90 +3  i0 tp1 |hello th[ere]|"]


def test_cli_synth(tmp_path):
    from tools.cli import main

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
def test_locust_streaming_user_and_trace_shape(noop_server, tmp_path):
    url = noop_server("--reply", "42", "--chunks", "2")
    stats = _locust(url, tmp_path, "-u", "3", "-r", "30", "-t", "2s")  # the 3 users in 0.1 s
    assert int(stats[("TTFT", "completion")][2]) > 0 and int(stats[("E2E", "completion")][2]) > 0
    assert int(stats[("POST", "/v1/completions (headers)")][3]) == 0
    write_trace([arith(i, 40, 2, 0.2 * i) for i in range(10)], tmp_path / "t.jsonl")
    stats = _locust(url, tmp_path, env={"REMASK_TRACE": str(tmp_path / "t.jsonl")})
    assert int(stats[("POST", "/v1/completions (headers)")][2]) == 10  # the shape ends once the trace is done
    assert stats[("ANSWER", "arith")][2:4] == ["10", "0"]
    assert int(stats[("LAG", "send")][2]) == 10


# ---- API keys --------------------------------------------------------------------------------------------------

KEY = "sk-test-0123456789"


def _stats(url: str) -> dict:
    return httpx.get(url + "/noop/stats").json()


@pytest.mark.parametrize("transport", ["raw", "httpx"])
def test_replay_sends_the_api_key(noop_server, transport):
    url = noop_server("--reply", "42", "--api-key", KEY)
    trace = [arith(i, 40, 2, 0.01 * i, "chat" if i % 2 else "completion") for i in range(4)]
    cfg = ReplayConfig(url=url, progress=False, transport=transport, api_key=KEY)
    assert KEY not in repr(cfg)
    doc = replay(trace, cfg)
    assert doc["summary"]["completed"] == 4 and doc["config"]["api_key_sent"] is True
    assert KEY not in json.dumps(doc)
    assert _stats(url)["authorization"] == {f"Bearer {KEY}": 4}


def test_chat_and_bench_control_send_the_api_key(noop_server, monkeypatch, capsys):
    from loadgen.chat import chat
    from tools.bench_control import bench_control
    from tools.cli import main

    url = noop_server("--reply", "hi", "--api-key", KEY)
    out = io.StringIO()
    assert chat(url, inp=io.StringIO("a\nb\n"), out=out, interactive=False, api_key=KEY) == 0
    assert out.getvalue() == "hi\nhi\n"
    res = bench_control(url, requests=3, concurrency=2, api_key=KEY)
    assert res["requests"] == 3 and res["sse_chunks"] > 0
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # the default of --api-key
    assert main(["bench", "control", "--url", url, "--requests", "2", "--json"]) == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("c\n"))
    assert main(["chat", "--url", url]) == 0
    assert KEY not in capsys.readouterr().out
    # chat: 2 turns + 1; bench control: 2 x (models, control, control) + 3 + 2 completions
    assert _stats(url)["authorization"] == {f"Bearer {KEY}": 3 + 6 + 5}


def test_401_is_reported_clearly(noop_server, tmp_path, monkeypatch, capsys):
    from loadgen.chat import chat
    from loadgen.client import Unauthorized
    from tools.bench_control import bench_control
    from tools.cli import main

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    url = noop_server("--reply", "42", "--api-key", KEY)
    write_trace([arith(i, 40, 2, 0.01 * i) for i in range(3)], tmp_path / "t.jsonl")
    args = ["loadgen", "replay", "--url", url, "--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "r.json"),
            "--quiet"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "3 requests got HTTP 401 Unauthorized: the server wants an API key: pass --api-key" in err
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["summary"]["errors_by_kind"] == {"401": 3}
    assert doc["requests"][0]["error"] == "HTTP 401: Incorrect API key provided."
    assert main([*args, "--api-key", "sk-wrong-key"]) == 0
    out, err = capsys.readouterr()
    assert "refused the API key" in err and "sk-wrong-key" not in out + err + (tmp_path / "r.json").read_text()

    out = io.StringIO()
    assert chat(url, inp=io.StringIO("a\nb\n"), out=out, interactive=False, api_key="sk-wrong-key") == 1
    err = capsys.readouterr().err
    assert "HTTP 401: Incorrect API key provided. (the server refused the API key" in err and "sk-wrong" not in err
    with pytest.raises(Unauthorized, match="HTTP 401 from GET /v1/models: .* pass --api-key KEY or set"):
        bench_control(url, requests=1)
    assert main(["bench", "control", "--url", url, "--requests", "1"]) == 2
    assert "remask: error: HTTP 401" in capsys.readouterr().err


# ---- vLLM benchmark_serving options: goodput, max concurrency, percentiles --------------------------------------


def _ok(i: int, ttft: float, e2el: float, tokens: int, **kw) -> RequestResult:
    return RequestResult(f"r{i}", "arith", "completion", 0.0, status=200, ok=True, ttft_ms=ttft, e2el_ms=e2el,
                         output_tokens=tokens, correct=True, **kw)


def test_goodput_counts_requests_meeting_every_bound():
    from loadgen.metrics import format_summary, is_good, parse_goodput

    rs = [_ok(0, 100.0, 1000.0, 10),  # tpot 100
          _ok(1, 300.0, 1200.0, 10),  # ttft too slow for ttft:200
          _ok(2, 50.0, 2050.0, 11),  # tpot 200
          _ok(3, 80.0, 80.0, 1),  # one token: tpot counts as 0 (vLLM)
          _ok(4, 90.0, 500.0, 5, slo_ms=400.0, slo_met=False),  # its own SLO missed
          RequestResult("r5", "arith", "completion", 0.0, status=500, error="HTTP 500")]
    bounds = parse_goodput(["ttft:200", "tpot:150"])
    assert bounds == {"ttft": 200.0, "tpot": 150.0}
    assert [is_good(r, bounds) for r in rs] == [True, False, False, True, False, False]
    s = summarize(rs, duration_s=2.0, goodput=bounds)
    assert s["request_goodput"] == 1.0 and s["goodput_share"] == pytest.approx(2 / 6)
    assert s["goodput_bounds"] == bounds and "Goodput ttft<=200 tpot<=150 ms (req/s):" in format_summary(s)
    s = summarize(rs, duration_s=2.0, goodput=parse_goodput(["e2el:1000"]))
    assert s["request_goodput"] == 1.0  # r0 (1000 <= 1000) and r3
    plain = summarize(rs, duration_s=2.0)  # no bounds: successes within their own SLO
    assert plain["request_goodput"] == 2.0 and plain["goodput_bounds"] is None
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_percentiles_option():
    from loadgen.metrics import format_summary, parse_percentiles

    rs = [_ok(i, float(10 * (i + 1)), 1000.0, 3, itl_ms=[1.0, 3.0]) for i in range(10)]
    ttfts = [10.0 * (i + 1) for i in range(10)]
    s = summarize(rs, 1.0)
    assert s["percentiles"] == [50.0, 90.0, 99.0]
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90)) and s["p50_itl_ms"] == 2.0
    s = summarize(rs, 1.0, percentiles=parse_percentiles("25,99.9"))
    assert s["p25_ttft_ms"] == pytest.approx(np.percentile(ttfts, 25))
    assert s["p99.9_e2el_ms"] == 1000.0 and "p99_ttft_ms" not in s and "p50_ttft_ms" not in s
    assert "TTFT mean / median / p25 / p99.9 (ms):" in format_summary(s)
    assert summarize([], 1.0, percentiles=(75.0,))["p75_tpot_ms"] is None
    for bad in ("", "x", "50,101", "-1"):
        with pytest.raises(ValueError, match="percentiles"):
            parse_percentiles(bad)


def test_max_concurrency_is_honoured(noop_server):
    url = noop_server("--reply", "42", "--first-delay-ms", "150")
    trace = [arith(i, 40, 2, 0.0) for i in range(9)]  # all at once
    doc = replay(trace, ReplayConfig(url=url, progress=False, max_concurrency=3))
    s, reqs = doc["summary"], doc["requests"]
    assert s["completed"] == 9 and s["max_concurrency"] == 3 and doc["config"]["max_concurrency"] == 3
    assert _stats(url)["max_inflight"] == 3
    waits = sorted(r["queued_ms"] for r in reqs)
    assert waits[2] < 50.0 and 100.0 < waits[3] and 250.0 < waits[6] < 600.0  # three waves of 150 ms
    assert all(140.0 <= r["ttft_ms"] < 400.0 for r in reqs)  # as in vLLM, the wait is not in the latencies
    assert max(abs(r["send_lag_ms"]) for r in reqs) < 50.0 and s["max_queue_ms"] == waits[-1]
    assert s["duration"] >= 0.45
    with pytest.raises(ValueError, match="max_concurrency"):
        ReplayConfig(url=url, max_concurrency=0)


def test_replay_cli_with_benchmark_options(noop_server, tmp_path, capsys):
    from tools.cli import main

    url = noop_server("--reply", "42", "--chunks", "2", "--first-delay-ms", "20")
    write_trace([arith(i, 40, 2, 0.0) for i in range(6)], tmp_path / "t.jsonl")
    base = ["loadgen", "replay", "--url", url, "--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "r.json"),
            "--quiet", "--max-concurrency", "2", "--percentiles", "50,95"]
    assert main([*base, "--goodput", "ttft:5000", "e2el:0", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 6 and s["goodput_share"] == 0.0 and s["goodput_bounds"] == {"ttft": 5000, "e2el": 0}
    assert "p95_itl_ms" in s and "p99_itl_ms" not in s and s["max_concurrency"] == 2
    assert _stats(url)["max_inflight"] == 2
    assert main([*base, "--goodput", "ttft:5000", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)  # the run's figures, then its printed summary (another run: shapes)
    assert main([*base, "--goodput", "ttft:5000"]) == 0
    printed = {line[:40].strip(): line[40:].strip() for line in capsys.readouterr().out.splitlines()}
    rate, share = printed["Goodput ttft<=5000 ms (req/s):"].split(" (")
    assert float(rate) > 0 and share == "1.000 of requests)" and s["goodput_share"] == 1.0  # every ttft well under
    assert printed["Maximum request concurrency:"] == "2" and printed["Successful requests:"] == "6"
    tpot = printed["TPOT mean / median / p50 / p95 (ms):"].split(" / ")
    assert len(tpot) == 4 and all(float(v) >= 0.0 for v in tpot)  # mean, median and the asked percentiles
    assert main([*base, "--goodput", "itl:5"]) == 2
    assert "--goodput takes" in capsys.readouterr().err


# ---- prompts from a JSONL file ---------------------------------------------------------------------------------


def test_prompts_file_is_parsed_and_bad_lines_are_refused(tmp_path):
    from loadgen.trace import read_prompts

    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "Once upon a time", "max_tokens": 32}\n\n'
                    '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}\n')
    assert read_prompts(good) == [{"prompt": "Once upon a time", "max_tokens": 32},
                                  {"messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi"}]}]
    bad = {'{"prompt": "a"}\nnot json\n': "p.jsonl:2: not JSON",
           '{"prompt": "a", "messages": []}\n': "p.jsonl:1: needs exactly one of prompt",
           '{"max_tokens": 3}\n': "p.jsonl:1: needs exactly one of prompt",
           '\n{"prompt": 3}\n': "p.jsonl:2: prompt must be a non-empty string",
           '{"messages": [{"content": "x"}]}\n': r"p.jsonl:1: messages\[0\] must be an object",
           '{"prompt": "a", "max_tokens": 0}\n': "p.jsonl:1: max_tokens must be a positive integer",
           '{"prompt": "a", "max_token": 8}\n': r"p.jsonl:1: unknown keys \['max_token'\]",
           '["a"]\n': "p.jsonl:1: expected a JSON object",
           "\n": "p.jsonl: no prompts"}
    for text, msg in bad.items():
        (tmp_path / "p.jsonl").write_text(text)
        with pytest.raises(ValueError, match=msg):
            read_prompts(tmp_path / "p.jsonl")


@pytest.mark.slow
def test_synth_from_prompts_file_and_replay(noop_server, tmp_path, capsys):
    from tools.cli import main

    (tmp_path / "p.jsonl").write_text('{"prompt": "Once upon a time", "max_tokens": 32}\n'
                                      '{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "Hello"}\n')
    out = tmp_path / "t.jsonl"
    assert main(["loadgen", "synth", "--prompts-file", str(tmp_path / "p.jsonl"), "--rate", "50",
                 "--max-tokens-cap", "64", "--slo-ms", "1000", "--out", str(out)]) == 0
    trace = read_trace(out)
    assert len(trace) == 3  # default --n: one request per line
    assert [(r.endpoint, r.max_tokens, r.category) for r in trace] == [
        ("completion", 32, "custom"), ("chat", 64, "custom"), ("completion", 64, "custom")]
    assert trace[0].prompt == "Once upon a time" and trace[1].messages == [{"role": "user", "content": "hi"}]
    assert trace[0].check("anything") is None and all(r.slo_ms for r in trace)
    assert main(["loadgen", "synth", "--prompts-file", str(tmp_path / "p.jsonl"), "--n", "7", "--endpoint", "chat",
                 "--rate", "50", "--out", str(out)]) == 0  # (the default 1 req/s: the replay below would wait 6 s)
    trace = read_trace(out)
    assert len(trace) == 7 and {r.endpoint for r in trace} == {"chat"} and trace[3].text == "Once upon a time"
    capsys.readouterr()
    url = noop_server("--reply", "42")
    s = replay(trace, ReplayConfig(url=url, progress=False))["summary"]
    assert s["completed"] == 7 and s["accuracy"] is None and s["accuracy_by_category"] == {}
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    assert main(["loadgen", "synth", "--prompts-file", str(tmp_path / "bad.jsonl"), "--out", str(out)]) == 2
    assert "bad.jsonl:2: prompt must be a non-empty string" in capsys.readouterr().err


# ---- remask chat --show-steps: the canvas ----------------------------------------------------------------------


def test_render_canvas():
    from loadgen.chat import render_canvas

    state: dict = {}
    assert render_canvas(state, {"choices": [{"index": 0, "delta": {"content": "x"}}]}) == ""
    first = {"round": 6, "instance": 0, "tp": 1, "threshold": 0.9, "block": [0, 4],
             "committed": [[0, 5, "He"], [1, 6, "llo"], [2, 7, "\n"], [3, 2, ""]], "masked": [], "length": 8}
    assert render_canvas(state, {"choices": [], "remask_canvas": first}) == \
        "round   6 thr 0.90 +4  i0 tp1 |[Hello↵·]____|"
    chunk = {"choices": [], "remask_canvas": {
        "round": 7, "instance": 0, "tp": 1, "threshold": 0.9, "block": [4, 8],
        "committed": [[5, 1234, "lo"], [7, 88, " w"]], "masked": [4, 6], "length": 10}}
    assert render_canvas(state, chunk) == "round   7 thr 0.90 +2  i0 tp1 |Hello↵·[_lo_ w]__|"
    assert state == {0: {0: "He", 1: "llo", 2: "\n", 3: "", 5: "lo", 7: " w"}}
    # the object alone, no threshold, no instance; a later choice keeps its own pieces
    view = {"index": 1, "round": 1, "threshold": None, "block": [0, 2], "committed": [[1, 9, "z"]], "masked": [0],
            "length": 3}
    assert render_canvas(state, view) == "round   1 thr   -  +1  |[_z]_|"
    assert state[1] == {1: "z"}


@pytest.mark.slow
def test_locust_sends_the_api_key(noop_server, tmp_path):
    url = noop_server("--reply", "42", "--api-key", KEY)
    write_trace([arith(i, 40, 2, 0.1 * i) for i in range(3)], tmp_path / "t.jsonl")
    env = {"REMASK_TRACE": str(tmp_path / "t.jsonl"), "OPENAI_API_KEY": ""}
    stats = _locust(url, tmp_path, "--api-key", KEY, env=env)  # Locust's own option
    assert stats[("POST", "/v1/completions (headers)")][2:4] == ["3", "0"]
    stats = _locust(url, tmp_path, env={**env, "OPENAI_API_KEY": KEY})  # the default
    assert stats[("POST", "/v1/completions (headers)")][2:4] == ["3", "0"]
    assert _stats(url)["authorization"] == {f"Bearer {KEY}": 6}
    stats = _locust(url, tmp_path, env=env)  # no key: every request fails with the server's 401
    assert stats[("POST", "/v1/completions (headers)")][2:4] == ["3", "3"]
    failures = (tmp_path / "loc_failures.csv").read_text()
    assert "HTTP 401" in failures and "the server wants an API key" in failures
