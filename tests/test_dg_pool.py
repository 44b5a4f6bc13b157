"""DiffusionGemma's K/V pool (engine/models/diffusion_gemma.py ``DGPool``) and its decoder's CUDA graphs
(engine/dg_graphs.py, emulated on a CPU), on tests/dg_builders.py's shrunk random model (sliding window 8, canvases
of 32, full and sliding layers of their own shapes):

- encoder passes into the pool keep what the caches' own tensors keep, bit for bit (prompts past the window,
  several requests of different lengths in one forward), and the decoder reading the pool by index gives the
  padded copy's logits bit for bit;
- the emulated graph gives the eager pooled step's bits (fillers, keys rounded up), captured when a shape is met
  again; a graphed engine answers as its eager steps do;
- a request's pages and its one ring (however many pages it holds) go back when it finishes, is aborted or its
  cache is dropped; an exhausted pool (no page or no ring free) gives a cache its own tensors (counted), never
  another request's; the instance scheduler reserves whole pages and caps its residents at the rings (more
  requests than rings wait); a budget buys a ring per resident and pages with the rest;
- served text is the same with the pool on and off; tensor-parallel ranks over their pools give TP-1's text;
  the CUDA layouts' emulation passes over the pool.
"""

from __future__ import annotations

import pytest
import torch

from engine.canvas import CanvasEngine, CanvasParams
from engine.dg_graphs import DecodeGraphs
from engine.models import diffusion_gemma as dg
from engine.tokenizer import CharTokenizer
from tests.dg_builders import ThreadAllReduce, random_dg, run_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer.default()


@pytest.fixture(scope="module")
def model(tok):
    return random_dg(tok)


def _pool(model, slots: int = 6, capacity: int = 48, rows: int = 4, rings: int | None = None) -> dg.DGPool:
    pool = dg.DGPool(model.config, slots, capacity, rows, torch.float32, "cpu", rings=rings)
    for t in pool.kv:  # never-written positions hold large finite values: they must stay masked
        t.fill_(1e3)
    return pool


def _prompts(model, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def test_pooled_caches_hold_the_own_tensors_bits_and_decode_alike(model):
    cfg = model.config
    pool = _pool(model, capacity=24)  # 30 + 7 positions take two slots: a cache across slots
    own = [dg.DGCache(cfg) for _ in range(3)]
    pooled = [dg.DGCache(cfg) for _ in range(3)]
    assert all(c.place(pool, 40) for c in pooled) and [len(c.slots) for c in pooled] == [2, 2, 2]
    for lengths in ((13, 5, 30), (7, 1, 7)):  # past the window of 8; a second pass over each
        chunks = _prompts(model, lengths, seed=sum(lengths))
        model.encode_many(chunks, own)
        model.encode_many(chunks, pooled)
    for i in range(cfg.num_layers):
        for a, b in zip(own, pooled):
            assert a.kept(i) == b.kept(i) and torch.equal(a.past(i)[0], b.past(i)[0])
            assert torch.equal(a.past(i)[1], b.past(i)[1])
    assert [c.nbytes for c in pooled] == [c.nbytes for c in own]
    g = torch.Generator().manual_seed(1)
    canvas = torch.randint(0, cfg.vocab_size, (3, cfg.canvas_length), generator=g)
    soft = torch.randn(3, cfg.canvas_length, cfg.hidden_size, generator=g)
    counted = torch.tensor([True, False, True])
    want = model.decode(canvas, own, soft, counted)
    got = model.decode(canvas, pooled, soft, counted)
    assert (got - want).abs().max() <= TOL and torch.equal(got, want)
    for r in range(3):  # one request alone
        assert torch.equal(model.decode(canvas[r:r + 1], pooled[r]), model.decode(canvas[r:r + 1], own[r]))
    # one encoder pass of one request (``encode``): the same hidden states and cache
    pooled[0].release()
    a, b = dg.DGCache(cfg), dg.DGCache(cfg)
    assert b.place(pool, 20) and b.slots == [0]
    ids = torch.tensor(_prompts(model, (11,), seed=4))
    assert torch.equal(model.encode(ids, a), model.encode(ids, b))
    assert all(torch.equal(a.past(i)[0], b.past(i)[0]) for i in range(cfg.num_layers))


@torch.no_grad()
def test_a_request_over_several_pages_holds_one_ring(model, tok):
    cfg = model.config
    pool = _pool(model, slots=6, capacity=16, rings=2)
    page, ring, rows = dg.DGPool.sizes(cfg, 16, 4, 4)
    assert (pool.bytes_per_slot, pool.bytes_per_ring, pool.row_bytes) == (page, ring, rows)
    assert pool.nbytes == 6 * page + 2 * ring + rows  # two rings, not six: the pages carry none
    long, short, third = dg.DGCache(cfg), dg.DGCache(cfg), dg.DGCache(cfg)
    assert long.place(pool, 40) and (long.ring, long.slots) == (0, [0, 1, 2])  # three pages, one ring
    assert short.place(pool, 10) and (short.ring, short.slots) == (1, [3])
    assert (pool.free, pool.free_rings) == (2, 0)
    assert not third.place(pool, 10) and pool.beyond == 1 and (pool.free, pool.free_rings) == (2, 0)  # no ring
    own = [dg.DGCache(cfg), dg.DGCache(cfg)]
    for lengths in ((13, 5), (20, 4)):  # past the window of 8, the long one across its pages
        chunks = _prompts(model, lengths, seed=sum(lengths))
        model.encode_many(chunks, own)
        model.encode_many(chunks, [long, short])
    for i in range(cfg.num_layers):
        for a, b in zip(own, (long, short)):
            assert torch.equal(a.past(i)[0], b.past(i)[0]) and torch.equal(a.past(i)[1], b.past(i)[1])
    canvas = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length), generator=torch.Generator().manual_seed(8))
    assert torch.equal(model.decode(canvas, [long, short]), model.decode(canvas, own))
    with pytest.raises(ValueError, match="ring 2 is not held"):  # checked before anything is freed
        pool.release(2, [4])
    with pytest.raises(ValueError, match="slot 4 is not held"):
        pool.release(0, [4])
    assert (pool.free, pool.free_rings) == (2, 0)
    long.release()
    assert (pool.free, pool.free_rings) == (5, 1) and third.place(pool, 70) and len(third.slots) == 5
    # served: a pool of one ring holds one request, the other keeps its own tensors (counted), same text
    params = CanvasParams(max_tokens=40, seed=11)
    prompts = _prompts(model, (3, 17), seed=9)
    want = [o.token_ids for o in CanvasEngine(model, tok).generate(prompts, params)]
    one = _pool(model, slots=4, capacity=64, rings=1)
    assert [o.token_ids for o in CanvasEngine(model, tok, pool=one).generate(prompts, params)] == want
    assert one.beyond == 1 and (one.free, one.free_rings) == (4, 1)


@torch.no_grad()
def test_a_cache_never_writes_past_its_slots(model):
    pool = _pool(model, slots=2, capacity=16)
    a, b = dg.DGCache(model.config), dg.DGCache(model.config)
    assert a.place(pool, 16) and b.place(pool, 16)
    model.encode_many(_prompts(model, (10, 12)), [a, b])
    before = [t.clone() for t in pool.kv]
    with pytest.raises(RuntimeError, match="cannot hold"):
        model.encode(torch.tensor(_prompts(model, (9,), seed=3)), a)  # 19 > 16 positions
    assert all(torch.equal(x, y) for x, y in zip(before, pool.kv)), "an overflow wrote into the pool"
    with pytest.raises(ValueError, match="page"):
        dg.DGPool(model.config, 0, 16, 1, torch.float32, "cpu")
    with pytest.raises(ValueError, match="rings"):
        dg.DGPool(model.config, 2, 16, 1, torch.float32, "cpu", rings=3)


@torch.no_grad()
def test_the_emulated_graph_gives_the_eager_steps_bits(model):
    cfg = model.config
    pool = _pool(model)
    caches = [dg.DGCache(cfg) for _ in range(3)]
    for c in caches:
        c.place(pool, 40)
    model.encode_many(_prompts(model, (13, 5, 30)), caches)
    graphs = DecodeGraphs(model, pool, "cpu", emulate=True, span_step=16)
    g = torch.Generator().manual_seed(2)
    for soft in (None, torch.randn(3, cfg.canvas_length, cfg.hidden_size, generator=g)):
        canvas = torch.randint(0, cfg.vocab_size, (3, cfg.canvas_length), generator=g)
        counted = torch.tensor([True, False, True])
        step = dg.PoolStep(pool, caches, cfg.canvas_length, "cpu", past=graphs.past_keys(caches))
        want = model.decode(canvas, step, soft, None if soft is None else counted)
        first = graphs.decode(canvas, caches, soft, counted)  # met first: the static forward, eager
        got = graphs.decode(canvas, caches, soft, counted)  # met again: captured (emulated), replayed
        assert got.shape == want.shape and torch.equal(got, want) and torch.equal(first, want)
        # the rounded keys change the kernel's sums a little, not the answer
        assert (got - model.decode(canvas, caches, soft, None if soft is None else counted)).abs().max() <= TOL
    assert graphs.key(caches, cfg.canvas_length) == (4, cfg.canvas_length, (7, 32))  # 3 canvases: a bucket of 4
    assert graphs.captures == 1 and graphs.replays == 3
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, pool, "cpu")


def test_a_graphed_engine_answers_as_its_eager_steps(model, tok):
    prompts = _prompts(model, (3, 10, 17, 24), seed=7)
    params = CanvasParams(max_tokens=70, seed=5)

    def engine(graphed: bool) -> CanvasEngine:
        pool = _pool(model, slots=8, capacity=160)
        graphs = DecodeGraphs(model, pool, "cpu", emulate=True, span_step=8, capture_at=2 if graphed else 10**9)
        return CanvasEngine(model, tok, pool=pool, graphs=graphs)  # not graphed: every step the static forward

    graphed, eager, failing = engine(True), engine(False), engine(True)

    def fail(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    failing.graphs._build = fail  # a capture that fails: graphs off, every step the static forward
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert [o.token_ids for o in failing.generate(prompts, params)] == want
    assert graphed.graphs.replays > graphed.graphs.captures > 0 and eager.graphs.captures == 0
    assert failing.graphs.capture_failures == 1 and "capturing" in failing.graphs.failed
    assert graphed.pool.free == graphed.pool.slots  # every request finished: its slots are back


def test_slots_return_on_finish_abort_and_drop_and_an_exhausted_pool_falls_back(model, tok):
    prompts = _prompts(model, (3, 10, 17, 24), seed=9)
    params = CanvasParams(max_tokens=40, seed=11)
    want = [o.token_ids for o in CanvasEngine(model, tok).generate(prompts, params)]
    pool = _pool(model, slots=3, capacity=64)  # the fourth request's cache does not fit
    eng = CanvasEngine(model, tok, pool=pool)
    seqs = [eng.add_request(p, params) for p in prompts]
    eng.step(seqs)
    assert [s.cache.pooled for s in seqs] == [True, True, True, False] and pool.beyond == 1 and pool.free == 0
    while not all(s.finished for s in seqs):
        eng.step(seqs)
    assert [s.output_ids for s in seqs] == want  # the own-tensor cache beside pooled ones: no corruption
    assert pool.free == 3
    seq = eng.add_request(prompts[0], params)
    eng.step([seq])
    assert seq.cache.pooled and pool.free == 2
    eng.abort(seq)
    assert pool.free == 3 and seq.cache.nbytes == 0
    c = dg.DGCache(model.config)
    c.place(pool, 10)
    assert pool.free == 2
    del c  # a dropped cache gives its slots back
    assert pool.free == 3
    eng.stop_ids = frozenset()  # no stop id: the stream's first canvas does not end it
    stream = eng.stream(prompts[1], CanvasParams(max_tokens=96, seed=1))
    assert next(stream) and pool.free == 1  # 10 + 96 positions: two slots of 64
    stream.close()  # a stream closed early
    assert pool.free == 3
    other = dg.DGCache(model.config)  # a pool of another dtype is not the cache's
    assert not other.place(pool, 10, torch.bfloat16) and pool.beyond == 2 and pool.free == 3


def _served(model, tok, **kw):
    from engine.canvas_serving import CanvasServeEngine

    return CanvasServeEngine(model, tok, max_slots=4, **kw)


def test_served_text_is_the_same_with_the_pool_on_and_off(model, tok):
    from engine.commands import SamplingParams

    on, off = _served(model, tok), _served(model, tok, kv_slots=0)
    assert on.runner.pool is not None and off.runner.pool is None and on.runner.graphs is None  # no graphs on a CPU
    budget = on.kv_pool_budget
    assert budget["slots"] == 4 and budget["bytes_per_slot"] == on.runner.pool.bytes_per_slot
    assert budget["canvas_row_bytes"] == on.runner.pool.row_bytes
    prompts = _prompts(model, (4, 12, 20), seed=13)
    params = [SamplingParams(max_tokens=50, seed=s) for s in (1, 2, 3)]
    assert [o.token_ids for o in on.generate(prompts, params)] == [o.token_ids for o in off.generate(prompts, params)]
    assert on.runner.pooled > 0 and on.runner.pool.free == 4


def test_tiny_dg_serves_the_same_text_with_the_pool_on_and_off():
    from engine.commands import SamplingParams
    from engine.loading import load_engine

    on, off = load_engine("tiny-dg", max_slots=4), load_engine("tiny-dg", max_slots=4, kv_slots=0)
    assert on.runner.pool is not None and off.runner.pool is None
    prompts = ["What is 2+2?", "rev: abcdef", "Name a colour."]
    params = [SamplingParams(max_tokens=40, seed=s) for s in (1, 2, 3)]
    got, want = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and any(o.token_ids for o in got)
    assert on.runner.pool.free == on.runner.pool.slots and on.runner.pool.beyond == 0


def test_graphs_need_cuda_a_pool_and_one_device(model, tok):
    with pytest.raises(ValueError, match="CUDA device"):
        _served(model, tok, cuda_graphs=True)
    with pytest.raises(ValueError, match="KV pool"):
        _served(model, tok, kv_slots=0, cuda_graphs=True)
    part = dg.shard(model, 0, 2, lambda x: x)
    with pytest.raises(ValueError, match="one device"):
        _served(part, tok, cuda_graphs=True)
    with pytest.raises(ValueError, match="single device"):
        DecodeGraphs(part, dg.DGPool(part.config, 1, 8, 1, torch.float32, "cpu"), "cpu", emulate=True)
    assert _served(part, tok).runner.graphs is None  # by default a shard stays eager (and a CPU engine too)


def test_the_instance_reserves_whole_pool_slots(model, tok):
    from engine.commands import SamplingParams
    from engine.instance import Instance

    eng = _served(model, tok, kv_slots=2, kv_slot_tokens=64)
    inst = Instance(eng)
    assert inst.kv_from_pool and inst.scheduler.cfg.kv_budget == 2 * 64
    with pytest.raises(ValueError, match="KV tokens"):  # 60 + 100 positions: three slots, more than the pool
        inst.add_request("big", _prompts(model, (60,))[0], SamplingParams(max_tokens=100, seed=1))
    for i, p in enumerate(_prompts(model, (5, 9, 14), seed=3)):  # one slot each: two resident at a time
        inst.add_request(f"r{i}", p, SamplingParams(max_tokens=40, seed=i))
    while inst.scheduler.has_work():
        inst.step()
        assert eng.runner.pool.free >= 0 and len(inst.scheduler.resident) <= 2
    assert eng.runner.pool.beyond == 0 and eng.runner.pool.free == 2
    assert sorted(inst.outputs) == ["r0", "r1", "r2"]


@torch.no_grad()
def test_tensor_parallel_ranks_over_their_pools(model, tok):
    """Each rank over its own pool (its shard's K/V heads): TP-1's logits, and the text its ranks give without
    the pool, bit for bit (this random model's text is sensitive to TP's summation order, with or without the
    pool: the fixture's test in tests/test_diffusion_gemma.py checks TP text against TP-1's)."""
    cfg, world = model.config, 2
    prompts = _prompts(model, (13, 4), seed=17)
    params = CanvasParams(max_tokens=40, seed=3)
    canvas = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length), generator=torch.Generator().manual_seed(6))

    def logits(m, pool):
        caches = [dg.DGCache(m.config) for _ in prompts]
        for c in caches:
            c.place(pool, 40)
        m.encode_many(prompts, caches)
        return m.decode(canvas, caches)

    want = logits(model, _pool(model))
    ar = ThreadAllReduce(world)
    def run(rank):
        part = dg.shard(model, rank, world, ar.for_rank(rank))
        pool = dg.DGPool(part.config, 4, 48, 2, torch.float32, "cpu")
        assert pool.shapes == [(True, 1, 8), (False, 1, 16)]  # sliding layers' 2 K/V heads split, full one kept
        pooled = [o.token_ids for o in CanvasEngine(part, tok, pool=pool).generate(prompts, params)]
        own = [o.token_ids for o in CanvasEngine(part, tok).generate(prompts, params)]
        return logits(part, pool), pooled, own

    out = run_ranks(world, run)
    for got, pooled, own in out:
        assert (got - want).abs().max() <= TOL and pooled == own == out[0][1]


@torch.no_grad()
def test_tiny_dg_tp2_over_pools_gives_tp1s_text():
    """tiny-dg's TP-2 ranks, each over a pool of its shard, give TP-1's pooled text: two canvases per request (no
    stop id ends them), so the finished canvas's encoder pass writes into the slots too."""
    from engine.loading import resolve_model
    from engine.tokenizer import load_tokenizer

    path = resolve_model("tiny-dg")
    full, tokenizer = dg.load(path), load_tokenizer(path)
    prompts = [tokenizer.prompt_ids(p, 0) for p in ("What is 2+2?", "rev: abcdef", "Name a colour.")]
    params = CanvasParams(max_tokens=2 * full.config.canvas_length, seed=3)

    def answers(m) -> list[list[int]]:
        engine = CanvasEngine(m, tokenizer, pool=dg.DGPool(m.config, 4, 160, 4, torch.float32, "cpu"))
        engine.stop_ids = frozenset()
        return [o.token_ids for o in engine.generate(prompts, params)]

    want = answers(full)
    ar = ThreadAllReduce(2)
    out = run_ranks(2, lambda rank: answers(dg.shard(full, rank, 2, ar.for_rank(rank))))
    assert out == [want, want] and all(len(w) == 2 * full.config.canvas_length for w in want)


@torch.no_grad()
def test_cuda_layouts_over_the_pool(model):
    from engine.models.layouts import cuda_layouts

    cfg = model.config
    canvas = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length), generator=torch.Generator().manual_seed(5))
    results = []
    for emulate in (False, True):
        with cuda_layouts(emulate):
            pool = _pool(model)
            caches = [dg.DGCache(cfg) for _ in range(2)]
            for c in caches:
                c.place(pool, 40)
            model.encode_many(_prompts(model, (13, 6)), caches)
            results.append(model.decode(canvas, caches))
    assert (results[0] - results[1]).abs().max() <= TOL


def test_the_instance_caps_its_residents_at_the_pools_rings(model, tok):
    from engine.commands import SamplingParams
    from engine.instance import Instance, ring_capped
    from engine.scheduler import SchedulerConfig

    eng = _served(model, tok, kv_slots=6, kv_slot_tokens=64, kv_residents_max=2)
    pool = eng.runner.pool
    assert (pool.slots, pool.rings) == (6, 2) and eng.kv_pool_budget["rings"] == 2
    inst = Instance(eng)  # B = 4, k = 8: 32 residents, more than the rings
    assert (inst.scheduler.cfg.slots, inst.scheduler.cfg.resident_factor) == (2, 1)
    off = Instance(_served(model, tok, kv_slots=0), slots=2, resident_factor=1)  # the same schedule, no pool
    prompts = _prompts(model, (5, 9, 14, 3, 11), seed=21)  # one page each: five requests, pages for six
    for inst_ in (inst, off):
        for i, p in enumerate(prompts):
            inst_.add_request(f"r{i}", p, SamplingParams(max_tokens=40, seed=i))
    waited = False
    while inst.scheduler.has_work():
        inst.step()
        resident = len(inst.scheduler.resident)
        assert resident <= 2 and pool.rings - pool.free_rings <= resident and pool.beyond == 0
        waited |= inst.scheduler.num_waiting > 0 and pool.free >= 1  # pages free, no ring: it waits
    while off.scheduler.has_work():
        off.step()
    assert waited and (pool.free, pool.free_rings, pool.beyond) == (6, 2, 0)
    assert {r: o.token_ids for r, o in inst.outputs.items()} == {r: o.token_ids for r, o in off.outputs.items()}
    # where the rings cover what can be resident (k x B, or the pages: a resident holds one), nothing changes
    cfg = SchedulerConfig(slots=4, resident_factor=8)
    assert ring_capped(cfg, None, 6) is cfg and ring_capped(cfg, 6, 6) is cfg and ring_capped(cfg, 32, 64) is cfg
    assert (ring_capped(cfg, 10, 64).slots, ring_capped(cfg, 10, 64).resident_factor) == (4, 2)
    assert (ring_capped(cfg, 3, 64).slots, ring_capped(cfg, 3, 64).resident_factor) == (3, 1)


def test_a_budget_buys_a_ring_per_resident_and_pages_with_the_rest(model, tok):
    cfg = model.config
    page, ring, rows = dg.DGPool.sizes(cfg, 64, 4, 4)
    small = _served(model, tok, kv_slot_tokens=64, kv_memory_bytes=rows + 3 * (page + ring) + page)
    budget = small.kv_pool_budget  # room for three residents' page and ring: as many rings as pages
    assert (budget["slots"], budget["rings"], budget["residents"]) == (3, 3, 32) and small.runner.pool.rings == 3
    room = 10 * (page + ring) + 20 * page
    big = _served(model, tok, kv_slot_tokens=64, kv_memory_bytes=rows + room, kv_residents_max=10)
    budget, pool = big.kv_pool_budget, big.runner.pool
    assert (budget["slots"], budget["rings"]) == (30, 10) == (pool.slots, pool.rings)  # the rest all pages
    assert pool.nbytes == budget["pages_bytes"] + budget["rings_bytes"] + rows <= budget["budget_bytes"]
    assert budget["bytes_per_slot"] == pool.bytes_per_slot and budget["bytes_per_ring"] == pool.bytes_per_ring
    capped = _served(model, tok, kv_slot_tokens=64, kv_memory_bytes=rows + room, kv_residents_max=2)
    long = -(-cfg.max_position_embeddings // 64)  # two requests as long as the context: no more pages than that
    assert (capped.kv_pool_budget["slots"], capped.kv_pool_budget["rings"]) == (min(2 * long, 38), 2)
    with pytest.raises(ValueError, match="no page"):
        _served(model, tok, kv_slot_tokens=64, kv_memory_bytes=rows + page)
    with pytest.raises(ValueError, match="kv_residents_max"):
        _served(model, tok, kv_slots=4, kv_residents_max=0)


def test_on_cuda_a_fraction_of_the_free_memory_pays_the_round_first(model, tok, monkeypatch):
    """The sizing alone (no tensor allocated): a fraction of the memory free now, less the round's transient
    memory (at most half of it), buys pages and rings as a budget does."""
    cfg = model.config
    served = _served(model, tok, kv_slot_tokens=64, kv_slots=1)
    served.device = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**20, 80 * 2**20))
    out = served._size_kv_pool(64, None, None, 0.5, None)
    reserve = out["round_reserve_bytes"]
    assert 0 < reserve <= 4 * 2**20 and out["budget_bytes"] == 4 * 2**20
    assert out["source"] == f"0.5 of 8 MiB free, the round's {reserve / 2**20:.0f} MiB aside"
    page, ring, rows = dg.DGPool.sizes(cfg, 64, served._rows(), 4)
    spent = out["slots"] * page + out["rings"] * ring + rows
    assert spent <= out["budget_bytes"] < spent + page + ring
    tight = served._size_kv_pool(64, None, None, 1.0, None)
    assert tight["budget_bytes"] == 8 * 2**20 - tight["round_reserve_bytes"]
    assert served._size_kv_pool(64, 3, None, 0.5, None)["slots"] == 3  # explicit slots win
