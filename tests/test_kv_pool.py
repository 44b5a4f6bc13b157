"""The KV pool: preallocated slots that caches take and give back, and forwards that attend to them in
place (no context copied) with the same results as the copying path."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.decoding import confidence
from engine.engine import Engine
from engine.kv_cache import ApproxCache, ExactCache, KVPool
from engine.models.flops import linear_weights
from engine.runner import TorchRunner
from engine.sequence import SamplingParams, StepInput, StepKind
from tests.builders import make_model

PROMPTS = ["max: a1 b7 c3 d2", "12+5=", "rev: abcdef", "story: cat 3 and some more words here", "a", "9-4="]


def _pool(cfg, slots=4, capacity=64, seed=0) -> KVPool:
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, slots, capacity, torch.float32, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))  # stale K/V
    return pool


def _kv(cfg, n, g) -> torch.Tensor:
    return torch.randn(cfg.num_layers, 2, cfg.num_kv_heads, n, cfg.head_dim, generator=g)


def _steps(model, pool, specs, seed=1) -> list[StepInput]:
    """One step per spec over a cache in ``pool``: ('exact', context, query) or (variant, filled,
    q_start, q_end) for an approximate cache."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    steps, caches = [], []
    for spec in specs:
        args = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 48, torch.float32, "cpu")
        if spec[0] == "exact":
            _, c, t = spec
            cache = ExactCache(*args, pool=pool)
            if c:
                cache.append(_kv(cfg, c, g), 0)
            (kv, pos), lo, hi = cache.context(), c, c + t
        else:
            variant, filled, lo, hi = spec
            cache = ApproxCache(*args, variant=variant, pool=pool)
            cache.refresh(_kv(cfg, filled, g))
            kv, pos = cache.context(lo, hi)
        caches.append(cache)
        steps.append(StepInput(StepKind.DENOISE, torch.randint(2, cfg.vocab_size, (hi - lo,), generator=g),
                               torch.arange(lo, hi), kv, pos, cfg.attention, cache.slot))
    return steps, caches


def test_pool_hands_out_the_lowest_free_slot_and_takes_it_back_when_the_cache_is_dropped():
    cfg = make_model().config
    pool = _pool(cfg, slots=3, capacity=32)
    args = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    a = ExactCache(*args, 16, torch.float32, "cpu", pool=pool)
    b = ExactCache(*args, 32, torch.float32, "cpu", pool=pool)
    assert (a.slot, b.slot, pool.free) == (0, 1, 1)
    assert a.kv.data_ptr() == pool.kv[:, :, 0].data_ptr() and a.capacity == 16
    too_long = ExactCache(*args, 33, torch.float32, "cpu", pool=pool)  # longer than a slot: its own tensor
    other = ExactCache(*args, 8, torch.bfloat16, "cpu", pool=pool)  # not the pool's dtype: its own tensor
    assert too_long.slot is None and other.slot is None and pool.free == 1
    del a
    gc.collect()
    assert pool.free == 2
    c = ApproxCache(*args, 8, torch.float32, "cpu", variant="prefix", pool=pool)
    d = ApproxCache(*args, 8, torch.float32, "cpu", variant="dual", pool=pool)
    assert (c.slot, d.slot) == (0, 2)
    e = ExactCache(*args, 8, torch.float32, "cpu", pool=pool)  # pool exhausted: its own tensor
    assert e.slot is None and pool.free == 0
    with pytest.raises(ValueError, match="not held"):
        pool.release(5)
    del b, c, d
    gc.collect()
    assert pool.free == 3
    with pytest.raises(ValueError, match="at least one slot"):
        KVPool(1, 1, 8, 0, 16, torch.float32, "cpu")


CASES = {
    "block_causal": [("exact", 16, 8), ("exact", 8, 12), ("exact", 0, 8), ("exact", 24, 6)],
    "bidirectional": [("dual", 40, 16, 24), ("prefix", 40, 16, 24), ("dual", 32, 24, 32), ("prefix", 20, 4, 9)],
    "bidirectional-even": [("prefix", 40, 16, 24)] * 3,  # same lengths: no mask at all
    "block_causal-even": [("exact", 16, 8), ("exact", 8, 8), ("exact", 24, 8)],  # no padding, ends differ
}


@pytest.mark.parametrize("case", CASES)
def test_pooled_forward_equals_the_copying_one_and_leaves_contexts_alone(case):
    """Steps over caches in consecutive pool slots (different context lengths, padded queries, a dual
    cache's query between its prefix and suffix, stale K/V past every end) attend to the pool in place;
    logits and fresh K/V equal the copying path's, and no context position is overwritten."""
    model = make_model(attention=case.split("-")[0])
    pool = _pool(model.config, slots=len(CASES[case]))
    steps, caches = _steps(model, pool, CASES[case])
    copied = TorchRunner(model).run(steps)
    contexts = [c.kv.clone() for c in caches]
    runner = TorchRunner(model)
    runner.pool = pool
    pooled = runner.run(steps)
    assert (runner.forwards, runner.pooled) == (1, 1)
    for s, a, b, cache, before in zip(steps, copied, pooled, caches, contexts):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.fresh, a.fresh, atol=1e-5, rtol=1e-5)
        lo = int(s.pos[0])
        assert b.fresh.data_ptr() == cache.kv[:, :, :, lo].data_ptr()  # written in place, in the slot
        kept = torch.ones(cache.capacity, dtype=torch.bool)
        kept[lo:] = False
        if s.ctx_pos is not None:
            kept[s.ctx_pos] = True
        assert torch.equal(cache.kv[:, :, :, kept], before[:, :, :, kept])


def test_slots_out_of_order_are_sorted_and_gaps_are_filled_or_copied():
    """Steps in slots 3, 2, 1, 0 make one pooled forward. Steps in slots 0, 2 and 3 leave slot 1 between
    them, held by a request not in this forward: it becomes a filler row when that costs less than
    copying the contexts (``fill_pays``), and its K/V stay as they were; otherwise contexts are copied."""
    model = make_model(attention="bidirectional")
    pool = _pool(model.config, slots=4)
    steps, caches = _steps(model, pool, [("dual", 40, 16, 24)] * 4)
    runner = TorchRunner(model)
    runner.pool = pool
    ref = TorchRunner(model).run(steps)
    out = runner.run(steps[::-1])[::-1]
    assert (runner.forwards, runner.pooled) == (1, 1)
    for a, b in zip(ref, out):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    some = [steps[0], steps[2], steps[3]]
    held = caches[1].kv.clone()
    runner.balance = 0.0  # filler rows never pay: contexts copied
    assert not runner.fill_pays(1, 10**9)
    copied = runner.run(some)
    assert (runner.forwards, runner.pooled) == (2, 1)
    runner.balance = float("inf")  # filler rows always pay
    filled = runner.run(some)
    assert (runner.forwards, runner.pooled) == (3, 2)
    for a, b, c in zip([ref[0], ref[2], ref[3]], copied, filled):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c.logits, a.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c.fresh, a.fresh, atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[1].kv, held)  # the filler row wrote only to the slot's scratch position
    rows = [torch.tensor([0, 3]), None, torch.tensor([7])]
    picked = runner.run(some, rows)  # each step's top1 comes from its own row, not the filler's
    for r, a, b in zip(rows, [ref[0], ref[2], ref[3]], picked):
        if r is not None:
            conf, tok = confidence(a.logits[r], model.config.mask_token_id)
            torch.testing.assert_close(b.top1[0], conf, atol=1e-5, rtol=1e-5)
            assert torch.equal(b.top1[1], tok)


def test_filler_rows_pay_for_long_contexts_not_short_ones():
    """The cost rule: one filler row of 32 tokens against copying the contexts of the other rows."""
    model = make_model()
    runner = TorchRunner(model)
    runner.balance = 150.0
    cfg = model.config
    layer_flops = 2 * 32 * linear_weights(cfg)
    kv_bytes = 2 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    even = layer_flops / (150.0 * kv_bytes)  # context tokens at which they cost the same
    assert runner.fill_pays(32, int(even) + 1) and not runner.fill_pays(32, int(even))


@pytest.mark.parametrize("attention,cache", [("block_causal", "dual"), ("bidirectional", "dual"),
                                             ("bidirectional", "prefix")])
def test_engine_decodes_the_same_with_and_without_the_pool_and_gives_every_slot_back(tok, attention, cache):
    model = make_model(attention=attention)
    params = SamplingParams(max_tokens=24, threshold=0.5)
    plain = Engine(model, tok, cache=cache, max_slots=4, kv_slots=0)
    assert plain.runner.pool is None
    ref = plain.generate(PROMPTS, params)
    engine = Engine(model, tok, cache=cache, max_slots=4, kv_slot_tokens=48)
    assert engine.runner.pool.slots == 4
    out = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert engine.runner.pooled > 0
    assert engine.runner.pool.free == 4
    seq = engine.add_request(PROMPTS[0], params)
    engine.step([seq])
    assert seq.cache.slot is not None and engine.runner.pool.free == 3
    engine.abort(seq.seq_id)
    gc.collect()
    assert engine.runner.pool.free == 4


def test_engine_pool_defaults(tok):
    model = make_model()
    engine = Engine(model, tok, max_slots=3, default_gen_length=32)
    cfg = model.config
    assert engine.runner.pool.slots == 3
    assert engine.runner.pool.capacity == min(cfg.max_position_embeddings, 512 + 32)


def test_a_cache_longer_than_a_slot_takes_several_slots_and_reads_back_what_was_written():
    cfg = make_model().config
    pool = _pool(cfg, slots=5, capacity=16)
    args = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    g = torch.Generator().manual_seed(3)
    exact = ExactCache(*args, 40, torch.float32, "cpu", pool=pool)  # 40 positions: three slots of 16
    assert exact.slot is None and len(exact.slots) == 3 and exact.capacity == 40 and pool.free == 2
    assert exact.nbytes() == 40 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    data = _kv(cfg, 40, g)
    exact.append(data[:, :, :, :10], 0)
    exact.append(data[:, :, :, 10:30], 10)  # across a slot boundary
    kv, pos = exact.context()
    assert isinstance(kv, tuple) and [k.shape[3] for k in kv] == [16, 14]  # one view per slot, in order
    assert torch.equal(torch.cat(kv, 3), data[:, :, :, :30]) and torch.equal(pos, torch.arange(30))
    with pytest.raises(RuntimeError, match="overflow"):
        exact.append(data[:, :, :, :11], 30)
    dual = ApproxCache(*args, 20, torch.float32, "cpu", variant="dual", pool=pool)  # the last two slots
    dual.refresh(data[:, :, :, :20])
    kv, pos = dual.context(8, 16)
    assert torch.equal(torch.cat(kv, 3), torch.cat((data[:, :, :, :8], data[:, :, :, 16:20]), 3))
    assert torch.equal(pos, torch.cat((torch.arange(8), torch.arange(16, 20))))
    beyond = ExactCache(*args, 20, torch.float32, "cpu", pool=pool)  # no free slot left: its own tensor
    assert beyond.slot is None and not beyond.slots and pool.beyond == 1
    with pytest.raises(AttributeError, match="several pool slots"):
        _ = exact.kv
    del exact, dual
    gc.collect()
    assert pool.free == 5


@pytest.mark.parametrize("attention,cache", [("block_causal", "dual"), ("bidirectional", "dual"),
                                             ("bidirectional", "prefix")])
def test_engine_decodes_the_same_with_caches_over_several_slots(tok, attention, cache):
    model = make_model(attention=attention)
    params = SamplingParams(max_tokens=24, threshold=0.5)
    ref = Engine(model, tok, cache=cache, max_slots=4, kv_slots=0).generate(PROMPTS, params)
    engine = Engine(model, tok, cache=cache, max_slots=4, kv_slots=16, kv_slot_tokens=16)  # 2-5 slots each
    out = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert engine.runner.pool.beyond == 0 and engine.runner.pool.free == 16


def test_the_pool_is_sized_from_a_memory_budget(tok):
    model = make_model()
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    budget = 1_000_000
    engine = Engine(model, tok, max_slots=4, kv_slot_tokens=64, kv_memory_bytes=budget)
    pool = engine.runner.pool
    assert engine.kv_bytes_per_token() == per_token and pool.bytes_per_slot == 65 * per_token
    assert pool.slots == budget // (65 * per_token) == engine.kv_pool_budget["slots"]
    assert pool.kv.numel() * pool.kv.element_size() == pool.slots * pool.bytes_per_slot <= budget
    assert engine.kv_pool_budget["source"] == "kv_memory_bytes"
    # never more slots than the resident requests could take, each as long as the model's context
    capped = Engine(model, tok, max_slots=4, kv_slot_tokens=64, kv_memory_bytes=budget, kv_residents_max=2)
    assert capped.runner.pool.slots == 2 * (512 // 64)
    with pytest.raises(ValueError, match="holds no slot"):
        Engine(model, tok, kv_slot_tokens=64, kv_memory_bytes=1000)
    if not torch.cuda.is_available():  # the free-memory fraction applies on CUDA only: the default pool here
        assert Engine(model, tok, max_slots=3, kv_memory_fraction=0.5).runner.pool.slots == 3


def test_on_cuda_the_pool_takes_a_fraction_of_the_memory_free_after_the_weights(tok, monkeypatch):
    engine = Engine(make_model(), tok, kv_slots=0)
    engine.device = torch.device("cuda")  # the sizing alone: no tensor is allocated here
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**20, 80 * 2**20))
    out = engine._size_kv_pool(64, None, None, 0.5, None)
    per_slot = 65 * engine.kv_bytes_per_token()
    assert out["budget_bytes"] == 5 * 2**20 and out["slots"] == 5 * 2**20 // per_slot
    reserve = out["round_reserve_bytes"]
    assert reserve == min(engine.round_bytes(64), 5 * 2**20) > 0
    assert out["source"] == f"0.5 of 10 MiB free, the largest round's {reserve / 2**20:.0f} MiB aside"
    # a fraction that would leave less than the largest round's transient memory: the round's room comes first
    tight = engine._size_kv_pool(64, None, None, 1.0, None)
    assert tight["budget_bytes"] == 10 * 2**20 - tight["round_reserve_bytes"]
    assert engine._size_kv_pool(64, None, 2**20, 0.5, None)["budget_bytes"] == 2**20  # an explicit budget wins
    assert engine._size_kv_pool(64, 7, None, 0.5, None)["slots"] == 7  # and explicit slots over both


def test_the_instance_reserves_exactly_the_pool_and_a_request_that_does_not_fit_waits(tok):
    """The scheduler's capacity is the pool's slots; a request whose cache needs two slots waits while only
    one is free and is admitted once another request finishes; reservations (residents and running) never
    exceed the pool, no cache is allocated beyond it, and the outputs are those of an engine alone."""
    from engine.instance import Instance

    model = make_model()
    prompts = ["abc", "12+5=", "story: cat 3 and some more words here, a few more"]
    params = [SamplingParams(max_tokens=8, threshold=0.9), SamplingParams(max_tokens=16, threshold=0.9),
              SamplingParams(max_tokens=40, threshold=0.9)]
    ref = Engine(model, tok, max_slots=4, kv_slots=0).generate(prompts, params)
    engine = Engine(model, tok, max_slots=4, kv_slots=3, kv_slot_tokens=64)
    inst = Instance(engine, slots=4)
    sched, pool = inst.scheduler, engine.runner.pool
    assert sched.cfg.kv_budget == 3 * 64
    for i, (p, sp) in enumerate(zip(prompts, params)):
        inst.add_request(f"q{i}", p, sp)
    assert [sched.requests[f"q{i}"].kv_tokens for i in range(3)] == [64, 64, 128]
    waited = admitted_after_finish = False
    finished: set[str] = set()
    while inst.has_work():
        plan, _, done = inst.step()
        waited |= "q2" in sched.requests and "q2" not in sched.resident
        admitted_after_finish |= "q2" in plan.admitted and bool(finished)
        finished |= {r.req_id for r in done}
        assert sched.kv_reserved <= sched.cfg.kv_budget
        assert (pool.slots - pool.free) * pool.capacity <= sched.kv_reserved
    assert waited and admitted_after_finish and pool.beyond == 0
    for i, r in enumerate(ref):
        assert inst.outputs[f"q{i}"].token_ids == r.token_ids
    with pytest.raises(ValueError, match="reservation budget"):  # four slots' worth never fits three
        inst.add_request("huge", "x" * 200, SamplingParams(max_tokens=64))
    assert "huge" not in inst.seqs and not engine.sequences
    # an explicit token budget overrides the pool's (reservations estimated from blocks, as before)
    assert Instance(Engine(model, tok, max_slots=2), slots=2, kv_capacity_tokens=5000).scheduler.cfg.kv_budget == 4500
