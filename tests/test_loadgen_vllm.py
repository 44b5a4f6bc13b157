"""``remask loadgen bench``: vLLM's ``vllm bench serve`` flags, summary table and result keys (loadgen/bench.py),
against the no-op server (no Ray)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from loadgen.bench import (
    build_trace,
    jsonl_prompts,
    load_tokenizer,
    random_prompts,
    request_offsets,
    sharegpt_prompts,
    vllm_metrics,
)
from loadgen.client import RequestResult
from tools.cli import main

# the keys of vLLM's saved result (vllm/benchmarks/serve.py) for the default --percentile-metrics
VLLM_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "queue_times", "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
             *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl"))}
TABLE = ["============ Serving Benchmark Result ============", "Successful requests:", "Failed requests:",
         "Request rate configured (RPS):", "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
         "Request throughput (req/s):", "Request goodput (req/s):", "Output token throughput (tok/s):",
         "Peak output token throughput (tok/s):", "Peak concurrent requests:",
         "Total Token throughput (tok/s):", "---------------Time to First Token----------------", "Mean TTFT (ms):",
         "Median TTFT (ms):", "P99 TTFT (ms):", "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):",
         "---------------Inter-token Latency----------------", "P99 ITL (ms):", "=" * 50]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-bd")


def _ok(rid: str, ttft: float, e2el: float, itl: list[float], out_tokens: int | None, text: str = "") -> RequestResult:
    return RequestResult(rid, "custom", "completion", 0.0, status=200, ok=True, ttft_ms=ttft, e2el_ms=e2el,
                         itl_ms=itl, output_tokens=out_tokens, text=text)


# ---- datasets and arrivals -------------------------------------------------------------------------------------


def test_random_prompts_have_their_exact_token_lengths(tok):
    ps = random_prompts(tok, 30, input_len=32, output_len=16, range_ratio=0.5, prefix_len=4, seed=1)
    assert all(len(tok.encode(p.prompt)) == p.prompt_len for p in ps)
    assert all(4 + 16 <= p.prompt_len <= 4 + 48 and 8 <= p.output_len <= 24 for p in ps)
    assert len({p.prompt_len for p in ps}) > 5 and len({p.prompt[:4] for p in ps}) == 1  # one shared prefix
    assert [p.prompt for p in ps] == [p.prompt for p in random_prompts(tok, 30, 32, 16, 0.5, 4, seed=1)]
    assert [p.prompt for p in ps] != [p.prompt for p in random_prompts(tok, 30, 32, 16, 0.5, 4, seed=2)]
    fixed = random_prompts(tok, 5, input_len=100, output_len=7)
    assert {(p.prompt_len, p.output_len) for p in fixed} == {(100, 7)}
    assert not any(c in p.prompt for p in fixed for c in "<>")  # no special tokens in a prompt
    with pytest.raises(ValueError, match="random-range-ratio"):
        random_prompts(tok, 5, range_ratio=1.0)


def test_request_offsets_follow_vllm():
    assert not request_offsets(10, float("inf")).any()
    t = request_offsets(40, 20.0, 1.0, seed=0)
    assert np.all(np.diff(t) >= 0) and t[0] > 0 and t[-1] == pytest.approx(2.0)  # rescaled to n / rate
    assert np.allclose(np.diff(request_offsets(5, 10.0, float("inf"))), 0.1)
    big = request_offsets(4000, 10.0, 1.0, seed=3)
    gaps = np.diff(big)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.1)  # Poisson: CV 1
    regular = np.diff(request_offsets(4000, 10.0, 4.0, seed=3))
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.5, abs=0.05)  # gamma shape 4: CV 1/2
    for bad in ((10, 0.0, 1.0), (10, 5.0, 0.0)):
        with pytest.raises(ValueError):
            request_offsets(*bad)


def test_sharegpt_and_jsonl_files(tmp_path, tok):
    def conv(q, a):
        return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}

    data = [conv("what is two plus two", "four, of course"), conv("hi", "a long enough answer"),  # prompt < 4
            conv("a fine question here", "no"), {"conversations": [{"from": "human", "value": "alone"}]},
            conv("x" * 1100, "too long a prompt")]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    ps = sharegpt_prompts(str(tmp_path / "sg.json"), tok, 3)
    assert [(p.prompt, p.prompt_len, p.output_len) for p in ps] == [("what is two plus two", 20, 15)] * 3
    fixed = sharegpt_prompts(str(tmp_path / "sg.json"), tok, 5, output_len=9, no_oversample=True)
    assert sorted(p.prompt for p in fixed) == ["a fine question here", "what is two plus two"]
    assert {p.output_len for p in fixed} == {9}

    lines = [{"prompt": "one two", "max_tokens": 5, "id": 7}, {"messages": [{"role": "user", "content": "three"}]}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    ps = jsonl_prompts(str(tmp_path / "p.jsonl"), tok, 2, output_len=12, shuffle=False)
    assert [(p.prompt, p.messages is not None, p.prompt_len, p.output_len) for p in ps] == \
        [("one two", False, 7, 12), (None, True, 5, 12)]
    with pytest.raises(ValueError, match="needs max_tokens"):
        jsonl_prompts(str(tmp_path / "p.jsonl"), tok, 2, output_len=-1)
    (tmp_path / "bad.jsonl").write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: prompt must be a non-empty string"):
        jsonl_prompts(str(tmp_path / "bad.jsonl"), tok, 1)


def test_trace_bodies_carry_vllm_fields(tok):
    ps = random_prompts(tok, 2, input_len=8, output_len=4)
    chat = build_trace(ps, np.zeros(2), "chat", {"ignore_eos": True, "temperature": 0.0}, "bench-x-")
    body = chat[1].body("m")
    assert chat[1].request_id == "bench-x-1" and body["messages"] == [{"role": "user", "content": ps[1].prompt}]
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["max_tokens"] == 4
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    comp = build_trace(ps, np.zeros(2), "completion", {}, "r", slo_ms=100.0, slo_ms_per_token=10.0)
    assert comp[0].body(None)["prompt"] == ps[0].prompt and comp[0].body(None)["slo_ms"] == 140.0


# ---- metrics on known inputs -----------------------------------------------------------------------------------


def test_vllm_metrics_on_known_inputs(tok):
    results = [_ok("a", 100.0, 1000.0, [300.0, 300.0, 300.0], 10),  # tpot 100
               _ok("b", 200.0, 600.0, [400.0], 5),  # tpot 100
               _ok("c", 300.0, 300.0, [], 1),  # one token: tpot 0 (for goodput), not in the TPOT stats
               RequestResult("d", "custom", "completion", 0.0, status=500, error="HTTP 500: boom"),
               _ok("e", 400.0, 2400.0, [1000.0, 1000.0], None, text="abcdefghijk")]  # 11 tokens by the tokenizer
    m = vllm_metrics(results, [10, 20, 30, 40, 50], 4.0, tok, ["ttft", "tpot", "itl", "e2el"], [50.0, 99.0],
                     {"ttft": 250.0, "tpot": 150.0})
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (4, 1, 110, 27)
    assert m["output_lens"] == [10, 5, 1, 0, 11] and m["input_lens"] == [10, 20, 30, 40, 50]
    assert (m["request_throughput"], m["output_throughput"], m["total_token_throughput"]) == (1.0, 27 / 4, 137 / 4)
    assert m["request_goodput"] == 2 / 4.0  # a, b (c's TTFT 300 > 250; e's too)
    assert m["mean_ttft_ms"] == 250.0 and m["median_ttft_ms"] == 250.0 and m["p50_ttft_ms"] == 250.0
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 3 * 100)  # linear between the order statistics
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300, 400]))
    assert m["mean_tpot_ms"] == pytest.approx(100.0 * 2 / 3 + 200.0 / 3)  # a 100, b 100, e 2000/10 = 200
    assert m["mean_itl_ms"] == pytest.approx(np.mean([300, 300, 300, 400, 1000, 1000]))
    assert m["p99_e2el_ms"] == pytest.approx(np.percentile([1000, 600, 300, 2400], 99))
    assert m["ttfts"] == [0.1, 0.2, 0.3, 0.0, 0.4] and m["itls"][1] == [0.4] and m["itls"][3] == []
    assert m["errors"] == ["", "", "", "HTTP 500: boom", ""] and m["latencies"][4] == 2.4
    assert vllm_metrics(results, [1] * 5, 4.0, tok, ["e2el"], [99.0], {"e2el": 1000.0})["request_goodput"] == 0.75
    # peaks: a sent at 0 (chunks at 0.5 s and 1.2 s), b at 0.8 s (one chunk at 1.0 s), e at 0.2 s (chunks at 0.3, 2.5 s)
    for r, send, offsets in ((results[0], 0.0, [500.0, 1200.0]), (results[1], 0.8, [200.0]),
                             (results[4], 0.2, [100.0, 2300.0])):
        r.send_s, r.chunk_offsets_ms = send, offsets
    results[2].send_s, results[2].chunk_offsets_ms = 5.0, [300.0]
    p = vllm_metrics(results, [1] * 5, 4.0, tok, ["ttft"], [99.0])
    # second 0: a 5 + e 5.5; second 1: a 5 + b 5; second 2: e 5.5; second 5: c 1
    assert p["max_output_tokens_per_s"] == 10.5 and p["max_concurrent_requests"] == 3  # a, b, e overlap at 0.8 s
    none = vllm_metrics(results[3:4], [4], 1.0, tok, ["ttft"], [99.0], None)
    assert none["request_goodput"] is None and none["mean_ttft_ms"] == 0.0 and none["completed"] == 0  # vLLM's 0


# ---- the command against a server ------------------------------------------------------------------------------


def test_bench_random_prints_vllms_table_and_saves_its_keys(noop_server, tmp_path, capsys):
    url = noop_server("--reply", "hello world", "--chunks", "3")
    args = ["loadgen", "bench", "--base-url", url, "--tokenizer", "tiny-bd", "--dataset-name", "random",
            "--num-prompts", "40", "--request-rate", "20", "--random-input-len", "32", "--random-output-len", "16",
            "--goodput", "ttft:5000", "--save-result", "--result-dir", str(tmp_path / "res"), "--disable-tqdm"]
    assert main(args) == 0
    out = capsys.readouterr().out
    at = [out.index(line) for line in TABLE]
    assert at == sorted(at), out
    assert "Mean E2EL (ms):" not in out  # not among vLLM's default --percentile-metrics
    [file] = (tmp_path / "res").iterdir()
    assert file.name.startswith("openai-20.0qps-noop-") and file.suffix == ".json"
    res = json.loads(file.read_text())
    assert VLLM_KEYS <= set(res), VLLM_KEYS - set(res)
    assert (res["completed"], res["num_prompts"], res["request_rate"], res["model_id"]) == (40, 40, 20.0, "noop")
    assert res["input_lens"] == [32] * 40 and res["output_lens"] == [11] * 40  # the no-op's usage: its reply
    assert res["total_output_tokens"] == 440 and res["request_goodput"] == res["request_throughput"]
    assert 1.9 < res["duration"] < 4.0 and res["remask"]["ignore_eos"] is True  # vLLM's default for random
    assert res["remask"]["request_ids"][0] == "bench-0"
    assert httpx.get(url + "/noop/stats").json()["count"] == 41  # the initial test request, then 40


def test_bench_chat_remask_dataset_and_options(noop_server, tmp_path, capsys):
    url = noop_server("--reply", "4", "--chunks", "1")
    port = url.rsplit(":", 1)[1]
    assert main(["loadgen", "bench", "--port", port, "--backend", "openai-chat", "--dataset-name", "remask",
                 "--tokenizer", "tiny-bd", "--num-prompts", "6", "--max-concurrency", "2", "--disable-tqdm",
                 "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9", "--slo-ms", "5000",
                 "--save-result", "--result-filename", str(tmp_path / "r.json"), "--metadata", "run=a"]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "r.json").read_text())
    printed = {line[:40].strip(): line[40:].strip() for line in out.splitlines()}  # vLLM's "{:<40} {:<10}"
    assert printed["Maximum request concurrency:"] == "2" and printed["Successful requests:"] == "6"
    assert printed["P99.9 E2EL (ms):"] == f"{res['p99.9_e2el_ms']:.2f}" and "Mean TPOT (ms):" not in printed
    assert printed["Answer accuracy:"] == f"{res['remask']['accuracy']:.3f}"
    assert printed["SLO attainment:"] == f"{res['remask']['slo_attainment']:.3f}"
    assert "Request rate configured (RPS):" not in printed
    assert res["request_rate"] == "inf" and res["max_concurrency"] == 2 and res["run"] == "a"
    assert "p99.9_e2el_ms" in res and "p50_ttft_ms" in res and "mean_tpot_ms" not in res
    assert res["remask"]["slo_attainment"] == 1.0 and res["remask"]["accuracy"] is not None
    assert res["remask"]["ignore_eos"] is False and httpx.get(url + "/noop/stats").json()["max_inflight"] <= 2


def test_bench_jsonl_file_with_completion_and_chat_lines(noop_server, tmp_path, capsys):
    url = noop_server("--reply", "fine")
    lines = [{"prompt": "tell me", "max_tokens": 5}, {"messages": [{"role": "user", "content": "and you"}],
                                                     "max_tokens": 3}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    assert main(["loadgen", "bench", "--base-url", url, "--tokenizer", "tiny-bd", "--dataset-name", "jsonl",
                 "--dataset-path", str(tmp_path / "p.jsonl"), "--num-prompts", "4", "--custom-output-len", "-1",
                 "--disable-tqdm", "--save-result", "--result-filename", str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["completed"] == 4 and res["remask"]["ignore_eos"] is False  # a chat line went to the chat path
    assert res["input_lens"] == [7] * 4 and res["output_lens"] == [4] * 4  # the no-op's usage: its reply


def test_random_dataset_goes_without_ignore_eos_when_the_server_refuses_it(noop_server, capsys):
    url = noop_server("--refuse", "ignore_eos")
    base = ["loadgen", "bench", "--base-url", url, "--tokenizer", "tiny-bd", "--num-prompts", "4", "--disable-tqdm",
            "--random-input-len", "8"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "WARNING: the server refused ignore_eos" in out and "Successful requests:                     4 " in out
    assert main([*base, "--ignore-eos"]) == 2  # asked for by name: refused is an error, not a silent change
    assert "Unrecognized request argument supplied: ignore_eos" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--burstiness", "-1"], "--burstiness must be > 0"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics takes"),
    (["--metric-percentiles", "50,abc"], "--metric-percentiles takes numbers"),
    (["--metric-percentiles", "0"], "must lie in (0, 100]"),
    (["--goodput", "itl:5"], "--goodput takes"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio must lie in [0, 1)"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-path", "x.json"], "takes no --dataset-path"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "needs a chat endpoint"),
    (["--endpoint", "/v1/chat/completions"], "use --backend openai-chat"),
    (["--tokenizer", "no-such-tokenizer-xyz"], "not an embedded model, not a local directory"),
    (["--dataset-name", "jsonl", "--dataset-path", "{chat}", "--endpoint", "/v1/completions"], "has chat lines"),
])
def test_bad_flag_values_are_clear_errors(extra, message, capsys, tmp_path):
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    extra = [x.replace("{chat}", str(tmp_path / "chat.jsonl")) for x in extra]
    base = ["loadgen", "bench", "--port", "9", "--model", "m", "--tokenizer", "tiny-bd", "--num-prompts", "3"]
    assert main([*base, *extra]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_and_refused_requests_are_clear_errors(noop_server, capsys):
    assert main(["loadgen", "bench", "--port", "9", "--tokenizer", "tiny-bd", "--num-prompts", "2"]) == 2
    assert "none read from http://127.0.0.1:9/v1/models" in capsys.readouterr().err
    url = noop_server("--fail-every", "1", "--fail-status", "400")
    assert main(["loadgen", "bench", "--base-url", url, "--tokenizer", "tiny-bd", "--num-prompts", "2",
                 "--disable-tqdm"]) == 2
    assert "Initial test run failed" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: an unknown backend
        main(["loadgen", "bench", "--backend", "tgi"])


def test_random_lengths_fit_the_served_context_unless_given():
    from types import SimpleNamespace

    from loadgen.bench import random_lengths

    def fit(n_in, n_out, ctx):
        return random_lengths(SimpleNamespace(random_input_len=n_in, random_output_len=n_out), ctx)

    assert fit(None, None, None) == (1024, 128, None)  # vLLM's defaults where the server says no context
    assert fit(None, None, 4096) == (1024, 128, None)  # they fit
    n_in, n_out, note = fit(None, None, 512)  # tiny-bd: 512 tokens, a sixteenth left for template and padding
    assert (n_in, n_out) == (360, 120) and "--random-input-len 360" in note
    assert fit(None, 64, 512)[:2] == (416, 64)  # the output given: the input takes what is left
    assert fit(100, None, 512) == (100, 128, None)  # the input given and the default output fit
    assert fit(1024, 128, 512) == (1024, 128, None)  # both given: as given (the server refuses what does not fit)
