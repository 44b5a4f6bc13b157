from __future__ import annotations

import pytest
import torch

from engine.decoding import DynamicRule, LowConfidenceRule, ThresholdRule, make_rule
from engine.engine import Engine
from engine.models.masks import full_mask
from engine.sequence import SamplingParams, StepKind
from tests.builders import make_model

PROMPTS = ["max: a1 b7 c3 d2", "12+5=", "rev: abcdef", "story: cat 3 and some more words here"]


def full_logits(model, tokens: torch.Tensor, mode: str) -> torch.Tensor:
    t = len(tokens)
    pos = torch.arange(t)[None]
    mask = full_mask(mode, pos, torch.ones(1, t, dtype=torch.bool), model.config.block_size)
    with torch.no_grad():
        return model(tokens[None], pos, mask)[0][0]


def drive(engine: Engine, seq, check) -> None:
    """Step one sequence through the engine's runner, checking each step's logits."""
    engine._ensure_cache(seq)
    while not seq.finished:
        inp = seq.build_step()
        out = engine.runner.run([inp])[0]
        check(seq, inp, out)
        seq.apply(inp, out.logits, out.fresh)


def test_block_causal_cache_matches_full_recompute(tok):
    model = make_model()
    engine = Engine(model, tok)
    seq = engine.add_request("abc", SamplingParams(max_tokens=24, threshold=0.3))
    kinds = []

    def check(seq, inp, out):
        kinds.append(inp.kind)
        end = int(inp.pos[-1]) + 1
        ref = full_logits(model, seq.tokens[:end], "block_causal")[int(inp.pos[0]) : end]
        torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)

    drive(engine, seq, check)
    assert kinds[0] is StepKind.PREFILL
    assert all(k is StepKind.DENOISE for k in kinds[1:])
    assert seq.rounds == len(kinds) - 1


def test_partial_prompt_block_joins_first_output_block(tok):
    model = make_model()
    engine = Engine(model, tok)
    seq = engine.add_request(list(range(10, 21)), SamplingParams(max_tokens=16, threshold=0.5))  # 11 tokens
    assert seq.prefill_blocks == 1 and seq.blocks[0] == (11, 16)

    def check(seq, inp, out):
        end = int(inp.pos[-1]) + 1
        ref = full_logits(model, seq.tokens[:end], "block_causal")[int(inp.pos[0]) : end]
        torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)

    drive(engine, seq, check)


@pytest.mark.parametrize("shift", [0, 1])
def test_dual_cache_is_exact_for_one_layer(tok, shift):
    # With one layer, K/V of a position depend on its token alone, so the dual
    # cache is exact: a cached step must equal a full recompute.
    model = make_model(attention="bidirectional", num_layers=1, logits_shift=shift)
    engine = Engine(model, tok, cache="dual")
    seq = engine.add_request("hello", SamplingParams(max_tokens=24, threshold=0.2))
    kinds = []

    def check(seq, inp, out):
        kinds.append(inp.kind)
        ref = full_logits(model, seq.tokens, "bidirectional")[inp.pos]
        torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)

    drive(engine, seq, check)
    assert kinds[0] is StepKind.RECOMPUTE and StepKind.CACHED in kinds


def test_prefix_cache_ignores_the_suffix(tok):
    model = make_model(attention="bidirectional", num_layers=1)
    engine = Engine(model, tok, cache="prefix")
    seq = engine.add_request("hello", SamplingParams(max_tokens=24, threshold=0.99))

    def check(seq, inp, out):
        if inp.kind is StepKind.CACHED:
            end = int(inp.pos[-1]) + 1
            ref = full_logits(model, seq.tokens[:end], "bidirectional")[inp.pos]
            torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)

    drive(engine, seq, check)


def test_no_cache_recomputes_every_step(tok):
    engine = Engine(make_model(attention="bidirectional"), tok, cache="none")
    out = engine.generate(["hi"], SamplingParams(max_tokens=16, threshold=0.95))[0]
    assert set(out.steps) == {"recompute"} and out.rounds == len(out.steps)


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_batched_equals_one_at_a_time(tok, attention):
    model = make_model(attention=attention)
    params = [SamplingParams(max_tokens=8 * (i + 1), threshold=0.6) for i in range(len(PROMPTS))]
    alone = [Engine(model, tok).generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    together = Engine(model, tok, max_slots=8).generate(PROMPTS, params)
    for a, b in zip(alone, together):
        assert (a.token_ids, a.rounds, a.steps) == (b.token_ids, b.rounds, b.steps)


def test_lower_threshold_needs_fewer_rounds(tok):
    engine = Engine(make_model(), tok)
    hi = engine.generate(PROMPTS, SamplingParams(max_tokens=32, threshold=0.99))
    lo = engine.generate(PROMPTS, SamplingParams(max_tokens=32, threshold=0.0))
    assert sum(o.rounds for o in lo) < sum(o.rounds for o in hi)
    # threshold 0 commits a whole block per round
    assert all(o.rounds <= 4 for o in lo)


def test_threshold_can_change_between_steps(tok):
    engine = Engine(make_model(), tok)
    seq = engine.add_request("abc", SamplingParams(max_tokens=32, threshold=0.99))
    committed = []
    while not seq.finished:
        result = engine.step([seq])
        committed.append(result.reports[0].committed)
        seq.threshold = 0.0  # from now on, whole blocks at once
    assert committed[0] == 0  # the prefill step
    # after the first denoising step at 0.99, each step finishes a whole block
    assert committed[2] == 8 - committed[1] or committed[1] == 8
    assert all(c == 8 for c in committed[3:-1])


def test_finish_reasons(tok):
    eng = Engine(make_model(), tok)
    out = eng.generate(["x"], SamplingParams(max_tokens=5, threshold=0.0))[0]
    assert out.finish_reason in ("stop", "length")
    assert len(out.token_ids) <= 5
    seq = eng.add_request("abc", SamplingParams(max_tokens=16, threshold=0.0))
    while not seq.finished:
        eng.step([seq])
    canvas = seq.canvas()
    if tok.eos_token_id in canvas[:16]:
        assert seq.finish_reason == "stop" and seq.output_ids() == canvas[: canvas.index(tok.eos_token_id)]
    else:
        assert seq.finish_reason == "length"


def test_bad_params_raise(tok):
    eng = Engine(make_model(), tok)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("a", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="threshold"):
        eng.add_request("a", SamplingParams(threshold=1.5))
    with pytest.raises(ValueError, match="context"):
        eng.add_request("a" * 600, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="unknown unmasking rule"):
        make_rule("nope")


def test_rules():
    conf = torch.tensor([0.95, 0.2, 0.91, 0.5])
    assert ThresholdRule(0.9).select(conf, 0, 4).tolist() == [True, False, True, False]
    assert ThresholdRule(0.99).select(conf, 0, 4).tolist() == [True, False, False, False]
    assert ThresholdRule(0.9).select(conf, 0, 4, threshold=0.4).tolist() == [True, False, True, True]
    assert DynamicRule(0.99, min_per_step=2).select(conf, 0, 4).sum() == 2
    rule = LowConfidenceRule(steps_per_block=3)
    assert [rule.quota(i, 8) for i in range(3)] == [3, 3, 2]
    assert rule.select(conf, 0, 8).tolist() == [True, False, True, True]
    assert rule.select(conf, 2, 8).all()
    with pytest.raises(ValueError):
        ThresholdRule(2.0)


def test_mask_token_is_never_committed(tok):
    model = make_model()
    head = model.lm_head

    class PrefersMask(torch.nn.Module):
        def forward(self, h):
            logits = head(h)
            logits[..., tok.mask_token_id] += 100.0
            return logits

    model.lm_head = PrefersMask()
    out = Engine(model, tok).generate(["abc"], SamplingParams(max_tokens=16, threshold=0.9))[0]
    assert tok.mask_token_id not in out.token_ids and out.rounds <= 16
