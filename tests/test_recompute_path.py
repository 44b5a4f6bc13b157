"""A full-sequence recompute as lean as a cached round of as many tokens (issue 39, item 2): no attention mask
for a bidirectional batch of equal-length rows (so CUDA may take a flash kernel), fresh K/V written into the
KV pool in place whether or not the requests' slots are consecutive (no K/V buffer of the forward's own, no
copy into the cache after it), the same tokens as the path before, and CUDA's forwards asking for the flash
kernels before cuDNN's (which builds a plan for every new shape)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

from engine.kv_cache import KVPool
from engine.loading import load_engine
from engine.memory import kv_bytes_per_token, peak_bytes
from engine.models import layouts
from engine.models.presets import build_preset, preset_config, random_prompt
from engine.models.transformer import ATTENTION_ORDERS, attention_order_default
from engine.runner import TorchRunner
from engine.sequence import SamplingParams
from tools.bench_round import round_inputs

# many layers for a small width, so that a forward's K/V outweigh any one activation (as in a real model)
NAME = "llada-8b-shape:layers=8,vocab=256,hidden=64,heads=4,kv_heads=4,intermediate=128"
ROWS, CANVAS = 3, 64


GQA = "dream-7b-shape:layers=2,vocab=256,hidden=64,heads=4,kv_heads=2,intermediate=128"  # grouped-query heads


def _runner(name: str = NAME, **kw):
    cfg = preset_config(name)
    runner = TorchRunner(build_preset(name, dtype=torch.float32), "cpu", **kw)
    runner.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2 * ROWS, CANVAS, torch.float32, "cpu")
    return cfg, runner


def _masks(monkeypatch) -> list:
    """The attn_mask of every scaled_dot_product_attention call from now on."""
    seen, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), default=0)


@pytest.mark.parametrize("apart", [False, True], ids=["consecutive slots", "slots apart"])
def test_an_equal_length_recompute_attends_unmasked_and_writes_its_kv_in_place(monkeypatch, apart):
    """Recompute steps (whole canvases, no context) of equal length: SDPA gets no mask, the forward runs over the
    pool in place (its steps' fresh K/V are views of their own slots: the cache's refresh copies nothing), no
    allocation is as large as the forward's K/V (a buffer of its own would be) and its peak stays below them."""
    cfg, runner = _runner()
    steps = round_inputs(cfg, ROWS, CANVAS, 0, "cpu", torch.float32, pool=runner.pool, gaps=ROWS if apart else 0)
    assert (max(s.slot for s in steps) - min(s.slot for s in steps) + 1 > ROWS) == apart
    rows = [torch.arange(cfg.block_size)] * ROWS
    masks = _masks(monkeypatch)
    with torch.inference_mode():
        outs = runner.run(steps, rows)
        assert masks and all(m is None for m in masks)
        assert runner.pooled == runner.forwards == 1
        for s, o in zip(steps, outs):
            assert o.fresh.data_ptr() == runner.pool.kv[:, :, s.slot].data_ptr()  # the slot itself, from position 0
        kv = ROWS * CANVAS * kv_bytes_per_token(cfg, 4)
        assert _largest_allocation(lambda: runner.run(steps, rows)) < kv / 2
        # nor do the layers hold their fresh K/V until the forward ends (they did over the pool: 1.3 MB here)
        assert peak_bytes(lambda: runner.run(steps, rows)) < kv
        if apart:  # the path before: a K/V buffer of the forward's own (then copied into each slot by the cache)
            runner.in_slots = False
            assert _largest_allocation(lambda: runner.run(steps, rows)) >= kv
            assert peak_bytes(lambda: runner.run(steps, rows)) >= kv
            assert runner.pooled == 3 and runner.forwards == 5


@pytest.mark.parametrize("name,apart", [(NAME, False), (NAME, True), (GQA, True)],
                         ids=["consecutive slots", "slots apart", "grouped-query heads"])
def test_rows_of_different_lengths_are_packed_unpadded_and_unmasked(monkeypatch, name, apart):
    """Recompute steps of different lengths: packed into one row (their tokens only, no padding), each attending
    to its own tokens with no mask, K/V written into their slots; hidden rows, K/V and top-1 rows equal the
    padded, masked forward with its own buffer (the path before)."""
    cfg, runner = _runner(name)
    steps = round_inputs(cfg, ROWS, CANVAS, 0, "cpu", torch.float32, pool=runner.pool, gaps=ROWS if apart else 0)
    steps[1] = type(steps[1])(steps[1].kind, steps[1].ids[:40], steps[1].pos[:40], None, None, steps[1].mode,
                              steps[1].slot)
    rows = [torch.arange(8, 40)] * ROWS
    batch = runner.prepare(steps)
    assert batch.ids.shape == (1, 2 * CANVAS + 40) and batch.bias is None
    masks = _masks(monkeypatch)
    with torch.inference_mode():
        fresh = [(o.hidden.clone(), o.fresh.clone(), o.top1) for o in runner.run(steps, rows)]
        assert len(masks) == ROWS * cfg.num_layers and all(m is None for m in masks)
        for s, o in zip(steps, runner.run(steps)):
            assert o.fresh.data_ptr() == runner.pool.kv[:, :, s.slot].data_ptr()
        runner.in_slots = False
        before = [(o.hidden, o.fresh, o.top1) for o in runner.run(steps, rows)]
    assert masks[-1] is not None  # the padded forward needed one
    for (h, kv, top), (h0, kv0, top0) in zip(fresh, before):
        torch.testing.assert_close(h, h0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv, kv0, rtol=1e-5, atol=1e-5)
        assert torch.equal(top[1], top0[1])


def test_a_mixed_round_decodes_the_same_tokens_with_recompute_written_in_place():
    """A round of recompute steps beside cached steps in the slots between theirs: the recompute forward now
    writes into its slots in place; every request commits the same tokens as with the buffered path."""
    def run(in_slots: bool):
        engine = load_engine(NAME, max_slots=8, kv_slot_tokens=160)
        engine.runner.in_slots = in_slots
        seqs = [engine.add_request(random_prompt(engine.cfg, 40 + 8 * i, seed=i),
                                   SamplingParams(threshold=0.0 if i % 2 == 0 else 1.0, max_tokens=64))
                for i in range(4)]
        for _ in range(4):
            engine.step(seqs)
        return engine, [s.tokens.tolist() for s in seqs]

    new, tokens = run(True)
    old, reference = run(False)
    assert tokens == reference
    assert new.runner.pooled > old.runner.pooled  # the recompute forwards between cached slots were in place


def test_cuda_forwards_ask_for_the_flash_kernels_before_cudnn(monkeypatch):
    """Where CUDA's paths are emulated, every attention call runs under the model's kernel order (flash first by
    default: cuDNN's kernel builds a plan for each new shape); "torch" leaves torch's order alone; a bad name in
    REMASK_SDPA is an error naming it."""
    orders, real = [], F.scaled_dot_product_attention

    def spy(*a, **kw):
        orders.append(list(torch._C._get_sdp_priority_order()))
        return real(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cfg, runner = _runner()
    steps = round_inputs(cfg, 2, CANVAS, 0, "cpu", torch.float32, pool=runner.pool)
    outside = list(torch._C._get_sdp_priority_order())
    with layouts.cuda_layouts(), torch.inference_mode():
        assert runner.model.attention_order == "flash"
        runner.run(steps)
        flash = [int(b) for b in ATTENTION_ORDERS["flash"]]
        assert orders and all(o[: len(flash)] == flash for o in orders)
        runner.model.attention_order = "torch"
        orders.clear()
        runner.run(steps)
        assert orders and all(o == outside for o in orders)
    orders.clear()
    runner.model.attention_order = "cudnn"
    runner.run(steps)  # on a CPU, not emulating: no override
    assert orders and all(o == outside for o in orders)
    assert list(torch._C._get_sdp_priority_order()) == outside  # restored after each forward
    assert ATTENTION_ORDERS["cudnn"][0] == SDPBackend.CUDNN_ATTENTION
    monkeypatch.setenv("REMASK_SDPA", "fastest")
    with pytest.raises(ValueError, match="REMASK_SDPA='fastest'.*cudnn.*flash.*torch"):
        attention_order_default()
