"""Sampling (temperature, top-k, top-p, seeded Gumbel noise) and stop token ids (issue 23, items 5 and 6)."""

from __future__ import annotations

import pytest
import torch

from engine import runner as runner_module
from engine.decoding import filter_logits, gumbel_noise, noise_seeds, sample
from engine.engine import Engine
from engine.instance import Follower, Instance
from engine.loading import load_engine
from engine.sequence import SamplingParams
from tasksuite import heldout_set

PROMPTS = [e.prompt for e in heldout_set(8)]
STORIES = [e.prompt for e in heldout_set(16) if e.prompt.startswith("story:")]  # long answers: many rounds
MODELS = ["tiny-bd", "tiny-mdm"]  # block-causal (exact cache), full sequence (approximate cache)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=48, **kw)


def sampled(seed: int = 7, temperature: float = 2.0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=temperature, seed=seed, **kw)


def ids(engine: Engine, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(list(prompts), params)]


# ---- the sampling function -------------------------------------------------------------------------


def frequencies(logits: torch.Tensor, n: int = 2000, **kw) -> torch.Tensor:
    """How often each token of a 1-row ``logits`` is drawn over ``n`` seeds."""
    seeds = [noise_seeds(s, [5])[0] for s in range(n)]
    _, tok = sample(logits.expand(n, -1), seeds=seeds, **kw)
    return torch.bincount(tok, minlength=logits.shape[-1]).double() / n


def test_gumbel_max_frequencies_match_the_tempered_softmax():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for t in (1.0, 2.0, 0.5):
        want = torch.softmax(logits[0].double() / t, -1)
        got = frequencies(logits, temperature=t, top_k=0, top_p=1.0)
        assert (got - want).abs().max() < 0.04, (t, got, want)


def test_top_k_and_top_p_never_choose_outside_their_set():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))  # ranked: 1, 3, 2, 0
    got = frequencies(logits, temperature=1.0, top_k=2, top_p=1.0)
    assert got[0] == 0 and got[2] == 0
    assert abs(got[1] - 0.5 / 0.8) < 0.04
    # nucleus: the fewest most likely tokens reaching top_p (0.5 + 0.3 >= 0.7 and >= 0.8; 0.81 needs token 2)
    for p, kept in ((0.7, {1, 3}), (0.8, {1, 3}), (0.81, {1, 2, 3}), (0.3, {1})):
        got = frequencies(logits, temperature=1.0, top_k=0, top_p=p)
        assert {i for i in range(4) if got[i] > 0} == kept, (p, got)
    got = frequencies(logits, temperature=1.0, top_k=0, top_p=0.7)
    assert abs(got[1] - 0.5 / 0.8) < 0.04
    # top-k first, then the nucleus of what is left: top_k=3 keeps {1, 3, 2}; top_p=0.9 of that needs all three
    got = frequencies(logits, temperature=3.0, top_k=3, top_p=0.9)
    assert got[0] == 0 and got[2] > 0
    # the filter on its own, per row: row 0 top-1, row 1 off
    scores = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    out = filter_logits(scores, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isinf(out[0]).tolist() == [True, False, True] and torch.equal(out[1], scores[1])


def test_sample_excludes_the_mask_token_and_reports_the_model_probability():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5]])
    seeds = [noise_seeds(s, [0])[0] for s in range(500)]
    conf, tok = sample(logits.expand(500, -1), 1.5, 0, 1.0, seeds, mask_token_id=1)
    assert not (tok == 1).any()
    probs = torch.softmax(torch.tensor([0.0, float("-inf"), 1.0, 0.5]), -1)  # untempered, unfiltered, mask out
    torch.testing.assert_close(conf, probs[tok])
    # top_k=1 at any temperature: the argmax and its confidence, as ``confidence`` gives them
    for t in (0.1, 1.0, 10.0):
        c, k = sample(logits, t, 1, 1.0, seeds[:1], mask_token_id=1)
        assert k.item() == 2 and c.item() == pytest.approx(probs[2].item())


def test_noise_depends_only_on_seed_and_position():
    a = noise_seeds(3, [10, 11, 12])
    assert a == noise_seeds(3, torch.tensor([10, 11, 12])) == [*noise_seeds(3, [10, 11]), *noise_seeds(3, [12])]
    assert len(set(a + noise_seeds(4, [10, 11, 12]))) == 6
    g = gumbel_noise(a, 64)
    assert torch.equal(g[1], gumbel_noise([a[1]], 64)[0]) and not torch.equal(g[0], g[1])


# ---- engine: greedy unchanged, seeded sampling reproducible ------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_temperature_zero_is_the_greedy_path(name, monkeypatch):
    engine = load_engine(name, max_slots=8)
    want = engine.generate(PROMPTS, greedy())

    def no_sampling(*a, **kw):
        raise AssertionError("a greedy round sampled")

    monkeypatch.setattr(runner_module, "sample", no_sampling)
    got = engine.generate(PROMPTS, greedy(temperature=0.0, top_k=3, top_p=0.5, seed=1))
    assert [(o.token_ids, o.rounds, o.finish_reason) for o in got] == \
        [(o.token_ids, o.rounds, o.finish_reason) for o in want]


@pytest.mark.parametrize("name", MODELS)
def test_seeded_sampling_is_the_same_alone_and_in_any_batch(name):
    engine = load_engine(name, max_slots=8)
    # six different requests: sampled with their own seeds and filters, and greedy ones
    params = [sampled(seed=11, temperature=1.0), sampled(seed=12, temperature=1.0, top_k=5), greedy(),
              sampled(seed=13, temperature=1.0, top_p=0.9), greedy(threshold=0.5), sampled(seed=11, temperature=1.0)]
    prompts = PROMPTS[:6]
    alone = [ids(engine, [p], sp)[0] for p, sp in zip(prompts, params)]
    assert ids(engine, prompts, params) == alone
    assert ids(engine, prompts[::-1], params[::-1]) == alone[::-1]  # other rows, other forwards' order
    # sampling changes something, and different seeds or temperatures change it differently
    base = ids(engine, PROMPTS, greedy())
    one = ids(engine, PROMPTS, sampled(seed=1, temperature=1.0))
    assert one != base
    assert ids(engine, PROMPTS, sampled(seed=1, temperature=1.0)) == one
    assert ids(engine, PROMPTS, sampled(seed=2, temperature=1.0)) != one
    assert ids(engine, PROMPTS, sampled(seed=1, temperature=3.0)) != one


@pytest.mark.parametrize("name", MODELS)
def test_top_k_one_is_greedy_at_any_temperature(name):
    engine = load_engine(name, max_slots=8)
    want = ids(engine, PROMPTS, greedy())
    for t in (0.5, 1.0, 4.0):
        assert ids(engine, PROMPTS, sampled(seed=5, temperature=t, top_k=1)) == want


@pytest.mark.parametrize("name", MODELS)
def test_apply_from_logits_samples_as_the_runner_does(name):
    """``Sequence.apply`` without the runner's top1 (computing from the step's logits) samples the same
    tokens: one sampling rule, one noise."""
    engine = load_engine(name, max_slots=2)
    params = sampled(seed=9, temperature=2.0)
    want = ids(engine, STORIES[:1], params)[0]
    seq = engine.add_request(STORIES[0], params)
    engine._ensure_cache(seq)
    while not seq.finished:
        inp = seq.build_step()
        out = engine.runner.run([inp])[0]
        seq.apply(inp, out.logits, out.fresh)
    assert seq.output_ids() == want != ids(engine, STORIES[:1], greedy())[0]


def test_a_request_without_a_seed_draws_one_and_followers_get_it():
    """An unseeded sampling request gets one random seed, kept on its sequence; a tensor-parallel
    instance sends it to its followers, which sample the same tokens."""
    follower = Follower(load_engine("tiny-bd", max_slots=4))

    def mirror(commands, plan):
        follower.step(commands, plan)
        return lambda: None

    engine = load_engine("tiny-bd", max_slots=4)
    inst = Instance(engine, slots=4, mirror=mirror)
    free = SamplingParams(max_tokens=48, temperature=3.0)
    for i, p in enumerate(PROMPTS[:4]):
        inst.add_request(f"r{i}", p, free)
    seqs = dict(inst.seqs)
    assert free.seed is None and len({s.params.seed for s in seqs.values()}) == 4
    canvases = {}
    while inst.has_work():
        inst.step()
        for rid, seq in follower.seqs.items():
            assert seq.params.seed == seqs[rid].params.seed
            canvases[rid] = seq
    assert canvases.keys() == seqs.keys()
    for rid, seq in seqs.items():
        assert canvases[rid].canvas() == seq.canvas()
    again = load_engine("tiny-bd", max_slots=4)
    for rid, seq in seqs.items():  # the seed reproduces the request
        out = again.generate([seq.prompt_ids], SamplingParams(max_tokens=48, temperature=3.0, seed=seq.params.seed))
        assert out[0].token_ids == inst.outputs[rid].token_ids


# ---- resume ------------------------------------------------------------------------------------


def interrupted(name: str, prompt: str, params: SamplingParams, rounds: int, **kw):
    """Run ``prompt`` round by round (one run: a run stopped after k rounds is this run's first k): after each
    of the first ``rounds`` rounds that leave it unfinished, its committed output, whether tokens were committed
    past the first mask (output_ids drops them) and whether it stands on a block boundary."""
    engine = load_engine(name, max_slots=4, **kw)
    seq = engine.add_request(prompt, params)
    for _ in range(rounds):
        engine.step()
        if seq.finished:
            return
        done = list(seq.output_ids())
        rest = seq.canvas()[len(done):]
        lost = any(t != engine.cfg.mask_token_id for t in rest)
        yield done, lost, not lost and seq.out_start + len(done) == seq.blocks[seq.block_idx][0]


def resumed(name: str, prompt: str, params: SamplingParams, committed: list[int], **kw) -> list[int]:
    engine = load_engine(name, max_slots=4, **kw)
    seq = engine.add_request(prompt, params, committed=committed)
    while not seq.finished:
        engine.step()
    return engine.output(seq).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("name,cache,where", [
    ("tiny-bd", "dual", "any"),  # exact cache: any round whose committed tokens are all kept
    ("tiny-mdm", "none", "any"),  # no cache: the canvas is the whole state
    ("tiny-mdm", "dual", "boundary"),  # approximate cache: only where the uninterrupted run recomputes too
    ("tiny-mdm", "prefix", "boundary"),
])
def test_resume_on_a_new_engine_gives_the_uninterrupted_tokens(name, cache, where):
    """A request stopped after k rounds and re-added elsewhere with ``committed=output_ids()`` and the
    same params ends with the uninterrupted run's tokens: greedy, and sampled (the noise of a position
    depends only on (seed, position)), wherever the resumed canvas and cache are what the uninterrupted
    run had: for a block-causal model (exact cache) and a full-sequence model without a cache at any
    round where nothing was committed past the first mask; for a full-sequence model with an
    approximate cache at block boundaries. (Elsewhere the resumed request re-decodes from another
    canvas or cache, as a greedy one does: tokens may differ.)"""
    assert len(STORIES) >= 2
    base = ids(load_engine(name, max_slots=8, cache=cache), STORIES[:2], greedy())
    hot = ids(load_engine(name, max_slots=8, cache=cache), STORIES[:2], sampled())
    assert base[0] != hot[0] and base[1] != hot[1], "sampling changed nothing: the test would not test it"
    checked = {"mid": 0, "boundary": 0}
    for prompt, params in [(STORIES[0], sampled()), (STORIES[1], sampled()), (STORIES[0], greedy())]:
        want = ids(load_engine(name, max_slots=4, cache=cache), [prompt], params)[0]
        for k, (done, lost, boundary) in enumerate(interrupted(name, prompt, params, 39, cache=cache), 1):
            if not done or lost or (where == "boundary" and not boundary) or len(done) >= params.max_tokens:
                continue
            assert resumed(name, prompt, params, done, cache=cache) == want, (prompt, params, k)
            checked["boundary" if boundary else "mid"] += 1
    assert checked["boundary"] >= 6 and (where == "boundary" or checked["mid"] >= 2), checked


# ---- stop token ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_stop_token_ids_end_the_output_like_eos(name):
    engine = load_engine(name, max_slots=8)
    outs = engine.generate(PROMPTS, greedy())
    prompt, out = next((p, o) for p, o in zip(PROMPTS, outs) if len(o.token_ids) >= 6)
    stop = out.token_ids[4]
    cut = out.token_ids.index(stop)
    got = engine.generate([prompt], greedy(stop_token_ids=[stop]))[0]
    assert got.token_ids == out.token_ids[:cut] and got.finish_reason == "stop"
    # partial outputs end before a stop id as before EOS
    seq = engine.add_request(prompt, greedy(stop_token_ids=(stop,)))
    while not seq.finished:
        assert stop not in seq.output_ids()
        engine.step()
    # a sampled request stops too; and the engine's own stop ids (its tokenizer's) apply to every request
    hot = engine.generate([prompt], sampled(temperature=1.0))[0].token_ids
    stop = hot[len(hot) // 2]
    assert engine.generate([prompt], sampled(temperature=1.0, stop_token_ids=(stop,)))[0].token_ids == \
        hot[: hot.index(stop)]
    tokenizer = load_engine(name).tokenizer  # a checkpoint's adapter has its EOS ids and end-of-turn token here
    tokenizer.stop_ids = (out.token_ids[4],)
    other = Engine(engine.model, tokenizer, max_slots=8)
    assert other.stop_ids == (out.token_ids[4],)
    got = other.generate([prompt], greedy())[0]
    assert got.token_ids == out.token_ids[:cut] and got.finish_reason == "stop"


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=-1.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(seed=1.5), "seed"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
])
def test_bad_sampling_params_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate(1024)
    engine = load_engine("tiny-bd", max_slots=2)
    with pytest.raises(ValueError, match=match):
        engine.add_request("12+5=", SamplingParams(**kw))


def test_good_sampling_params_and_stop_ids_the_model_cannot_emit():
    for kw in (dict(temperature=0.7, top_p=0.9, top_k=-1, seed=-5), dict(top_k=0), dict(top_k=1, top_p=1.0)):
        SamplingParams(**kw).validate(1024)
    engine = load_engine("tiny-bd", max_slots=2)
    for bad in (engine.cfg.vocab_size, engine.cfg.mask_token_id):
        with pytest.raises(ValueError, match="stop_token_ids"):
            engine.add_request("12+5=", SamplingParams(stop_token_ids=[bad]))
    assert engine.add_request("12+5=", SamplingParams(stop_token_ids=[5, 6])).stop_ids == (5, 6)
