from __future__ import annotations

import json

import pytest
import torch

from engine.decoding import make_rule
from engine.device import parse_dtype
from engine.engine import Engine
from engine.loading import load_engine
from engine.models.flops import forward_flops
from engine.sequence import SamplingParams
from tasksuite import heldout_set
from tests.builders import make_model
from tools.bench_engine import bench_engine, format_report, measure_peak
from tools.cli import main
from tools.reference import fastdllm_generate, llada_generate

PRESET = "llada-8b-shape:layers=2,vocab=1024,hidden=128,heads=4,kv_heads=4,intermediate=256"


@pytest.fixture(scope="module")
def mdm():
    """tiny-mdm's model and tokenizer, and six held-out examples with their prompt ids."""
    engine = load_engine("tiny-mdm")
    examples = heldout_set(6, seed=7)
    ids = [engine.tokenizer.prompt_ids(e.prompt, engine.cfg.block_size) for e in examples]
    return engine.model, engine.tokenizer, examples, ids


@pytest.mark.slow
@pytest.mark.parametrize("steps", [3, 8])
def test_llada_loop_gives_the_engine_low_confidence_tokens(mdm, steps):
    model, tok, _, ids = mdm
    engine = Engine(model, tok, rule=make_rule("low_confidence", steps_per_block=steps), cache="none")
    outs = engine.generate(ids, SamplingParams(max_tokens=40))  # batched: padding must not change a token
    refs = [llada_generate(model, p, 40, steps_per_block=steps) for p in ids]
    assert [r.token_ids for r in refs] == [o.token_ids for o in outs]
    assert [r.forwards for r in refs] == [o.rounds for o in outs]
    assert [r.finish_reason for r in refs] == [o.finish_reason for o in outs]
    for p, r in zip(ids, refs):  # no cache: every forward covers prompt + the 40-token canvas
        assert r.flops == r.forwards * forward_flops(model.config, 1, len(p) + 40)


@pytest.mark.slow
def test_fastdllm_loop_is_the_engine_with_a_prefix_cache_and_needs_fewer_forwards(mdm):
    model, tok, examples, ids = mdm
    engine = Engine(model, tok, rule=make_rule("threshold", threshold=0.9), cache="prefix")
    outs = engine.generate(ids, SamplingParams(max_tokens=64))
    fast = [fastdllm_generate(model, p, 64, threshold=0.9) for p in ids]
    assert [r.token_ids for r in fast] == [o.token_ids for o in outs]
    assert [r.forwards for r in fast] == [o.rounds for o in outs]
    # complete answers: an EOS with nothing masked before it, or 64 tokens (the story), and most are right
    assert all(tok.mask_token_id not in r.token_ids for r in fast)
    assert [r.finish_reason for r in fast] == ["stop" if e.category != "prose" else "length" for e in examples]
    assert all(len(r.token_ids) == 64 for r in fast if r.finish_reason == "length")
    assert sum(e.check(tok.decode(r.token_ids)) for e, r in zip(examples, fast)) >= 3
    llada = [llada_generate(model, p, 64, steps_per_block=8) for p in ids]  # one token a step
    assert sum(r.forwards for r in fast) * 2 < sum(r.forwards for r in llada)
    for p, r in zip(ids, fast):  # cached steps are cheaper than full forwards
        full = forward_flops(model.config, 1, len(p) + 64)
        assert full <= r.flops < r.forwards * full or r.forwards == 1


def test_fastdllm_loop_at_threshold_one_commits_one_token_a_step(mdm):
    model, tok, _, ids = mdm
    for p in ids[:3]:
        r = fastdllm_generate(model, p, 32, threshold=1.0)  # no confidence exceeds 1: only the top one
        decoded = sum(t != tok.mask_token_id for t in r.canvas)
        assert r.forwards == decoded


def test_reference_loops_handle_shifted_logits():
    """Dream-style models (row p-1 predicts position p): both loops match the engine."""
    model = make_model(seed=3, attention="bidirectional", logits_shift=1)
    from engine.tokenizer import CharTokenizer

    tok = CharTokenizer.default()
    prompts = [[3] + tok.encode(s) + [4] for s in ("12+5=", "rev: abc", "max: a1 b7 c3 d2")]
    low = Engine(model, tok, rule=make_rule("low_confidence", steps_per_block=4), cache="none")
    outs = low.generate(prompts, SamplingParams(max_tokens=20))
    refs = [llada_generate(model, p, 20, steps_per_block=4) for p in prompts]
    assert [r.token_ids for r in refs] == [o.token_ids for o in outs]
    thr = Engine(model, tok, rule=make_rule("threshold", threshold=0.3), cache="prefix")
    outs = thr.generate(prompts, SamplingParams(max_tokens=20))
    refs = [fastdllm_generate(model, p, 20, threshold=0.3) for p in prompts]
    assert [r.token_ids for r in refs] == [o.token_ids for o in outs]
    assert [r.forwards for r in refs] == [o.rounds for o in outs]
    assert any(o.rounds > 2 for o in outs)  # cached steps ran (more than the one full forward a block)


def test_reference_loops_refuse_block_causal_models_and_bad_arguments():
    model = make_model()  # block-causal
    with pytest.raises(ValueError, match="bidirectional"):
        llada_generate(model, [3, 10, 11], 8)
    with pytest.raises(ValueError, match="bidirectional"):
        fastdllm_generate(model, [3, 10, 11], 8)
    bidi = make_model(attention="bidirectional")
    with pytest.raises(ValueError, match="threshold"):
        fastdllm_generate(bidi, [3, 10, 11], 8, threshold=1.5)
    with pytest.raises(ValueError, match="empty"):
        llada_generate(bidi, [], 8)
    with pytest.raises(ValueError, match="context"):
        llada_generate(bidi, [3, 10, 11], 1000)


def test_measure_peak_and_dtypes():
    assert measure_peak("cpu", "float32", size=128, repeats=2) > 1e6
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("int8")


@pytest.mark.slow
def test_bench_engine_on_a_tiny_preset():
    res = bench_engine(PRESET, requests=3, prompt_len=16, gen_length=32, threshold=0.9, steps_per_block=8)
    c = res["contenders"]
    assert set(c) == {"remask-batched", "remask-single", "fastdllm-loop", "llada-loop"}
    for r in c.values():
        assert r["requests"] == 3 and r["output_tokens"] > 0 and r["tokens_per_s"] > 0 and r["rounds_per_s"] > 0
        assert 0 < r["mfu"] < 5 and r["flops"] > 0 and r["mean_latency_s"] > 0
    cfg = load_engine(PRESET).cfg
    llada = c["llada-loop"]
    assert llada["flops"] == llada["forwards"] * forward_flops(cfg, 1, 16 + 32)
    # random weights: confidences near 1/vocab, so the threshold rule commits one token a step
    assert c["fastdllm-loop"]["rounds"] == c["fastdllm-loop"]["output_tokens"] == 3 * 32
    best = max(c["fastdllm-loop"]["tokens_per_s"], c["llada-loop"]["tokens_per_s"])
    assert res["batched_vs_best_loop_throughput"] == pytest.approx(c["remask-batched"]["tokens_per_s"] / best)
    assert res["single_vs_fastdllm_latency"] == pytest.approx(
        c["remask-single"]["mean_latency_s"] / c["fastdllm-loop"]["mean_latency_s"])
    assert isinstance(res["targets"]["batched_throughput_met"], bool)
    assert res["peak_flops_per_s"] > 0 and res["prompt_tokens_mean"] == 16


def test_cli_bench_engine_json(capsys):
    assert main(["bench", "engine", "--model", "tiny-mdm", "--requests", "2", "--gen-length", "16",
                 "--steps-per-block", "4", "--quiet", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["requests"] == 2 and res["gen_length"] == 16 and res["steps_per_block"] == 4
    assert set(res["contenders"]) == {"remask-batched", "remask-single", "fastdllm-loop", "llada-loop"}
    assert "accuracy" in res["contenders"]["llada-loop"]
    table = format_report(res)
    assert all(name in table for name in res["contenders"]) and "target >= 10x" in table
    assert res["cuda_graphs"] is None and "CUDA graphs" not in table  # a CPU engine has none
    res["cuda_graphs"] = {"captures": 3, "replays": 40, "rounds": 50, "failed": None}
    assert "3 captured, 40 forwards replayed over 50 rounds" in format_report(res)


@pytest.mark.parametrize("argv", [["--model", "tiny-bd"], ["--model", "sdar-8b-shape"], ["--dtype", "int3"],
                                  ["--model", "no-such-model"], ["--requests", "0"]])
def test_cli_bench_engine_bad_input_exits_2(capsys, argv):
    assert main(["bench", "engine", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remask: error:")
