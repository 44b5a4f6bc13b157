"""CUDA graphs of small pooled forwards (engine/graphs.py). On a CPU the graphs are emulated: the same
static buffers (inputs copied in, keys rounded up and masked past the round's span) run eagerly, so
everything but the capture itself is checked here; the GPU tests capture and replay for real."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.graphs import ForwardGraphs
from engine.kv_cache import KVPool
from engine.sequence import SamplingParams, StepInput, StepKind
from tests.builders import make_model

PROMPTS = ["max: a1 b7 c3 d2", "12+5=", "rev: abcdef", "story: cat 3 and some more words here", "a", "9-4="]


def _engines(tok, attention, cache, **graphs):
    model = make_model(attention=attention)
    plain = Engine(model, tok, cache=cache, max_slots=4, kv_slot_tokens=80, cuda_graphs=False)
    graphed = Engine(model, tok, cache=cache, max_slots=4, kv_slot_tokens=80, cuda_graphs=False)
    graphed.runner.graphs = ForwardGraphs(graphed.runner.forward, "cpu", emulate=True, **graphs)
    for e in (plain, graphed):  # never-written pool positions hold large finite values: they must stay masked
        e.runner.pool.kv.fill_(1e3)
    return plain, graphed


@pytest.mark.parametrize("attention,cache", [("block_causal", "dual"), ("bidirectional", "dual"),
                                             ("bidirectional", "prefix")])
def test_graphed_engine_decodes_exactly_the_eager_tokens(tok, attention, cache):
    plain, graphed = _engines(tok, attention, cache, span_step=16)
    params = SamplingParams(max_tokens=40, threshold=0.5)
    ref = plain.generate(PROMPTS, params)
    one = [plain.generate([p], params)[0] for p in PROMPTS[:3]]
    out = graphed.generate(PROMPTS, params)
    alone = [graphed.generate([p], params)[0] for p in PROMPTS[:3]]  # one request: slot 0, a row
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.token_ids for o in alone] == [o.token_ids for o in one]
    g = graphed.runner.graphs
    assert g.replays > 0 and 0 < g.captures <= len(g.seen)
    assert graphed.runner.forwards == plain.runner.forwards  # replays are forwards like the eager ones


def test_shapes_are_captured_when_met_again_and_keys_round_up(tok):
    model = make_model(attention="bidirectional")
    cfg = model.config
    engine = Engine(model, tok, max_slots=4, kv_slot_tokens=80, cuda_graphs=False)
    runner = engine.runner
    graphs = runner.graphs = ForwardGraphs(runner.forward, "cpu", emulate=True, span_step=32)
    pool: KVPool = runner.pool
    pool.kv.normal_()

    def step(ctx: int, tokens: int = 8) -> StepInput:
        ids = torch.randint(2, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(ctx))
        return StepInput(StepKind.DENOISE, ids, torch.arange(ctx, ctx + tokens), pool.kv[:, :, 0, :, :ctx],
                         torch.arange(ctx), cfg.attention, 0)

    with torch.inference_mode():
        batch = runner.prepare([step(20)])
        assert graphs.takes(batch) and graphs.key(batch)[2:] == (1, 8, 32)  # span 28 -> 32 keys
        assert graphs.forward(batch) is None and graphs.captures == 0  # first sight: eager
        for ctx in (20, 24, 10):  # spans 28, 32 and 18 share the 32-key graph
            batch = runner.prepare([step(ctx)])
            want = runner.forward(runner.prepare([step(ctx)]))
            torch.testing.assert_close(graphs.forward(batch), want)
        assert graphs.captures == 1 and graphs.replays == 3
        graphs.max_tokens = 7
        assert not graphs.takes(runner.prepare([step(20)]))
        runner.pool = None  # a forward that copies its contexts is never a graph's
        assert not ForwardGraphs(runner.forward, "cpu", emulate=True).takes(runner.prepare([step(20)]))


def test_least_recently_used_graph_is_dropped(tok):
    plain, graphed = _engines(tok, "block_causal", "dual", span_step=8, max_graphs=2)
    params = SamplingParams(max_tokens=40, threshold=0.5)
    assert [o.token_ids for o in graphed.generate(PROMPTS, params)] == \
           [o.token_ids for o in plain.generate(PROMPTS, params)]
    g = graphed.runner.graphs
    assert len(g.graphs) <= 2 and g.captures > 2


def test_graph_options_are_checked(tok):
    model = make_model()
    with pytest.raises(ValueError, match="CUDA device"):
        Engine(model, tok, max_slots=2, cuda_graphs=True)
    with pytest.raises(ValueError, match="KV pool"):
        Engine(model, tok, max_slots=2, kv_slots=0, cuda_graphs=True)
    engine = Engine(model, tok, max_slots=2)
    assert engine.runner.graphs is None  # off by default on a CPU
    with pytest.raises(ValueError, match="positive"):
        ForwardGraphs(engine.runner.forward, "cpu", span_step=0, emulate=True)


def test_a_failed_capture_turns_graphs_off_and_the_round_runs_eagerly(tok, caplog):
    plain, graphed = _engines(tok, "bidirectional", "dual")
    g = graphed.runner.graphs

    def broken(key, batch):
        raise RuntimeError("operation not permitted when stream is capturing")

    g._build = broken
    params = SamplingParams(max_tokens=40, threshold=0.5)
    assert [o.token_ids for o in graphed.generate(PROMPTS, params)] == \
           [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert g.failed.startswith("RuntimeError") and g.replays == 0 and "graphs are off" in caplog.text
    # not only logged: the instance's stats (its /debug/instances entry) and the service's /metrics count it
    from app.metrics import Metrics
    from engine.instance import Instance
    from engine.loop import RoundLoop

    loop = RoundLoop(Instance(graphed, slots=4), lambda batch: None)
    try:
        stats = loop.stats()
    finally:
        loop.stop()
    assert stats["cuda_graph_capture_failures"] == 1 and "not permitted" in stats["cuda_graphs_off"]
    assert stats["cuda_graph_captures"] == g.captures and stats["cuda_graph_replays"] == 0
    metrics = Metrics("m")
    metrics.set_cluster([stats, {"running": 0}], kv_capacity_tokens=1)
    text = metrics.render()[0].decode()
    assert 'remask:cuda_graph_capture_failures{model_name="m"} 1.0' in text
    assert 'remask:cuda_graphs_off_instances{model_name="m"} 1.0' in text


def test_profile_skips_the_rounds_that_meet_or_capture_a_graph(tok, monkeypatch):
    import engine.profiling as profiling

    model = make_model(attention="block_causal")
    engine = Engine(model, tok, max_slots=2, kv_slot_tokens=200, cuda_graphs=False)
    graphs = engine.runner.graphs = ForwardGraphs(engine.runner.forward, "cpu", emulate=True)
    steady = []
    timed = profiling._timed_step

    def spy(e, seqs):  # a round that met or captured a shape reads as 1e6 ms: the profile must drop it
        before = (graphs.captures, len(graphs.seen))
        ms, comp = timed(e, seqs)
        steady.append(before == (graphs.captures, len(graphs.seen)))
        return (ms if steady[-1] else 1e6), comp

    monkeypatch.setattr(profiling, "_timed_step", spy)
    prof = profiling.profile_engine(engine, "t", batch_sizes=(1, 2), rounds=4, prompt_lens=(20,), max_tokens=40)
    assert prof.meta["cuda_graphs"] and graphs.replays > 0 and not all(steady)
    assert prof.curves["denoise"] and all(ms < 1e6 for curve in prof.curves.values() for _, ms in curve)


def test_profile_check_reports_the_rounds_without_warming_apart(tok):
    from engine.profiling import check_profile, profile_engine

    model = make_model(attention="block_causal")
    engine = Engine(model, tok, max_slots=4, kv_slot_tokens=200, cuda_graphs=False)
    prof = profile_engine(engine, "t", batch_sizes=(1, 4), rounds=3, prompt_lens=(20,))
    assert "steady" not in check_profile(engine, prof, requests=6, slots=4)
    graphs = engine.runner.graphs = ForwardGraphs(engine.runner.forward, "cpu", emulate=True)
    res = check_profile(engine, prof, requests=8, slots=4)
    assert graphs.captures > 0 and graphs.replays > 0
    # a round may meet or capture several shapes (one per forward)
    assert res["rounds"] - graphs.captures - len(graphs.seen) <= res["steady"]["rounds"] == \
           res["rounds"] - res["warming_rounds"] < res["rounds"]
    assert res["steady"]["measured_s"] < res["measured_s"]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-bd", "tiny-mdm"])
def test_cuda_graphs_decode_exactly_the_eager_tokens(model):
    """Trained models (confident, well separated choices) in float32, so that the graphs' masked
    attention kernel and the eager forward's unmasked one pick the same tokens."""
    from engine.loading import load_engine

    prompts = ["12+5=", "rev: abcdef", "max: a1 b7 c3 d2", "story: cat 3"]
    params = SamplingParams(max_tokens=48)
    outs = {}
    for graphs in (False, True):
        engine = load_engine(model, device="cuda", max_slots=4, cuda_graphs=graphs)
        outs[graphs] = ([o.token_ids for o in engine.generate(prompts, params)]
                        + [engine.generate([p], params)[0].token_ids for p in prompts])
        if graphs:
            assert engine.runner.graphs.replays > 0
    assert outs[True] == outs[False]


def test_graphed_rounds_pad_their_rows_to_a_power_of_two(tok):
    """The scheduler's batch changes size from round to round; a graphed forward over the pool is padded with
    filler rows to the next power of two (within max_tokens), so 5, 6 or 7 requests replay the graph of 8
    rows, with the very tokens of the eager rounds."""
    model = make_model(attention="block_causal")
    plain = Engine(model, tok, max_slots=8, kv_slot_tokens=80, cuda_graphs=False)
    graphed = Engine(model, tok, max_slots=8, kv_slot_tokens=80, cuda_graphs=False)
    graphed.runner.graphs = g = ForwardGraphs(graphed.runner.forward, "cpu", emulate=True, span_step=16)
    prompts = [*PROMPTS, "7*6=", "dog 3 and a cat"]  # 8 requests, finishing at different rounds
    params = [SamplingParams(max_tokens=8 * (1 + k % 4), threshold=0.5) for k in range(len(prompts))]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == \
           [o.token_ids for o in plain.generate(prompts, params)]
    rows = {key[2] for key in g.seen}
    assert rows and all(r & (r - 1) == 0 for r in rows), rows  # every shape met has 1, 2, 4 or 8 rows
    assert g.rows_bucket(5, 8) == 8 and g.rows_bucket(3, 200) == 3  # past max_tokens: not padded
